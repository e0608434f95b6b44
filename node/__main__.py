"""`python -m node --config broker.conf`: run one mqstore node until SIGTERM/SIGINT.

Exit codes: 0 clean stop, 1 fatal store error (failed fsync, corrupt committed data),
2 bad configuration or the node could not start.
"""

from __future__ import annotations

import argparse
import gc
import sys

from node.config import ConfigError, load_config


# A node allocates a few GC-tracked objects per message (drafts, entries, tuples) and frees
# them in bulk; at CPython's default young-generation threshold (700) the cyclic collector
# took about 10% of a DLedger leader's CPU. The young generation is collected once the
# tracked objects alive have grown by the threshold since the last collection. A DLedger
# node's entry cache (64 MiB) keeps one Entry per entry and drops its older half when full:
# with 1 KiB messages it grows by about 30,000 live objects between two drops, and each drop
# takes the count back to zero. Above that (100,000), the cache turning over never triggers
# a collection, and each collection it triggered cost ~10 ms of cold-cache traversal of
# objects that cannot form cycles (bench.bench_dledger: 15-19 collections per node in a
# quick run at 20,000, none at 100,000; test_node_main_gc measures it).
GC_THRESHOLDS = (100_000, 10, 10)


def tune_gc() -> None:
    gc.set_threshold(*GC_THRESHOLDS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node", description="Run an mqstore broker node.")
    parser.add_argument("-c", "--config", help="broker.conf (Java properties); MQSTORE_<key> env vars override")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        from node.auth import preflight
        preflight(config)   # aclEnable: an unusable ACL file stops the start here, before the store opens
    except ConfigError as e:
        print(f"ConfigError: {e}", file=sys.stderr)
        return 2
    from node.server import main as serve_main
    tune_gc()
    return serve_main(config)


if __name__ == "__main__":
    sys.exit(main())

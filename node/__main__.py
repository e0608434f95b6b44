"""`python -m node --config broker.conf`: run one mqstore node until SIGTERM/SIGINT.

Exit codes: 0 clean stop, 1 fatal store error (failed fsync, corrupt committed data),
2 bad configuration or the node could not start.
"""

from __future__ import annotations

import argparse
import sys

from node.config import ConfigError, load_config


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
    return serve_main(config)


if __name__ == "__main__":
    sys.exit(main())

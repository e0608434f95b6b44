"""Run the simulator from the command line.

    python -m tests.sim.run --seeds 1000            # seeds 0..999, report failures
    python -m tests.sim.run --seeds 1000 --start 5000
    python -m tests.sim.run --seed 42 [--steps K] [--nodes N]   # replay one seed, with its trace

Exit status 1 if any seed failed; each failure prints the command that replays it.
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.sim.checkers import SimFailure
from tests.sim.cluster import Cluster, run_seed


def _summary(cluster: Cluster) -> str:
    leader = cluster.leader()
    terms = max((node.core.term for node in cluster.live_nodes()), default=0)
    return (
        f"ticks={cluster.now} nodes={len(cluster.ids)} max_term={terms} "
        f"committed={cluster.checker.max_committed} acked={len(cluster.checker.acked)} "
        f"leader={leader.node_id if leader else None} sent={cluster.net.sent} dropped={cluster.net.dropped}"
    )


def replay(seed: int, steps: int, nodes: int | None) -> int:
    try:
        cluster = run_seed(seed, steps, nodes)
    except SimFailure as failure:
        print(f"FAIL {failure}")
        return 1
    print(f"seed {seed} ok: {_summary(cluster)}")
    print("last events:\n  " + "\n  ".join(cluster.trace))
    return 0


def sweep(count: int, start: int, steps: int, nodes: int | None, stop_on_failure: bool) -> int:
    began = time.monotonic()
    failures: list[int] = []
    for seed in range(start, start + count):
        try:
            run_seed(seed, steps, nodes)
        except SimFailure as failure:
            failures.append(seed)
            print(f"FAIL {failure}\n", flush=True)
            if stop_on_failure:
                break
    elapsed = time.monotonic() - began
    print(f"{count} seeds from {start}, {steps} steps each: {len(failures)} failed in {elapsed:.1f} s")
    if failures:
        print("failing seeds: " + " ".join(str(seed) for seed in failures))
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim.run", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=0, help="run this many seeds")
    parser.add_argument("--start", type=int, default=0, help="first seed of a sweep")
    parser.add_argument("--seed", type=int, help="replay one seed with its event trace")
    parser.add_argument("--steps", type=int, default=300, help="fault-phase ticks per seed")
    parser.add_argument("--nodes", type=int, choices=(3, 5), help="force the group size")
    parser.add_argument("--stop", action="store_true", help="stop at the first failing seed")
    args = parser.parse_args(argv)
    if args.seed is not None:
        return replay(args.seed, args.steps, args.nodes)
    return sweep(args.seeds or 100, args.start, args.steps, args.nodes, args.stop)


if __name__ == "__main__":
    sys.exit(main())

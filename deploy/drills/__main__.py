"""`mqstore drill <scenario>...` / `python -m deploy.drills`: failover drills and the compose cluster.

    mqstore drill list                      the scenarios and what each expects
    mqstore drill kill_leader kill_master   run drills against the running cluster (`make up`)
    mqstore drill all                       every scenario, one after another
    mqstore drill up | down | clean | endpoints

Each drill writes deploy/reports/<time>-<scenario>/{verdict.json, plot.png, index.html,
history.jsonl} and prints one summary line. Exit code: 0 every drill passed, 1 a drill
failed its checks, 2 the cluster or the command line is not usable.
"""

from __future__ import annotations

import argparse
import os
import sys

from deploy.drills.cluster import CONTROLLERS, GROUPS, ROOT, Cluster, Compose, DrillError

DEFAULT_REPORTS = os.path.join(ROOT, "deploy", "reports")


def endpoints_text(c: Cluster) -> str:
    lines = ["mqstore compose cluster (project %s): API endpoints on 127.0.0.1" % c.project]
    for group, services in GROUPS.items():
        for s in services:
            h = c.health(s) or {}
            lines.append(f"  {group:9} {s}  http://{c.nodes[s].api}   {h.get('role', 'DOWN'):9} ip {c.nodes[s].ip}")
    for s in CONTROLLERS:
        lines.append(f"  {'controller':9} {s}  http://{c.nodes[s].api}   ip {c.nodes[s].ip}")
    lead = c.nodes[c.leader("broker-a", timeout_s=5)].api
    lines += ["", "ACL is on: requests but /health and /metrics are signed with a key pair of "
              "deploy/conf/acl.json (drill-admin: admin; app-client: PUB|SUB on topics).",
              "Try it:", f"  curl -s http://{lead}/health",
              "  export MQSTORE_ACCESS_KEY=drill-admin MQSTORE_SECRET_KEY=$(python3 -c \"import json; "
              "print(json.load(open('deploy/conf/acl.json'))['accounts'][0]['secretKey'])\")",
              f"  .venv/bin/mqstore updateTopic -n {lead} -t TopicTest",
              f"  .venv/bin/mqstore send -n {lead} -t TopicTest -b hello",
              "  make drill                 (kill_leader, kill_master; DRILL=all for every scenario)"]
    return "\n".join(lines)


def cmd_up(args) -> int:
    Compose(args.project).up()
    c = Cluster(args.project)
    took = c.wait_healthy([*GROUPS["broker-a"], *GROUPS["broker-b"], *CONTROLLERS], timeout_s=args.timeout)
    c.leader("broker-a", timeout_s=30)
    c.leader("broker-b", timeout_s=30)
    print(f"healthy after {took:.1f} s")
    print(endpoints_text(c))
    return 0


def cmd_drills(args, cluster=None) -> int:
    from deploy.drills.runner import run
    from deploy.drills.scenarios import SCENARIOS
    names = list(SCENARIOS) if args.scenarios == ["all"] else args.scenarios
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"error: unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    c = cluster if cluster is not None else Cluster(args.project)
    failed = 0
    for n in names:
        r = run(SCENARIOS[n], args.reports, warmup_s=args.warmup, recovery_s=args.recovery, rate_per_s=args.rate,
                store_audit=not args.no_store_audit, cluster=c)
        print(f"{n}: {r['summary']} load={r['load_avg']:.2f} report={r['paths']['html']}", flush=True)
        failed += not r["ok"]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="mqstore drill", description="failover drills against the compose cluster")
    p.add_argument("scenarios", nargs="+", help="scenario names, `all`, `list`, or up|down|clean|endpoints")
    p.add_argument("--tier", choices=("docker", "netns"), default="docker",
                   help="docker: the compose cluster; netns: node processes in network namespaces (root, no Docker)")
    p.add_argument("--project", default=os.environ.get("MQSTORE_PROJECT", "mqstore"), help="compose project name")
    p.add_argument("--reports", default=DEFAULT_REPORTS, help="where reports go (default %(default)s)")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the fault")
    p.add_argument("--recovery", type=float, default=10.0, help="seconds of load after the heal")
    p.add_argument("--rate", type=float, default=40.0, help="sends per second (kept small: 2-core machine)")
    p.add_argument("--timeout", type=float, default=120.0, help="`up`: seconds to wait for health")
    p.add_argument("--no-store-audit", action="store_true", help="skip stopping the group to audit its volumes")
    args = p.parse_args(argv)
    if args.rate <= 0 or args.rate > 2000 or args.warmup < 0 or args.recovery < 0:
        p.error("--rate must be in (0, 2000]; --warmup and --recovery must be >= 0")
    verb = args.scenarios[0]
    try:
        if verb == "list":
            from deploy.drills.scenarios import SCENARIOS
            for s in SCENARIOS.values():
                print(f"{s.name:17} [{s.group}] {s.description}\n{'':17} expected: {s.expected}")
            return 0
        if args.tier == "netns":
            from deploy.netns.cli import main_netns
            return main_netns(args, cmd_drills)
        if verb == "up":
            return cmd_up(args)
        if verb in ("down", "clean"):
            Compose(args.project).down(volumes=verb == "clean")
            return 0
        if verb == "endpoints":
            print(endpoints_text(Cluster(args.project)))
            return 0
        return cmd_drills(args)
    except DrillError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

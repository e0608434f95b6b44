"""`python -m deploy.drills --tier netns <scenario>...`: the drills against a namespace cluster.

    --tier netns kill_leader kill_master   build the cluster, run the drills, tear it all down
    --tier netns all                       every scenario against one cluster
    --tier netns up                        build it, print endpoints, keep it until Ctrl-C / SIGTERM
    --tier netns clean                     remove namespaces, links and rules left by a run that died
    --tier netns list                      same as the docker tier

The cluster lives only as long as the command: there is no detached `up`/`down` pair here.
"""

from __future__ import annotations

import signal
import sys
import time

from deploy.drills.cluster import CONTROLLERS, GROUPS, DrillError
from deploy.netns import net
from deploy.netns.cluster import NetnsCluster


def endpoints_text(c: NetnsCluster) -> str:
    lines = [f"mqstore netns cluster (tag {c.tag}, bridge {c.net.bridge} {c.net.gateway}/24, "
             f"work dir {c.workdir})"]
    for group, services in GROUPS.items():
        for s in services:
            h = c.health(s) or {}
            lines.append(f"  {group:10} {s}  http://{c.nodes[s].api}   {h.get('role', 'DOWN'):9} "
                         f"netns {c.net.ns(s)}  pid {c.pid(s)}")
    for s in CONTROLLERS:
        lines.append(f"  {'controller':10} {s}  http://{c.nodes[s].api}   netns {c.net.ns(s)}  pid {c.pid(s)}")
    lead = c.nodes[c.leader("broker-a", timeout_s=5)].api
    lines += ["", "Try it (from this host's root namespace):", f"  curl -s http://{lead}/health",
              f"  .venv/bin/mqstore send -n {lead} -t TopicTest -b hello",
              f"  ip netns exec {c.net.ns('a0')} iptables -S      (faults are rules in a node's namespace)"]
    return "\n".join(lines)


def _raise_on_sigterm() -> None:
    def on_term(signum, frame):  # noqa: ARG001 - signal handler signature
        raise SystemExit(143)     # unwinds through NetnsCluster.__exit__, which cleans up
    signal.signal(signal.SIGTERM, on_term)


def main_netns(args, cmd_drills) -> int:
    """args: the parsed drill command line; cmd_drills(args, cluster) runs the named scenarios."""
    verb = args.scenarios[0]
    if verb == "clean":
        removed = net.clean_leftovers()
        print("\n".join(removed) if removed else "nothing left over")
        return 0
    if verb in ("down", "endpoints"):
        raise DrillError(f"`{verb}` has no meaning for the netns tier: its cluster lives only as long as the "
                         "command that made it (`--tier netns up` keeps one until Ctrl-C)")
    if verb != "up":
        from deploy.drills.scenarios import SCENARIOS
        names = list(SCENARIOS) if args.scenarios == ["all"] else args.scenarios
        unknown = [n for n in names if n not in SCENARIOS]
        if unknown:
            print(f"error: unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
            return 2
    _raise_on_sigterm()
    try:
        net.preflight()
    except net.NetnsError as e:
        raise DrillError(str(e)) from None
    t0 = time.monotonic()
    with NetnsCluster() as c:
        print(f"netns cluster healthy after {time.monotonic() - t0:.1f} s (subnet {c.net.subnet}.0/24)", flush=True)
        if verb == "up":
            print(endpoints_text(c), flush=True)
            print("Ctrl-C (or SIGTERM) stops it and removes everything it made.", flush=True)
            while True:
                time.sleep(1.0)
        return cmd_drills(args, cluster=c)

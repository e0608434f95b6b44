"""The drills. Each names its group, its fault (inject returns the heal), and what must hold.

Every drill runs the same frame (runner.run): warm-up, fault for `fault_s`, heal, recovery,
drain every queue from every replica, check. `inject(cluster, state)` may record what it
did in `state` (the victim, the saved network) for the heal and the report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from deploy.drills.cluster import CONTROLLERS, GROUPS, Cluster

NO_LOSS = ("no acked message lost, no duplicate, no phantom or changed read, replicas identical, "
           "consume queues equal a rebuild")


@dataclass(frozen=True)
class Scenario:
    name: str
    group: str
    description: str
    expected: str
    inject: Callable[[Cluster, dict], Callable[[], None]]
    fault_s: float = 8.0
    failover_target_s: float | None = None   # DESIGN.md section 7, where one is set


def _kill_leader(c: Cluster, st: dict):
    v = st["victim"] = c.leader("broker-a")
    c.kill(v)
    return lambda: c.start(v)


def _pause_leader(c: Cluster, st: dict):
    v = st["victim"] = c.leader("broker-a")
    c.pause(v)
    return lambda: c.unpause(v)


def _partition_leader(c: Cluster, st: dict):
    v = st["victim"] = c.leader("broker-a")
    saved = c.disconnect(v)
    return lambda: c.reconnect(v, saved)


def _oneway_leader(c: Cluster, st: dict):
    v = st["victim"] = c.leader("broker-a")
    peers = [p for p in GROUPS["broker-a"] if p != v]
    c.iptables_drop_from(v, peers)
    return lambda: c.iptables_flush(v)


def _kill_master(c: Cluster, st: dict):
    v = st["victim"] = c.leader("broker-b")
    c.kill(v)
    return lambda: c.start(v)


def _restart_all(c: Cluster, st: dict):
    services = [*CONTROLLERS, *GROUPS["broker-a"], *GROUPS["broker-b"]]
    st["victim"] = "all"
    for s in services:
        c.kill(s)

    def heal():
        for s in services:
            c.start(s)
    return heal


def _rolling_restart(c: Cluster, st: dict):
    """Followers first, the leader last; each stopped gracefully, started, and waited for."""
    leader = c.leader("broker-a")
    order = [s for s in GROUPS["broker-a"] if s != leader] + [leader]
    st["victim"] = order
    for s in order:
        c.stop(s)
        time.sleep(1.0)
        c.start(s)
        c.wait_healthy([s], timeout_s=60)
        c.wait_converged("broker-a", timeout_s=30)
    return lambda: None


SCENARIOS = {s.name: s for s in [
    Scenario("kill_leader", "broker-a", "kill -9 the DLedger leader of broker-a; restart it after the fault window.",
             NO_LOSS + "; a new leader takes writes within the failover target", _kill_leader,
             failover_target_s=2.0),
    Scenario("pause_leader", "broker-a", "docker pause the DLedger leader (a long GC stop); unpause it later.",
             NO_LOSS + "; the others elect a new leader; the old one steps down when it wakes", _pause_leader,
             failover_target_s=2.0),
    Scenario("partition_leader", "broker-a",
             "disconnect the DLedger leader from the compose network (both directions); reconnect later.",
             NO_LOSS + "; the majority side elects a leader; the isolated one commits nothing", _partition_leader,
             failover_target_s=2.0),
    Scenario("oneway_leader", "broker-a",
             "iptables inside the leader drops every packet from its peers (it can still send, but hears "
             "no acks); flush the rule later.",
             NO_LOSS + "; CheckQuorum makes the deaf leader step down, a new leader is elected",
             _oneway_leader),
    Scenario("kill_master", "broker-b", "kill -9 the classic master of broker-b; the controllers elect the slave; "
             "the old master rejoins as a slave after the fault window.",
             NO_LOSS + " (SYNC_MASTER); the slave is elected within the failover target", _kill_master,
             failover_target_s=5.0),
    Scenario("restart_all", "broker-a", "kill -9 every container (controllers, both groups) at once; start them all.",
             NO_LOSS + "; the group elects a leader and takes writes after the restart", _restart_all, fault_s=5.0),
    Scenario("rolling_restart", "broker-a", "stop and start each broker-a node in turn (followers first, "
             "leader last), waiting for health and catch-up between nodes.",
             NO_LOSS + "; writes continue apart from one leader change", _rolling_restart, fault_s=0.0),
]}

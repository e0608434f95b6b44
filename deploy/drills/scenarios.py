"""The drills. Each names its group, its fault (inject returns the heal), and what must hold.

Every drill runs the same frame (runner.run): warm-up, fault for `fault_s`, heal, recovery,
drain every queue from every replica, check. `inject(cluster, state)` may record what it
did in `state` (the victim, the saved network) for the heal and the report.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

from deploy.drills.cluster import CONTROLLERS, GROUPS, Cluster, DrillError

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
    # extra checks of this scenario: (history events, inject state) -> problems (empty = fine)
    extra_check: Callable[[list, dict], list] | None = None
    # the recovery window is at least this long (a full restart needs time to elect and serve)
    recovery_min_s: float = 0.0
    # the fault window opens before inject (inject itself is the whole fault, e.g. a rolling restart)
    window_includes_inject: bool = False


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


BALLAST = "mqstore-drill-ballast"
BALLAST_CHUNK = 1 << 20


def _fill(path: str, limit_bytes: int) -> int:
    """Write zeros to path/BALLAST until ENOSPC (or limit_bytes); the bytes written."""
    import errno
    chunk = b"\0" * BALLAST_CHUNK
    written = 0
    with open(os.path.join(path, BALLAST), "wb", buffering=0) as f:
        while written < limit_bytes:
            try:
                written += f.write(chunk[: min(BALLAST_CHUNK, limit_bytes - written)])
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                # the last partial chunk: fill to the very last block
                for size in (1 << 16, 1 << 12, 1 << 9):
                    try:
                        while True:
                            written += f.write(chunk[:size])
                    except OSError as e2:
                        if e2.errno != errno.ENOSPC:
                            raise
                break
    return written


def _disk_full(group: str) -> Callable[[Cluster, dict], Callable[[], None]]:
    """Fill the store of `group`'s master or leader (a small host tmpfs, deploy/compose.smalldisk.yml)
    to 100 %; the heal deletes the ballast."""
    return lambda c, st: _fill_victim(c, st, c.leader(group))


def _fill_victim(c: Cluster, st: dict, v: str) -> Callable[[], None]:
    st["victim"] = v
    path = c.volume_mountpoint(v)
    if path is None or not os.path.ismount(path):
        raise DrillError(f"disk_full needs {v}'s store on its small tmpfs (deploy/compose.smalldisk.yml, "
                         f"applied by `make up` as root); found {path}")
    vfs = os.statvfs(path)
    total = vfs.f_blocks * vfs.f_frsize
    if total > (4 << 30):
        raise DrillError(f"{v}'s store at {path} is {total >> 20} MiB, not a small disk; refusing to fill it")
    st["disk_total_bytes"] = total
    # the history's clock: the guard refuses sends once the fill passes its ratio, before
    # the fill ends and the runner stamps the fault's start
    st["fill_started_t"] = time.time()
    st["ballast_bytes"] = _fill(path, total)
    after = os.statvfs(path)
    st["disk_free_bytes_full"] = after.f_bavail * after.f_frsize

    def heal():
        try:
            os.unlink(os.path.join(path, BALLAST))
        except FileNotFoundError:
            pass
        st["disk_free_bytes_healed"] = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
    return heal


def _fault_window(events: list) -> tuple[float | None, float | None]:
    start = next((e["t"] for e in events if e.get("type") == "fault" and e.get("phase") == "start"), None)
    end = next((e["t"] for e in events if e.get("type") == "fault" and e.get("phase") == "end"), None)
    return start, end


NO_DISK_FULL_REFUSAL = "no send failed with a disk-full message"


def _disk_full_checks(events: list, st: dict) -> list:
    """Writes during the fault fail with a clear disk-full error; acks resume after the heal.
    The fault counts from the start of the fill: sends are refused once the disk passes the
    guard's ratio, which may be before the fill ends and the fault's start is stamped."""
    problems = []
    start, end = _fault_window(events)
    if start is None or end is None:
        return ["no fault window in the history"]
    start = min(start, st.get("fill_started_t", start))
    fails = [e for e in events if e.get("type") == "fail" and start <= e["t"] <= end]
    disk = [e for e in fails if "disk" in (e.get("message") or "").lower() and "full" in (e.get("message") or "")]
    st["disk_full_errors"] = len(disk)
    st["fault_fail_errors"] = sorted({e.get("error", "?") for e in fails})
    if not disk:
        problems.append(f"{NO_DISK_FULL_REFUSAL} while the disk was full "
                        f"({len(fails)} failures: {st['fault_fail_errors']})")
    if not any(e.get("type") == "ack" and e["t"] > end for e in events):
        problems.append("no ack after the space came back")
    return problems


def _disk_full_leader_checks(events: list, st: dict) -> list:
    """`_disk_full_checks`, and writes continue during the fault: the full leader handed
    leadership to a node with room.

    The full leader may hand over before any send reaches it while full: it then answers
    NOT_LEADER, as any follower does, and never a disk-full error. That handover is the disk
    guard at work (DLedgerLog hands a full leader's role to a peer), so it is accepted in place
    of a disk-full refusal when every send the victim refused in the fault was NOT_LEADER and
    another node acked meanwhile."""
    problems = _disk_full_checks(events, st)
    start, end = _fault_window(events)
    if start is not None and end is not None:
        st["acks_while_full"] = sum(1 for e in events if e.get("type") == "ack" and start < e["t"] <= end)
        if not st["acks_while_full"]:
            problems.append("no ack while the leader's disk was full: leadership did not move to a node with room")
        elif st.get("disk_full_errors") == 0 and _victim_only_redirected(events, st, start, end):
            st["handed_over_before_any_send"] = True
            problems = [p for p in problems if not p.startswith(NO_DISK_FULL_REFUSAL)]
    return problems


def _victim_only_redirected(events: list, st: dict, start: float, end: float) -> bool:
    """Every send to the victim that failed from the fill's start to the heal failed NOT_LEADER."""
    node_of = {e["id"]: e.get("node") for e in events if e.get("type") == "send"}
    start = min(start, st.get("fill_started_t", start))
    victim_fails = [e for e in events if e.get("type") == "fail" and start <= e["t"] <= end
                    and node_of.get(e.get("id")) == st.get("victim")]
    return all(e.get("error") == "NOT_LEADER" for e in victim_fails)


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
             NO_LOSS + "; the group elects a leader and takes writes after the restart", _restart_all, fault_s=5.0,
             recovery_min_s=45.0),
    Scenario("rolling_restart", "broker-a", "stop and start each broker-a node in turn (followers first, "
             "leader last), waiting for health and catch-up between nodes.",
             NO_LOSS + "; writes continue apart from one leader change", _rolling_restart, fault_s=0.0,
             window_includes_inject=True),
    Scenario("disk_full", "broker-b", "fill the classic master's store (a small tmpfs) to 100 %; delete the "
             "ballast after the fault window.",
             NO_LOSS + "; sends fail with a clear disk-full error (HTTP 507) while the disk is full, the node "
             "keeps running, and writes resume once space returns", _disk_full("broker-b"),
             extra_check=_disk_full_checks),
    Scenario("disk_full_leader", "broker-a", "fill the DLedger leader's store (a small tmpfs) to 100 %; delete "
             "the ballast after the fault window.",
             NO_LOSS + "; the full leader refuses sends with a clear disk-full error (HTTP 507) and hands "
             "leadership to a node with room, where writes continue; no node stops",
             _disk_full("broker-a"), extra_check=_disk_full_leader_checks),
]}

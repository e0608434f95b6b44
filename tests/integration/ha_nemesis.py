"""Seeded random faults against a real classic HA group, then every safety check.

    python -m tests.integration.ha_nemesis --seeds 5 [--start 1] [--seconds 60] [--keep DIR]

The group: controllers c0..c2 (pysyncobj) and brokers b0, b1 of broker-b, SYNC_MASTER with
allAckInSyncStateSet=true and minInSyncReplicas=1 (the shape of docs/deploy.md). Each broker
binds its own loopback address (127.0.0.11, 127.0.0.12) and is reached at 127.0.0.1 through
the fault proxy (deploy.faultproxy): its API ("api-b0", never cut), its HA port ("ha-b0",
what a slave of b0 connects to) and its own way to each controller ("b0>c1"). Fault kinds
(nemesis.schedule; target "leader" is the master, "other" the slave):

    kill9               kill -9 of the broker, started again when the step ends
    sigstop             SIGSTOP, then SIGCONT
    cut_controllers     the broker's links to every controller cut (blackhole or drop)
    cut_ha              the link into the broker's HA port cut: a slave of it gets nothing
    delay_ha            that link delayed 50-600 ms
    disk_full           the broker's store (a small file system of its own) filled to the last
                        page, freed when the step ends; mode "restart": the broker is also
                        killed -9 and started again on the full disk
    kill9_controller    kill -9 of a controller (the leader for target "leader"), restarted
    sigstop_controller  SIGSTOP, then SIGCONT, of a controller
    clock_step          the broker's wall clock stepped by a minute to two days, either way,
                        and back when the step ends (tests/integration/wallclock.py)
    clock_step_controller  the same on a controller
    retention           kill -9 of the slave; the master then cuts its whole commitlog but the
                        file being written (nemesis.py's retention), and the slave, started
                        again when the step ends, is behind the master's first offset: its
                        log restarts there
    kill_all            kill -9 of both brokers, then both started again

Client threads send unique messages to the master (dledger_harness.Workload): SEND_OK is
acked; FLUSH_SLAVE_TIMEOUT and SLAVE_NOT_AVAILABLE were stored on the master alone, so their
outcome is unknown; a refusal before anything was stored is failed. A monitor polls each
broker's /cluster: no two brokers may claim MASTER at one epoch.

Checked once every fault is undone: a master takes writes within LIVENESS_S, the slave
rejoins the SyncStateSet and catches up, every process stops cleanly; then, on the stopped
stores, identical commitlog bytes, every acked message exactly once at its acked place on
both, nothing failed visible, dense queue offsets, consume queues equal to a rebuild.
"""

from __future__ import annotations

import collections
import errno
import os
import random
import time

from deploy.faultproxy import ProxyHub
from mqstore import localcluster as lc
from mqstore.localcluster import free_ports
from mqstore.localcluster import get_ok as try_http
from node.loop_watchdog import stalls_in_logs
from tests.integration.dledger_harness import (ACKED, FAILED, SEGMENT_BYTES, SMALL_FILES, Attempt, Workload,
                                               check_messages, compare_consume_queues)
from tests.integration.nemesis import (DISK_MIB, RETENTION_CONF, START_ATTEMPTS, ClaimMonitor, Fault, Nemesis,
                                       available_kinds, cli, events_in_logs, fault_figures, run_figures, schedule,
                                       seed_failed)
from tests.integration.small_disk import SmallDisk
from tests.integration.wallclock import WallClock

BROKERS = ("b0", "b1")
CONTROLLERS = ("c0", "c1", "c2")
HA_KINDS = ("kill9", "sigstop", "cut_controllers", "cut_ha", "delay_ha", "kill9_controller", "sigstop_controller",
            "disk_full", "clock_step", "clock_step_controller", "retention")
HA_WEIGHTS = (3, 2, 2, 3, 1, 1, 1, 2, 1, 1, 1)
CONTROLLER_HEARTBEAT_TIMEOUT_MS = 3000
# A fault lasts 0.5-7 s: past the controller's heartbeat timeout often enough that masters
# are replaced (a shorter fault is over before anyone notices).
HA_HOLD_S = (0.5, 7.0)
LIVENESS_S = 45.0        # after the last fault: a master's first SEND_OK within this
CONVERGE_S = 60.0        # ... and the slave back in the SyncStateSet, caught up, within this


class BrokerProc(lc.Proc):
    def __init__(self, node_id: str, api: str, conf: str, log_path: str, store_dir: str):
        super().__init__(lc.node_argv(conf), log_path, node_id)
        self.node_id, self.api, self.store_dir = node_id, api, store_dir


class ClassicGroup:
    """Three controllers and two brokers, every broker link through the fault proxy. Offers
    what dledger_harness.Workload and nemesis.Nemesis use of a group: ids, nodes, apis,
    leader(), describe(), heal(), stop_all()."""

    def __init__(self, root: str, disk_mib: int | None = None, wall_clock: bool = False):
        os.makedirs(root, exist_ok=True)
        self.root, self.ids = root, BROKERS
        # With `wall_clock`, every process's CLOCK_REALTIME can be stepped (tests/integration/wallclock.py).
        self.clock = WallClock(os.path.join(root, "wallclock")) if wall_clock else None
        self.hub = ProxyHub()
        self.controllers: dict[str, lc.Proc] = {}
        self.nodes: dict[str, BrokerProc] = {}
        self.disks: dict[str, SmallDisk] = {}
        try:   # a proxy may lose its probed port (EADDRINUSE): nothing is left open then
            p = free_ports(10)
            ctl_api, ctl_raft = p[0:3], p[3:6]
            self.ctl_api = dict(zip(CONTROLLERS, ctl_api))
            for i, c in enumerate(CONTROLLERS):
                others = [j for j in range(3) if j != i]
                argv = lc.controller_argv(ctl_api[i], ctl_raft[i], os.path.join(root, c),
                                          peers=[f"127.0.0.1:{ctl_raft[j]}" for j in others],
                                          peer_apis=[f"127.0.0.1:{ctl_api[j]}" for j in others],
                                          heartbeat_timeout_ms=CONTROLLER_HEARTBEAT_TIMEOUT_MS)
                self.controllers[c] = lc.Proc(argv, os.path.join(root, f"{c}.log"), c)
            for k, b in enumerate(BROKERS):
                host, api, ha = f"127.0.0.{11 + k}", p[6 + k], p[8 + k]
                self.hub.add(f"api-{b}", (host, api), listen=("127.0.0.1", api))
                self.hub.add(f"ha-{b}", (host, ha), listen=("127.0.0.1", ha))
                ctl = ";".join(f"127.0.0.1:{self.hub.add(f'{b}>{c}', ('127.0.0.1', self.ctl_api[c]))}"
                               for c in CONTROLLERS)
                store = os.path.join(root, f"store-{b}")
                conf = lc.write_conf(os.path.join(root, f"{b}.conf"), [
                    *SMALL_FILES, f"listenPort={api}", f"bindAddress={host}", "brokerIP1=127.0.0.1",
                    f"storePathRootDir={store}", "brokerClusterName=ha-nemesis", "brokerName=broker-b",
                    *lc.classic_lines(k, "SYNC_MASTER", ha, ctl), "allAckInSyncStateSet=true", "minInSyncReplicas=1",
                    "flushDiskType=ASYNC_FLUSH", "slaveReadEnable=true", *RETENTION_CONF])
                self.nodes[b] = BrokerProc(b, f"127.0.0.1:{api}", conf, os.path.join(root, f"{b}.log"), store)
            for name, proc in [*self.controllers.items(), *self.nodes.items()] if self.clock else ():
                self.clock.attach(name, proc)
            # With `disk_mib`, each broker's store is a file system of its own that a test can fill.
            for b in BROKERS if disk_mib else ():
                self.disks[b] = SmallDisk(self.nodes[b].store_dir, disk_mib).mount()
        except BaseException:
            self.close()
            raise

    @property
    def apis(self) -> list[str]:
        return [n.api for n in self.nodes.values()]

    def data_dir(self, b: str) -> str:
        """Where the broker's commitlog keeps its files."""
        return os.path.join(self.nodes[b].store_dir, "commitlog")

    # --- start and look -------------------------------------------------------------------
    def start(self) -> None:
        for c in self.controllers.values():
            c.start()
        lc.wait_for(lambda: self.controller_leader() is not None, 30, "a controller leader")
        self.nodes["b0"].start()
        lc.wait_for(lambda: self._role("b0") == "MASTER", 30, "b0 master")
        self.nodes["b1"].start()
        self.wait_in_sync(CONVERGE_S)

    def controller_leader(self) -> str | None:
        for c, proc in self.controllers.items():
            if proc.running and not proc.stopped:
                doc = try_http(f"127.0.0.1:{self.ctl_api[c]}", "/health", 0.5)
                if doc and doc.get("role") == "LEADER":
                    return c
        return None

    def sync_state_set(self) -> list[int] | None:
        c = self.controller_leader()
        doc = try_http(f"127.0.0.1:{self.ctl_api[c]}", "/groups/broker-b/sync-state-set", 0.5) if c else None
        return sorted(doc.get("sync_state_set") or []) if doc else None

    def _doc(self, b: str) -> dict | None:
        n = self.nodes[b]
        return try_http(n.api, "/cluster", 0.5) if n.running and not n.stopped else None

    def _role(self, b: str) -> str | None:
        return (self._doc(b) or {}).get("role")

    def leader(self, timeout_s: float = 15.0) -> str:
        """The broker that is MASTER and accepts writes (waits for one)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for b in BROKERS:
                doc = self._doc(b)
                if doc and doc.get("role") == "MASTER" and (doc.get("log") or {}).get("accepting_writes"):
                    return b
            time.sleep(0.05)
        raise AssertionError("no master accepting writes in time:\n" + self.describe())

    def wait_in_sync(self, timeout_s: float) -> None:
        """A master, the other broker its slave in the SyncStateSet, both at one committed offset."""
        def in_sync() -> bool:
            docs = {b: self._doc(b) for b in BROKERS}
            if not all(docs.values()):
                return False
            roles = sorted(d["role"] for d in docs.values())
            offsets = {d["committed_offset"] for d in docs.values()}
            return roles == ["MASTER", "SLAVE"] and len(offsets) == 1 and self.sync_state_set() == [0, 1]
        try:
            lc.wait_for(in_sync, timeout_s, "master and slave in sync")
        except lc.ClusterError:
            raise AssertionError("brokers did not get back in sync:\n" + self.describe()) from None

    def describe(self) -> str:
        out = []
        for b in BROKERS:
            n, doc = self.nodes[b], self._doc(b) or {}
            lg = doc.get("log") or {}
            out.append(f"{b}: running={n.running} stopped={n.stopped} role={doc.get('role')} "
                       f"epoch={lg.get('master_epoch')} committed={doc.get('committed_offset')} "
                       f"accepting={lg.get('accepting_writes')}")
        out.append(f"controller leader={self.controller_leader()} sync_state_set={self.sync_state_set()}")
        return "\n".join(out)

    # --- faults ---------------------------------------------------------------------------
    def heal(self) -> None:
        self.hub.heal("*")

    def stop_all(self, sig: str = "TERM") -> dict[str, int | None]:
        """The brokers only (controllers: stop_controllers)."""
        codes: dict[str, int | None] = {}
        for b, n in self.nodes.items():
            if n.proc is None:
                continue
            if sig == "KILL":
                n.kill9()
                codes[b] = n.returncode
            elif n.running:
                codes[b] = n.terminate()
        return codes

    def stop_controllers(self) -> None:
        for c in self.controllers.values():
            c.stop(10)

    def close(self, keep_stores: bool = False) -> None:
        for p in [*self.nodes.values(), *self.controllers.values()]:
            if p.running:
                p.kill9()
        self.hub.close()
        for disk in self.disks.values():
            disk.unmount(keep=keep_stores)


# What a run's logs say happened (nemesis.events_in_logs): which paths the faults reached.
CLASSIC_EVENTS = {"truncations": "truncated commitlog to", "slave_restarts": "restarting its log there",
                  "promotions": "became MASTER (was SLAVE)"}


class ClassicNemesis(Nemesis):
    def _target_of(self, f: Fault) -> str:
        # retention kills the slave: the master takes the filler and cuts, and the slave comes
        # back behind the master's first offset (its log restarts there). A master killed
        # instead was most often back before the controller replaced it, and the slave cut
        # its own log: nothing returned behind anyone.
        return "other" if f.kind == "retention" else f.target

    def _apply(self, f: Fault, node: str, used: list[str]):
        g: ClassicGroup = self.cluster
        if f.kind in ("kill9_controller", "sigstop_controller", "clock_step_controller"):
            leader = g.controller_leader()
            c = leader if f.target == "leader" and leader else self.rng.choice(CONTROLLERS)
            proc = g.controllers[c]
            if f.kind == "clock_step_controller":
                return self._step_clock(c, int(f.mode), f"{self._now()} {f.kind} {c}")
            if f.kind == "kill9_controller":
                proc.kill9()
                self.applied.append(f"{self._now()} {f.kind} {c}")
                return proc.start
            proc.sigstop()
            self.applied.append(f"{self._now()} {f.kind} {c}")
            return proc.cont
        if f.kind in ("kill9", "sigstop", "disk_full", "clock_step", "retention"):
            return super()._apply(f, node, used)
        what = f"{self._now()} {f.kind} {node}"
        if f.kind == "cut_controllers":
            g.hub.set(f"{node}>*", "both", f.mode)
            self.applied.append(f"{what} {f.mode}")
        elif f.kind == "cut_ha":
            g.hub.set(f"ha-{node}", "both", f.mode)
            self.applied.append(f"{what} {f.mode}")
        elif f.kind == "delay_ha":
            g.hub.set(f"ha-{node}", "both", "delay", int(f.mode))
            self.applied.append(f"{what} {f.mode} ms")
        else:
            raise ValueError(f"unknown fault kind {f.kind!r}")
        return g.heal

    def heal_all(self) -> None:
        super().heal_all()
        for c in self.cluster.controllers.values():
            if c.stopped:
                c.cont()
            if not c.running:
                c.start()


def master_claims(group: ClassicGroup) -> list[tuple[int, str]]:
    """(master epoch, broker) of every live broker whose /cluster says MASTER."""
    out = []
    for b in BROKERS:
        doc = group._doc(b)
        lg = (doc or {}).get("log") or {}
        if doc and doc.get("role") == "MASTER" and lg.get("master_epoch") is not None:
            out.append((int(lg["master_epoch"]), b))
    return out


# --- offline checks --------------------------------------------------------------------------
def _commitlog(store_dir: str) -> tuple[list[tuple], int]:
    """(topic, queue_id, queue_offset, commitlog_offset, body) of every record, and the data end."""
    from pipeline import parsers as P
    F = P.MESSAGE_FIELD
    rows, end = [], 0
    for seg in P.list_segments(store_dir):
        report = P.ParseReport()
        for m in P.parse_commitlog_segment(seg.path, seg.base_offset, report=report):
            rows.append((m[F["topic"]], m[F["queue_id"]], m[F["queue_offset"]], m[F["commitlog_offset"]],
                         bytes(m[F["body"]]).decode("utf-8", "replace")))
            end = m[F["commitlog_offset"]] + m[F["size"]]
        assert report.end_reason != P.END_CORRUPT, f"{seg.path}: corrupt: {report.__dict__}"
    return rows, end


def _first_offset(store_dir: str) -> int:
    """Where the broker's commitlog starts: 0, or the first file kept after a retention cut
    (a full disk deletes the oldest files, as RocketMQ does above diskMaxUsedSpaceRatio)."""
    names = sorted(os.listdir(os.path.join(store_dir, "commitlog")))
    return int(names[0]) if names else 0


def _raw(store_dir: str, start: int, end: int) -> bytes:
    d = os.path.join(store_dir, "commitlog")
    data = bytearray()
    for name in sorted(os.listdir(d)):
        base = int(name)
        if base + SEGMENT_BYTES <= start:
            continue
        if start + len(data) >= end:
            break
        with open(os.path.join(d, name), "rb") as f:
            f.seek(max(0, start - base))
            data += f.read(end - start - len(data))
    return bytes(data)


def verify_classic(group: ClassicGroup, attempts: list[Attempt], topic: str) -> dict:
    logs = {b: _commitlog(n.store_dir) for b, n in group.nodes.items()}
    ends = {b: end for b, (_, end) in logs.items()}
    assert len(set(ends.values())) == 1, f"commitlog ends differ after catching up: {ends}"
    end = ends["b0"]
    first = {b: _first_offset(n.store_dir) for b, n in group.nodes.items()}
    start = max(first.values())
    assert _raw(group.nodes["b0"].store_dir, start, end) == _raw(group.nodes["b1"].store_dir, start, end), \
        "the brokers' commitlog bytes differ"
    for b, (rows, _) in logs.items():
        check_messages(b, rows, attempts, topic, first[b])
    for b, n in group.nodes.items():
        compare_consume_queues(n.store_dir, None, first[b])
    outcomes = collections.Counter(a.outcome for a in attempts)
    stored = {r[4] for r in logs["b0"][0]}
    return {"commitlog_bytes": end, "first_offset": first, "acked": outcomes[ACKED], "failed": outcomes[FAILED],
            "unknown": len(attempts) - outcomes[ACKED] - outcomes[FAILED],
            "unknown_visible": sum(1 for a in attempts if a.outcome not in (ACKED, FAILED) and a.body in stored)}


def _started_group(root: str, disk_mib: int | None, wall_clock: bool = False) -> ClassicGroup:
    """A started group on fresh ports; a fault proxy that lost a probed port to another process
    (EADDRINUSE between probe and bind) makes it start anew, START_ATTEMPTS times."""
    for attempt in range(START_ATTEMPTS):
        group = None
        try:
            group = ClassicGroup(os.path.join(root, f"group{attempt or ''}"), disk_mib=disk_mib, wall_clock=wall_clock)
            group.start()
            return group
        except OSError as e:
            if group is not None:
                group.close()
            if e.errno != errno.EADDRINUSE or attempt + 1 == START_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def run_seed(seed: int, seconds: float, root: str) -> dict:
    kinds, weights, off = available_kinds(HA_KINDS, HA_WEIGHTS)
    steps = schedule(seed, seconds, kinds, weights, HA_HOLD_S)
    group = workload = monitor = nemesis = None
    failed = True
    try:
        group = _started_group(root, None if "disk" in off else DISK_MIB, "clock" not in off)
        workload = Workload(group, topic="HaChaos", max_attempts=400_000, max_s=seconds + LIVENESS_S + 180)
        workload.create_topic()
        workload.start()
        workload.wait_acks(50)
        monitor = ClaimMonitor(lambda: master_claims(group))
        monitor.start()
        nemesis = ClassicNemesis(group, random.Random(seed))
        nemesis.run(steps, time.monotonic() + 2 * seconds)
        nemesis.heal_all()
        healed_at = time.monotonic()
        workload.wait_acks(50, after=healed_at, timeout_s=LIVENESS_S)
        liveness_s = workload.failover_s(healed_at)
        group.wait_in_sync(CONVERGE_S)
        workload.stop()
        monitor.stop()
        split = monitor.split()
        assert not split, f"two masters at one epoch: {split}"
        group.wait_in_sync(CONVERGE_S)
        codes = group.stop_all("TERM")
        assert all(c == 0 for c in codes.values()), f"exit codes {codes}"
        group.stop_controllers()
        attempts = workload.snapshot()
        figures = verify_classic(group, attempts, workload.topic)
        figures["loop_stalls"] = stalls_in_logs([n.log_path for n in group.nodes.values()])
        figures["log_events"] = events_in_logs([n.log_path for n in group.nodes.values()], CLASSIC_EVENTS)
        failed = False
    except BaseException as e:
        raise seed_failed(e, f"HA nemesis seed {seed} ({seconds} s)", workload, monitor, nemesis,
                          group.describe if group is not None else str) from e
    finally:
        if group is not None:
            group.close(keep_stores=failed)
    figures.update(run_figures(seed, nemesis, liveness_s, attempts), epochs_seen=len(monitor.claims),
                   **fault_figures(off))
    return figures


def main(argv: list[str] | None = None) -> int:
    return cli(argv, "python -m tests.integration.ha_nemesis", __doc__, "ha-nemesis", run_seed)


if __name__ == "__main__":
    raise SystemExit(main())

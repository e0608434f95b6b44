"""Seeded random faults against a real DLedger group (3 or 5 nodes), then every safety check.

    python -m tests.integration.nemesis --seeds 5 [--start 1] [--seconds 60] [--nodes 3|5] [--keep DIR]

One seed gives one schedule (`schedule`): steps of one fault, or two at once on different
nodes (the group may then have no majority), each held for a while and then undone, with a
rest between steps. Faults:

    kill9     kill -9; the node is started again when the step ends (recovery from a crash)
    sigstop   SIGSTOP, then SIGCONT (a paused process: a GC pause, a stalled VM)
    isolate   the node's Raft links through the fault proxy: blackhole or drop, in, out or
              both ways (one-way partitions included)
    bridge    the node cut from one peer only; both still reach the third (a bridge partition)
    delay     every Raft link of the node delayed 50-600 ms (a slow network, a slow node)
    disk_full the node's store (a small file system of its own, tests/integration/small_disk.py)
              filled to the last page, freed when the step ends; mode "restart": the node is
              also killed -9 and started again on the full disk
    clock_step the node's wall clock stepped by a minute to two days, either way, and stepped
              back when the step ends (tests/integration/wallclock.py: CLOCK_REALTIME only)
    slow_sync every fsync of the node waits 200-1,500 ms first (a contended disk), until the
              step ends (tests/integration/slowsync.py: writes and reads keep their speed)
    retention kill -9 of the node; the others then cut their whole log but the file being
              written (a filler batch makes the leader roll a new file; every older file is
              aged past fileReservedTime, then `POST /commitlog/delete-expired`), and the node,
              started again when the step ends, is behind the group's first entry: a leader
              resets it to its base (InstallBase)
    bitflip   one bit flipped in the body of a committed entry in the node's oldest data file,
              under the running process (bit rot); its scrubber (every SCRUB_MS) must find it
              and have the entry repaired from a peer: once the last fault is undone, every
              flip must be gone (the byte back, or the entry cut away) within REPAIR_S
    kill_all  kill -9 of every node at once, then all started again (rare)

Targets are roles ("leader", "other"), resolved when the step starts. Client threads send
unique messages throughout (dledger_harness.Workload: two over HTTP, one over the produce
stream), and a monitor polls each node's /cluster for the leader it claims to be.

A thread commits a consumer group's offsets throughout (dledger_harness.OffsetCommits).

Checked: no two nodes ever claim leadership of one term; once the last step is undone a
leader takes writes within LIVENESS_S; every process stops cleanly; then, on the stopped
stores, every acked message exactly once at its acked place on every replica, no refused
send visible, byte-identical committed entries, consume queues equal to a rebuild
(dledger_harness.verify_stores), and every acked offset commit kept (no replica's stored offset
older than the last acked commit). Real processes make timing differ between runs of one
seed: the schedule replays, the interleaving may not; each run prints the steps it applied.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

from mqstore.localcluster import get_ok as try_http
from node.loop_watchdog import stalls_in_logs
from node.store import layout as L
from tests.integration import slowsync, small_disk, wallclock
from tests.integration.dledger_harness import (ACKED, DLedgerCluster, OffsetCommits, Poller, Workload, http,
                                               verify_stores)

KINDS = ("kill9", "sigstop", "isolate", "bridge", "delay", "disk_full", "clock_step", "slow_sync", "retention",
         "bitflip")
KIND_WEIGHTS = (3, 2, 3, 2, 1, 2, 1, 1, 1, 1)
RETENTION_CONF = ("fileReservedTime=1",)   # hours: files aged by the retention fault expire
SCRUB_MS = 2000                            # the scrubber's pause between passes, for bitflip
SCRUB_CONF = (f"storeScrubIntervalMs={SCRUB_MS}", "storeScrubRateMb=64")
REPAIR_S = 60.0                            # after the last fault: every flip repaired within this
FILLER_TOPIC = "NemesisFiller"             # the retention fault's filler batch (not the workload's topic)
FILLER = [{"body": "f" * 60_000}] * 5      # over a 256 KiB data file: the leader rolls a new one
FILLER_S = 5.0                             # the filler is tried this long (a new leader's election)
RETENTION_DURABLE_S = 1.5                  # retention cuts below the durable mark, checkpointed each second
RETENTION_PASSES = 4                       # passes asked for at most, until each live node has 1 file left
DISK_MIB = 160             # each node's store file system, when disk faults run (tmpfs: memory)
KILL_ALL_P = 0.05          # share of steps that kill every node at once
TWO_FAULTS_P = 0.25        # share of steps with two faults on different nodes
LEADER_P = 0.6             # a step's first fault hits the leader this often
HOLD_S = (0.3, 3.0)        # a fault lasts this long (uniform)
REST_S = (0.3, 1.5)        # quiet time after a step
DELAYS_MS = (50, 200, 600)
CLOCK_STEPS_S = (-172_800, -7_200, -60, 60, 7_200, 86_400)
SYNC_DELAYS_MS = (200, 800, 1500)
LIVENESS_S = 30.0          # after the last step: the first ack within this
RESTART_ON_FULL_DISK_S = 30.0   # a node restarted on a full disk answers /health within this
MONITOR_PERIOD_S = 0.1
START_ATTEMPTS = 3         # a group whose start lost a probed port to another process is started anew


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str              # "leader" | "other" | "all"
    mode: str = ""           # isolate/bridge: blackhole | drop; delay: milliseconds
    way: str = "both"        # isolate: in | out | both


@dataclass(frozen=True)
class Step:
    faults: tuple[Fault, ...]
    hold_s: float
    rest_s: float


def schedule(seed: int, seconds: float, kinds: tuple[str, ...] = KINDS,
             weights: tuple[int, ...] = KIND_WEIGHTS, hold_s: tuple[float, float] = HOLD_S) -> list[Step]:
    """The steps of one seed, until their hold and rest times add up to `seconds`. A fault
    kind that cuts links (isolate, bridge, cut_*) gets a mode (blackhole or drop) and, for
    isolate, a direction; a delay kind gets its milliseconds."""
    rng = random.Random(seed)
    steps: list[Step] = []
    total = 0.0
    while total < seconds:
        hold, rest = round(rng.uniform(*hold_s), 2), round(rng.uniform(*REST_S), 2)
        if rng.random() < KILL_ALL_P:
            faults: tuple[Fault, ...] = (Fault("kill_all", "all"),)
        else:
            n = 2 if rng.random() < TWO_FAULTS_P else 1
            faults = tuple(_fault(rng, "leader" if i == 0 and rng.random() < LEADER_P else "other", kinds, weights)
                           for i in range(n))
        steps.append(Step(faults, hold, rest))
        total += hold + rest
    return steps


# What a run's logs say happened, counted for its verdict: which paths the faults reached.
DLEDGER_EVENTS = {"resets": "log reset to the leader's base", "truncations": ": truncated from index",
                  "repairs": ") repaired: ", "dropped_unrepaired": ") dropped unrepaired: "}


def events_in_logs(paths: list[str], events: dict[str, str], max_bytes: int = 64 << 20) -> dict[str, int]:
    """How many log lines of `paths` hold each event's phrase (at most `max_bytes` a file)."""
    counts = dict.fromkeys(events, 0)
    for path in paths:
        try:
            with open(path, "rb") as f:
                text = f.read(max_bytes).decode("utf-8", "replace")
        except OSError:
            continue
        for name, phrase in events.items():
            counts[name] += text.count(phrase)
    return counts


def _fault(rng: random.Random, target: str, kinds: tuple[str, ...], weights: tuple[int, ...]) -> Fault:
    kind = rng.choices(kinds, weights)[0]
    if kind in ("isolate", "bridge") or kind.startswith("cut_"):
        return Fault(kind, target, rng.choice(("blackhole", "drop")),
                     rng.choice(("in", "out", "both")) if kind == "isolate" else "both")
    if kind.startswith("delay"):
        return Fault(kind, target, str(rng.choice(DELAYS_MS)))
    if kind == "disk_full":
        return Fault(kind, target, rng.choice(("", "restart")))
    if kind.startswith("clock_step"):
        return Fault(kind, target, str(rng.choice(CLOCK_STEPS_S)))
    if kind == "slow_sync":
        return Fault(kind, target, str(rng.choice(SYNC_DELAYS_MS)))
    return Fault(kind, target)


def available_kinds(kinds: tuple[str, ...] = KINDS, weights: tuple[int, ...] = KIND_WEIGHTS
                    ) -> tuple[tuple[str, ...], tuple[int, ...], dict[str, str]]:
    """The kinds and weights to draw from here, and why any were left out: disk_full where no
    small disk can be mounted (not root), clock steps and slow syncs where their shim cannot
    be built."""
    off: dict[str, str] = {}
    why = small_disk.unavailable()
    if why is not None:
        off["disk"] = why
    why = wallclock.unavailable()
    if why is not None:
        off["clock"] = why
    why = slowsync.unavailable() if "slow_sync" in kinds else None
    if why is not None:
        off["sync"] = why
    keep = [i for i, k in enumerate(kinds)
            if not ("disk" in off and k == "disk_full") and not ("clock" in off and k.startswith("clock_step"))
            and not ("sync" in off and k == "slow_sync")]
    return tuple(kinds[i] for i in keep), tuple(weights[i] for i in keep), off


def fault_figures(off: dict[str, str], whats: tuple[str, ...] = ("disk", "clock")) -> dict[str, str]:
    return {f"{what}_faults": f"off: {off[what]}" if what in off else "on" for what in whats}


class ClaimMonitor(Poller):
    """Polls `claims()` every MONITOR_PERIOD_S on a thread: (term or epoch, node) for each node
    that says it leads; remembers who claimed each term. `split()`: terms claimed twice."""

    def __init__(self, claims: Callable[[], list[tuple[int, str]]]):
        super().__init__("claim-monitor", MONITOR_PERIOD_S)
        self._claims = claims
        self.claims: dict[int, set[str]] = collections.defaultdict(set)

    def poll(self) -> None:
        for term, node in self._claims():
            self.claims[term].add(node)

    def split(self) -> dict[int, list[str]]:
        return {t: sorted(ids) for t, ids in self.claims.items() if len(ids) > 1}


def _wait_serving(n, timeout_s: float, what: str) -> None:
    """Until the process answers /health; AssertionError (with its log) if it exits or is
    not serving by then."""
    deadline = time.monotonic() + timeout_s
    while try_http(n.api, "/health", 0.5) is None:
        if not n.running:
            raise AssertionError(f"{what}: exited with {n.proc.returncode}:\n{n.tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not serving in {timeout_s:.0f} s:\n{n.tail()}")
        time.sleep(0.1)


def leader_claims(cluster: DLedgerCluster) -> list[tuple[int, str]]:
    """(term, node) of every live node whose /cluster says LEADER."""
    out = []
    for i, n in list(cluster.nodes.items()):
        if n.running and not n.stopped:
            lg = (try_http(n.api, "/cluster", 0.3) or {}).get("log") or {}
            if lg.get("role") == "LEADER" and lg.get("term") is not None:
                out.append((int(lg["term"]), i))
    return out


class Nemesis:
    """Applies steps to a cluster and undoes them; `applied` lists what was done, for the report."""

    def __init__(self, cluster: DLedgerCluster, rng: random.Random):
        self.cluster, self.rng = cluster, rng
        self.applied: list[str] = []
        self.flips: list[tuple[str, str, int, int]] = []    # (node, data file, offset, original byte)
        self.t0 = time.monotonic()

    def current_leader(self) -> str | None:
        try:
            return self.cluster.leader(timeout_s=2.0)
        except AssertionError:
            return None

    def run(self, steps: list[Step], deadline: float) -> None:
        for step in steps:
            if time.monotonic() >= deadline:
                self.applied.append(f"{self._now()} deadline: {len(self.applied)} steps applied")
                return
            self.run_step(step)

    def run_step(self, step: Step) -> None:
        leader = self.current_leader()
        used: list[str] = []
        undo = []
        for f in step.faults:
            if f.kind == "kill_all":
                self.cluster.stop_all("KILL")
                undo.append(self._start_all)
                self.applied.append(f"{self._now()} kill_all hold {step.hold_s}")
                continue
            node = self._resolve(self._target_of(f), leader, used)
            used.append(node)
            undo.append(self._apply(f, node, used))
        time.sleep(step.hold_s)
        for u in reversed(undo):
            u()
        time.sleep(step.rest_s)

    def _target_of(self, f: Fault) -> str:
        return f.target

    def _resolve(self, target: str, leader: str | None, used: list[str]) -> str:
        free = [i for i in self.cluster.ids if i not in used]
        if target == "leader" and leader in free:
            return leader
        others = [i for i in free if i != leader] or free
        return self.rng.choice(others)

    def _apply(self, f: Fault, node: str, used: list[str]):
        c, n = self.cluster, self.cluster.nodes[node]
        what = f"{self._now()} {f.kind} {node}"
        if f.kind == "kill9":
            n.kill9()
            self.applied.append(what)
            return n.start
        if f.kind == "sigstop":
            n.sigstop()
            self.applied.append(what)
            return n.cont
        if f.kind == "isolate":
            c.isolate(node, f.mode, f.way)
            self.applied.append(f"{what} {f.mode} {f.way}")
        elif f.kind == "bridge":
            peer = self.rng.choice([i for i in c.ids if i != node and i not in used] or
                                   [i for i in c.ids if i != node])
            c.hub.set(f"{node}>{peer}", "both", f.mode)
            c.hub.set(f"{peer}>{node}", "both", f.mode)
            self.applied.append(f"{what}-{peer} {f.mode}")
        elif f.kind == "delay":
            c.hub.set(f"{node}>*", "both", "delay", int(f.mode))
            c.hub.set(f"*>{node}", "both", "delay", int(f.mode))
            self.applied.append(f"{what} {f.mode} ms")
        elif f.kind == "disk_full":
            disk = c.disks[node]
            disk.fill()
            self.applied.append(f"{what} {disk.used_ratio():.0%}{' restart' if f.mode == 'restart' else ''}")
            if f.mode != "restart":
                return disk.free
            n.kill9()
            n.start()                # recovery on a full disk: it must come up before space returns

            def up_then_free() -> None:
                _wait_serving(n, RESTART_ON_FULL_DISK_S, f"{node} restarted on a full disk")
                disk.free()
            return up_then_free
        elif f.kind == "clock_step":
            return self._step_clock(node, int(f.mode), what)
        elif f.kind == "slow_sync":
            syncs = c.syncs
            syncs.set(node, int(f.mode))
            self.applied.append(f"{what} {f.mode} ms")
            return lambda: syncs.set(node, 0)
        elif f.kind == "retention":
            n.kill9()
            self.applied.append(f"{what} cut {self._cut_all_but_the_last_file(node)}")
            return n.start
        elif f.kind == "bitflip":
            self.applied.append(f"{what} {self._flip_a_bit(node)}")
            return lambda: None
        else:
            raise ValueError(f"unknown fault kind {f.kind!r}")
        return lambda: c.hub.heal("*")

    def _cut_all_but_the_last_file(self, down: str) -> str:
        """The retention fault's cut, on every live node but `down`, best effort (a step's other
        fault may hold a node or the leader): a filler batch to the leader, so that it writes
        past the file `down` stopped in; once that is below the durable mark, every data file
        but the last aged two hours and a retention pass asked for. Says which nodes were asked,
        and how the filler went."""
        c = self.cluster
        filled, deadline = "nobody", time.monotonic() + FILLER_S
        while filled == "nobody" and time.monotonic() < deadline:   # a leader killed: the next one
            for i in (i for i in c.ids if i != down):    # whoever takes the batch leads
                try:
                    http(c.nodes[i].api, "POST", "/topics", {"topic": FILLER_TOPIC, "queues": 1}, timeout=1.0)
                    st, _ = http(c.nodes[i].api, "POST", f"/topics/{FILLER_TOPIC}/messages", {"messages": FILLER},
                                 timeout=3.0)
                except OSError:
                    continue
                if st == 200:
                    filled = i
                    break
            else:
                time.sleep(0.2)
        time.sleep(RETENTION_DURABLE_S)
        asked: set[str] = set()
        aged = time.time() - 2 * 3600
        live = {i: n for i, n in c.nodes.items() if i != down and n.running and not n.stopped}
        data = {i: c.data_dir(i) for i in live}
        for i in live:
            for name in sorted(os.listdir(data[i]))[:-1]:
                os.utime(os.path.join(data[i], name), (aged, aged))
        for _ in range(RETENTION_PASSES):     # a pass deletes at most 10 files (deleteFilesBatchMax)
            more = [i for i in live if len(os.listdir(data[i])) > 1]
            if not more:
                break
            for i in more:
                try:
                    http(live[i].api, "POST", "/commitlog/delete-expired", {}, timeout=1.0)
                    asked.add(i)
                except OSError:
                    pass
            time.sleep(0.3)
        return f"{','.join(sorted(asked)) or 'none'} (filler to {filled})"

    def _flip_a_bit(self, node: str) -> str:
        """One bit of a committed entry's body in `node`'s oldest data file (not the one being
        written), flipped with pwrite: what the process reads from there on is damaged. The
        flip is kept in `flips` for `wait_flips_gone`. Says where, or why nothing was flipped."""
        n = self.cluster.nodes[node]
        lg = ((try_http(n.api, "/cluster", 0.5) or {}).get("log") or {}) if n.running and not n.stopped else {}
        commit = lg.get("commit_index") or 0
        d = self.cluster.data_dir(node)
        names = sorted(os.listdir(d)) if os.path.isdir(d) else []
        if len(names) < 2 or not commit:
            return "nothing old enough"
        path = os.path.join(d, names[0])
        with open(path, "rb") as fh:
            buf = fh.read()
        bodies, at, head = [], 0, L.ENTRY_HEADER
        while at + head.size <= len(buf):     # bounded: every step moves on by a whole entry
            magic, size, index = head.unpack_from(buf, at)[:3]
            if magic not in (L.ENTRY_MAGIC_NORMAL, L.ENTRY_MAGIC_NOOP, L.ENTRY_MAGIC_CONFIG) \
                    or size < head.size or index > commit:
                break                         # a blank, zeros before a base, or past the commit
            if magic == L.ENTRY_MAGIC_NORMAL and size > head.size:
                bodies.append((at + head.size, size - head.size))
            at += size
        if not bodies:
            return "no committed body"
        start, length = self.rng.choice(bodies)
        off = start + self.rng.randrange(length)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, bytes([buf[off] ^ (1 << self.rng.randrange(8))]), off)
        finally:
            os.close(fd)
        self.flips.append((node, path, off, buf[off]))
        return f"{os.path.basename(path)}+{off}"

    def wait_flips_gone(self, timeout_s: float = REPAIR_S) -> None:
        """Until no flipped byte stands: each is its original value again (repaired), or was cut
        away (its file deleted, or the entry truncated to zeros)."""
        def standing() -> list[tuple]:
            out = []
            for node, path, off, orig in self.flips:
                try:
                    with open(path, "rb") as fh:
                        fh.seek(off)
                        now = fh.read(1)
                except FileNotFoundError:
                    continue
                if now and now[0] not in (orig, 0):
                    out.append((node, os.path.basename(path), off))
            return out
        deadline = time.monotonic() + timeout_s
        while standing():
            if time.monotonic() > deadline:
                raise AssertionError(f"flipped bits not repaired in {timeout_s:.0f} s: {standing()}")
            time.sleep(0.5)

    def _step_clock(self, name: str, by_s: int, what: str):
        clock = self.cluster.clock
        clock.step(name, by_s)
        self.applied.append(f"{what} {by_s:+d} s")
        return lambda: clock.step(name, -by_s)

    def _start_all(self) -> None:
        for n in self.cluster.nodes.values():
            if not n.running:
                n.start()

    def heal_all(self) -> None:
        """Every fault undone: links healed, disks freed, paused nodes continued, dead ones started."""
        self.cluster.heal()
        if self.cluster.clock is not None:
            self.cluster.clock.reset()
        syncs = getattr(self.cluster, "syncs", None)      # DLedger groups only (classic: ha_nemesis.py)
        if syncs is not None:
            syncs.reset()
        for disk in self.cluster.disks.values():
            disk.free()
        for n in self.cluster.nodes.values():
            if n.stopped:
                n.cont()
        self._start_all()

    def _now(self) -> str:
        return f"{time.monotonic() - self.t0:6.2f}s"


def run_seed(seed: int, seconds: float, root: str, nodes: int = 3) -> dict:
    """One seed's whole run; raises AssertionError (with the applied steps) on any failed check."""
    kinds, weights, off = available_kinds()
    steps = schedule(seed, seconds, kinds, weights)
    cluster = workload = monitor = nemesis = offsets = None
    failed = True
    try:
        cluster = started_cluster(root, nodes, None if "disk" in off else DISK_MIB, "clock" not in off,
                                  "sync" not in off)
        workload = Workload(cluster, stream_threads=1, max_attempts=400_000, max_s=seconds + LIVENESS_S + 120)
        workload.create_topic()
        workload.start()
        workload.wait_acks(50)
        offsets = OffsetCommits(cluster, workload, max_s=seconds + LIVENESS_S + 120)
        offsets.start()
        monitor = ClaimMonitor(lambda: leader_claims(cluster))
        monitor.start()
        nemesis = Nemesis(cluster, random.Random(seed))
        nemesis.run(steps, time.monotonic() + 2 * seconds)
        nemesis.heal_all()
        cluster.wait_healthy(list(cluster.ids), timeout_s=60)
        healed_at = time.monotonic()
        workload.wait_acks(50, after=healed_at, timeout_s=LIVENESS_S)
        liveness_s = workload.failover_s(healed_at)
        workload.wait_each_transport_acks(healed_at, LIVENESS_S)     # the stream thread too
        nemesis.wait_flips_gone()
        workload.stop()
        offsets.stop()
        monitor.stop()
        split = monitor.split()
        assert not split, f"two leaders in one term: {split}"
        cluster.wait_converged(timeout_s=30)
        codes = cluster.stop_all("TERM")
        assert all(c == 0 for c in codes.values()), f"exit codes {codes}"
        attempts = workload.snapshot()
        figures = verify_stores(cluster, attempts, workload.topic)
        for n in cluster.nodes.values():
            offsets.check(n.store_dir)
        figures["offset_commits_acked"] = offsets.acked()
        figures["loop_stalls"] = stalls_in_logs([n.log_path for n in cluster.nodes.values()])
        figures["log_events"] = events_in_logs([n.log_path for n in cluster.nodes.values()], DLEDGER_EVENTS)
        failed = False
    except BaseException as e:
        if offsets is not None:
            offsets.halt()
        raise seed_failed(e, f"nemesis seed {seed} ({seconds} s)", workload, monitor, nemesis,
                          cluster.describe if cluster is not None else str) from e
    finally:
        if cluster is not None:
            cluster.close(keep_stores=failed)
    figures.update(run_figures(seed, nemesis, liveness_s, attempts), nodes=nodes, leader_terms_seen=len(monitor.claims),
                   **fault_figures(off, ("disk", "clock", "sync")))
    return figures


def started_cluster(root: str, nodes: int, disk_mib: int | None, wall_clock: bool = False,
                    slow_sync: bool = False) -> DLedgerCluster:
    """A started group on fresh ports. Ports are probed free and then bound by the nodes, and
    any process may take one in between (an outgoing connection's ephemeral port): a start
    that fails on "address already in use" is tried again on new ports, START_ATTEMPTS times."""
    for attempt in range(START_ATTEMPTS):
        cluster = DLedgerCluster(os.path.join(root, f"cluster{attempt or ''}"), ids=tuple(f"n{i}" for i in range(nodes)),
                                 extra_conf=RETENTION_CONF + SCRUB_CONF, disk_mib=disk_mib, wall_clock=wall_clock,
                                 slow_sync=slow_sync)
        try:
            cluster.start()
            return cluster
        except AssertionError as e:
            cluster.close()
            if "address already in use" not in str(e) or attempt + 1 == START_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def seed_failed(e: BaseException, title: str, workload, monitor, nemesis, describe) -> AssertionError:
    """Stop the run's threads; the error names the steps applied and the group's state."""
    if workload is not None:
        workload.halt()
    if monitor is not None:
        monitor.stop()
    applied = "\n".join(nemesis.applied) if nemesis else "(none)"
    summary = workload.summary() if workload is not None else ""
    # The steps first: an error can carry a long log tail, and a report may be cut short.
    return AssertionError(f"{title} failed; steps applied:\n{applied}\n{summary}\n{describe()}\nerror: {e}")


def run_figures(seed: int, nemesis: Nemesis, liveness_s: float | None, attempts: list) -> dict:
    return {"seed": seed, "steps": len(nemesis.applied), "liveness_s": round(liveness_s or 0.0, 3),
            "attempts": len(attempts),
            "acked_over_stream": sum(1 for a in attempts if a.outcome == ACKED and a.transport == "stream"),
            "non_acks": dict(collections.Counter(a.detail.split(":")[0] for a in attempts
                                                 if a.outcome != ACKED).most_common(6)),
            "kinds": dict(collections.Counter(a.split()[1] for a in nemesis.applied))}


KEEP_STALL_MS = 500     # with --keep, a passing seed whose event loop stalled this long keeps its files too


def cli(argv: list[str] | None, prog: str, doc: str, prefix: str, run, nodes: tuple[int, ...] = ()) -> int:
    """Run seeds one after another, one JSON line each; keep a failing seed's files if asked,
    and a passing one's whose loop stalled KEEP_STALL_MS or more (its logs hold the stack)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="how many seeds")
    p.add_argument("--start", type=int, default=1, help="first seed")
    p.add_argument("--seconds", type=float, default=60.0, help="faults per seed, seconds of hold and rest")
    if nodes:
        p.add_argument("--nodes", type=int, choices=nodes, default=nodes[0], help="group size")
    p.add_argument("--keep", default=None, help="keep each failing seed's stores and logs under this directory "
                                                f"(and a seed's whose event loop stalled {KEEP_STALL_MS} ms or more)")
    args = p.parse_args(argv)
    # SIGTERM ends the run through the finally blocks: processes killed, small disks unmounted.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    failed = 0
    for seed in range(args.start, args.start + args.seeds):
        root = tempfile.mkdtemp(prefix=f"{prefix}-{seed}-")
        try:
            figures = run(seed, args.seconds, root, **({"nodes": args.nodes} if nodes else {}))
            print(json.dumps({"ok": True, **figures}), flush=True)
            stalled = (figures.get("loop_stalls") or {}).get("longest_ms", 0) >= KEEP_STALL_MS
            _keep_or_remove(root, args.keep if stalled else None, f"{prefix}-seed-{seed}-stalled", seed)
        except AssertionError as e:
            failed += 1
            print(json.dumps({"ok": False, "seed": seed, "error": str(e)[:4000]}), flush=True)
            _keep_or_remove(root, args.keep, f"{prefix}-seed-{seed}", seed)
    print(json.dumps({"seeds": args.seeds, "failed": failed}))
    return 1 if failed else 0


def _keep_or_remove(root: str, keep: str | None, name: str, seed: int) -> None:
    if keep:
        os.makedirs(keep, exist_ok=True)
        dest = os.path.join(keep, name)
        shutil.move(root, dest)
        print(f"seed {seed}: stores and logs kept in {dest}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    return cli(argv, "python -m tests.integration.nemesis", __doc__, "nemesis", run_seed, nodes=(3, 5))


if __name__ == "__main__":
    sys.exit(main())

"""Dispatcher: committed log -> consume queues, index, handlers, listeners, checkpoint.

Goal: what the dispatcher builds equals a rebuild computed straight from the log;
it catches up (behind_bytes -> 0), checkpoints only after CQs and index are
flushed, re-dispatch after a crash yields byte-identical CQ files, and it stops
loudly on a corrupt record. Method: an in-memory fake `ReplicatedLog` whose log
positions differ from physical offsets by a 48-byte entry header (DLedger-like),
tiny CQ and index files, FaultyFileSystem for crashes.
"""

from __future__ import annotations

import asyncio
import threading
import bisect
import logging
import os

import pytest

from node.replicated_log import ScanBatch, ScannedRecord
from node.store import layout as L
from node.store.checkpoint import Checkpoint
from node.store.consume_queue import ConsumeQueueStore
from node.store.dispatcher import DEFAULT_DELAY_LEVELS_MS, SCHEDULE_TOPIC, Dispatcher
from node.store.errors import CorruptRecord
from node.store.fileio import FaultyFileSystem, FileSystem
from node.store.index_file import IndexService
from node.store.reaper import FileReaper
from node.store.message import MessageDraft, encode_record, tags_code
from node.store.segment import ORPHAN_SUFFIX
from tests.unit.fsync_hooks import FsyncHooked

GAP = 48        # position -> physical offset, like a DLedger entry header
T0 = 1_700_000_000_000
UPF = 5


class FakeLog:
    """Committed records in memory; positions are GAP bytes before physical offsets."""

    mode = "standalone"

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.records: list[tuple[int, bytes]] = []      # (physical offset, record)
        self.end = 0
        self.committed_position = 0
        self.min_position = 0
        self.min_physical_offset = GAP
        self.queue_offsets: dict[tuple[str, int], int] = {}
        self.auto_commit = True
        self._cond: asyncio.Condition | None = None

    def append(self, topic: str, queue_id: int = 0, *, tags: str | None = None, keys: str | None = None,
               uniq: str | None = None, props: dict[str, str] | None = None, sys_flag: int = 0,
               body: bytes = b"hello", ts: int | None = None) -> int:
        p = dict(props or {})
        for name, value in (("TAGS", tags), ("KEYS", keys), ("UNIQ_KEY", uniq)):
            if value is not None:
                p[name] = value
        draft = MessageDraft(topic, queue_id, body, p, sys_flag=sys_flag).seal()
        qo = self.queue_offsets.get((topic, queue_id), 0)
        if draft.is_dispatched:
            self.queue_offsets[(topic, queue_id)] = qo + 1
        phys = self.end + GAP
        ts = T0 + len(self.records) if ts is None else ts
        data = encode_record(draft, qo, phys, ts, b"\x7f\x00\x00\x01", 10911)
        self.append_raw(phys, data)
        return phys

    def append_raw(self, phys: int, data: bytes) -> None:
        self.positions.append(self.end)
        self.records.append((phys, data))
        self.end += GAP + len(data)
        if self.auto_commit:
            self.commit()

    def commit(self, upto: int | None = None) -> None:
        self.committed_position = self.end if upto is None else upto
        if self._cond is not None:
            asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        assert self._cond is not None
        async with self._cond:
            self._cond.notify_all()

    def truncate(self, n_records: int) -> None:
        del self.records[n_records:]
        del self.positions[n_records:]
        self.end = self.positions[-1] + GAP + len(self.records[-1][1]) if self.records else 0
        self.committed_position = min(self.committed_position, self.end)
        # a real log rebuilds its queue-offset table from what it kept
        self.queue_offsets = {key: len(rows) for key, rows in expected_cqs(self).items()}

    @property
    def end_physical(self) -> int:
        return self.end + GAP

    def scan(self, position: int, max_bytes: int) -> ScanBatch:
        i = bisect.bisect_left(self.positions, position)
        assert i == len(self.positions) or self.positions[i] == position, "scan from a record boundary"
        out, size = [], 0
        while i < len(self.records) and self.positions[i] < self.committed_position and size < max_bytes:
            phys, data = self.records[i]
            out.append(ScannedRecord(phys, data))
            size += len(data) + GAP
            i += 1
        nxt = self.positions[i] if i < len(self.positions) else self.end
        return ScanBatch(tuple(out), min(nxt, max(position, self.committed_position)))

    async def wait_committed(self, beyond_position: int, timeout_s: float) -> int:
        if self._cond is None:
            self._cond = asyncio.Condition()
        if self.committed_position <= beyond_position:
            async with self._cond:
                try:
                    await asyncio.wait_for(self._cond.wait_for(lambda: self.committed_position > beyond_position),
                                           timeout_s)
                except asyncio.TimeoutError:
                    pass
        return self.committed_position


class Store:
    """The dispatcher and everything it writes, for one store root."""

    def __init__(self, log: FakeLog, root, fs=None, **kw) -> None:
        self.fs = fs or FileSystem()
        self.root = str(root)
        self.cqs = ConsumeQueueStore(self.fs, self.root, units_per_file=UPF)
        self.index = IndexService(self.fs, self.root, hash_slots=7, max_entries=9)
        self.cp = Checkpoint(self.fs, self.root)
        self.d = Dispatcher(log, self.cqs, self.index, self.cp, **kw)

    def recover(self, log: FakeLog) -> int:
        return self.d.startup_recover(log.end_physical)

    def close(self) -> None:
        self.cqs.close()
        self.index.close()


def expected_cqs(log: FakeLog) -> dict[tuple[str, int], list[tuple[int, int, int]]]:
    """The consume queues, rebuilt straight from the log with the full decoder."""
    from node.store.message import decode_record
    out: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for phys, data in log.records:
        m = decode_record(data)
        tx = m.sys_flag & L.SYSFLAG_TRANSACTION_MASK
        if tx in (L.SYSFLAG_TRANSACTION_PREPARED_TYPE, L.SYSFLAG_TRANSACTION_ROLLBACK_TYPE):
            continue
        rows = out.setdefault((m.topic, m.queue_id), [])
        assert m.queue_offset == len(rows)
        rows.append((phys, m.total_size, tags_code(m.tags)))
    return out


def cq_contents(store: Store) -> dict[tuple[str, int], list[tuple[int, int, int]]]:
    out = {}
    for cq in store.cqs.queues():
        rows: list[tuple[int, int, int]] = []
        while len(rows) < cq.max_offset:
            rows += cq.get_range(len(rows), 1000)
        out[(cq.topic, cq.queue_id)] = rows
    return out


def cq_files(root) -> dict[str, bytes]:
    out = {}
    base = os.path.join(str(root), "consumequeue")
    for dirpath, _dirs, names in os.walk(base):
        for name in names:
            if name.endswith(ORPHAN_SUFFIX):        # set aside at load: not part of the queue
                continue
            data = open(os.path.join(dirpath, name), "rb").read()
            if data.strip(b"\0"):
                out[os.path.relpath(os.path.join(dirpath, name), base)] = data
    return out


def fill(log: FakeLog, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        log.append("TopicA" if i % 3 else "TopicB", i % 4, tags=f"tag{i % 5}", keys=f"order-{i} cust-{i % 7}",
                   uniq=f"U{i:08d}")


def test_catch_up_builds_the_consume_queues_the_log_implies(tmp_path):
    log = FakeLog()
    fill(log, 40)
    log.append("TopicA", 1, tags="tx", sys_flag=L.SYSFLAG_TRANSACTION_PREPARED_TYPE, keys="prepared-1")
    log.append("TopicA", 1, tags="tx", sys_flag=L.SYSFLAG_TRANSACTION_ROLLBACK_TYPE, keys="rolled-1")
    log.append("TopicA", 1, tags="tx", sys_flag=L.SYSFLAG_TRANSACTION_COMMIT_TYPE, keys="commit-1")
    s = Store(log, tmp_path, batch_bytes=700)
    assert s.recover(log) == 0
    assert s.d.behind_bytes == log.end
    assert s.d.catch_up() == 43
    assert s.d.behind_bytes == 0
    assert s.d.position == log.end
    assert cq_contents(s) == expected_cqs(log)
    # Keys, UNIQ_KEY and a prepared half message are indexed; a rolled-back one is not.
    assert s.index.query("TopicA", "order-7", 0, 2**62, 5) == [log.records[7][0]]
    assert s.index.query("TopicB", "U00000003", 0, 2**62, 5) == [log.records[3][0]]
    assert s.index.query("TopicA", "prepared-1", 0, 2**62, 5) == [log.records[40][0]]
    assert s.index.query("TopicA", "rolled-1", 0, 2**62, 5) == []
    assert s.cp.committed_offset == log.end                  # catch_up flushed and checkpointed


def test_catch_up_yielding_lets_the_event_loop_run_between_batches(tmp_path):
    """A DLedger node's Raft runs before its broker catches up the consume queues; the catch-up
    ran in one synchronous call (a whole log to re-dispatch: minutes without heartbeats). The
    yielding catch-up gives the loop a turn after each batch and builds the same queues,
    flushed and checkpointed."""
    log = FakeLog()
    fill(log, 40)
    s = Store(log, tmp_path, batch_bytes=700)
    s.recover(log)

    async def go():
        turns, done = [], asyncio.Event()

        async def other_work():
            while not done.is_set():
                turns.append(s.d.position)
                await asyncio.sleep(0)
        task = asyncio.create_task(other_work())
        n = await s.d.catch_up_yielding()
        done.set()
        await task
        return n, turns
    n, turns = asyncio.run(go())
    assert n == 40 and s.d.position == log.end
    assert len({p for p in turns if 0 < p < log.end}) >= 5     # the loop ran between batches
    assert cq_contents(s) == expected_cqs(log)
    assert s.cp.committed_offset == log.end


def test_checkpoint_is_saved_only_after_cqs_and_index_are_flushed(tmp_path):
    log = FakeLog()
    fill(log, 10)
    s = Store(log, tmp_path)
    s.recover(log)
    calls: list[str] = []
    for obj, name in ((s.index, "write_out"), (s.cqs, "flush_all"), (s.index, "sync"), (s.cp, "save")):
        orig = getattr(obj, name)
        setattr(obj, name, lambda orig=orig, name=name: (calls.append(name), orig())[1])
    s.d.catch_up()
    done = ["write_out", "flush_all", "sync", "save"]
    assert calls == done
    assert s.d.flush() is False                 # nothing new: no write at all
    assert calls == done
    fill(log, 5, start=10)
    s.d.dispatch_once()
    assert asyncio.run(s.d.flush_in_background()) is True     # the same steps, fsyncs off the loop
    assert calls == done * 2
    again = Checkpoint(FileSystem(), str(tmp_path))
    assert again.load()
    assert again.committed_offset == log.end
    assert again.logics_msg_timestamp == T0 + 14


@pytest.mark.parametrize("new_names", ["lost", "random"])
@pytest.mark.parametrize("seed", range(6))
def test_redispatch_after_a_crash_yields_identical_cq_files(tmp_path, seed, new_names):
    """Seed 2 with new_names="random" is a regression: an index file's header, written out
    before the crash, survived while the entries past the checkpoint it counts did not, and
    re-dispatch skipped those messages as indexed (below the header's end offset): their keys
    were not found."""
    log = FakeLog()
    fill(log, 30)
    fs = FaultyFileSystem(seed=seed)
    a = Store(log, tmp_path / "crashed", fs=fs, batch_bytes=1500)
    a.recover(log)
    a.d.catch_up()                              # flushed + checkpoint at 30 records
    fill(log, 25, start=30)
    for _ in range(3):
        a.d.dispatch_once()                     # dispatched, never flushed
    assert a.d.position > a.d.flushed_position
    fs.crash(torn=True, new_names=new_names)
    a.close()
    b = Store(log, tmp_path / "crashed", fs=fs, batch_bytes=1500)
    assert b.recover(log) == a.d.flushed_position
    b.d.catch_up()
    clean = Store(log, tmp_path / "clean")
    clean.recover(log)
    clean.d.catch_up()
    assert cq_files(tmp_path / "crashed") == cq_files(tmp_path / "clean")
    assert cq_contents(b) == expected_cqs(log)
    for i in (0, 29, 31, 54):
        topic = "TopicA" if i % 3 else "TopicB"
        assert b.index.query(topic, f"order-{i}", 0, 2**62, 5) == [log.records[i][0]]


def test_startup_recover_drops_units_past_a_cut_log(tmp_path):
    log = FakeLog()
    fill(log, 20)
    s = Store(log, tmp_path)
    s.recover(log)
    s.d.catch_up()
    s.close()
    log.truncate(12)                            # the log's tail was cut (e.g. HA truncation)
    t = Store(log, tmp_path)
    assert t.recover(log) == log.end            # checkpoint clamped to the committed end
    assert cq_contents(t) == expected_cqs(log)
    assert t.index.query("TopicA", "order-13", 0, 2**62, 5) == []
    fill(log, 5, start=100)
    t.d.catch_up()
    assert cq_contents(t) == expected_cqs(log)
    assert t.index.query("TopicA", "order-101", 0, 2**62, 5) == [log.records[13][0]]


def test_system_handler_gets_the_message_and_its_failure_does_not_stop_dispatch(tmp_path, caplog):
    log = FakeLog()
    seen = []

    def handler(msg):
        seen.append((msg.topic, msg.physical_offset, msg.body))
        if msg.body == b"boom":
            raise RuntimeError("handler bug")

    log.append("RMQ_SYS_TRANS_OP_HALF_TOPIC", 0, body=b"op1")
    log.append("TopicA", 0)
    log.append("RMQ_SYS_TRANS_OP_HALF_TOPIC", 0, body=b"boom")
    log.append("RMQ_SYS_TRANS_OP_HALF_TOPIC", 0, body=b"op3")
    s = Store(log, tmp_path, system_handlers={"RMQ_SYS_TRANS_OP_HALF_TOPIC": handler})
    s.recover(log)
    s.d.catch_up()
    assert seen == [("RMQ_SYS_TRANS_OP_HALF_TOPIC", log.records[i][0], b) for i, b in
                    ((0, b"op1"), (2, b"boom"), (3, b"op3"))]
    assert s.d.handler_errors == 1
    assert "handler bug" in caplog.text
    assert s.d.behind_bytes == 0


def test_schedule_topic_units_carry_the_delivery_time(tmp_path):
    log = FakeLog()
    log.append(SCHEDULE_TOPIC, 2, props={"DELAY": "3"}, tags="t", ts=T0)
    log.append(SCHEDULE_TOPIC, 2, props={"DELAY": "99"}, ts=T0)     # clamped to the last level
    log.append("TopicA", 0, props={"DELAY": "3"}, tags="t", ts=T0)  # ordinary topic: tag hash
    s = Store(log, tmp_path)
    s.recover(log)
    s.d.catch_up()
    cq = s.cqs.get(SCHEDULE_TOPIC, 2)
    assert [u[2] for u in cq.get_range(0, 5)] == [T0 + 10_000, T0 + DEFAULT_DELAY_LEVELS_MS[-1]]
    assert s.cqs.get("TopicA", 0).get(0)[2] == tags_code("t")


def test_corrupt_record_stops_dispatch_loudly(tmp_path, caplog):
    log = FakeLog()
    fill(log, 3)
    phys = log.end + GAP
    good = log.records[0][1]
    bad = bytearray(good[:20] + L.MESSAGE_HEADER.pack(*L.MESSAGE_HEADER.unpack_from(good))[20:] + good[88:])
    bad[4:8] = b"\x00\x00\x00\x00"               # magic
    log.append_raw(phys, bytes(bad))
    fill(log, 2, start=3)
    s = Store(log, tmp_path, batch_bytes=10**6)
    s.recover(log)
    with pytest.raises(CorruptRecord):
        s.d.catch_up()
    assert s.d.position == 0                    # the batch holding it was not applied
    assert isinstance(s.d.failed, CorruptRecord)
    assert "corrupt record" in caplog.text


def test_run_loop_follows_commits_fires_listeners_and_checkpoints_on_stop(tmp_path):
    async def scenario() -> tuple[list, int, int]:
        log = FakeLog()
        fill(log, 5)
        s = Store(log, tmp_path, flush_interval_ms=50)
        s.recover(log)
        fired: list[tuple[str, int, int]] = []
        s.d.add_listener(lambda t, q, m: fired.append((t, q, m)))
        s.d.start()
        log.auto_commit = False
        fill(log, 6, start=5)
        await asyncio.sleep(0.05)
        assert s.d.position < log.end or log.committed_position < log.end
        log.commit()
        for _ in range(200):
            if s.d.behind_bytes == 0 and s.d.position == log.end:
                break
            await asyncio.sleep(0.01)
        assert s.d.behind_bytes == 0
        await asyncio.sleep(0.1)                 # a periodic flush happens
        assert s.cp.committed_offset == log.end
        log.auto_commit = True
        log.append("TopicA", 1)
        await asyncio.sleep(0.05)
        await s.d.stop()
        return fired, s.cp.committed_offset, log.end

    fired, committed, end = asyncio.run(scenario())
    assert committed == end                     # stop flushed and checkpointed the last record
    assert ("TopicA", 1, 3) in fired            # TopicA/1 got offsets 0..2 (records 1, 5, last)
    by_queue: dict[tuple[str, int], int] = {}
    for t, q, m in fired:
        assert m > by_queue.get((t, q), 0)      # max offsets only grow
        by_queue[(t, q)] = m
    assert sorted(by_queue) == sorted({("TopicA", 1), ("TopicA", 2), ("TopicB", 0), ("TopicB", 3),
                                       ("TopicA", 0), ("TopicA", 3), ("TopicB", 2), ("TopicB", 1)}
                                      & set(by_queue))


def test_dispatches_20k_keyed_1kib_messages(tmp_path, caplog):
    # Speed lives in bench/bench_store.py; this checks a large keyed catch-up completes.
    caplog.set_level(logging.WARNING)
    log = FakeLog()
    n = 20_000
    body = b"x" * 1024
    for i in range(n):
        log.append("Bench", i % 8, tags="TagA", keys=f"k{i}", uniq=f"7F00000100002A9F0000{i:012X}", body=body)
    s = Store(log, tmp_path)
    s.cqs.units_per_file = 300_000
    s.index = s.d.index = IndexService(s.fs, s.root, hash_slots=500_000, max_entries=2_000_000)
    s.recover(log)
    assert s.d.catch_up() == n
    assert sorted(cq.max_offset for cq in s.cqs.queues()) == [n // 8] * 8
    for i in (0, n // 2, n - 1):
        assert s.index.query("Bench", f"k{i}", 0, 2**62, 5) == [log.records[i][0]]


def test_a_log_that_asks_for_linger_gets_small_commits_dispatched_as_one_batch(tmp_path):
    """An HA slave commits per received push; its log's dispatch_linger_s makes the run loop
    gather the commits of that interval into one batch (fewer CQ and index writes)."""
    async def scenario(linger: float) -> int:
        log = FakeLog()
        log.dispatch_linger_s = linger
        s = Store(log, tmp_path / f"linger{linger}", flush_interval_ms=1000)
        s.recover(log)
        batches = []
        real = s.d._dispatch_spans
        s.d._dispatch_spans = lambda spans, *a: batches.append(len(spans)) or real(spans, *a)
        s.d.start()
        await asyncio.sleep(0.01)
        for i in range(10):                  # ten commits of one record, 1 ms apart
            log.append("TopicA", i % 2)
            await asyncio.sleep(0.001)
        for _ in range(200):
            if s.d.position == log.end:
                break
            await asyncio.sleep(0.005)
        assert s.d.position == log.end and sum(batches) == 10
        await s.d.stop()
        return len(batches)

    assert asyncio.run(scenario(0.0)) >= 8           # no linger: a batch per commit, or nearly
    assert asyncio.run(scenario(0.02)) <= 3          # 20 ms linger: the ten commits in a few batches


def _gated_recovery(store: Store) -> tuple[threading.Event, threading.Event, list[bool]]:
    """Hold the store's background recovery on its worker until `go` is set; `entered` once
    it is there; the list records whether it ran on the main thread."""
    entered, go, on_main = threading.Event(), threading.Event(), []
    real = store.d._recover_files

    def gated(*args):
        on_main.append(threading.current_thread() is threading.main_thread())
        entered.set()
        assert go.wait(10)
        return real(*args)
    store.d._recover_files = gated
    return entered, go, on_main


async def until(pred, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if pred():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


def test_regression_startup_recovery_off_the_loop_reads_the_log_positions_once(tmp_path):
    """Moved to a worker thread once before, the recovery read the log's committed position
    twice: units were cut at the caller's reading, and the dispatch start was clamped by a
    second one, taken on the thread after the log had moved on (Raft learning the leader's
    commit index). Dispatch then started past units it had just cut ("gap in queue offsets",
    docker drill restart_all). One reading serves both now; the loop is free meanwhile."""
    log = FakeLog()
    fill(log, 30)
    s = Store(log, tmp_path)
    s.recover(log)
    s.d.catch_up()                               # dispatched and checkpointed at 30 records
    s.close()
    cut_at = log.positions[20]
    log.committed_position = cut_at              # restarted: 20 records known committed so far
    t = Store(log, tmp_path)
    entered, go, on_main = _gated_recovery(t)

    async def scenario() -> int:
        task = asyncio.ensure_future(t.d.startup_recover_in_background(log.records[20][0]))
        await until(entered.is_set)
        log.commit()                             # meanwhile the log learns all 30 are committed
        go.set()
        start = await task
        await t.d.catch_up_yielding()
        return start

    assert asyncio.run(scenario()) == cut_at
    assert on_main == [False]
    assert cq_contents(t) == expected_cqs(log)
    fill(log, 3, start=30)
    t.d.catch_up()                               # no gap at the next put
    assert cq_contents(t) == expected_cqs(log)
    t.close()


def test_a_change_of_the_log_during_the_recovery_reaches_the_queues_after_it(tmp_path):
    """A reset or truncation of the log (their listeners call when_recovered) that arrives
    while the queues are being recovered off the loop waits for the recovery, then runs, in
    order; at any other time it runs at once."""
    log = FakeLog()
    fill(log, 12)
    s = Store(log, tmp_path)
    entered, go, _ = _gated_recovery(s)
    calls = []

    async def scenario() -> None:
        task = asyncio.ensure_future(s.d.startup_recover_in_background(log.end_physical))
        await until(entered.is_set)
        s.d.when_recovered(lambda: calls.append(("first", s.d.position)))
        s.d.when_recovered(lambda: (calls.append(("second", s.d.position)), s.d.skip_to(log.positions[5])))
        assert calls == []
        go.set()
        assert await task == log.positions[5]    # the position after the held changes
        s.d.when_recovered(lambda: calls.append(("later", s.d.position)))

    asyncio.run(scenario())
    assert calls == [("first", 0), ("second", 0), ("later", log.positions[5])]
    s.close()


def test_regression_the_final_flush_at_stop_does_not_hold_the_event_loop(tmp_path):
    """The dispatcher's last flush at stop ran its fsyncs on the event loop: 591 ms on a slow
    disk in a random-fault run, with Raft and HA tasks of the stopping node held behind it.
    It runs on a worker now; the loop goes on meanwhile and the checkpoint still ends at the log."""
    class GatedFsync(FsyncHooked):
        def __init__(self):
            self.gate, self.entered = threading.Event(), threading.Event()
            self.gate.set()

        def before_fsync(self):
            if not self.gate.is_set():
                self.entered.set()
                assert self.gate.wait(10)

    async def scenario() -> tuple[int, int, int]:
        log = FakeLog()
        fill(log, 5)
        fs = GatedFsync()
        s = Store(log, tmp_path, fs=fs, flush_interval_ms=60_000)   # no periodic flush: only the final one
        s.recover(log)
        s.d.start()
        fill(log, 4, start=5)
        for _ in range(200):
            if s.d.position == log.end:
                break
            await asyncio.sleep(0.01)
        fs.gate.clear()                                  # every fsync now waits at the gate
        stopping = asyncio.ensure_future(s.d.stop())
        ticks = 0
        while not fs.entered.is_set() and ticks < 1000:
            await asyncio.sleep(0.001)
            ticks += 1
        before = ticks
        for _ in range(20):                              # the loop runs while the flush waits
            await asyncio.sleep(0.001)
            ticks += 1
        fs.gate.set()
        await stopping
        return ticks - before, s.cp.committed_offset, log.end

    ran, committed, end = asyncio.run(scenario())
    assert ran == 20
    assert committed == end


def test_regression_messages_written_over_a_cut_log_are_indexed(tmp_path):
    """A slave's truncation rewinds dispatch; the new master's messages then come at the
    offsets the cut ones had. The index skipped every message below the newest entry of
    its files that was also below the checkpoint of the node's start: the new messages
    there were never indexed, and a query by key missed them."""
    async def scenario() -> None:
        log = FakeLog()
        for i in range(12):
            log.append("T", 0, keys=f"old{i}")
        s = Store(log, tmp_path, flush_interval_ms=60_000)
        s.recover(log)
        s.index.redispatch_from = log.end_physical       # as after a start whose checkpoint is past the cut
        s.d.start()
        await until(lambda: s.d.position == log.end)
        log.truncate(5)
        s.d.cut_queues(log.end_physical, rewind_to=log.end)
        for i in range(5, 12):
            log.append("T", 0, keys=f"new{i}")
        await until(lambda: s.d.position == log.end)
        for i in range(5, 12):
            assert s.index.query("T", f"new{i}", 0, 2**62, 4) == [log.records[i][0]], i
        await s.d.stop()
        s.close()
    asyncio.run(scenario())


def test_regression_cut_queues_makes_its_cuts_durable_off_the_event_loop(tmp_path):
    """After a slave's truncation (and a DLedger reset) every consume queue was cut on the
    event loop, a truncate and an fsync per queue: seconds with a few hundred queues on a slow
    disk. Now the cut is made in memory on the loop (no pull sees a dropped unit from then on)
    and the files on a worker; dispatch waits for them, the checkpoint is lowered to the
    rewound position, and the queues end up as a rebuild from the log would make them."""
    class Watched(FsyncHooked):
        def __init__(self):
            self.gate, self.entered = threading.Event(), threading.Event()
            self.gate.set()
            self.on_loop = 0

        def before_fsync(self):
            if threading.current_thread() is threading.main_thread():
                self.on_loop += 1
            if not self.gate.is_set():
                self.entered.set()
                assert self.gate.wait(10)

    async def scenario() -> None:
        log = FakeLog()
        fill(log, 40)
        fs = Watched()
        s = Store(log, tmp_path, fs=fs, flush_interval_ms=60_000)
        s.recover(log)
        s.d.start()
        await until(lambda: s.d.position == log.end)
        assert await s.d.flush_in_background() and s.cp.committed_offset == log.end
        old_max = {key: cq.max_offset for key, cq in ((k, s.cqs.get(*k)) for k in expected_cqs(log))}
        log.truncate(25)
        fs.on_loop = 0
        fs.gate.clear()                                  # the cuts' fsyncs wait at the gate
        dropped = s.d.cut_queues(log.end_physical, rewind_to=log.end)
        assert dropped == 40 - 25
        kept = expected_cqs(log)
        assert {key: s.cqs.get(*key).max_offset for key in old_max} == \
            {key: len(kept.get(key, [])) for key in old_max}        # at once, before any file work
        fill(log, 6, start=25)                           # the log goes on over the cut
        await until(fs.entered.is_set)
        for _ in range(20):
            await asyncio.sleep(0.001)
        assert s.d.position == log.positions[25]         # dispatch waits for the cuts
        fs.gate.set()
        await s.d.queues_settled()
        on_disk = Checkpoint(FileSystem(), str(tmp_path))
        on_disk.load()
        assert on_disk.committed_offset == log.positions[25]   # lowered to the rewound position
        await until(lambda: s.d.position == log.end)
        await s.d.stop()
        assert fs.on_loop == 0, f"{fs.on_loop} fsync(s) of the cut ran on the event loop"
        assert cq_contents(s) == expected_cqs(log)
        assert s.cp.committed_offset == log.end
        s.close()
        again = Store(log, tmp_path)                     # and as the files hold them
        again.recover(log)
        assert cq_contents(again) == expected_cqs(log)
        again.close()

    asyncio.run(scenario())


def test_regression_a_flush_staged_before_a_rewind_saves_no_checkpoint(tmp_path):
    """A flush staged before a truncation's rewind, its worker run after the rewind's cut,
    would save the old (later) position: a restart would then dispatch from past the cut and
    leave out the records the new master sent there."""
    async def scenario() -> None:
        log = FakeLog()
        fill(log, 12)
        s = Store(log, tmp_path)
        s.recover(log)
        s.d.catch_up()
        fill(log, 4, start=12)
        s.d.dispatch_once()
        staged = s.d._stage_flush()
        assert staged is not None and staged[0] == log.end
        log.truncate(8)
        s.d.cut_queues(log.end_physical, rewind_to=log.end)
        await s.d.queues_settled()
        assert s.cp.committed_offset == log.end
        assert s.d._sync(*staged) is False               # the stale flush: queues synced, no checkpoint
        assert s.cp.committed_offset == log.end
        s.close()

    asyncio.run(scenario())


def test_regression_a_new_files_directory_fsync_never_runs_on_the_event_loop(tmp_path):
    """Random-fault run (DLedger seed 539): the event loop stalled 791 ms in a directory fsync.
    In a directory with no durable name yet (a new queue, any queue after a reset, a new index
    directory) one new file's name waits for the next flush; a second new file before that
    flush fsynced the directory at once, in the dispatch, on the loop. Now a worker makes the
    names durable first and the batch is dispatched again: the queues and the index come out
    as before, and every directory fsync ran off the loop."""
    class Watched(FsyncHooked):
        def __init__(self):
            super().__init__()
            self.loop_thread: int | None = None
            self.on_loop: list[str] = []
            self.off_loop: list[str] = []

        def before_fsync_of(self, path):
            if os.path.isdir(path) and self.loop_thread is not None:
                (self.on_loop if threading.get_ident() == self.loop_thread else self.off_loop).append(path)

    async def scenario(s: Store, fs: Watched, log: FakeLog) -> None:
        fs.loop_thread = threading.get_ident()
        s.d.start()
        await until(lambda: s.d.position == log.end)
        await s.d.stop()

    log = FakeLog()
    for i in range(3 * UPF + 2):                      # one new queue: four files
        log.append("TopicA", 0, keys=f"k{i}", uniq=f"U{i:08d}")   # 2 index entries each: 5 index files
    for i in range(2 * UPF):                          # and a second new queue: two files
        log.append("TopicB", 1)
    fs = Watched()
    s = Store(log, tmp_path, fs=fs, flush_interval_ms=60_000)
    s.recover(log)
    asyncio.run(scenario(s, fs, log))
    assert fs.on_loop == [], f"directory fsyncs on the event loop: {fs.on_loop}"
    assert {os.path.basename(p) for p in fs.off_loop} >= {"0", "1", "index"}
    assert cq_contents(s) == expected_cqs(log)
    # Each entry once: the batches dispatched again skip what they indexed (the index rolled).
    assert len(s.index.files) > 1 and sum(f.entries for f in s.index.files) == 2 * (3 * UPF + 2)
    assert all(s.index.query("TopicA", f"k{i}", 0, 2**62, 4) == [phys]
               for i, (phys, _) in enumerate(log.records[:3 * UPF + 2]))
    s.close()


def test_regression_expiry_never_waits_on_the_event_loop_for_a_flush_in_progress(tmp_path):
    """The broker expires consume-queue and index files on its event loop every retention
    pass. Closing a file takes the lock a flush holds across its fsync (on a worker thread),
    so the loop waited for that fsync: seconds on a slow disk, with Raft's heartbeats and HA's
    pushes waiting too. Now a queue whose flush is in progress keeps its expired files until
    the next pass (its min offset is raised at once all the same), and index files leave the
    set on the loop and are closed and removed by the reaper's thread."""
    class Gated(FsyncHooked):
        def __init__(self):
            super().__init__()
            self.hold, self.entered = "", threading.Event()
            self.gate = threading.Event()
            self.gate.set()

        def before_fsync_of(self, path):
            if self.hold and self.hold in path and not self.gate.is_set():
                self.entered.set()
                assert self.gate.wait(10)

        def holding(self, part: str) -> None:
            self.hold = part
            self.entered.clear()
            self.gate.clear()
            # Were the loop to wait for the fsync, only this would free it: the check below
            # then finds the gate open.
            threading.Timer(3.0, self.gate.set).start()

    def append(log: FakeLog, start: int, n: int) -> None:
        for i in range(start, start + n):
            log.append("TopicA", 0, keys=f"k{i}", uniq=f"U{i:08d}")

    async def flush_held(s: Store, fs: Gated, part: str) -> asyncio.Task:
        fs.holding(part)
        flushing = asyncio.ensure_future(s.d.flush_in_background())
        await until(fs.entered.is_set)
        return flushing

    async def scenario() -> None:
        log = FakeLog()
        append(log, 0, 40)                                # one queue: 8 files of UPF units
        fs = Gated()
        fs.reaper = FileReaper()
        s = Store(log, tmp_path, fs=fs, flush_interval_ms=60_000)
        s.recover(log)
        s.d.start()
        await until(lambda: s.d.position == log.end)
        assert await s.d.flush_in_background()
        cq, min_phys = s.cqs.get("TopicA", 0), log.records[22][0]

        append(log, 40, 3)
        await until(lambda: s.d.position == log.end)
        cq_files_before = len(cq.file.segments)
        flushing = await flush_held(s, fs, os.path.join("consumequeue", "TopicA"))
        removed = s.cqs.delete_expired(min_phys)
        assert not fs.gate.is_set(), "the consume-queue expiry waited for a flush's fsync"
        assert removed == 0                               # the queue's files are the flush's now
        assert cq.min_offset == 22                        # raised at once all the same
        assert len(cq.file.segments) == cq_files_before
        fs.gate.set()
        assert await flushing

        append(log, 43, 3)
        await until(lambda: s.d.position == log.end)
        index_files_before = len(s.index.files)
        flushing = await flush_held(s, fs, os.path.join(str(tmp_path), "index"))
        expired = s.index.delete_expired(min_phys)
        assert not fs.gate.is_set(), "the index expiry waited for a flush's fsync"
        assert expired and len(s.index.files) == index_files_before - len(expired)
        fs.gate.set()
        assert await flushing
        assert fs.reaper.drain(10)
        assert not any(os.path.exists(os.path.join(s.index.directory, name)) for name in expired)

        on_disk = sorted(os.listdir(cq.directory))
        assert s.cqs.delete_expired(min_phys) == 4        # the next pass takes the queue's files
        assert fs.reaper.drain(10)
        assert sorted(os.listdir(cq.directory)) == on_disk[4:]
        rows: list = []
        while 22 + len(rows) < cq.max_offset:
            rows += cq.get_range(22 + len(rows), 100)
        assert rows == expected_cqs(log)[("TopicA", 0)][22:]
        assert s.index.query("TopicA", "k45", 0, 2**62, 5) == [log.records[45][0]]
        await s.d.stop()
        s.close()

    asyncio.run(scenario())

"""LocalLog: the standalone ReplicatedLog's flush policies, errors and lifecycle.

Method: each test runs its own event loop (asyncio.run) over a real or faulty
FileSystem; FileSystem wrappers count fsyncs, make them slow, or report a full
disk, so group commit, FLUSH_DISK_TIMEOUT, StoreFatal and DiskFull are observed
from the outside, as the broker sees them.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from datetime import datetime, timedelta

import pytest

from node.local_log import ASYNC_FLUSH, SYNC_FLUSH, LocalLog, LocalLogConfig, LocalLogConfigError
from node.replicated_log import PutStatus
from node.store import abort
from node.store.errors import DiskFull, StoreFatal
from node.store.fileio import FaultyFileSystem, FileSystem
from node.store.message import MessageDraft, decode_record
from node.store.retention import RetentionPolicy
from tests.loop_lag import LoopLag

SEG = 64 * 1024


def cfg(**kw) -> LocalLogConfig:
    base = dict(segment_size_bytes=SEG, flush_disk_type=SYNC_FLUSH, refuse_check_interval_ms=0)
    base.update(kw)
    return LocalLogConfig(**base)


def msg(body: bytes = b"hello", queue_id: int = 0, topic: str = "T") -> MessageDraft:
    return MessageDraft(topic, queue_id, body, {"TAGS": "a"}).seal()


class CountingFS(FileSystem):
    """Counts fsyncs of store files; optionally makes each one slow."""

    def __init__(self, fsync_delay_s: float = 0.0):
        self.fsyncs = 0
        self.delay = fsync_delay_s
        self.ratio: float | None = None
        self._lock = threading.Lock()

    def open(self, path):
        inner = super().open(path)
        fs = self

        class _H:
            path = inner.path

            def fsync(self):
                if fs.delay:
                    time.sleep(fs.delay)
                with fs._lock:
                    fs.fsyncs += 1
                inner.fsync()

            def __getattr__(self, name):
                return getattr(inner, name)

        return _H()

    def disk_usage_ratio(self, path):
        return self.ratio if self.ratio is not None else super().disk_usage_ratio(path)


def run(coro):
    return asyncio.run(coro)


def test_config_validation_names_the_bad_field():
    with pytest.raises(LocalLogConfigError, match="flush_disk_type"):
        LocalLogConfig(flush_disk_type="SOMETIMES").validate()


def test_sync_flush_acks_after_fsync_and_commits_only_flushed_bytes(tmp_path):
    async def go():
        log = LocalLog(FileSystem(), str(tmp_path), cfg())
        await log.start()
        [r] = await log.append([msg(b"one")])
        assert r.status is PutStatus.SEND_OK
        assert log.commitlog.flushed_offset >= r.physical_offset + r.size
        assert log.committed_position == log.commitlog.flushed_offset
        assert decode_record(log.read(r.physical_offset, r.size)).body == b"one"
        assert log.status()["role"] == "STANDALONE"
        await log.stop()
    run(go())


def test_group_commit_50_concurrent_appenders_share_fsyncs(tmp_path):
    fs = CountingFS(fsync_delay_s=0.002)

    async def go():
        log = LocalLog(fs, str(tmp_path), cfg())
        await log.start()
        before = fs.fsyncs
        results = await asyncio.gather(*(log.append([msg(bytes([i]) * 100)]) for i in range(50)))
        assert all(rs[0].status is PutStatus.SEND_OK for rs in results)
        used = fs.fsyncs - before
        assert 1 <= used < 50, f"{used} fsyncs for 50 appends: no group commit"
        assert len({rs[0].physical_offset for rs in results}) == 50
        await log.stop()
    run(go())


def test_slow_fsync_gives_flush_disk_timeout_and_the_data_still_lands(tmp_path):
    fs = CountingFS(fsync_delay_s=0.5)

    async def go():
        log = LocalLog(fs, str(tmp_path), cfg(sync_flush_timeout_ms=100))
        await log.start()
        t0 = time.monotonic()
        [r] = await log.append([msg(b"slow")])
        assert r.status is PutStatus.FLUSH_DISK_TIMEOUT
        assert time.monotonic() - t0 < 0.45, "the timeout must not wait for the fsync"
        end = await log.wait_committed(r.physical_offset, 3.0)
        assert end >= r.physical_offset + r.size
        await log.stop()
    run(go())


def test_eio_on_fsync_is_fatal_and_nothing_is_acked(tmp_path):
    fs = FaultyFileSystem(1)

    async def go():
        log = LocalLog(fs, str(tmp_path), cfg())
        await log.start()
        await log.append([msg(b"ok")])
        fs.fail_fsync = True
        with pytest.raises(StoreFatal):
            await log.append([msg(b"lost")])
        with pytest.raises(StoreFatal):
            await log.append([msg(b"later")])
        st = log.status()
        assert st["fatal_error"] and not st["accepting_writes"]
        await log.stop()
        assert abort.exists(fs, str(tmp_path)), "a fatal stop is not a clean stop"
    run(go())


def test_enospc_mid_batch_is_disk_full_and_the_log_stays_usable(tmp_path):
    fs = FaultyFileSystem(2)

    async def go():
        log = LocalLog(fs, str(tmp_path), cfg())
        await log.start()
        [first] = await log.append([msg(b"a" * 1000)])
        fs.write_budget_bytes = 500
        with pytest.raises(DiskFull):
            await log.append([msg(b"b" * 1000), msg(b"c" * 1000)])
        assert log.commitlog.max_offset == first.physical_offset + first.size
        assert log.queue_offset_of("T", 0) == 1
        fs.write_budget_bytes = None
        [r] = await log.append([msg(b"d")])
        assert (r.status, r.physical_offset, r.queue_offset) == (PutStatus.SEND_OK, first.size, 1)
        await log.stop()
    run(go())


def test_writes_are_refused_at_90_percent_disk(tmp_path):
    fs = CountingFS()

    async def go():
        log = LocalLog(fs, str(tmp_path), cfg())
        await log.start()
        fs.ratio = 0.90
        with pytest.raises(DiskFull, match="90"):
            await log.append([msg()])
        fs.ratio = 0.89
        [r] = await log.append([msg()])
        assert r.status is PutStatus.SEND_OK
        await log.stop()
    run(go())


def test_async_flush_acks_at_once_commits_written_and_flushes_in_background(tmp_path):
    async def go():
        log = LocalLog(FileSystem(), str(tmp_path), cfg(flush_disk_type=ASYNC_FLUSH, flush_interval_ms=20))
        await log.start()
        waiter = asyncio.create_task(log.wait_committed(0, 2.0))
        await asyncio.sleep(0)
        [r] = await log.append([msg(b"x")])
        assert r.status is PutStatus.SEND_OK
        assert log.committed_position == log.commitlog.max_offset
        assert await waiter == log.committed_position
        for _ in range(100):
            if log.commitlog.flushed_offset == log.commitlog.max_offset:
                break
            await asyncio.sleep(0.01)
        assert log.commitlog.flushed_offset == log.commitlog.max_offset
        assert await log.wait_committed(log.committed_position, 0.05) == log.committed_position
        await log.stop()
    run(go())


def test_scan_and_read_see_only_committed_records(tmp_path):
    fs = CountingFS(fsync_delay_s=0.3)

    async def go():
        log = LocalLog(fs, str(tmp_path), cfg(sync_flush_timeout_ms=50))
        await log.start()
        [r] = await log.append([msg(b"pending")])
        assert r.status is PutStatus.FLUSH_DISK_TIMEOUT
        if log.committed_position <= r.physical_offset:
            assert log.scan(r.physical_offset, 1 << 16).records == ()
            with pytest.raises(KeyError):
                log.read(r.physical_offset, r.size)
        await log.wait_committed(r.physical_offset, 2.0)
        assert [x.physical_offset for x in log.scan(0, 1 << 16).records] == [r.physical_offset]
        await log.stop()
    run(go())


def test_clean_stop_then_normal_recovery_crash_then_abnormal(tmp_path):
    fs = FaultyFileSystem(3)

    async def go():
        log = LocalLog(fs, str(tmp_path), cfg())
        await log.start()
        assert abort.exists(fs, str(tmp_path))
        acked = await log.append([msg(bytes([i]) * 300) for i in range(10)])
        await log.stop()
        assert not abort.exists(fs, str(tmp_path))

        log = LocalLog(fs, str(tmp_path), cfg(flush_disk_type=ASYNC_FLUSH, flush_interval_ms=10_000))
        await log.start()
        assert not log.recovery.abnormal
        assert log.committed_position == acked[-1].physical_offset + acked[-1].size
        await log.append([msg(b"unsynced" * 50)])
        fs.crash(torn=True)                      # no stop: the abort marker stays
        log.commitlog.close()

        log = LocalLog(fs, str(tmp_path), cfg())
        await log.start()
        assert log.recovery.abnormal
        assert log.committed_position == acked[-1].physical_offset + acked[-1].size
        for r in acked:
            assert log.read(r.physical_offset, r.size)
        await log.stop()
    run(go())


def test_init_queue_offsets_sets_the_next_offsets(tmp_path):
    async def go():
        log = LocalLog(FileSystem(), str(tmp_path), cfg())
        await log.start()
        log.init_queue_offsets({("T", 0): 100, ("T", 1): 7})
        [a, b] = await log.append([msg(queue_id=0), msg(queue_id=1)])
        assert (a.queue_offset, b.queue_offset) == (100, 7)
        assert (log.queue_offset_of("T", 0), log.queue_offset_of("T", 1), log.queue_offset_of("U", 0)) == (101, 8, 0)
        await log.stop()
    run(go())


def test_retention_tick_deletes_expired_segments_and_min_offset_rises(tmp_path):
    async def go():
        c = cfg(retention=RetentionPolicy(file_reserved_time_hours=1, delete_when="04"))
        fs = CountingFS()
        fs.ratio = 0.10
        log = LocalLog(fs, str(tmp_path), c)
        await log.start()
        for _ in range(4):
            await log.append([msg(b"z" * 40_000)])
        assert len(log.commitlog.files.segments) == 4
        at_four = datetime(2031, 3, 1, 4, 30)
        old = (at_four - timedelta(hours=2)).timestamp()
        for seg in log.commitlog.files.segments:
            os.utime(seg.path, (old, old))
        d = await log.retention_tick(at_four + timedelta(hours=1))
        assert d.delete_bases == (), "expired, but not the deleteWhen hour and the disk has room"
        d = await log.retention_tick(at_four)
        assert len(d.delete_bases) == 3, "every expired segment but the one being written"
        assert log.min_position == log.min_physical_offset == 3 * SEG
        assert len(log.commitlog.files.segments) == 1
        [r] = await log.append([msg(b"after")])
        assert r.status is PutStatus.SEND_OK
        await log.stop()
    run(go())


def test_a_restart_on_a_disk_full_to_the_last_block_takes_the_reserve_and_retention_puts_it_back(tmp_path, caplog):
    """Regression: a node whose disk had no block left could not start (the abort marker, its
    first write, met ENOSPC), so its retention, which would have freed the disk, never ran."""
    async def go():
        c = cfg(retention=RetentionPolicy(file_reserved_time_hours=1, delete_when="04"), reserve_bytes=8192)
        fs = FaultyFileSystem(7)
        log = LocalLog(fs, str(tmp_path), c)
        await log.start()
        assert os.path.getsize(log.reserve.path) == 8192
        for _ in range(4):
            await log.append([msg(b"z" * 40_000)])
        await log.stop()
        fs.write_budget_bytes = 0                    # not one block left
        with pytest.raises(OSError):                 # what happened before, and without a reserve
            LocalLog(fs, str(tmp_path / "other"), cfg()).reserve.using(
                lambda: abort.create(fs, str(tmp_path)), "a write with no reserve to give up")
        log = LocalLog(fs, str(tmp_path), c)
        await log.start()                            # the abort marker took the reserve's room
        assert log.reserve.given_up == 1 and "the 8192-byte reserve" in caplog.text
        assert not os.path.exists(log.reserve.path), "its room is left to the node until retention frees more"
        at_four = datetime(2031, 3, 1, 4, 30)
        old = (at_four - timedelta(hours=2)).timestamp()
        for seg in log.commitlog.files.segments:
            os.utime(seg.path, (old, old))
        d = await log.retention_tick(at_four)
        assert len(d.delete_bases) == 3
        assert os.path.getsize(log.reserve.path) == 8192, "put back from the room the deletion made"
        await log.stop()
    run(go())


def test_append_after_stop_raises(tmp_path):
    async def go():
        log = LocalLog(FileSystem(), str(tmp_path), cfg())
        await log.start()
        await log.stop()
        with pytest.raises(StoreFatal):
            await log.append([msg()])
    run(go())


def test_regression_the_commitlog_recovers_off_the_event_loop(tmp_path, monkeypatch):
    """A DLedger node's recovery on the event loop blocked it 240-480 ms at each restart; the
    commitlog's recovery ran there too. It runs on a worker thread: held for 0.3 s, the loop
    never stalls, and the log starts from what the recovery found."""
    import node.local_log as local_log
    real, threads = local_log.recover, []

    def slow_recover(*args):
        threads.append(threading.current_thread() is threading.main_thread())
        time.sleep(0.3)
        return real(*args)
    monkeypatch.setattr(local_log, "recover", slow_recover)

    async def scenario():
        log = LocalLog(FileSystem(), str(tmp_path), cfg())
        try:
            async with LoopLag() as lag:
                await log.start()
                (result,) = await log.append([msg(b"after recovery")])
                assert result.status is PutStatus.SEND_OK
        finally:
            await log.stop()
        return lag.worst_s
    worst = run(scenario())
    assert threads == [False]
    assert worst < 0.2, f"the event loop stalled {worst * 1000:.0f} ms during recovery"

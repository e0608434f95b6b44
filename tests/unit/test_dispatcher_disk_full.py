"""Regression: a full disk must not stop the dispatcher (found by the disk_full drill).

With the store's disk at 100 %, the commitlog refuses appends (DiskFull, HTTP 507) and the
node must keep serving; but the dispatcher's periodic checkpoint save hit ENOSPC, the
dispatcher task died and the whole node stopped ("fatal store error, stopping: [Errno 28]").
A checkpoint written with write_atomic either replaces the old file or leaves it untouched,
so on ENOSPC the dispatcher keeps the old one and tries again at the next flush.
"""

from __future__ import annotations

import asyncio
import errno

from node.store.checkpoint import Checkpoint
from node.store.fileio import FileSystem
from tests.unit.test_dispatcher import FakeLog, Store


class FullDiskFileSystem(FileSystem):
    """Real files; while `full`, an atomic write fails with ENOSPC as on a full disk."""

    def __init__(self) -> None:
        self.full = False
        self.refused = 0

    def write_atomic(self, path: str, data: bytes) -> None:
        if self.full:
            self.refused += 1
            raise OSError(errno.ENOSPC, "No space left on device", path + ".tmp")
        super().write_atomic(path, data)


def _saved_offset(fs: FileSystem, root: str) -> int:
    cp = Checkpoint(fs, root)
    assert cp.load()
    return cp.committed_offset


def test_checkpoint_enospc_keeps_the_old_checkpoint_and_retries(tmp_path):
    fs = FullDiskFileSystem()
    log = FakeLog()
    s = Store(log, tmp_path, fs=fs)
    for i in range(3):
        log.append("T", 0, body=b"m%d" % i)
    s.d.dispatch_once()
    assert s.d.flush()
    first = _saved_offset(fs, str(tmp_path))

    log.append("T", 0, body=b"later")
    s.d.dispatch_once()
    fs.full = True
    assert s.d.flush() is False                       # no exception: nothing saved this time
    assert fs.refused == 1
    assert s.d.flushed_position < s.d.position         # so the next flush tries again
    assert _saved_offset(fs, str(tmp_path)) == first   # the old checkpoint is intact

    fs.full = False
    assert s.d.flush()
    assert s.d.flushed_position == s.d.position
    assert _saved_offset(fs, str(tmp_path)) > first
    s.close()


def test_run_loop_survives_a_full_disk(tmp_path):
    fs = FullDiskFileSystem()
    log = FakeLog()
    s = Store(log, tmp_path, fs=fs, flush_interval_ms=10)

    async def scenario():
        task = asyncio.create_task(s.d.run())
        fs.full = True
        for i in range(5):
            log.append("T", i % 2, body=b"x%d" % i)
            await asyncio.sleep(0.03)
        assert fs.refused >= 1 and not task.done() and s.d.failed is None
        fs.full = False
        await asyncio.sleep(0.1)
        assert not task.done()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(scenario())
    assert s.d.flushed_position == s.d.position
    s.close()


def test_regression_cq_and_index_enospc_pauses_dispatch_instead_of_stopping_the_node(tmp_path, monkeypatch):
    """Found by the disk_full drill (180 s matrix): with the classic node's disk at 100 %, an
    index-file write failed with "[Errno 28] short write to /store/index/...", the dispatcher
    task died and the node stopped. Now the batch is retried until there is room; the queues
    and the index end up exactly as a dispatch on a roomy disk makes them, nothing twice."""
    from node.store.fileio import FaultyFileSystem
    from tests.unit.test_dispatcher import cq_contents, expected_cqs

    fs = FaultyFileSystem(seed=7)
    log = FakeLog()
    s = Store(log, tmp_path, fs=fs, flush_interval_ms=10)

    async def scenario():
        task = asyncio.create_task(s.d.run())
        for i in range(6):
            log.append("T", i % 2, keys=f"k{i}", body=b"a%d" % i)
        await asyncio.sleep(0.1)
        assert s.d.position == log.committed_position
        fs.write_budget_bytes = 0                           # the disk is full from now on
        for i in range(6, 40):
            log.append("T", i % 2, keys=f"k{i}", body=b"b%d" % i)
        await asyncio.sleep(0.3)
        assert not task.done() and s.d.failed is None       # paused, not dead
        assert s.d.disk_full_errors >= 1
        assert s.d.position < log.committed_position              # the refused batch is not counted
        fs.write_budget_bytes = None                        # room again
        deadline = asyncio.get_running_loop().time() + 5
        while s.d.position < log.committed_position and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert not task.done()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    monkeypatch.setattr("node.store.dispatcher.DISK_FULL_RETRY_S", 0.05)
    asyncio.run(scenario())
    assert s.d.position == log.committed_position
    assert cq_contents(s) == expected_cqs(log)
    for i in (3, 6, 25, 39):
        assert s.index.query("T", f"k{i}", 0, 2**62, 5) == [log.records[i][0]], i
    s.close()


def test_regression_torn_cq_unit_on_a_full_disk_is_cut_and_the_retry_appends(tmp_path):
    """Found by the disk_full drill once dispatch retried instead of stopping: a consume-queue
    write that the full disk cut short left the file 12 bytes into a unit ("append at 8180,
    file end 8192") and the retry stopped the node. The torn part is cut back at once."""
    from node.store.fileio import FaultyFileSystem
    from tests.unit.test_dispatcher import cq_contents, expected_cqs

    fs = FaultyFileSystem(seed=3)
    log = FakeLog()
    s = Store(log, tmp_path, fs=fs)
    for i in range(4):
        log.append("T", 0, body=b"a%d" % i)
    s.d.dispatch_once()
    for i in range(4, 9):
        log.append("T", 0, body=b"b%d" % i)
    fs.short_write_bytes = 12                     # the next write longer than that stops there
    position = s.d.position
    try:
        s.d.dispatch_once()
    except OSError as e:
        assert e.errno == errno.ENOSPC
    else:
        raise AssertionError("the short write was not reported")
    assert s.d.position == position               # the batch is not counted as dispatched
    cq = next(iter(s.cqs.queues()))
    assert cq.max_offset == 4                     # no torn unit at the end
    s.d.dispatch_once()                           # room again: the retry appends where it stopped
    assert cq_contents(s) == expected_cqs(log)
    s.close()

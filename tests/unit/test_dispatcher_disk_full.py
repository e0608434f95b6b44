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

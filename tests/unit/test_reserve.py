"""DiskReserve (node/store/reserve.py): room kept for the writes that must come before a full
disk is freed."""

from __future__ import annotations

import errno
import os

from node.store.fileio import FileSystem
from node.store.reserve import RESTORE_ROOM_FACTOR, DiskReserve

SIZE = 8192


class RoomFs(FileSystem):
    """The real file system, reporting the free bytes the test sets."""

    free = 0

    def free_bytes(self, path: str) -> int:
        return self.free


def _full_once():
    calls = []

    def write() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
    return write, calls


def test_a_spent_reserve_comes_back_once_the_disk_has_room(tmp_path):
    """Regression (random-fault runs): a reserve given up on a full disk came back only after a
    retention deletion, so a node whose disk filled a second time and was restarted then could
    not write its meta at recovery and stopped. It now comes back on the periodic tick once
    the disk has room again, and not before."""
    fs = RoomFs()
    r = DiskReserve(fs, str(tmp_path), SIZE)
    assert r.ensure() and os.path.getsize(r.path) == SIZE
    write, calls = _full_once()
    r.using(write, "meta")
    assert len(calls) == 2 and r.given_up == 1 and not os.path.exists(r.path)
    assert not r.ensure(), "spent: an ordinary ensure leaves the room to the writes it was given for"
    fs.free = RESTORE_ROOM_FACTOR * SIZE - 1
    assert not r.restore_if_room() and not os.path.exists(r.path)
    fs.free = RESTORE_ROOM_FACTOR * SIZE
    assert r.restore_if_room() and os.path.getsize(r.path) == SIZE
    write, calls = _full_once()
    r.using(write, "meta again")                 # a second full disk finds it in place
    assert len(calls) == 2 and r.given_up == 2


def test_restore_if_room_leaves_a_reserve_in_place_and_a_zero_size_alone(tmp_path):
    fs = RoomFs()
    r = DiskReserve(fs, str(tmp_path), SIZE)
    assert r.ensure()
    mtime = os.stat(r.path).st_mtime_ns
    assert r.restore_if_room() and os.stat(r.path).st_mtime_ns == mtime
    none = DiskReserve(fs, str(tmp_path / "x"), 0)
    fs.free = 1 << 40
    assert not none.restore_if_room() and not os.path.exists(none.path)


class SlowRemoveFs(FileSystem):
    """Removing the reserve takes a while: two writers meeting a full disk overlap in it."""

    def remove(self, path: str) -> None:
        import time
        time.sleep(0.2)
        super().remove(path)


def test_two_writers_on_two_threads_give_the_reserve_up_once(tmp_path):
    """A DLedger node writes its term and vote on a worker thread (dledger/shell.py) while the
    event loop may write a retention cut's base state; both can meet the full disk at once.
    The reserve is given up once and both writes are tried again in its room. Before, both
    gave it up: the one file was removed twice and counted as given up twice."""
    import threading
    r = DiskReserve(SlowRemoveFs(), str(tmp_path), SIZE)
    assert r.ensure()
    outcomes: list[str] = []

    def writer() -> None:
        calls = []

        def write() -> None:
            calls.append(1)
            if len(calls) == 1:
                raise OSError(errno.ENOSPC, "No space left on device")
        try:
            r.using(write, "meta")
            outcomes.append("written")
        except OSError as e:
            outcomes.append("enospc" if e.errno == errno.ENOSPC else repr(e))

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert outcomes == ["written", "written"], outcomes
    assert r.given_up == 1 and not os.path.exists(r.path)

"""Retention's removals off the event loop (node/store/reaper.py, SegmentedFile.delete_head).

Regression: a retention pass removed each old file and fsynced its directory on the event
loop, one consume-queue file per queue and the commitlog's files, each fsync as long as a
busy disk makes it. The files now leave the set on the loop and the node's reaper thread
removes them, oldest first, each durable before the next."""

from __future__ import annotations

import os
import threading

import pytest

from node.store.errors import StoreFatal
from node.store.fileio import FaultyFileSystem, FileSystem
from node.store.reaper import FileReaper
from node.store.segment import SegmentedFile, segment_name

SEG = 100


class GatedDirSync(FileSystem):
    """Directory fsyncs wait at a gate while it is closed; removals are recorded in order."""

    def __init__(self):
        self.reaper = FileReaper()
        self.open_gate = threading.Event()
        self.open_gate.set()
        self.removed: list[str] = []

    def fsync_dir(self, path):
        assert self.open_gate.wait(10)
        super().fsync_dir(path)

    def remove(self, path):
        self.removed.append(os.path.basename(path))
        super().remove(path)


def filled(fs, root, files: int) -> SegmentedFile:
    sf = SegmentedFile(fs, str(root), SEG)
    for i in range(files):
        sf.ensure_writable().append(bytes([65 + i]) * SEG)
    sf.flush()
    return sf


def test_regression_delete_head_does_not_wait_for_the_directory_fsync(tmp_path):
    fs = GatedDirSync()
    sf = filled(fs, tmp_path, 4)
    fs.open_gate.clear()                       # a disk whose directory fsyncs take long
    try:
        done = threading.Event()
        result: list = []
        t = threading.Thread(target=lambda: (result.append(sf.delete_head(3 * SEG)), done.set()))
        t.start()
        assert done.wait(5), "delete_head waited for the directory fsync"
        assert [os.path.basename(p) for p in result[0]] == [segment_name(0), segment_name(SEG), segment_name(2 * SEG)]
        assert sf.start == 3 * SEG and len(sf.segments) == 1        # gone from the set at once
        assert sf.read(3 * SEG, SEG) == b"D" * SEG
    finally:
        fs.open_gate.set()
    assert fs.reaper.drain(10)
    assert fs.removed == [segment_name(0), segment_name(SEG), segment_name(2 * SEG)]   # oldest first
    assert sorted(os.listdir(tmp_path)) == [segment_name(3 * SEG)]


def test_each_removal_is_durable_before_the_next_so_a_crash_leaves_no_gap(tmp_path):
    """A crash while the reaper works keeps a prefix of the old files at most: they load as
    the head of the set, contiguous with the live ones."""
    for seed in range(20):
        root = tmp_path / str(seed)
        fs = FaultyFileSystem(seed=seed)
        fs.reaper = FileReaper()
        sf = filled(fs, root, 5)
        crashed = threading.Event()
        removals = seed % 4            # the crash comes after this many removals

        class Stop(Exception):
            pass
        real_remove = fs.remove

        def remove(path, _n=[0]):
            if _n[0] == removals:
                crashed.set()
                raise Stop()
            _n[0] += 1
            real_remove(path)
        fs.remove = remove
        sf.delete_head(4 * SEG)
        assert fs.reaper.drain(10) or crashed.is_set()
        fs.crash(new_names="random")
        fs.remove = real_remove
        again = SegmentedFile(FileSystem(), str(root), SEG)
        again.load()
        bases = [s.base for s in again.segments]
        assert bases == list(range(bases[0], 5 * SEG, SEG)), (seed, bases)   # contiguous to the end
        assert bases[0] <= min(removals, 4) * SEG


def test_a_failed_removal_stops_the_rest_and_the_next_delete_is_fatal(tmp_path):
    class FailingRemove(FileSystem):
        def __init__(self):
            self.reaper = FileReaper()
            self.fail = False

        def remove(self, path):
            if self.fail:
                raise OSError(5, "Input/output error (test)")
            super().remove(path)

    fs = FailingRemove()
    sf = filled(fs, tmp_path, 4)
    fs.fail = True
    sf.delete_head(2 * SEG)
    assert fs.reaper.drain(10)
    assert sorted(os.listdir(tmp_path)) == [segment_name(i * SEG) for i in range(4)]   # none removed: no gap
    with pytest.raises(StoreFatal, match="removing old files"):
        sf.delete_head(3 * SEG)
    sf.close()


def test_a_name_made_live_again_is_not_removed(tmp_path):
    """A reset that creates a file of a name still waiting for removal keeps it."""
    fs = FileSystem()
    fs.reaper = FileReaper()
    sf = filled(fs, tmp_path, 3)
    busy = threading.Event()
    fs.reaper.submit(lambda: busy.wait(10))   # the reaper is busy with an earlier job
    try:
        sf.delete_head(2 * SEG)                # 0 and 100 wait for the reaper
        sf.reset_to(0)                          # 0 is a live name again
    finally:
        busy.set()
    assert fs.reaper.drain(10)
    assert sorted(os.listdir(tmp_path)) == [segment_name(0)]
    sf.ensure_writable().append(b"z" * 10)
    assert sf.read(0, 10) == b"z" * 10
    sf.close()


def test_close_waits_for_the_set_s_removals(tmp_path):
    fs = GatedDirSync()
    sf = filled(fs, tmp_path, 3)
    sf.delete_head(2 * SEG)
    sf.close()
    assert sorted(os.listdir(tmp_path)) == [segment_name(2 * SEG)]


def test_the_reaper_runs_jobs_in_order_and_a_full_queue_makes_the_caller_wait_for_room():
    """Order is what keeps a crash from leaving a gap: a job that meets a full queue waits for
    room rather than running at once ahead of older removals."""
    reaper = FileReaper(max_pending=1)
    gate, seen = threading.Event(), []
    reaper.submit(lambda: (gate.wait(10), seen.append(0)))
    for _ in range(100):                        # the first job is running (out of the queue)
        if reaper._jobs.empty():
            break
        threading.Event().wait(0.01)
    reaper.submit(lambda: seen.append(1))       # fills the queue
    third = threading.Thread(target=lambda: reaper.submit(lambda: seen.append(2)))
    third.start()
    third.join(0.2)
    assert third.is_alive() and seen == []      # waiting for room, not run ahead
    gate.set()
    third.join(10)
    assert reaper.drain(10)
    assert seen == [0, 1, 2] and reaper.waited_for_room == 1


def test_expired_index_files_are_removed_by_the_reaper_too(tmp_path):
    from node.store.index_file import IndexService
    fs = GatedDirSync()
    idx = IndexService(fs, str(tmp_path), hash_slots=3, max_entries=3)   # 2 entries per file
    idx.load()
    for i in range(6):
        idx.put("T", "k", i * 10, 1_700_000_000_000 + i)
    idx.flush()
    first = idx.files[0]
    fs.open_gate.clear()
    try:
        assert idx.delete_expired(25) == [first.name]      # returns with the directory fsync held
        assert idx.query("T", "k", 0, 2**62, 32) == [50, 40, 30, 20]
    finally:
        fs.open_gate.set()
    idx.close()                                             # waits for the removal
    assert not os.path.exists(first.path)

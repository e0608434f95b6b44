"""FaultyFileSystem does what the crash tests rely on, and SegmentedFile durability on top of it.

Method: write through FaultyFileSystem handles, fsync some, crash, and read the
files back with plain os calls.
"""

from __future__ import annotations

import errno
import os

import pytest

from node.store.errors import StoreFatal
from node.store.fileio import FaultyFileSystem
from node.store.segment import SegmentedFile


def raw(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_crash_loses_unsynced_writes_and_keeps_synced_ones(tmp_path):
    fs = FaultyFileSystem(0)
    f = fs.open(str(tmp_path / "a"))
    fs.fsync_dir(str(tmp_path))
    f.pwrite(b"durable", 0)
    f.fsync()
    f.pwrite(b"LOST", 0)
    f.pwrite(b"tail", 7)
    fs.crash()
    assert raw(str(tmp_path / "a")) == b"durable"


def test_crash_loses_a_file_whose_directory_was_never_fsynced(tmp_path):
    fs = FaultyFileSystem(0)
    kept, lost = str(tmp_path / "kept"), str(tmp_path / "lost")
    for p in (kept, lost):
        f = fs.open(p)
        f.pwrite(b"data", 0)
        f.fsync()                      # its bytes are durable, its name is not yet
        if p == kept:
            fs.fsync_dir(str(tmp_path))
    fs.crash()
    assert raw(kept) == b"data" and not os.path.exists(lost)


def test_segments_created_by_appends_survive_a_crash_once_flushed_and_only_the_newest_can_go(tmp_path):
    """An append's new segment has its directory entry fsynced by the next flush, not at
    once; a second new segment before that flush fsyncs the directory itself, so a crash
    never leaves a hole between segments (load() refuses one)."""
    fs = FaultyFileSystem(0)
    d = str(tmp_path / "seg")
    sf = SegmentedFile(fs, d, 8)
    sf.ensure_writable(0).append(b"A" * 8)
    sf.ensure_writable(0).append(b"B" * 8)          # a second new segment: the first one's name synced now
    sf.ensure_writable(0).append(b"C" * 4)
    fs.crash()
    assert sorted(os.listdir(d)) == ["00000000000000000000", "00000000000000000008"]
    sf2 = SegmentedFile(fs, d, 8)
    sf2.load()                                      # contiguous: no StoreFatal
    sf3 = SegmentedFile(fs, str(tmp_path / "seg2"), 8)
    sf3.ensure_writable(0).append(b"A" * 8)
    sf3.ensure_writable(0).append(b"B" * 4)
    assert sf3.flush() == 12
    fs.crash()
    assert sorted(os.listdir(str(tmp_path / "seg2"))) == ["00000000000000000000", "00000000000000000008"]


def test_regression_a_restarted_file_set_rolls_before_its_first_flush_without_a_directory_fsync(tmp_path):
    """The names a start finds are made durable by load() (run off the event loop at a start),
    not by the first roll: a roll before the first flush fsynced the directory on the loop
    (805 ms on a slow disk in a random-fault run). Still, a crash then keeps every file."""
    fs = FaultyFileSystem(0)
    d = str(tmp_path / "seg")
    sf = SegmentedFile(fs, d, 8)
    sf.ensure_writable(0).append(b"A" * 8)
    assert sf.flush() == 8
    sf.close()
    sf = SegmentedFile(fs, d, 8)
    sf.load()
    sf.set_end(8)
    calls: list[str] = []
    real = fs.fsync_dir
    fs.fsync_dir = lambda path: (calls.append(path), real(path))
    sf.ensure_writable(8).append(b"B" * 8)         # the restart's first roll, before any flush
    sf.ensure_writable(16).append(b"C" * 4)        # and a second one
    assert calls == [], "a roll fsynced the directory"
    assert sf.flush() == 20 and calls == [d]       # the flush syncs the new names, once
    fs.crash()
    assert sorted(os.listdir(d)) == [f"{i:020d}" for i in (0, 8, 16)]


def test_torn_crash_keeps_at_most_a_prefix_of_the_last_write(tmp_path):
    seen = set()
    for seed in range(40):
        fs = FaultyFileSystem(seed)
        p = str(tmp_path / f"t{seed}")
        f = fs.open(p)
        fs.fsync_dir(str(tmp_path))
        f.truncate(16)
        f.fsync()
        f.pwrite(b"ABCDEFGHIJKLMNOP", 0)
        fs.crash(torn=True)
        got = raw(p)
        kept = len(got.rstrip(b"\x00"))
        assert got[:kept] == b"ABCDEFGHIJKLMNOP"[:kept]
        seen.add(kept)
        f.close()
    assert 0 in seen and len(seen) > 3, "torn crashes should keep varied prefixes"


def test_write_budget_gives_enospc_without_writing(tmp_path):
    fs = FaultyFileSystem(0)
    fs.write_budget_bytes = 10
    f = fs.open(str(tmp_path / "b"))
    f.pwrite(b"12345", 0)
    with pytest.raises(OSError) as e:
        f.pwrite(b"123456", 5)
    assert e.value.errno == errno.ENOSPC
    assert raw(str(tmp_path / "b")) == b"12345"


def test_fail_fsync_is_eio_and_segment_flush_turns_it_fatal(tmp_path):
    fs = FaultyFileSystem(0)
    sf = SegmentedFile(fs, str(tmp_path / "seg"), 4096)
    sf.load()
    sf.ensure_writable(0).append(b"x" * 100)
    fs.fail_fsync = True
    with pytest.raises(StoreFatal):
        sf.flush()
    assert sf.flushed == 0, "a failed fsync must not advance the flushed offset"


def test_segment_truncate_is_durable_across_a_crash(tmp_path):
    fs = FaultyFileSystem(0)
    sf = SegmentedFile(fs, str(tmp_path / "seg"), 4096)
    sf.load()
    seg = sf.ensure_writable(0)
    seg.append(b"y" * 3000)
    sf.flush()
    sf.truncate(1000)
    fs.crash(torn=True)
    data = raw(seg.path)
    assert data[:1000] == b"y" * 1000
    assert data[1000:] == bytes(4096 - 1000), "truncated bytes came back after a crash"
    assert sorted(os.listdir(tmp_path / "seg")) == ["00000000000000000000"]


# --- regressions ---------------------------------------------------------------------------
def test_regression_enospc_budget_is_not_charged_for_overwrites(tmp_path):
    """FaultyFileSystem used to charge every written byte against its budget, so rewriting
    bytes already on disk (a consume-queue repair, a header rewrite) hit ENOSPC where a real
    disk would not. Only newly allocated bytes count."""
    fs = FaultyFileSystem(0)
    fs.write_budget_bytes = 100
    f = fs.open(str(tmp_path / "o"))
    f.pwrite(b"x" * 80, 0)
    assert fs.write_budget_bytes == 20
    for _ in range(10):
        f.pwrite(b"y" * 80, 0)                       # overwrite: free
    f.pwrite(b"z" * 30, 60)                          # 20 old bytes + 10 new
    assert fs.write_budget_bytes == 10
    with pytest.raises(OSError) as e:
        f.pwrite(b"w" * 20, 90)                      # 20 new bytes, 10 left
    assert e.value.errno == errno.ENOSPC
    assert raw(str(tmp_path / "o")) == b"y" * 60 + b"z" * 30


def test_regression_enospc_budget_charges_filling_sparse_holes(tmp_path):
    """Segment files are created at full size, sparse: writing into the hole allocates space
    and must be charged, and a file reopened later knows which of its bytes exist."""
    fs = FaultyFileSystem(0)
    sf = SegmentedFile(fs, str(tmp_path / "seg"), 4096)
    sf.load()
    seg = sf.ensure_writable(0)
    fs.write_budget_bytes = 1000
    seg.append(b"a" * 600)
    assert fs.write_budget_bytes == 400
    with pytest.raises(OSError) as e:
        seg.append(b"b" * 600)
    assert e.value.errno == errno.ENOSPC
    assert seg.write_pos == 600, "a write refused before writing anything leaves the end alone"
    seg.handle.pwrite(b"c" * 600, 0)                 # rewrite of allocated bytes: free
    assert fs.write_budget_bytes == 400
    sf.flush()
    sf.close()
    fs2 = FaultyFileSystem(0)                        # a fresh view learns allocation from the kernel
    fs2.write_budget_bytes = 0
    h = fs2.open(seg.path)
    h.pwrite(b"d" * 100, 0)                          # inside the allocated first block: free
    with pytest.raises(OSError):
        h.pwrite(b"e" * 10, 8000)                     # past the file: new bytes
    h.close()


def test_regression_filesystem_has_mtime_and_retention_reads_it_through_the_layer(tmp_path):
    """FileSystem had no mtime, so retention stat'ed files behind the file layer and tests
    could not age a file without touching the real clock."""
    from datetime import datetime

    from node.store.commitlog import CommitLog
    from node.store.message import MessageDraft
    from node.store.queue_offsets import QueueOffsetTable
    from node.store.retention import RetentionPolicy, apply

    fs = FaultyFileSystem(0)
    p = str(tmp_path / "m")
    fs.open(p).close()
    assert abs(fs.mtime(p) - os.stat(p).st_mtime) < 1e-6
    cl = CommitLog(fs, str(tmp_path / "commitlog"), 4096, b"\x7f\x00\x00\x01", 1)
    cl.load()
    qt = QueueOffsetTable()
    for _ in range(3):
        cl.append_batch([MessageDraft("T", 0, b"q" * 3000, {}).seal()], qt, 1)
    now = datetime(2030, 6, 1, 4, 15)
    old = now.timestamp() - 100 * 3600
    paths = [s.path for s in cl.files.segments]
    fs.mtimes.update({paths[0]: old, paths[1]: now.timestamp(), paths[2]: now.timestamp()})
    decision = apply(cl, RetentionPolicy(), now, 0.2, safe_upto=cl.max_offset)
    assert decision.delete_bases == (0,)
    assert not os.path.exists(paths[0]) and os.path.exists(paths[1])


def test_allocation_extents_match_a_byte_set_model():
    """The ENOSPC accounting's range set agrees with a plain set of bytes under random
    writes and truncations (sorted, disjoint, never touching)."""
    import random

    from node.store.fileio import _Extents

    rng = random.Random(5)
    for _ in range(200):
        ext, model = _Extents(), set()
        for _ in range(40):
            if rng.random() < 0.8:
                lo = rng.randrange(200)
                hi = lo + rng.randrange(0, 40)
                assert ext.covered(lo, hi) == sum(1 for x in range(lo, hi) if x in model)
                a = rng.randrange(200)
                b = a + rng.randrange(1, 30)
                ext.add(a, b)
                model.update(range(a, b))
            else:
                c = rng.randrange(230)
                ext.cut(c)
                model = {x for x in model if x < c}
            pairs = list(zip(ext.starts, ext.ends))
            assert all(a < b for a, b in pairs)
            assert all(pairs[k - 1][1] < pairs[k][0] for k in range(1, len(pairs)))
            assert {x for a, b in pairs for x in range(a, b)} == model

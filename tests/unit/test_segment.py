"""Segment files: naming, roll, reads never crossing files, durable truncation."""

import os
import random

import pytest

from node.store.errors import StoreFatal
from node.store.fileio import FaultyFileSystem, FileSystem
from node.store.segment import ORPHAN_SUFFIX, SegmentedFile, segment_name


def test_segments_are_named_by_20_digit_base_and_preallocated(tmp_path):
    sf = SegmentedFile(FileSystem(), str(tmp_path), 1024)
    seg = sf.ensure_writable()
    seg.append(b"a" * 1024)
    sf.ensure_writable().append(b"b")
    assert sorted(os.listdir(tmp_path)) == [segment_name(0), segment_name(1024)]
    assert segment_name(1024) == "00000000000000001024"
    assert os.path.getsize(tmp_path / segment_name(1024)) == 1024
    assert sf.read(1020, 100) == b"aaaa"            # stops at the file's end
    assert sf.read(1024, 10) == b"b"


def test_truncate_zeroes_the_tail_durably_and_removes_later_files(tmp_path):
    fs = FaultyFileSystem(seed=1)
    sf = SegmentedFile(fs, str(tmp_path), 100)
    sf.ensure_writable().append(b"x" * 100)
    sf.ensure_writable().append(b"y" * 50)
    sf.flush()
    report = sf.truncate(60)
    assert report.removed_files and report.zeroed_bytes == 40
    fs.crash()                                     # nothing of the truncated tail comes back
    sf2 = SegmentedFile(FileSystem(), str(tmp_path), 100)
    sf2.load()
    assert len(sf2.segments) == 1
    assert sf2.read(0, 100) == b"x" * 60 + bytes(40)


def test_crash_loses_only_unsynced_writes(tmp_path):
    fs = FaultyFileSystem(seed=2)
    sf = SegmentedFile(fs, str(tmp_path), 100)
    seg = sf.ensure_writable()
    seg.append(b"durable")
    sf.flush()
    seg.append(b"volatile")
    fs.crash()
    assert open(tmp_path / segment_name(0), "rb").read(15) == b"durable" + bytes(8)


def test_delete_head_keeps_the_last_segment(tmp_path):
    sf = SegmentedFile(FileSystem(), str(tmp_path), 10)
    for _ in range(3):
        sf.ensure_writable().append(b"z" * 10)
    removed = sf.delete_head(10 ** 9)
    assert len(removed) == 2 and sf.start == 20


# --- regressions ---------------------------------------------------------------------------
def test_regression_short_write_advances_write_pos_over_the_bytes_that_landed(tmp_path):
    """A short write used to leave write_pos at the old end while the file held new bytes,
    so the owner's truncate back to the batch start did not clear them."""
    import errno

    import pytest

    from node.store.fileio import ShortWrite

    fs = FaultyFileSystem(seed=3)
    sf = SegmentedFile(fs, str(tmp_path), 4096)
    seg = sf.ensure_writable()
    seg.append(b"a" * 100)
    fs.short_write_bytes = 30
    with pytest.raises(ShortWrite) as e:
        seg.append(b"b" * 200)
    assert e.value.errno == errno.ENOSPC and e.value.written == 30
    assert seg.write_pos == 130 and sf.end == 130, "write_pos must cover the bytes in the file"
    assert sf.read(0, 4096) == b"a" * 100 + b"b" * 30
    report = sf.truncate(100)
    assert report.zeroed_bytes == 30
    assert open(tmp_path / segment_name(0), "rb").read(300) == b"a" * 100 + bytes(200)
    assert seg.append(b"c") == 100                   # the next write goes where the batch began


def test_regression_read_past_the_data_end_inside_a_segment_returns_empty(tmp_path):
    """SegmentedFile.read at an offset past the data end but inside the last file used to
    pass a negative length to pread (EINVAL)."""
    sf = SegmentedFile(FileSystem(), str(tmp_path), 1024)
    sf.ensure_writable().append(b"0123456789")
    assert sf.read(5, 100) == b"56789"               # the bytes that exist
    assert sf.read(10, 100) == b""                   # exactly at the end
    assert sf.read(500, 100) == b""                  # past the end, inside the file
    assert sf.read(2048, 10) == b""                  # past every file
    assert sf.read(3, 0) == b"" and sf.read(3, -5) == b""
    seg = sf.last()
    assert seg.read(1024, 10) == b"" and seg.read(1000, -1) == b""


class _CountingFS(FileSystem):
    """Counts bytes written through its handles."""

    def __init__(self):
        self.written = 0

    def open(self, path):
        handle = super().open(path)
        outer = self

        class Counting:
            def __getattr__(self, name):
                return getattr(handle, name)

            def pwrite(self, data, offset):
                outer.written += len(data)
                return handle.pwrite(data, offset)

        c = Counting()
        c.path = handle.path
        return c


def test_regression_truncate_after_load_punches_a_hole_instead_of_writing_zeros(tmp_path):
    """After load() every segment counts as full (end unknown), and truncate used to write
    zeros up to the whole capacity: gigabytes for a 1 GiB commitlog file."""
    size = 64 << 20
    sf = SegmentedFile(FileSystem(), str(tmp_path), size)
    sf.ensure_writable().append(b"r" * 5000)
    sf.flush()
    sf.close()
    fs = _CountingFS()
    sf2 = SegmentedFile(fs, str(tmp_path), size)
    sf2.load()
    assert sf2.end == size                           # unknown end: the whole file
    report = sf2.truncate(1000)
    assert fs.written == 0, "truncate must not write zeros"
    assert report.zeroed_bytes == size - 1000
    assert sf2.end == 1000
    path = tmp_path / segment_name(0)
    assert os.path.getsize(path) == size             # still full size (sparse)
    with open(path, "rb") as f:
        data = f.read(8192)
    assert data == b"r" * 1000 + bytes(8192 - 1000)
    assert os.stat(path).st_blocks * 512 < 1 << 20, "the cut range must be a hole, not zeros on disk"


class _DirSyncs(FaultyFileSystem):
    """Counts directory fsyncs."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.dir_syncs = 0

    def fsync_dir(self, path):
        self.dir_syncs += 1
        super().fsync_dir(path)


def test_regression_new_segments_before_a_flush_leave_the_directory_fsync_to_the_flush(tmp_path):
    """A second new file before the next flush used to fsync the directory on the append path
    (at most one name could wait): 1.5-2.4 s event-loop stalls on a slow disk in the random-fault
    runs. Once the directory holds a durable name, any number of new names wait for the flush."""
    fs = _DirSyncs()
    sf = SegmentedFile(fs, str(tmp_path), 100)
    sf.ensure_writable().append(b"a" * 100)
    sf.flush()                                      # the first name is durable: the directory is anchored
    synced = fs.dir_syncs
    for i in range(5):                              # five new files, no flush between them
        sf.ensure_writable().append(bytes([98 + i]) * 100)
    assert fs.dir_syncs == synced, "an append must not fsync the directory"
    sf.flush()
    assert fs.dir_syncs == synced + 1               # one fsync for all five names, before the data's


def test_a_new_directory_syncs_its_second_new_file_at_once(tmp_path):
    """With no durable name yet, a crash could keep a later file without the first one and
    nothing would show the gap: the second new file fsyncs the directory at once."""
    fs = _DirSyncs()
    sf = SegmentedFile(fs, str(tmp_path), 100)
    sf.ensure_writable().append(b"a" * 100)
    assert fs.dir_syncs == 0
    sf.ensure_writable().append(b"b")
    assert fs.dir_syncs == 1
    sf.ensure_writable().append(b"b" * 99)
    sf.ensure_writable().append(b"c")               # anchored now: this one waits
    assert fs.dir_syncs == 1


def test_opened_files_count_as_a_waiting_name(tmp_path):
    """Names found at load may not be durable yet (a process crash keeps them in the page
    cache only): they wait for the next directory fsync like a new one, so a new file before
    the first flush fsyncs the directory."""
    sf = SegmentedFile(FileSystem(), str(tmp_path), 100)
    sf.ensure_writable().append(b"a" * 100)
    sf.flush()
    sf.close()
    fs = _DirSyncs()
    sf = SegmentedFile(fs, str(tmp_path), 100)
    sf.load()
    sf.set_end(100)
    sf.ensure_writable().append(b"b" * 100)         # a name waits already (the opened ones)
    assert fs.dir_syncs == 1
    sf.ensure_writable().append(b"c" * 100)         # anchored by that fsync: these wait
    sf.ensure_writable().append(b"d")
    assert fs.dir_syncs == 1
    sf.flush()
    assert fs.dir_syncs == 2


@pytest.mark.parametrize("seed", range(40))
def test_a_crash_that_keeps_a_later_new_file_without_an_earlier_one_loses_no_flushed_byte(tmp_path, seed):
    """Appends over many small files, flushes now and then, a crash that keeps each unsynced
    name or not: every flushed byte is back, the files load contiguous, and files after a
    gap are set aside (renamed, not deleted)."""
    rng = random.Random(seed)
    fs = FaultyFileSystem(seed)
    sf = SegmentedFile(fs, str(tmp_path), 64)
    data = bytearray()
    flushed = 0
    for _ in range(rng.randrange(20, 80)):
        seg = sf.ensure_writable()
        chunk = bytes(rng.randrange(1, 256) for _ in range(rng.randrange(1, seg.remaining + 1)))
        seg.append(chunk)
        data += chunk
        if rng.random() < 0.1:
            flushed = sf.flush()
    fs.crash(torn=True, new_names="random")
    sf2 = SegmentedFile(FileSystem(), str(tmp_path), 64)
    sf2.load()
    bases = [s.base for s in sf2.segments]
    assert bases == list(range(0, 64 * len(bases), 64)), "segments must load contiguous"
    assert sf2.end >= flushed
    assert b"".join(sf2.read(o, 64) for o in range(0, flushed, 64))[:flushed] == bytes(data[:flushed])
    orphans = sorted(n for n in os.listdir(tmp_path) if n.endswith(ORPHAN_SUFFIX))
    assert all(int(n[:-len(ORPHAN_SUFFIX)]) > sf2.end for n in orphans)
    sf2.close()


def test_files_after_a_gap_are_set_aside_and_the_segments_end_at_it(tmp_path, caplog):
    sf = SegmentedFile(FileSystem(), str(tmp_path), 100)
    for c in b"abcd":
        sf.ensure_writable().append(bytes([c]) * 100)
    sf.flush()
    sf.close()
    os.remove(tmp_path / segment_name(200))
    sf2 = SegmentedFile(FileSystem(), str(tmp_path), 100)
    sf2.load()
    assert [s.base for s in sf2.segments] == [0, 100] and sf2.end == 200
    assert sorted(os.listdir(tmp_path)) == [segment_name(0), segment_name(100), segment_name(300) + ORPHAN_SUFFIX]
    assert "segment 00000000000000000200 is missing" in caplog.text
    sf2.close()
    sf3 = SegmentedFile(FileSystem(), str(tmp_path), 100)     # the orphan is not ours at the next load
    sf3.load()
    assert sf3.end == 200
    sf3.close()


@pytest.mark.parametrize("written_with, opened_with", [(200, 100), (100, 300)])
def test_files_of_another_mapped_file_size_are_refused_not_set_aside(tmp_path, written_with, opened_with):
    """A store opened with another mappedFileSize: a file longer than a segment, or a name off
    a multiple of it, stops the load (before, its names only looked like a gap)."""
    sf = SegmentedFile(FileSystem(), str(tmp_path), written_with)
    for c in b"abc":
        sf.ensure_writable().append(bytes([c]) * written_with)
    sf.flush()
    sf.close()
    with pytest.raises(StoreFatal, match="mappedFileSize"):
        SegmentedFile(FileSystem(), str(tmp_path), opened_with).load()
    assert not [n for n in os.listdir(tmp_path) if n.endswith(ORPHAN_SUFFIX)]


def test_delete_head_makes_each_removal_durable_before_the_next(tmp_path):
    """Removals persisted out of order could leave an old file before a gap, and load would
    then take the live files for orphans: each removal is fsynced before the next."""
    fs = _DirSyncs()
    sf = SegmentedFile(fs, str(tmp_path), 100)
    for c in b"abcde":
        sf.ensure_writable().append(bytes([c]) * 100)
    sf.flush()
    synced = fs.dir_syncs
    assert len(sf.delete_head(300)) == 3
    assert fs.dir_syncs == synced + 3


def test_regression_a_new_segment_does_not_wait_for_a_flush_s_directory_fsync(tmp_path):
    """The flush thread held the names' lock over its directory fsync, so a new segment on the
    append path waited for that fsync (as long as a slow disk takes)."""
    import threading
    import time

    class GatedDirSync(FileSystem):
        def __init__(self):
            self.entered, self.release = threading.Event(), threading.Event()
            self.gate = False

        def fsync_dir(self, path):
            if self.gate:
                self.entered.set()
                assert self.release.wait(10)
            super().fsync_dir(path)

    fs = GatedDirSync()
    sf = SegmentedFile(fs, str(tmp_path), 100)
    sf.ensure_writable().append(b"a" * 100)
    sf.flush()                                      # anchored
    sf.ensure_writable().append(b"b" * 100)         # a name waits
    fs.gate = True
    flusher = threading.Thread(target=sf.flush)
    flusher.start()
    try:
        assert fs.entered.wait(10)                  # the flush is inside its directory fsync
        t0 = time.monotonic()
        sf.ensure_writable().append(b"c")           # the append path creates a segment meanwhile
        assert time.monotonic() - t0 < 1.0, "the append path waited for the flush's fsync"
    finally:
        fs.release.set()
        flusher.join(10)
    fs.gate = False
    sf.flush()                                      # the name created during the fsync is synced now
    assert sf.flushed == sf.end == 201

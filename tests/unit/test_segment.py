"""Segment files: naming, roll, reads never crossing files, durable truncation."""

import os

from node.store.fileio import FaultyFileSystem, FileSystem
from node.store.segment import SegmentedFile, segment_name


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

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

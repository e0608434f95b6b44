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
    f.pwrite(b"durable", 0)
    f.fsync()
    f.pwrite(b"LOST", 0)
    f.pwrite(b"tail", 7)
    fs.crash()
    assert raw(str(tmp_path / "a")) == b"durable"


def test_torn_crash_keeps_at_most_a_prefix_of_the_last_write(tmp_path):
    seen = set()
    for seed in range(40):
        fs = FaultyFileSystem(seed)
        p = str(tmp_path / f"t{seed}")
        f = fs.open(p)
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

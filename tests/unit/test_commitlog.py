"""CommitLog: segment roll, BLANK padding, reads across files, all-or-nothing batches.

Method: small segments (a few KiB) so every rule at a file boundary is hit with
exact sizes; records are built with known total sizes (92 + body bytes for topic
"T" without properties) and checked against `encode_record`/`decode_record`.
"""

from __future__ import annotations

import errno
import os
import random

import pytest

from node.store import layout as L
from node.store.commitlog import CommitLog
from node.store.errors import CorruptRecord, DiskFull, InvalidMessage
from node.store.fileio import FileSystem
from node.store.message import MessageDraft, decode_record, encode_record
from node.store.queue_offsets import QueueOffsetTable

SEG = 4096
IP = b"\x0a\x00\x00\x01"
PORT = 10911
BASE_SIZE = L.MESSAGE_OVERHEAD + 1          # topic "T", no properties


def draft(total: int, queue_id: int = 0, fill: int = 0x61, **kw) -> MessageDraft:
    assert total >= BASE_SIZE
    d = MessageDraft("T", queue_id, bytes([fill]) * (total - BASE_SIZE), {}, **kw).seal()
    assert d.total_size == total
    return d


def open_log(tmp_path, fs: FileSystem | None = None, seg: int = SEG) -> CommitLog:
    cl = CommitLog(fs or FileSystem(), str(tmp_path / "commitlog"), seg, IP, PORT)
    cl.load()
    return cl


def segment_files(tmp_path) -> list[str]:
    return sorted(os.listdir(tmp_path / "commitlog"))


def test_record_of_remaining_minus_8_fits_in_the_file(tmp_path):
    cl = open_log(tmp_path)
    qt = QueueOffsetTable()
    first = cl.append_batch([draft(1000)], qt, 1)
    remaining = SEG - 1000
    placed = cl.append_batch([draft(remaining - 8)], qt, 1)
    assert placed[0][0] == 1000
    assert cl.max_offset == SEG - 8
    assert segment_files(tmp_path) == ["00000000000000000000"]
    assert first[0] == (0, 1000, 0)


def test_record_of_remaining_minus_7_rolls_with_a_blank(tmp_path):
    cl = open_log(tmp_path)
    qt = QueueOffsetTable()
    cl.append_batch([draft(1000)], qt, 1)
    placed = cl.append_batch([draft(SEG - 1000 - 7)], qt, 1)
    assert placed[0][0] == SEG, "the record must start the next file"
    blank = cl.files.read(1000, 8)
    assert L.BLANK.unpack(blank) == (SEG - 1000, L.BLANK_MAGIC)
    assert cl.files.read(1008, SEG - 1008) == bytes(SEG - 1008), "the rest of the file is zeros"
    assert segment_files(tmp_path) == ["00000000000000000000", f"{SEG:020d}"]


def test_blank_of_exactly_8_bytes_when_the_file_has_8_left(tmp_path):
    cl = open_log(tmp_path)
    qt = QueueOffsetTable()
    cl.append_batch([draft(SEG - 8)], qt, 1)
    placed = cl.append_batch([draft(100)], qt, 1)
    assert placed[0][0] == SEG
    assert L.BLANK.unpack(cl.files.read(SEG - 8, 8)) == (8, L.BLANK_MAGIC)


def test_records_never_span_files_and_scan_reads_across_them(tmp_path):
    rng = random.Random(7)
    cl = open_log(tmp_path)
    qt = QueueOffsetTable()
    expected = []
    for _ in range(60):
        batch = [draft(rng.randrange(BASE_SIZE, 1500), queue_id=rng.randrange(3), fill=rng.randrange(256))
                 for _ in range(rng.randrange(1, 6))]
        for d, (phys, size, qoff) in zip(batch, cl.append_batch(batch, qt, 5)):
            assert phys // SEG == (phys + size - 1) // SEG, "a record spans two files"
            assert phys % SEG + size + 8 <= SEG, "a record must leave room for a blank"
            expected.append((phys, encode_record(d, qoff, phys, 5, IP, PORT)))
    assert len(segment_files(tmp_path)) > 5
    got, pos = [], 0
    for _ in range(10_000):
        if pos >= cl.max_offset:
            break
        batch = cl.scan(pos, 3000)
        assert batch.records, "scan must make progress"
        got.extend((r.physical_offset, r.data) for r in batch.records)
        pos = batch.next_position
    assert got == expected
    for phys, data in expected:
        assert cl.read(phys, len(data)) == data


def test_append_writes_what_encode_record_encodes(tmp_path):
    cl = open_log(tmp_path)
    qt = QueueOffsetTable({("T", 3): 41})
    d = MessageDraft("T", 3, b"hello", {"TAGS": "a", "KEYS": "k1 k2"}, flag=7, born_timestamp=123,
                     born_port=999, reconsume_times=2).seal()
    [(phys, size, qoff)] = cl.append_batch([d], qt, 777)
    assert (phys, size, qoff) == (0, d.total_size, 41)
    raw = cl.read(0, size)
    assert raw == encode_record(d, 41, 0, 777, IP, PORT)
    m = decode_record(raw)
    assert (m.body, m.tags, m.keys, m.queue_offset, m.store_timestamp) == (b"hello", "a", ["k1", "k2"], 41, 777)
    assert qt.get("T", 3) == 42


def test_prepared_transaction_takes_no_queue_offset(tmp_path):
    cl = open_log(tmp_path)
    qt = QueueOffsetTable()
    prepared = draft(200, sys_flag=L.SYSFLAG_TRANSACTION_PREPARED_TYPE)
    placed = cl.append_batch([draft(200), prepared, draft(200)], qt, 1)
    assert [p[2] for p in placed] == [0, -1, 1]


def test_record_larger_than_a_file_is_rejected_and_nothing_written(tmp_path):
    cl = open_log(tmp_path)
    qt = QueueOffsetTable()
    with pytest.raises(InvalidMessage):
        cl.append_batch([draft(100), draft(SEG - 7)], qt, 1)
    assert cl.max_offset == 0
    assert qt.get("T", 0) == 0
    assert cl.append_batch([draft(SEG - 8)], qt, 1)[0][:2] == (0, SEG - 8)


def test_scan_stops_at_limit_and_returns_one_oversized_record(tmp_path):
    cl = open_log(tmp_path)
    placed = cl.append_batch([draft(1000), draft(1000), draft(1000)], QueueOffsetTable(), 1)
    assert [r.physical_offset for r in cl.scan(0, 10).records] == [0], "one record even if over budget"
    assert [r.physical_offset for r in cl.scan(0, 1 << 20, limit=2000).records] == [0, 1000]
    assert cl.scan(placed[2][0], 1 << 20).next_position == 3000


def test_scan_raises_on_garbage(tmp_path):
    cl = open_log(tmp_path)
    cl.append_batch([draft(500), draft(500)], QueueOffsetTable(), 1)
    seg = cl.files.segments[0]
    seg.handle.pwrite(b"\xde\xad\xbe\xef" * 4, 500)
    with pytest.raises(CorruptRecord) as e:
        cl.scan(0, 1 << 20)
    assert e.value.offset == 500


def test_read_rejects_a_flipped_body_bit_and_unknown_offsets(tmp_path):
    cl = open_log(tmp_path)
    cl.append_batch([draft(500)], QueueOffsetTable(), 1)
    with pytest.raises(KeyError):
        cl.read(8, 492)
    with pytest.raises(KeyError):
        cl.read(0, 600)
    cl.files.segments[0].handle.pwrite(b"Z", 200)
    with pytest.raises(CorruptRecord):
        cl.read(0, 500)


def test_truncate_zeroes_and_removes_later_files(tmp_path):
    cl = open_log(tmp_path)
    qt = QueueOffsetTable()
    placed = cl.append_batch([draft(3000), draft(3000), draft(3000)], qt, 1)
    assert len(segment_files(tmp_path)) == 3
    report = cl.truncate(placed[1][0] + 0)
    assert cl.max_offset == SEG
    assert len(report.removed_files) == 1
    assert cl.files.read(SEG, 10) == b""
    assert cl.files.segments[-1].handle.pread(3000, 0) == bytes(3000)


class _EnospcOnNthWrite(FileSystem):
    """A real FileSystem whose n-th pwrite (counting from arming) fails with ENOSPC, writing
    only a prefix: a short write, like a filling disk."""

    def __init__(self):
        self.countdown: int | None = None

    def open(self, path):
        inner = super().open(path)
        fs = self

        class _H:
            def __init__(self):
                self.path = inner.path

            def pwrite(self, data, offset):
                if fs.countdown is not None:
                    fs.countdown -= 1
                    if fs.countdown == 0:
                        fs.countdown = None
                        inner.pwrite(bytes(data)[:len(data) // 2], offset)
                        raise OSError(errno.ENOSPC, "no space left (test)")
                return inner.pwrite(data, offset)

            def __getattr__(self, name):
                return getattr(inner, name)

        return _H()


def test_enospc_in_a_batch_that_rolled_removes_every_byte_and_rewinds_offsets(tmp_path):
    fs = _EnospcOnNthWrite()
    cl = open_log(tmp_path, fs)
    qt = QueueOffsetTable()
    cl.append_batch([draft(1000)], qt, 1)
    fs.countdown = 2   # the first segment's part (records + blank) succeeds, the next file's fails
    with pytest.raises(DiskFull):
        cl.append_batch([draft(2000), draft(2000), draft(2000)], qt, 1)
    assert cl.max_offset == 1000
    assert qt.get("T", 0) == 1
    assert segment_files(tmp_path) == ["00000000000000000000"]
    assert cl.files.segments[0].handle.pread(SEG - 1000, 1000) == bytes(SEG - 1000)
    placed = cl.append_batch([draft(300)], qt, 1)
    assert placed == [(1000, 300, 1)]


def test_short_write_bytes_past_the_end_are_zeroed(tmp_path):
    fs = _EnospcOnNthWrite()
    cl = open_log(tmp_path, fs)
    qt = QueueOffsetTable()
    fs.countdown = 1
    with pytest.raises(DiskFull):
        cl.append_batch([draft(1000), draft(1000)], qt, 1)
    assert cl.max_offset == 0
    assert cl.files.segments[0].handle.pread(2000, 0) == bytes(2000), "half-written batch left on disk"

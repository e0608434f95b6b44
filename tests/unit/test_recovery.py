"""Commitlog recovery: finds the valid end, cuts durably, reports exactly what it cut.

Method: write records through CommitLog on a FaultyFileSystem, fsync at random
points (what was fsynced is "acked"), crash with torn writes, recover, and check:
every acked record is intact at its offset; nothing past the valid end survives
(zeros to the end of the file, no later files); after more unsynced writes and a
second crash the recovered log is the same (a truncated tail never returns,
RocketMQ #10666). 200 seeded iterations; a failure names its seed.
"""

from __future__ import annotations

import logging
import os
import random

import pytest

from node.store import layout as L
from node.store.commitlog import CommitLog
from node.store.fileio import FaultyFileSystem, FileSystem
from node.store.message import MessageDraft
from node.store.queue_offsets import QueueOffsetTable
from node.store.recovery import recover

SEG = 8192
IP = b"\x0a\x00\x00\x02"


def open_log(path, fs) -> CommitLog:
    cl = CommitLog(fs, os.path.join(path, "commitlog"), SEG, IP, 10911)
    cl.load()
    return cl


def random_batch(rng: random.Random) -> list[MessageDraft]:
    return [MessageDraft("TopicA", rng.randrange(4), rng.randbytes(rng.randrange(0, 1200)),
                         {"TAGS": "t"} if rng.random() < 0.5 else {}).seal() for _ in range(rng.randrange(1, 8))]


def all_records(cl: CommitLog) -> list[tuple[int, bytes]]:
    out, pos = [], cl.min_offset
    for _ in range(100_000):
        if pos >= cl.max_offset:
            break
        batch = cl.scan(pos, 1 << 16)
        out.extend((r.physical_offset, r.data) for r in batch.records)
        if batch.next_position == pos:
            break
        pos = batch.next_position
    return out


def assert_nothing_past(cl: CommitLog, end: int) -> None:
    segs = cl.files.segments
    if not segs:        # no file was ever flushed: the crash took its name too
        assert end == 0 and not [n for n in os.listdir(cl.files.directory) if n.isdigit()]
        return
    assert segs[-1].base <= end <= segs[-1].base + SEG, "no file may start past the valid end"
    rel = end - segs[-1].base
    assert segs[-1].handle.pread(SEG - rel, rel) == bytes(SEG - rel), "bytes survive past the valid end"
    names = sorted(os.listdir(os.path.dirname(segs[-1].path)))
    assert names[-1] == os.path.basename(segs[-1].path)


def write_and_crash(tmp: str, rng: random.Random, fs: FaultyFileSystem) -> dict[int, bytes]:
    """Append random batches, fsync at random points; return the acked (fsynced) records."""
    cl = open_log(tmp, fs)
    recover(cl, None, abnormal=True)
    qt = QueueOffsetTable()
    acked: dict[int, bytes] = {}
    unsynced: dict[int, bytes] = {}
    for _ in range(rng.randrange(1, 30)):
        batch = random_batch(rng)
        for phys, size, _q in cl.append_batch(batch, qt, 1):
            unsynced[phys] = size
        if rng.random() < 0.3:
            cl.flush()
            acked.update({p: cl.files.read(p, s) for p, s in unsynced.items()})
            unsynced.clear()
    fs.crash(torn=True)
    cl.close()
    return acked


@pytest.mark.parametrize("seed", range(200))
def test_crash_with_torn_tail_keeps_every_acked_record_and_drops_the_rest_for_good(tmp_path, seed):
    rng = random.Random(seed)
    fs = FaultyFileSystem(seed)
    tmp = str(tmp_path)
    acked = write_and_crash(tmp, rng, fs)

    cl = open_log(tmp, fs)
    report = recover(cl, None, abnormal=True)
    for phys, data in acked.items():
        assert cl.read(phys, len(data)) == data, f"seed {seed}: acked record at {phys} lost"
    assert report.valid_end == cl.max_offset
    assert_nothing_past(cl, report.valid_end)
    survivors = all_records(cl)
    assert survivors[-1:] == [] or survivors[-1][0] + len(survivors[-1][1]) <= report.valid_end

    # More unsynced writes, a second crash: the log comes back exactly as the first recovery left it.
    # A torn write may keep a whole prefix of the new batch, but nothing that recovery cut.
    new = [(p, cl.files.read(p, s)) for p, s, _q in cl.append_batch(random_batch(rng), QueueOffsetTable(), 2)]
    fs.crash(torn=rng.random() < 0.5)
    cl.close()
    cl2 = open_log(tmp, fs)
    report2 = recover(cl2, None, abnormal=True)
    again = all_records(cl2)
    assert again[:len(survivors)] == survivors, f"seed {seed}: recovered records changed"
    assert again[len(survivors):] == new[:len(again) - len(survivors)], f"seed {seed}: truncated tail came back"
    assert report2.valid_end >= report.valid_end
    assert_nothing_past(cl2, report2.valid_end)
    cl2.close()


def build(tmp_path, sizes: list[int], fs: FileSystem | None = None) -> tuple[CommitLog, list[tuple[int, int, int]]]:
    cl = open_log(str(tmp_path), fs or FileSystem())
    drafts = [MessageDraft("T", 0, b"x" * (n - L.MESSAGE_OVERHEAD - 1), {}).seal() for n in sizes]
    placed = cl.append_batch(drafts, QueueOffsetTable(), 1)
    cl.flush()
    return cl, placed


def reopen(tmp_path, abnormal: bool, checkpoint: int | None = None):
    cl = open_log(str(tmp_path), FileSystem())
    return cl, recover(cl, checkpoint, abnormal)


def test_garbage_after_the_last_record_is_reported_zeroed_and_logged(tmp_path, caplog):
    cl, placed = build(tmp_path, [500, 500])
    cl.files.segments[0].handle.pwrite(b"\x01" * 300, 1500)   # torn junk, a gap after the end
    cl.close()
    with caplog.at_level(logging.WARNING, logger="node.store.recovery"):
        cl, r = reopen(tmp_path, abnormal=True)
    assert (r.valid_end, r.records, r.stop_reason) == (1000, 2, "end of data")
    # A dropped range runs from the valid end to the last non-zero byte after it.
    assert r.dropped_ranges == ((1000, 1800),)
    assert r.dropped_bytes == 800
    assert "recovery dropped 800 bytes at offsets [1000, 1800)" in caplog.text
    assert_nothing_past(cl, 1000)


def test_a_flipped_body_bit_ends_the_valid_data_at_that_record(tmp_path):
    cl, placed = build(tmp_path, [500, 500, 500, 500])
    cl.files.segments[0].handle.pwrite(b"?", 1000 + 200)
    cl.close()
    cl, r = reopen(tmp_path, abnormal=True)
    assert r.valid_end == 1000
    assert r.stop_reason == "body crc mismatch"
    assert r.dropped_ranges == ((1000, 1998),)   # the last record ends in its zero properties length
    assert_nothing_past(cl, 1000)


def test_a_stale_record_at_the_wrong_position_is_not_valid(tmp_path):
    cl, placed = build(tmp_path, [500, 500])
    stale = cl.files.read(0, 500)                 # a whole valid record, but written for offset 0
    cl.files.segments[0].handle.pwrite(stale, 1000)
    cl.close()
    cl, r = reopen(tmp_path, abnormal=True)
    assert r.valid_end == 1000
    assert "physical offset" in r.stop_reason


def test_later_files_past_a_bad_record_are_removed(tmp_path):
    cl, placed = build(tmp_path, [5000, 5000, 5000, 5000])
    assert len(cl.files.segments) == 4
    cl.files.segments[1].handle.pwrite(b"\x00" * 4, 0)    # zero the TOTALSIZE of file 2's record
    cl.close()
    cl, r = reopen(tmp_path, abnormal=True)
    assert r.valid_end == SEG
    assert len(r.files_removed) == 2
    assert len(cl.files.segments) == 2
    # Files 2 and 3 held a record + BLANK (5008 bytes each), file 4 a record ending in 2 zero bytes.
    assert r.dropped_ranges == ((SEG, SEG + 5008), (2 * SEG, 2 * SEG + 5008), (3 * SEG, 3 * SEG + 4998))
    assert r.dropped_bytes == 5008 + 5008 + 4998


def test_normal_recovery_walks_only_the_last_three_files(tmp_path):
    cl, placed = build(tmp_path, [5000] * 6)
    cl.close()
    cl, r = reopen(tmp_path, abnormal=False)
    assert r.start_offset == 3 * SEG
    assert r.valid_end == 5 * SEG + 5000
    assert r.records == 3


def test_abnormal_recovery_starts_at_the_checkpoint_file(tmp_path):
    cl, placed = build(tmp_path, [5000] * 6)
    cl.close()
    cl, r = reopen(tmp_path, abnormal=True, checkpoint=2 * SEG + 100)
    assert r.start_offset == 2 * SEG
    assert r.records == 4
    cl.close()
    cl, r = reopen(tmp_path, abnormal=True, checkpoint=None)
    assert (r.start_offset, r.records) == (0, 6)


def test_blank_in_the_last_file_ends_the_data_at_the_file_end(tmp_path):
    cl, placed = build(tmp_path, [5000, 5000])
    cl.close()
    os.remove(cl.files.segments[1].path)          # the roll's file was lost, the BLANK was not
    cl, r = reopen(tmp_path, abnormal=True)
    assert r.valid_end == SEG
    qt = QueueOffsetTable()
    assert cl.append_batch([MessageDraft("T", 0, b"a", {}).seal()], qt, 1)[0][0] == SEG


def test_empty_store_recovers_to_zero(tmp_path):
    cl, r = reopen(tmp_path, abnormal=True)
    assert (r.valid_end, r.scanned_bytes, r.dropped_bytes) == (0, 0, 0)

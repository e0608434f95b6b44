"""Goal: a slave's committed boundary (`HALog._advance_boundary`, the in-memory record walk)
lands only on record ends, crosses segment-end blanks, handles a record larger than its read
chunk, waits on a half-received record, and leaves the same queue offsets the master has.
Method: a master HALog writes messages of mixed sizes, queues and transaction types; its
bytes are fed to a controller-mode slave (no links) in random cuts that never cross a
segment, with `ha_settle` after each cut, as the HA client does."""

from __future__ import annotations

import asyncio
import random

import pytest

import ha.ha_log as H
from ha.ha_log import MASTER, SLAVE, HALog, HALogConfig
from node.local_log import ASYNC_FLUSH, LocalLogConfig
from node.store import layout as L
from node.store.fileio import FileSystem
from node.store.message import MessageDraft

SEG = 64 * 1024


def draft(rng: random.Random, i: int) -> MessageDraft:
    size = rng.choice([10, 200, 1500, 6000])
    flag = rng.choice([0, 0, 0, L.SYSFLAG_TRANSACTION_PREPARED_TYPE, L.SYSFLAG_TRANSACTION_COMMIT_TYPE])
    topic = rng.choice(["T", "Orders"])
    return MessageDraft(topic, rng.randrange(3), b"%06d" % i + b"x" * size, {"TAGS": "a"}, sys_flag=flag).seal()


def log(root, role: str) -> HALog:
    cfg = LocalLogConfig(segment_size_bytes=SEG, flush_disk_type=ASYNC_FLUSH, refuse_check_interval_ms=0)
    return HALog(FileSystem(), str(root), cfg, HALogConfig(broker_id=0 if role == MASTER else 1, initial_role=role,
                                                          controller_mode=role == SLAVE, ha_listen_host="127.0.0.1",
                                                          ha_listen_port=0))


@pytest.mark.parametrize("seed", range(6))
def test_slave_boundary_walk_matches_the_master(tmp_path, monkeypatch, seed):
    monkeypatch.setattr(H, "_ADVANCE_CHUNK_BYTES", 4096)   # many records larger than one read chunk
    rng = random.Random(seed)

    async def main():
        m = log(tmp_path / "m", MASTER)
        await m.start()
        for i in range(0, 120, 4):
            await m.append([draft(rng, i + k) for k in range(4)])
        end = m.commitlog.max_offset
        assert end > 2 * SEG, "the data must span segments (and their end blanks)"
        s = log(tmp_path / "s", SLAVE)
        await s.start()
        ends = set()
        pos = 0
        while pos < end:
            seg_end = pos - pos % SEG + SEG
            n = min(rng.choice([1, 7, 90, 700, 5000, 20000]), end - pos, seg_end - pos)
            await s._append_raw(pos, m.ha_read(pos, n))
            pos += n
            await s.ha_settle()
            assert s.committed_position <= pos
            ends.add(s.committed_position)
        assert s.committed_position == end
        batch_ends, p = set(range(0, end + 1, SEG)), 0   # file starts (past a blank) count as ends
        for _ in range(10_000):           # every boundary seen is a record end on the master
            if p >= end:
                break
            spans, p = m.commitlog.scan_spans(p, 1 << 20, verify=False)
            batch_ends |= {phys + size for _, _, phys, size in spans}
            batch_ends.add(p)
        assert ends <= batch_ends
        for topic in ("T", "Orders"):
            for q in range(3):
                assert s.queue_offset_of(topic, q) == m.queue_offset_of(topic, q), (topic, q)
        await s.stop()
        await m.stop()
    asyncio.run(main())


def test_bad_record_header_from_the_master_is_corruption(tmp_path):
    from node.store.errors import CorruptRecord

    async def main():
        s = log(tmp_path / "s", SLAVE)
        await s.start()
        await s._append_raw(0, b"\x00\x00\x00\x40" + b"\x12\x34\x56\x78" + bytes(56))
        with pytest.raises(CorruptRecord):
            await s.ha_settle()
        await s.stop()
    asyncio.run(main())


def test_a_slave_whose_disk_fills_pauses_replication_and_resumes_where_it_stopped(tmp_path):
    """Regression: a push that met ENOSPC on the slave marked its log fatal ("the node must
    exit"). Now what landed is cut away, DiskFull (retriable) drops the link, the slave stays
    up, and the same bytes are taken from the same offset once space returns."""
    from node.store.errors import DiskFull
    from node.store.fileio import FaultyFileSystem
    rng = random.Random(3)

    async def main():
        m = log(tmp_path / "m", MASTER)
        await m.start()
        for i in range(0, 40, 4):
            await m.append([draft(rng, i + k) for k in range(4)])
        end = min(m.commitlog.max_offset, SEG)
        fs = FaultyFileSystem(5)
        cfg = LocalLogConfig(segment_size_bytes=SEG, flush_disk_type=ASYNC_FLUSH, refuse_check_interval_ms=0)
        s = HALog(fs, str(tmp_path / "s"), cfg, HALogConfig(broker_id=1, initial_role=SLAVE, controller_mode=True,
                                                             ha_listen_host="127.0.0.1", ha_listen_port=0))
        await s.start()
        half = end // 2
        await s._append_raw(0, m.ha_read(0, half))
        await s.ha_settle()
        fs.short_write_bytes = 100                      # the next write stores 100 bytes, then ENOSPC
        with pytest.raises(DiskFull, match="resumes from there"):
            await s._append_raw(half, m.ha_read(half, end - half))
        assert s.ha_max_offset() == half, "what landed of the refused push is cut away"
        assert s.local.fatal is None, "a full disk is not fatal"
        fs.write_budget_bytes = 0                       # no room at all: refused again, nothing lands
        with pytest.raises(DiskFull):
            await s._append_raw(half, m.ha_read(half, end - half))
        assert s.ha_max_offset() == half
        fs.write_budget_bytes = None                    # space returns: the same push from the same offset
        await s._append_raw(half, m.ha_read(half, end - half))
        await s.ha_settle()
        assert s.ha_max_offset() == end and s.commitlog.files.read(0, end) == m.ha_read(0, end)
        await s.stop()
        await m.stop()
    asyncio.run(main())

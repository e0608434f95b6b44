"""Goal: regression for RocketMQ #10666 in classic HA: a returning replica's truncation is
durable, so the truncated tail (and its epoch) does not come back after a crash that loses
every write not fsynced. Method: an HALog on FaultyFileSystem under SYNC_FLUSH (the tail is
fsynced before it is cut), truncate as a slave, crash at once (no clean stop, no later
fsync of the segment), reopen on a plain FileSystem and check log, epochs and queue offsets."""

from __future__ import annotations

import asyncio

from ha.epoch import EpochFile
from ha.ha_log import MASTER, SLAVE, HALog, HALogConfig
from ha.replication import HATimings
from node.local_log import SYNC_FLUSH, LocalLogConfig
from node.store.fileio import FaultyFileSystem, FileSystem
from node.store.message import MessageDraft, decode_record

SEG = 64 * 1024
FAST = HATimings(heartbeat_interval_ms=200, housekeeping_ms=2000, slave_ack_timeout_ms=500)


def msg(i: int) -> MessageDraft:
    return MessageDraft("T", 0, b"%06d" % i + b"x" * 94, {}).seal()


def open_log(fs, root, role=MASTER) -> HALog:
    return HALog(fs, str(root), LocalLogConfig(segment_size_bytes=SEG, flush_disk_type=SYNC_FLUSH,
                                               refuse_check_interval_ms=0),
                 HALogConfig(broker_id=0, initial_role=role, sync_master=False, ha_listen_host="127.0.0.1",
                             ha_listen_port=0, ha_master_address="127.0.0.1:1", timings=FAST))


def bodies(log: HALog) -> list[bytes]:
    out, pos = [], log.min_position
    for _ in range(1000):
        if pos >= log.committed_position:
            break
        batch = log.scan(pos, 1 << 20)
        out += [decode_record(r.data).body[:6] for r in batch.records]
        pos = batch.next_position
    return out


def test_regression_rocketmq_10666_truncated_tail_stays_gone_after_crash(tmp_path):
    fs = FaultyFileSystem(seed=7)
    state: dict = {}

    async def before_crash():
        a = open_log(fs, tmp_path)
        await a.start()
        await a.become_master(epoch=1)
        await a.append([msg(i) for i in range(5)])
        await a.become_master(epoch=2)
        cut = a.commitlog.max_offset
        await a.append([msg(100 + i) for i in range(5)])     # SYNC_FLUSH: this tail is on disk
        assert a.commitlog.flushed_offset == a.commitlog.max_offset
        # Demoted; the new master's history ends at `cut`: truncate there, then lose power at once.
        await a.become_slave("127.0.0.1:1", None, epoch=3)
        await a.truncate(cut)
        state["cut"] = cut
        fs.crash()     # every write not fsynced is undone: a non-durable truncation would resurrect the tail
        # No stop(): the process is gone. asyncio.run cancels the log's tasks.

    asyncio.run(before_crash())

    async def after_crash():
        b = open_log(FileSystem(), tmp_path, role=SLAVE)
        await b.start()
        try:
            assert b.commitlog.max_offset == state["cut"], "the truncated tail came back"
            assert bodies(b) == [b"%06d" % i for i in range(5)]
            assert [(e.epoch, e.start_offset) for e in EpochFile(FileSystem(), str(tmp_path)).load()] == [(1, 0)]
        finally:
            await b.stop()

    asyncio.run(after_crash())

"""A classic broker being promoted says MASTER only once it accepts writes.

Regression: `become_master` set the role first and opened writes only after the new epoch was
written (two fsyncs on a worker). Meanwhile /health said MASTER and every write answered 421
NOT_LEADER: a test that created a topic as soon as /health said MASTER failed
(test_ha_controllers3, steady load with allAckInSyncStateSet). The role the broker shows is now
MASTER only while writes are accepted."""

from __future__ import annotations

import asyncio

import pytest

from ha.ha_log import MASTER, SLAVE, HALog, HALogConfig
from ha.replication import HATimings
from node.local_log import LocalLogConfig
from node.store.errors import NotLeader
from node.store.fileio import FileSystem
from node.store.message import MessageDraft

FAST = HATimings(heartbeat_interval_ms=200, housekeeping_ms=2000, slave_ack_timeout_ms=500)


def msg(i: int) -> MessageDraft:
    return MessageDraft("T", 0, b"%06d" % i, {}).seal()


def test_regression_a_master_being_promoted_is_not_shown_as_master_before_it_accepts_writes(tmp_path):
    async def main():
        log = HALog(FileSystem(), str(tmp_path), LocalLogConfig(segment_size_bytes=64 * 1024),
                    HALogConfig(broker_id=1, initial_role=SLAVE, sync_master=False, ha_listen_host="127.0.0.1",
                                ha_listen_port=0, ha_master_address="127.0.0.1:1", timings=FAST))
        await log.start()
        gate, written = asyncio.Event(), log._epochs_write

        async def slow_epoch_write(*args):
            await gate.wait()
            await written(*args)
        log._epochs_write = slow_epoch_write
        try:
            promotion = asyncio.create_task(log.become_master(epoch=1))
            for _ in range(100):
                await asyncio.sleep(0)
            assert not promotion.done()          # held in the epoch write
            assert log.role() == SLAVE and log.status()["role"] == SLAVE
            assert log.status()["accepting_writes"] is False
            with pytest.raises(NotLeader):
                await log.append([msg(0)])
            gate.set()
            await asyncio.wait_for(promotion, 10)
            assert log.role() == MASTER and log.status()["role"] == MASTER
            results = await log.append([msg(1)])
            assert [r.status.name for r in results] == ["SEND_OK"]
            await log.become_slave("127.0.0.1:1", None, epoch=2)
            assert log.role() == SLAVE
        finally:
            gate.set()
            await log.stop()
    asyncio.run(main())

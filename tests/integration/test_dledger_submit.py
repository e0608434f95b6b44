"""A send appended without a task (DLedgerLog.submit_packed, the produce stream's path on a
DLedger leader) is answered exactly once: from the Raft round that commits it, with the
same offsets an awaited append gets; FLUSH_SLAVE_TIMEOUT when no majority acks in time;
the error when the write is lost; and a refusal raised before anything is proposed.

Method: three RaftNodes + DLedgerLogs on loopback in one loop (test_dledger_inprocess's
Cluster); followers stopped to take the majority away.
"""

from __future__ import annotations

import asyncio

import pytest

from node.replicated_log import PutStatus
from node.store.errors import NotLeader
from node.store.message import decode_record
from tests.integration.test_dledger_inprocess import Cluster, draft, wait_for


def recorder():
    calls: list = []

    def on_done(status, now, placed):
        calls.append((status, now, placed, asyncio.current_task()))
    return calls, on_done


def test_a_submitted_send_is_answered_once_from_the_round_that_commits_it(tmp_path):
    async def main():
        c = Cluster(str(tmp_path))
        await c.start_all()
        try:
            leader = await c.leader()
            awaited = await leader.append_packed([draft(0), draft(1, queue_id=1)])
            calls, on_done = recorder()
            leader.submit_packed([draft(2), draft(3, queue_id=1)], on_done)
            await wait_for(lambda: calls)
            await asyncio.sleep(0.1)
            assert len(calls) == 1
            status, _now, placed, task = calls[0]
            assert status is PutStatus.SEND_OK
            assert task is None                 # called in the ack's read callback, no task resumed
            assert [q for _p, _s, q in placed] == [1, 1]
            assert placed[0][0] > awaited[2][-1][0]
            for phys, size, qoff in placed:
                assert decode_record(leader.read(phys, size)).queue_offset == qoff
        finally:
            await c.stop_all()
    asyncio.run(main())


def test_a_submitted_send_without_a_majority_times_out_once_and_a_refusal_raises(tmp_path):
    async def main():
        c = Cluster(str(tmp_path))
        await c.start_all()
        try:
            leader = await c.leader()
            follower = next(lg for lg in c.logs.values() if lg is not leader)
            calls, on_done = recorder()
            with pytest.raises(NotLeader):
                follower.submit_packed([draft(0)], on_done)
            for lg in list(c.logs.values()):
                if lg is not leader:
                    await lg.stop()
            leader.append_timeout_s = 0.3
            leader.submit_packed([draft(1)], on_done)
            await wait_for(lambda: calls, timeout=3.0)
            await asyncio.sleep(0.4)
            assert [(s, len(p)) for s, _n, p, _t in calls] == [(PutStatus.FLUSH_SLAVE_TIMEOUT, 1)]
            # The write is still pending in the log: lost with the leader's stop, it is not answered again.
            await leader.stop()
            await asyncio.sleep(0.1)
            assert len(calls) == 1
        finally:
            await c.stop_all()
    asyncio.run(main())


def test_a_submitted_send_lost_with_the_leadership_is_answered_with_the_error(tmp_path):
    async def main():
        c = Cluster(str(tmp_path))
        await c.start_all()
        try:
            leader = await c.leader()
            for lg in list(c.logs.values()):
                if lg is not leader:
                    await lg.stop()
            calls, on_done = recorder()
            leader.submit_packed([draft(1)], on_done)
            await asyncio.sleep(0.05)
            assert calls == []
            await leader.stop()
            assert len(calls) == 1
            status, _now, placed, _task = calls[0]
            assert isinstance(status, NotLeader) and placed == []
        finally:
            await c.stop_all()
    asyncio.run(main())


def test_followers_gather_commits_for_their_dispatcher_and_a_leader_does_not(tmp_path):
    """A follower learns commits push by push; its dispatcher waits FOLLOWER_DISPATCH_LINGER_S
    after a small commit so that one batch covers several (node/store/dispatcher.py). The
    leader's consume queues serve its consumers: no wait, and none once a follower leads."""
    from dledger.dledger_log import FOLLOWER_DISPATCH_LINGER_S

    async def main():
        c = Cluster(str(tmp_path))
        await c.start_all()
        try:
            leader = await c.leader()
            followers = [lg for lg in c.logs.values() if lg is not leader]
            assert leader.dispatch_linger_s == 0.0
            assert [f.dispatch_linger_s for f in followers] == [FOLLOWER_DISPATCH_LINGER_S] * 2
            await leader.stop()
            new = await c.leader(exclude={leader.node.node_id})
            assert new.dispatch_linger_s == 0.0
        finally:
            await c.stop_all()
    asyncio.run(main())

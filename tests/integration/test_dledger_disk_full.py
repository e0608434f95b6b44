"""A full disk in DLedger mode: refused with a clear error, nothing lost, no election.

Goal: at diskSpaceWarningLevelRatio a leader refuses sends with DiskFull (HTTP 507,
retriable) before proposing anything; a follower refuses the leader's appends (dropped as
if lost) yet keeps answering heartbeats, so the group keeps its leader and commits on the
other majority; when space returns the follower catches up to a byte-identical log. With a
majority full a send is not acknowledged (FLUSH_SLAVE_TIMEOUT) and commits once space returns.
Before, a DLedger store had no free-space check: a full disk failed the entry write and
stopped the node.
Method: three RaftNodes + DLedgerLogs on loopback in one loop, each with a DiskGuard over a
file system whose reported fill level the test sets.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from dledger.core import RaftConfig
from dledger.dledger_log import DLedgerLog
from dledger.entry_store import EntryStore
from dledger.shell import RaftNode, ShellConfig
from node.replicated_log import PutStatus
from node.store.disk_guard import DiskGuard
from node.store.errors import DiskFull
from node.store.fileio import FileSystem
from tests.integration.test_dledger_inprocess import IDX_SEG, SEG, Cluster, committed_records, draft, wait_for

FULL, ROOMY = 0.95, 0.10


class FillFs(FileSystem):
    """The real file system, reporting the fill level the test sets."""

    def __init__(self) -> None:
        self.ratio = ROOMY

    def disk_usage_ratio(self, path: str) -> float:
        return self.ratio


class GuardedCluster(Cluster):
    def __init__(self, root: str, append_timeout_s: float = 5.0):
        super().__init__(root)
        self.fs: dict[str, FillFs] = {}
        self.append_timeout_s = append_timeout_s

    def make(self, node_id: str, seed: int) -> DLedgerLog:
        fs = self.fs[node_id] = FillFs()
        store = EntryStore(fs, self.root, node_id, data_segment_size=SEG, index_segment_size=IDX_SEG)
        node = RaftNode(node_id, "g", self.peers, store, RaftConfig(), ShellConfig(tick_ms=20), rng=random.Random(seed))
        log = DLedgerLog(node, self.apis, store_port=10911, append_timeout_s=self.append_timeout_s,
                         disk=DiskGuard(fs, self.root, 90, check_interval_ms=0))
        self.logs[node_id] = log
        return log


def _terms(c: Cluster) -> set[int]:
    return {lg.node.core.term for lg in c.logs.values()}


def test_a_full_leader_refuses_sends_before_proposing_anything(tmp_path):
    async def main():
        c = GuardedCluster(str(tmp_path))
        await c.start_all()
        try:
            leader = await c.leader()
            assert (await leader.append([draft(0)]))[0].status is PutStatus.SEND_OK
            last = leader.node.core.last_index
            c.fs[leader.node.node_id].ratio = FULL
            with pytest.raises(DiskFull, match=r"disk 95\.0% full .* diskSpaceWarningLevelRatio 90%") as ei:
                await leader.append([draft(1)])
            assert ei.value.http_status == 507 and ei.value.retriable
            assert leader.node.core.last_index == last, "a refused send proposed nothing"
            assert leader.status()["disk_usage_ratio"] == FULL
            c.fs[leader.node.node_id].ratio = ROOMY
            assert (await leader.append([draft(2)]))[0].status is PutStatus.SEND_OK
        finally:
            await c.stop_all()

    asyncio.run(main())


def test_a_full_follower_refuses_appends_without_an_election_and_catches_up_after(tmp_path):
    async def main():
        c = GuardedCluster(str(tmp_path))
        await c.start_all()
        try:
            leader = await c.leader()
            full, other = [lg for lg in c.logs.values() if lg is not leader]
            terms = _terms(c)
            c.fs[full.node.node_id].ratio = FULL
            before = full.node.core.last_index
            for b in range(10):
                res = await leader.append([draft(b * 5 + k) for k in range(5)])
                assert all(r.status is PutStatus.SEND_OK for r in res)   # committed with `other`
            await wait_for(lambda: other.node.core.last_index == leader.node.core.last_index)
            await asyncio.sleep(0.5)            # past the push timeout: the leader pushed again
            assert full.node.core.last_index == before, "a full follower stored the leader's entries"
            assert full.node.metrics["appends_refused"] > 0
            assert full.node.status()["appends_refused"] == full.node.metrics["appends_refused"]
            assert _terms(c) == terms and leader.is_writable, "refused appends started an election"
            c.fs[full.node.node_id].ratio = ROOMY
            await wait_for(lambda: full.node.core.commit_index == leader.node.core.commit_index, timeout=10)
            assert committed_records(full) == committed_records(leader)
            assert _terms(c) == terms
        finally:
            await c.stop_all()

    asyncio.run(main())


def test_with_a_majority_full_a_send_is_not_acked_and_commits_once_space_returns(tmp_path):
    async def main():
        c = GuardedCluster(str(tmp_path), append_timeout_s=1.0)
        await c.start_all()
        try:
            leader = await c.leader()
            followers = [lg for lg in c.logs.values() if lg is not leader]
            for f in followers:
                c.fs[f.node.node_id].ratio = FULL
            res = await leader.append([draft(7)])
            assert res[0].status is PutStatus.FLUSH_SLAVE_TIMEOUT
            index = leader.node.core.last_index
            assert leader.node.core.commit_index < index
            for f in followers:
                c.fs[f.node.node_id].ratio = ROOMY
            await wait_for(lambda: all(lg.node.core.commit_index >= index for lg in c.logs.values()), timeout=10)
            assert committed_records(followers[0]) == committed_records(leader) == committed_records(followers[1])
        finally:
            await c.stop_all()

    asyncio.run(main())

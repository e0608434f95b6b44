"""A full disk in DLedger mode: refused with a clear error, nothing lost, no election.

Goal: at diskSpaceWarningLevelRatio a leader refuses sends with DiskFull (HTTP 507,
retriable) before proposing anything; a follower refuses the leader's appends (dropped as
if lost) yet keeps answering heartbeats, so the group keeps its leader and commits on the
other majority; when space returns the follower catches up to a byte-identical log. With a
majority full a send is not acknowledged (FLUSH_SLAVE_TIMEOUT) and commits once space returns.
When ENOSPC gets past the guard (the disk filled between the check and the write), the node
holds its Raft state like a paused process instead of stopping: a stalled leader is
replaced, and once space returns it writes the held entries, steps down and converges.
Before, a DLedger store had no free-space check: a full disk failed the entry write and
stopped the node.
Method: three RaftNodes + DLedgerLogs on loopback in one loop, each with a DiskGuard over a
file system whose reported fill level the test sets, and which can fail writes with ENOSPC.
"""

from __future__ import annotations

import asyncio
import errno
import random

import pytest

from dledger.core import RaftConfig
from dledger.dledger_log import DLedgerLog
from dledger.entry_store import EntryStore
from dledger.shell import RaftNode, ShellConfig
from node.replicated_log import PutStatus
from node.store.disk_guard import DiskGuard
from node.store.errors import DiskFull, NotLeader
from node.store.fileio import FileSystem
from tests.integration.test_dledger_inprocess import IDX_SEG, SEG, Cluster, committed_records, draft, wait_for

FULL, ROOMY = 0.95, 0.10


class FillFs(FileSystem):
    """The real file system, reporting the fill level the test sets; with `enospc` every
    write fails for want of space whatever the reported level."""

    def __init__(self) -> None:
        self.ratio = ROOMY
        self.enospc = False

    def disk_usage_ratio(self, path: str) -> float:
        return self.ratio

    def open(self, path: str):
        return _NoSpaceWhenFull(super().open(path), self)


class _NoSpaceWhenFull:
    def __init__(self, inner, fs: FillFs):
        self._inner, self._fs = inner, fs

    def pwrite(self, data, offset: int) -> int:
        if self._fs.enospc:
            raise OSError(errno.ENOSPC, "No space left on device (test)")
        return self._inner.pwrite(data, offset)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class GuardedCluster(Cluster):
    def __init__(self, root: str, append_timeout_s: float = 5.0, disk_watch_s: float = 3600.0):
        super().__init__(root)
        self.fs: dict[str, FillFs] = {}
        self.append_timeout_s = append_timeout_s
        self.disk_watch_s = disk_watch_s     # the handover of a full leader: off unless a test turns it on

    def make(self, node_id: str, seed: int) -> DLedgerLog:
        fs = self.fs[node_id] = FillFs()
        store = EntryStore(fs, self.root, node_id, data_segment_size=SEG, index_segment_size=IDX_SEG)
        node = RaftNode(node_id, "g", self.peers, store, RaftConfig(), ShellConfig(tick_ms=20), rng=random.Random(seed))
        log = DLedgerLog(node, self.apis, store_port=10911, append_timeout_s=self.append_timeout_s,
                         disk=DiskGuard(fs, self.root, 90, check_interval_ms=0))
        log.disk_watch_s, log.handover_retry_s = self.disk_watch_s, 0.3
        self.logs[node_id] = log
        return log


def _terms(c: Cluster) -> set[int]:
    return {lg.node.core.term for lg in c.logs.values()}


def _run(tmp_path, body, append_timeout_s: float = 5.0, disk_watch_s: float = 3600.0) -> None:
    """`await body(cluster, leader)` on a started three-node group, stopped afterwards."""
    async def main():
        c = GuardedCluster(str(tmp_path), append_timeout_s, disk_watch_s)
        await c.start_all()
        try:
            await body(c, await c.leader())
        finally:
            await c.stop_all()

    asyncio.run(main())


def test_a_full_leader_refuses_sends_before_proposing_anything(tmp_path):
    async def body(c, leader):
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

    _run(tmp_path, body)


def test_a_full_leader_hands_leadership_to_a_node_with_room_and_a_full_one_declines_it(tmp_path):
    async def body(c, old):
        oid = old.node.node_id
        assert (await old.append([draft(0)]))[0].status is PutStatus.SEND_OK
        best = max((p for p in old.node.core.peers), key=lambda p: old.node.core.match_index(p) or 0)
        roomy = next(p for p in c.logs if p not in (oid, best))
        t0 = old.node.core.term
        c.fs[oid].ratio = c.fs[best].ratio = FULL    # the first peer it tries is full too
        new = await c.leader(exclude=(oid, best), timeout=10)
        assert new.node.node_id == roomy
        assert new.node.core.term == t0 + 1, "one transfer: the full peer declined the first one"
        assert c.logs[best].node.core.decline_transfers and old.node.core.decline_transfers
        c.fs[best].ratio = ROOMY                     # a majority with room again: sends commit there
        for b in range(5):
            assert (await new.append([draft(10 + b)]))[0].status is PutStatus.SEND_OK
        c.fs[roomy].ratio = c.fs[best].ratio = FULL  # every node full: nobody takes it, the leader stays
        terms = _terms(c)
        await asyncio.sleep(1.5)
        assert new.is_writable and _terms(c) == terms
        with pytest.raises(DiskFull):
            await new.append([draft(20)])
        for n in c.fs:
            c.fs[n].ratio = ROOMY
        await wait_for(lambda: not any(lg.node.core.decline_transfers for lg in c.logs.values()))
        leader = await c.leader()
        assert (await leader.append([draft(21)]))[0].status is PutStatus.SEND_OK
        await wait_for(lambda: len({lg.node.core.commit_index for lg in c.logs.values()}) == 1, 10)
        assert committed_records(c.logs[oid]) == committed_records(new) == committed_records(c.logs[best])

    _run(tmp_path, body, disk_watch_s=0.05)


def test_a_full_follower_refuses_appends_without_an_election_and_catches_up_after(tmp_path):
    async def body(c, leader):
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

    _run(tmp_path, body)


def test_with_a_majority_full_a_send_is_not_acked_and_commits_once_space_returns(tmp_path):
    async def body(c, leader):
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

    _run(tmp_path, body, append_timeout_s=1.0)


def test_enospc_past_the_guard_stalls_the_leader_like_a_pause_not_a_stop(tmp_path):
    async def body(c, old):
        oid = old.node.node_id
        for b in range(3):
            assert (await old.append([draft(b)]))[0].status is PutStatus.SEND_OK
        c.fs[oid].enospc = True                # the guard still sees room: the write itself fails
        stuck = asyncio.ensure_future(old.append([draft(99)]))
        await wait_for(lambda: old.node.stall_reason is not None)
        assert "ENOSPC" in old.node.status()["stalled_on_disk"] and old.node.metrics["disk_stalls"] == 1
        with pytest.raises(DiskFull, match="stalled on a full disk"):
            await old.append([draft(100)])
        new = await c.leader(exclude=(oid,), timeout=10)     # no heartbeats from the stalled one
        for b in range(5):
            assert (await new.append([draft(200 + b)]))[0].status is PutStatus.SEND_OK
        assert old.node.fatal is None and old.node.stall_reason is not None
        c.fs[oid].enospc = False
        await wait_for(lambda: old.node.stall_reason is None and old.node.core.role.name == "FOLLOWER", 10)
        await new.append([draft(300)])
        await wait_for(lambda: old.node.core.commit_index == new.node.core.commit_index, 10)
        assert committed_records(old) == committed_records(new)
        try:                                    # the entry held during the stall was never acked
            outcome = (await stuck)[0].status
        except NotLeader:
            outcome = "NotLeader"
        assert outcome in (PutStatus.FLUSH_SLAVE_TIMEOUT, "NotLeader")

    _run(tmp_path, body, append_timeout_s=3.0)

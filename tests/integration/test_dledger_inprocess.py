"""Three RaftNodes + DLedgerLogs in one event loop on loopback ports.

Goal: the DLedger ReplicatedLog elects a leader, commits appends on a majority,
survives the leader stopping (a new leader is elected and accepts writes with
queue offsets that continue the old ones), and every acknowledged entry ends up
byte-identical on all live replicas, at the same position.
Method: real sockets and files, short ticks; each step waits on observable state.
"""

from __future__ import annotations

import asyncio
import random
import os

import pytest

from dledger.core import RaftConfig
from dledger.dledger_log import DLedgerLog
from dledger.entry_store import EntryStore
from dledger.shell import ShellConfig, RaftNode
from mqstore.localcluster import free_ports
from node.replicated_log import PutStatus
from node.store.errors import NotLeader
from node.store.fileio import FileSystem
from node.store.message import MessageDraft, decode_record

# Small files by default so the test crosses blanks and rolls; env overrides for quick perf runs.
SEG = int(os.environ.get("DLEDGER_TEST_SEG", 64 * 1024))
IDX_SEG = 32 * int(os.environ.get("DLEDGER_TEST_IDX", 256))


def draft(i: int, queue_id: int = 0) -> MessageDraft:
    return MessageDraft("T", queue_id, f"m{i}".encode() * 50, {"KEYS": f"k{i}"}).seal()


class Cluster:
    def __init__(self, root: str, flush: str = "ASYNC_FLUSH", ids=("n0", "n1", "n2")):
        ports = free_ports(len(ids))
        self.root = root
        self.flush = flush
        self.peers = {i: ("127.0.0.1", p) for i, p in zip(ids, ports)}
        self.apis = {i: f"127.0.0.1:{20000 + k}" for k, i in enumerate(ids)}
        self.logs: dict[str, DLedgerLog] = {}

    def make(self, node_id: str, seed: int) -> DLedgerLog:
        store = EntryStore(FileSystem(), self.root, node_id, data_segment_size=SEG, index_segment_size=IDX_SEG)
        node = RaftNode(node_id, "g", self.peers, store, RaftConfig(),
                        ShellConfig(tick_ms=20, flush_disk_type=self.flush), rng=random.Random(seed))
        log = DLedgerLog(node, self.apis, store_port=10911, append_timeout_s=5)
        self.logs[node_id] = log
        return log

    async def start_all(self) -> None:
        for k, i in enumerate(self.peers):
            await self.make(i, k).start()

    async def leader(self, exclude=(), timeout=5.0) -> DLedgerLog:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            for i, lg in self.logs.items():
                if i not in exclude and lg.is_writable:
                    return lg
            await asyncio.sleep(0.01)
        raise AssertionError("no leader elected")

    async def stop_all(self) -> None:
        for lg in self.logs.values():
            if lg.node.core is not None and lg.node._running:
                await lg.stop()


async def wait_for(cond, timeout=5.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def committed_records(lg: DLedgerLog) -> list[tuple[int, bytes]]:
    out, pos = [], lg.min_position
    while True:
        batch = lg.scan(pos, 1 << 20)
        out.extend((r.physical_offset, r.data) for r in batch.records)
        if batch.next_position == pos:
            return out
        pos = batch.next_position


@pytest.mark.parametrize("flush", ["ASYNC_FLUSH", "SYNC_FLUSH"])
def test_elect_append_failover_identical(tmp_path, flush):
    async def main():
        c = Cluster(str(tmp_path), flush)
        await c.start_all()
        try:
            leader = await c.leader()
            follower = next(lg for lg in c.logs.values() if lg is not leader)
            with pytest.raises(NotLeader) as ei:
                await follower.append([draft(0)])
            assert ei.value.leader == c.apis[leader.node.node_id] or ei.value.leader is None

            acked = []
            for b in range(20):
                res = await leader.append([draft(b * 10 + k, queue_id=k % 2) for k in range(10)])
                assert all(r.status is PutStatus.SEND_OK for r in res)
                acked.extend(res)
            qoffs = [r.queue_offset for r in acked]
            assert sorted(qoffs[0::2]) == list(range(100)) and sorted(qoffs[1::2]) == list(range(100))
            for r in acked:
                rec = decode_record(leader.read(r.physical_offset, r.size))
                assert rec.physical_offset == r.physical_offset

            # Stop the leader; the others elect a new one that continues the queue offsets.
            old = leader.node.node_id
            await leader.stop()
            new = await c.leader(exclude={old}, timeout=5)
            res = await new.append([draft(1000, 0), draft(1001, 1)])
            assert [r.queue_offset for r in res] == [100, 100]
            acked.extend(res)

            live = [lg for i, lg in c.logs.items() if i != old]
            target = max(lg.committed_position for lg in live)
            await wait_for(lambda: all(lg.committed_position >= target for lg in live))
            views = [committed_records(lg) for lg in live]
            assert views[0] == views[1]
            got = dict(views[0])
            for r in acked:
                assert r.physical_offset in got
                assert decode_record(got[r.physical_offset]).queue_offset == r.queue_offset
            # The stopped replica holds a byte-identical prefix on disk.
            s_old = EntryStore(FileSystem(), str(tmp_path), old, data_segment_size=SEG, index_segment_size=IDX_SEG)
            s_old.recover()
            s_new = live[0].store
            n = min(s_old.last_index(), s_new.last_index())
            assert n > 200
            assert [e for e in s_old.entries(1, n + 1, 1 << 30)] == s_new.entries(1, n + 1, 1 << 30)
            assert s_old.entry_at(n) == s_new.entry_at(n)
            s_old.close()
        finally:
            await c.stop_all()
    asyncio.run(main())


def test_restart_keeps_queue_offsets(tmp_path):
    async def main():
        c = Cluster(str(tmp_path))
        await c.start_all()
        leader = await c.leader()
        await leader.append([draft(k) for k in range(5)])
        await c.stop_all()
        c.logs.clear()
        await c.start_all()
        try:
            leader = await c.leader()
            res = await leader.append([draft(99)])
            assert res[0].queue_offset == 5
            assert res[0].status is PutStatus.SEND_OK
        finally:
            await c.stop_all()
    asyncio.run(main())


class _GatedTermVoteFs(FileSystem):
    """Once armed, a meta write that changes the term waits for the test to open the gate."""

    def __init__(self) -> None:
        import threading
        self.armed = False
        self.gate = threading.Event()
        self.waiting = threading.Event()
        self.term: int | None = None

    def write_atomic(self, path, data):
        if path.endswith("/meta"):
            import json
            term = json.loads(data)["term"]
            if self.armed and self.term is not None and term != self.term:
                self.waiting.set()
                assert self.gate.wait(10), "the test never opened the gate"
            self.term = term
        super().write_atomic(path, data)


def test_regression_a_leader_storing_a_newer_term_reports_no_leadership_in_it(tmp_path):
    """A leader that stepped down to a newer term in memory, its term and vote still being
    written (on a worker thread), reported role LEADER (the last Ready heard) with the new
    term (the core's) on /cluster: the random-fault runs saw "two leaders in one term". While
    the write is held it now reports the core's role and refuses writes; the group elects the
    transfer target meanwhile, and the old leader follows once the write lands."""
    class GatedCluster(Cluster):
        def __init__(self, root: str):
            super().__init__(root)
            self.fs: dict[str, _GatedTermVoteFs] = {}

        def make(self, node_id: str, seed: int) -> DLedgerLog:
            fs = self.fs[node_id] = _GatedTermVoteFs()
            store = EntryStore(fs, self.root, node_id, data_segment_size=SEG, index_segment_size=IDX_SEG)
            node = RaftNode(node_id, "g", self.peers, store, RaftConfig(), ShellConfig(tick_ms=20),
                            rng=random.Random(seed))
            log = self.logs[node_id] = DLedgerLog(node, self.apis, store_port=10911, append_timeout_s=5)
            return log

    async def main():
        c = GatedCluster(str(tmp_path))
        await c.start_all()
        old = await c.leader()
        fs = c.fs[old.node.node_id]
        try:
            assert (await old.append([draft(1)]))[0].status is PutStatus.SEND_OK
            term = old.node.core.term
            target = next(i for i in c.logs if i != old.node.node_id)
            fs.armed = True
            old.node.transfer_leadership(target)
            await wait_for(lambda: fs.waiting.is_set(), timeout=5)
            held = old.status()
            new = await c.leader(exclude=(old.node.node_id,), timeout=5)
            during = (old.role(), old.is_writable, old.status())
            fs.gate.set()
            await wait_for(lambda: old.role() == "FOLLOWER" and not old.node.holds_ready, timeout=5)
            res = await new.append([draft(2)])
            return term, held, during, new.node.node_id, target, res
        finally:
            fs.gate.set()
            await c.stop_all()

    term, held, during, new_id, target, res = asyncio.run(main())
    assert held["term"] > term and held["role"] != "LEADER", held
    role, writable, status = during
    assert role != "LEADER" and not writable and status["role"] == role, status
    assert new_id == target and res[0].status is PutStatus.SEND_OK

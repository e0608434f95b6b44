"""DLedgerLog's batched append and copy-free scan keep the bytes and the queue offsets.

Goal: `append_packed` (one status per batch, header packed inline) stores exactly the
records `encode_record` describes; `scan_spans` names exactly the records `scan` returns,
across file rolls; a batch the core refuses leaves no hole in any queue.
Method: three RaftNodes + DLedgerLogs in one loop on loopback (the harness of
test_dledger_inprocess.py), small data files so batches cross blanks.

Regressions:
- an append refused by the core while a leadership transfer was in progress raised
  TypeError (QueueOffsetTable.rewind was called with one argument) instead of NotLeader,
  and left its queue offsets assigned;
- a batch past max_uncommitted_entries (core ProposalDropped), or one with a record that cannot
  be encoded (struct.error), escaped as a non-store error
  (HTTP 500) with its queue offsets assigned, so the next batch left a hole in the queue.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from dledger.core import RaftConfig
from dledger.dledger_log import DLedgerLog, ReplicationBusy
from dledger.entry_store import EntryStore
from dledger.shell import RaftNode, ShellConfig
from node.replicated_log import PutStatus
from node.store.errors import NotLeader
from node.store.fileio import FileSystem
from node.store.message import MessageDraft, encode_record, host_bytes
from tests.integration.test_dledger_inprocess import IDX_SEG, SEG, Cluster, committed_records


def plain(i: int, queue_id: int) -> MessageDraft:
    return MessageDraft.sealed_plain("T", queue_id, f"m{i}-".encode() * 40, "TagA" if i % 2 else None, 1000 + i)


class SmallCluster(Cluster):
    """The harness's cluster with a low max_uncommitted_entries."""

    def __init__(self, root: str, max_uncommitted: int):
        super().__init__(root)
        self.max_uncommitted = max_uncommitted

    def make(self, node_id: str, seed: int) -> DLedgerLog:
        store = EntryStore(FileSystem(), self.root, node_id, data_segment_size=SEG, index_segment_size=IDX_SEG)
        node = RaftNode(node_id, "g", self.peers, store, RaftConfig(max_uncommitted_entries=self.max_uncommitted),
                        ShellConfig(tick_ms=20, flush_disk_type=self.flush), rng=random.Random(seed))
        log = DLedgerLog(node, self.apis, store_port=10911, append_timeout_s=5)
        self.logs[node_id] = log
        return log


def test_packed_append_stores_encode_record_bytes_and_spans_match_scan(tmp_path):
    async def main():
        c = Cluster(str(tmp_path))
        await c.start_all()
        try:
            leader = await c.leader()
            sent: list[tuple[MessageDraft, int, int, int, int]] = []
            for b in range(12):   # ~12 x 16 x 0.9 KiB: several 64 KiB files, so blanks and rolls
                drafts = [plain(b * 16 + k, k % 3) for k in range(16)]
                status, ts, placed = await leader.append_packed(drafts)
                assert status is PutStatus.SEND_OK
                assert len(placed) == len(drafts)
                sent.extend((d, phys, size, qoff, ts) for d, (phys, size, qoff) in zip(drafts, placed))
            ip = host_bytes("127.0.0.1")
            for d, phys, size, qoff, ts in sent:
                assert size == d.total_size
                assert leader.read(phys, size) == encode_record(d, qoff, phys, ts, ip, 10911)
            for q in range(3):
                assert [s[3] for s in sent if s[0].queue_id == q] == list(range(sum(1 for s in sent if s[0].queue_id == q)))
            # spans name the very records scan copies out, batch by batch, with the same next position
            pos, seen = leader.min_position, 0
            while True:
                spans, nxt = leader.scan_spans(pos, 8 * 1024)
                batch = leader.scan(pos, 8 * 1024)
                assert nxt == batch.next_position
                assert [(phys, buf[at:at + size]) for buf, at, phys, size in spans] == \
                       [(r.physical_offset, r.data) for r in batch.records]
                seen += len(spans)
                if nxt == pos:
                    break
                pos = nxt
            assert seen == len(sent)
            assert dict(committed_records(leader)) == {phys: leader.read(phys, size) for _, phys, size, _, _ in sent}
        finally:
            await c.stop_all()
    asyncio.run(main())


def test_append_during_leadership_transfer_is_not_leader_and_gives_offsets_back(tmp_path):
    async def main():
        c = Cluster(str(tmp_path))
        await c.start_all()
        try:
            leader = await c.leader()
            _, _, placed = await leader.append_packed([plain(0, 0), plain(1, 0)])
            assert [q for _, _, q in placed] == [0, 1]
            other = next(i for i in c.logs if c.logs[i] is not leader)
            leader.node.transfer_leadership(other)   # the core refuses proposals from now on
            with pytest.raises(NotLeader):
                await leader.append([plain(2, 0)])
            assert leader._table.get("T", 0) == 2     # the refused message's offset was given back
            new = await c.leader(exclude={leader.node.node_id}, timeout=5)
            res = await new.append([plain(3, 0)])
            assert res[0].queue_offset == 2
        finally:
            await c.stop_all()
    asyncio.run(main())


def test_batch_past_max_uncommitted_is_refused_whole_without_a_hole(tmp_path):
    async def main():
        c = SmallCluster(str(tmp_path), max_uncommitted=8)
        await c.start_all()
        try:
            leader = await c.leader()
            with pytest.raises(ReplicationBusy) as ei:
                await leader.append([plain(k, 0) for k in range(9)])
            assert ei.value.retriable and ei.value.code == "SYSTEM_BUSY" and ei.value.http_status == 503
            assert leader._table.get("T", 0) == 0
            res = await leader.append([plain(k, 0) for k in range(4)])
            assert [r.queue_offset for r in res] == [0, 1, 2, 3]
            assert all(r.status is PutStatus.SEND_OK for r in res)
        finally:
            await c.stop_all()
    asyncio.run(main())


def test_a_record_that_cannot_be_encoded_gives_its_batch_offsets_back(tmp_path):
    """Regression: a field out of range (struct.error while packing) escaped as a non-store
    error and left the queue offsets of the whole batch assigned."""
    from node.store.errors import InvalidMessage

    async def main():
        c = Cluster(str(tmp_path))
        await c.start_all()
        try:
            leader = await c.leader()
            bad = plain(1, 0)
            bad.born_timestamp = 1 << 64                 # does not fit BORNTIMESTAMP (int64)
            with pytest.raises(InvalidMessage):
                await leader.append([plain(0, 0), bad])
            assert leader._table.get("T", 0) == 0
            res = await leader.append([plain(2, 0)])
            assert res[0].queue_offset == 0 and res[0].status is PutStatus.SEND_OK
        finally:
            await c.stop_all()
    asyncio.run(main())

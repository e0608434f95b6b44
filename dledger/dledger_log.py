"""DLedgerLog: the ReplicatedLog of DLedger mode (committed = stored on a majority).

Log positions are entry positions in the data segments; a message's physical offset
is its entry's pos + 48 (the body). Only the leader appends: it assigns each message
its queue offset, PHYSICALOFFSET and store timestamp *before* proposing, so the
bytes every replica stores are the bytes the broker indexes. To know the pos of an
entry that is not written yet, the log keeps a virtual tail and places each entry
with the store's own rule (`place_entry`); the store checks the result on append.

Queue offsets: every replica folds each committed NORMAL entry into an
*applied table* as it commits (committed entries are never truncated). A node
that becomes leader copies that table and folds in its uncommitted tail (its whole
log is persisted by then, its no-op included) before it accepts a write: DESIGN 4,
"a new leader rebuilds its queue-offset table from its whole log". At start the
applied table is replayed from the log up to the last checkpointed commit.

A caller's append resolves SEND_OK when its last entry commits in the term it was
proposed in; it fails with a retriable NotLeader when leadership is lost or its
entries are truncated first (the outcome is then unknown to the caller: RocketMQ's
behaviour too), and returns FLUSH_SLAVE_TIMEOUT if no majority acked in time.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time
from dataclasses import dataclass
from typing import Sequence

from dledger.core import NotLeader as CoreNotLeader
from dledger.core import Ready, Role
from dledger.entry import HEADER_SIZE
from dledger.entry_store import EntryStore, place_entry
from dledger.messages import EntryType
from dledger.shell import RaftNode
from node.replicated_log import PutResult, PutStatus, ScanBatch, ScannedRecord
from node.store import layout as L
from node.store.errors import NotLeader, StoreFatal
from node.store.message import MessageDraft, encode_record
from node.store.queue_offsets import QueueOffsetTable

log = logging.getLogger(__name__)

_ROLE_NAMES = {Role.LEADER: "LEADER", Role.FOLLOWER: "FOLLOWER", Role.CANDIDATE: "CANDIDATE",
               Role.PRE_CANDIDATE: "CANDIDATE"}
_REPLAY_BATCH_BYTES = 8 << 20
_MSG_QID_AT = L.MESSAGE_FIELD_OFFSET["queue_id"]
_MSG_QOFF_AT = L.MESSAGE_FIELD_OFFSET["queue_offset"]
_MSG_BODYLEN_AT = L.MESSAGE_FIELD_OFFSET["body_len"]


@dataclass(slots=True)
class _Pending:
    first: int
    last: int
    term: int
    future: asyncio.Future


class DLedgerLog:
    """ReplicatedLog over a RaftNode + EntryStore."""

    mode = "dledger"

    def __init__(self, node: RaftNode, peer_api_addrs: dict[str, str], store_host: str = "127.0.0.1",
                 store_port: int = 0, append_timeout_s: float = 5.0, max_propose_entries: int | None = None):
        self.node = node
        self.store: EntryStore = node.store
        self.peer_api_addrs = dict(peer_api_addrs)
        self.store_ip = socket.inet_aton(store_host)
        self.store_port = store_port
        self.append_timeout_s = append_timeout_s
        self.max_propose_entries = max_propose_entries or node.raft_config.max_batch_entries
        node.listener = self
        self._applied_table = QueueOffsetTable()
        self._table = QueueOffsetTable()       # leader only: includes uncommitted entries
        self._applied_index = 0
        self._commit_index = 0
        self._committed_pos = 0
        self._writable_term: int | None = None  # term in which this node accepts writes
        self._tail_pos = 0                      # leader: where the next proposed entry goes
        self._pending: collections.deque[_Pending] = collections.deque()
        self._commit_changed = asyncio.Event()
        self._role = Role.FOLLOWER
        self._leader_id: str | None = None
        self._term = 0
        self.leader_changes = 0          # times a new leader became known (metrics)

    # --- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        await self.node.start()

    async def stop(self) -> None:
        self._fail_pending(0, "node stopping")
        await self.node.stop()

    def init_queue_offsets(self, table: dict) -> None:
        """Accepted and ignored: the DLedger log derives queue offsets from its own entries."""

    # --- ReadyListener -------------------------------------------------------------------
    def on_recovered(self, node: RaftNode) -> None:
        s = self.store
        known = min(max(s.meta.committed, s.first_index() - 1), s.last_index())
        self._applied_index = s.first_index() - 1
        self._replay(self._applied_table, self._applied_index + 1, known)
        self._applied_index = self._commit_index = known
        self._committed_pos = self._end_of(known)

    def on_truncated(self, from_index: int) -> None:
        assert from_index > self._commit_index or from_index == self.store.first_index(), \
            (from_index, self._commit_index)
        self._fail_pending(from_index, f"entries from {from_index} were truncated")

    @property
    def term(self) -> int:
        """The Raft term this node last saw (log lines carry it)."""
        return self._term

    def on_ready(self, rd: Ready) -> None:
        if rd.leader_id is not None and rd.leader_id != self._leader_id:
            self.leader_changes += 1   # metrics: rocketmq_raft_leader_changes_total
        self._term, self._leader_id = rd.term, rd.leader_id
        was_writable = self._writable_term is not None
        self._role = rd.soft_role
        if was_writable and (rd.soft_role is not Role.LEADER or rd.term != self._writable_term):
            self._writable_term = None
            self._fail_pending(0, "leadership lost before the write committed")
        if rd.reset_base is not None:
            self._on_reset(rd.reset_base[0])
        if rd.committed > self._commit_index:
            self._apply_commits(rd.committed)
        if rd.soft_role is Role.LEADER and self._writable_term != rd.term:
            self._become_writable(rd.term)

    def on_fatal(self, error: BaseException) -> None:
        self._writable_term = None
        self._fail_pending(0, f"store failure: {error}", fatal=True)

    def _on_reset(self, base_index: int) -> None:
        # The base is committed by definition; the leader's state for it is unknown here,
        # so the applied table cannot be continued (it is rebuilt at the next restart).
        log.warning("dledger: log reset to %d; queue-offset table continues from the reset", base_index)
        self._applied_index = max(self._applied_index, base_index)
        self._commit_index = max(self._commit_index, base_index)
        self._committed_pos = self.store.start_pos

    def _become_writable(self, term: int) -> None:
        """New leader: its whole log is persisted now (no-op included); rebuild, then accept."""
        t0 = time.monotonic()
        table = QueueOffsetTable(self._applied_table.snapshot())
        self._replay(table, self._applied_index + 1, self.store.last_index())
        self._table = table
        self._tail_pos = self.store.end_pos
        self._writable_term = term
        log.info("dledger %s: leader of term %d; queue offsets rebuilt over %d uncommitted entries in %.1f ms",
                 self.node.node_id, term, self.store.last_index() - self._applied_index,
                 (time.monotonic() - t0) * 1000)

    def _apply_commits(self, committed: int) -> None:
        self._replay(self._applied_table, self._applied_index + 1, committed)
        self._applied_index = self._commit_index = committed
        self._committed_pos = self._end_of(committed)
        while self._pending and self._pending[0].last <= committed:
            p = self._pending.popleft()
            if p.future.done():
                continue
            if self.store.term(p.last) == p.term:
                p.future.set_result(None)
            else:
                p.future.set_exception(NotLeader("the write was replaced by another leader's entries",
                                                 leader=self.leader()))
        self._commit_changed.set()
        self._commit_changed = asyncio.Event()

    def _replay(self, table: QueueOffsetTable, lo: int, hi: int) -> None:
        """Fold NORMAL entries lo..hi (inclusive) into `table`."""
        i = lo
        while i <= hi:
            batch = self.store.entries(i, hi + 1, _REPLAY_BATCH_BYTES)
            for e in batch:
                if e.type is EntryType.NORMAL and len(e.body) >= L.MESSAGE_OVERHEAD:
                    _fold_record(table, e.body)
            i += len(batch)

    def _end_of(self, index: int) -> int:
        if index < self.store.first_index():
            return self.store.start_pos
        return self.store.entry_at(index).end

    def _fail_pending(self, from_index: int, why: str, fatal: bool = False) -> None:
        keep: collections.deque[_Pending] = collections.deque()
        for p in self._pending:
            if p.last >= from_index and not p.future.done():
                err = StoreFatal(why) if fatal else NotLeader(f"{why}; the outcome is unknown, retry",
                                                              leader=self.leader())
                p.future.set_exception(err)
            elif not p.future.done():
                keep.append(p)
        self._pending = keep

    # --- writes ---------------------------------------------------------------------------
    async def append(self, drafts: Sequence[MessageDraft]) -> list[PutResult]:
        """Leader only: assign offsets, propose, wait for the majority commit."""
        if self.node.fatal is not None:
            raise StoreFatal(f"the DLedger store stopped: {self.node.fatal}")
        if self._writable_term is None:
            raise NotLeader(leader=self.leader())
        if not drafts:
            return []
        now = int(time.time() * 1000)
        bodies, results, assigned, tail = self._encode(drafts, now)
        try:
            first, last = self._propose(bodies)
        except CoreNotLeader as e:
            self._table.rewind(assigned)
            raise NotLeader(str(e), leader=self.peer_api_addrs.get(e.leader) if e.leader else None) from None
        self._tail_pos = tail
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(first, last, self._writable_term, fut))
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.append_timeout_s)
        except asyncio.TimeoutError:
            return [PutResult(PutStatus.FLUSH_SLAVE_TIMEOUT, *r) for r in results]
        return [PutResult(PutStatus.SEND_OK, *r) for r in results]

    def _encode(self, drafts: Sequence[MessageDraft], now: int):
        """Records with their final offsets; positions follow the store's placement rule."""
        seg = self.store.segment_size
        tail = self._tail_pos
        bodies, results, assigned = [], [], []
        for d in drafts:
            pos = place_entry(tail, HEADER_SIZE + d.total_size, seg)
            qo = self._table.assign(d)
            assigned.append((d, qo))
            phys = pos + HEADER_SIZE
            bodies.append(encode_record(d, qo, phys, now, self.store_ip, self.store_port))
            results.append((phys, d.total_size, qo, now))
            tail = phys + d.total_size
        return bodies, results, assigned, tail

    def _propose(self, bodies: list[bytes]) -> tuple[int, int]:
        """Propose in core-sized chunks. Nothing can change the role between chunks (no await)."""
        first = last = -1
        for i in range(0, len(bodies), self.max_propose_entries):
            f, last = self.node.propose(bodies[i:i + self.max_propose_entries])
            first = f if first < 0 else first
        return first, last

    # --- reads ------------------------------------------------------------------------------
    @property
    def committed_position(self) -> int:
        return self._committed_pos

    @property
    def min_position(self) -> int:
        return self.store.start_pos

    @property
    def min_physical_offset(self) -> int:
        return self.store.start_pos + HEADER_SIZE

    def scan(self, position: int, max_bytes: int) -> ScanBatch:
        """Committed NORMAL bodies from `position` (an entry or blank start), ~max_bytes of them."""
        limit = self._committed_pos
        pos = max(position, self.store.start_pos)
        records: list[ScannedRecord] = []
        used = 0
        data = self.store.data
        while pos < limit and used < max_bytes:
            seg = data.segment_for(pos)
            if seg is None:
                break
            buf = data.read(pos, min(max(max_bytes - used, HEADER_SIZE), limit - pos))
            at = 0
            while at + L.ENTRY_BLANK.size <= len(buf):
                magic, size = L.ENTRY_BLANK.unpack_from(buf, at)
                if magic == L.ENTRY_MAGIC_BLANK:
                    at = seg.base + seg.capacity - pos
                    break
                if at + size > len(buf):
                    break
                if magic == L.ENTRY_MAGIC_NORMAL:
                    records.append(ScannedRecord(pos + at + HEADER_SIZE, buf[at + HEADER_SIZE:at + size]))
                at += size
                used += size
            if at == 0:  # one entry larger than what we read: read it whole
                magic, size = L.ENTRY_BLANK.unpack_from(data.read(pos, L.ENTRY_BLANK.size))
                entry = data.read(pos, size)
                if len(entry) < size:
                    break
                if magic == L.ENTRY_MAGIC_NORMAL:
                    records.append(ScannedRecord(pos + HEADER_SIZE, entry[HEADER_SIZE:]))
                at, used = size, used + size
            pos += at
        return ScanBatch(tuple(records), pos)

    def read(self, physical_offset: int, size: int) -> bytes:
        if physical_offset < self.min_physical_offset or physical_offset + size > self._committed_pos:
            raise KeyError(physical_offset)
        data = self.store.read_body(physical_offset, size)
        if len(data) != size:
            raise KeyError(physical_offset)
        return data

    async def wait_committed(self, beyond_position: int, timeout_s: float) -> int:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._committed_pos <= beyond_position:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            # asyncio.timeout, not wait_for: 3.11's wait_for swallows a cancel that races the
            # event, and the dispatcher's stop then waits forever on a loop that runs on.
            try:
                async with asyncio.timeout(left):
                    await self._commit_changed.wait()
            except TimeoutError:
                break
        return self._committed_pos

    def queue_offset_of(self, topic: str, queue_id: int) -> int:
        table = self._table if self._writable_term is not None else self._applied_table
        return table.get(topic, queue_id)

    # --- status -------------------------------------------------------------------------------
    def role(self) -> str:
        return _ROLE_NAMES[self._role]

    def leader(self) -> str | None:
        return self.peer_api_addrs.get(self._leader_id) if self._leader_id else None

    @property
    def fatal(self) -> BaseException | None:
        """Set once the Raft node stopped (store failure or a failed Raft loop); the server
        stops the process on it (node.server._watch_fatal)."""
        return self.node.fatal

    @property
    def is_writable(self) -> bool:
        return self._writable_term is not None

    def status(self) -> dict:
        st = self.node.status()
        st.update({"mode": self.mode, "role": self.role(), "leader": self.leader(), "leader_id": self._leader_id,
                   "applied_index": self._applied_index, "committed_position": self._committed_pos,
                   "writable": self.is_writable, "pending_appends": len(self._pending)})
        return st


def _fold_record(table: QueueOffsetTable, body: bytes) -> None:
    """queue offset + 1 of a committed record becomes its queue's next offset (if larger)."""
    qoff = int.from_bytes(body[_MSG_QOFF_AT:_MSG_QOFF_AT + 8], "big", signed=True)
    if qoff < 0:
        return  # prepared / rolled-back transaction message: takes no queue offset
    qid = int.from_bytes(body[_MSG_QID_AT:_MSG_QID_AT + 4], "big", signed=True)
    body_len = int.from_bytes(body[_MSG_BODYLEN_AT:_MSG_BODYLEN_AT + 4], "big", signed=True)
    at = L.MESSAGE_HEADER.size + body_len
    topic_len = body[at]
    topic = body[at + 1:at + 1 + topic_len].decode("ascii", "replace")
    if qoff + 1 > table.get(topic, qid):
        table.set(topic, qid, qoff + 1)

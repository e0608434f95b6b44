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
applied table is replayed from the log up to the last checkpointed commit, starting
from the table stored with the log's base.

Retention (`retention_tick`, RocketMQ's fileReservedTime / deleteWhen / disk ratios):
head data files go whole, and only below what is committed, fsynced, applied and
dispatched here. The new base is the last entry before the first kept file; the
applied table as of that entry is stored with it (`EntryStore.compact_to`), so a
restart replays from there, and InstallBase hands it to a follower that is reset to
the base, whose queue offsets then continue where the leader's do. To have that table
at hand, the applied table is copied each time it folds the first entry of a new
data file (`_file_tables`: one small dict per file).

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
import struct
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Sequence

import msgpack

from dledger.core import NotLeader as CoreNotLeader
from dledger.core import ProposalDropped
from dledger.core import Ready, Role
from dledger.entry import HEADER_SIZE
from dledger.entry_store import EntryStore, place_entry
from dledger.messages import EntryType
from dledger.shell import RaftNode
from node.replicated_log import PutResult, PutStatus, ScanBatch, ScannedRecord
from node.store import layout as L
from node.store.disk_guard import DiskGuard
from node.store.errors import DiskFull, InvalidMessage, NotLeader, StoreError, StoreFatal
from node.store.message import MessageDraft
from node.store.queue_offsets import QueueOffsetTable
from node.store.retention import RetentionDecision, RetentionPolicy, decide, segment_ages
from node.store.scrub import CorruptData, CorruptionRegistry, CorruptRange
from dledger import repair as R

log = logging.getLogger(__name__)

_ROLE_NAMES = {Role.LEADER: "LEADER", Role.FOLLOWER: "FOLLOWER", Role.CANDIDATE: "CANDIDATE",
               Role.PRE_CANDIDATE: "CANDIDATE"}
_REPLAY_BATCH_BYTES = 8 << 20
_STARTUP_REPAIR_WAIT_S = 5.0     # start() waits this long for peers to repair what recovery found
_DISK_WATCH_S = 1.0              # how often the disk's fill level is looked at without a write
_HANDOVER_RETRY_S = 5.0          # a full leader tries one peer per this long
WAITER_SWEEP_S = 0.05            # how often submitted writes are checked against their deadline
FOLLOWER_DISPATCH_LINGER_S = 0.005   # a follower dispatches what 5 ms of commits brought, as one batch
_MSG_QID_AT = L.MESSAGE_FIELD_OFFSET["queue_id"]
_MSG_QOFF_AT = L.MESSAGE_FIELD_OFFSET["queue_offset"]
_MSG_BODYLEN_AT = L.MESSAGE_FIELD_OFFSET["body_len"]
_QUEUE_FIELDS = L.MESSAGE_QUEUE_FIELDS      # queue_id, queue_offset, sys_flag, body_len from _MSG_QID_AT


class ReplicationBusy(StoreError):
    """Too many entries await a majority (max_uncommitted_entries): the batch was not
    proposed (none of it is stored); retry shortly."""

    code = "SYSTEM_BUSY"
    retriable = True
    http_status = 503


@dataclass(slots=True)
class _Pending:
    first: int
    last: int
    term: int
    future: "asyncio.Future | _Waiter"


class _Waiter:
    """A pending append answered by a call instead of a future (`submit_packed`): the Future
    methods `_pending` uses. `fn(error)` runs once, with None on commit, where the commit is
    applied (in the Raft round), or with the error; once `deadline` (monotonic) has passed,
    DLedgerLog's sweep calls it with TimeoutError."""

    __slots__ = ("fn", "deadline", "_done")

    def __init__(self, fn: Callable[[BaseException | None], None], deadline: float):
        self.fn, self.deadline, self._done = fn, deadline, False

    def done(self) -> bool:
        return self._done

    def set_result(self, _result: None) -> None:
        self._finish(None)

    def set_exception(self, error: BaseException) -> None:
        self._finish(error)

    def _finish(self, error: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        try:
            self.fn(error)
        except Exception:  # noqa: BLE001 - runs inside a Raft round: a caller's bug must not stop the node
            log.exception("dledger: a send's completion failed")


class DLedgerLog:
    """ReplicatedLog over a RaftNode + EntryStore."""

    mode = "dledger"

    def __init__(self, node: RaftNode, peer_api_addrs: dict[str, str], store_host: str = "127.0.0.1",
                 store_port: int = 0, append_timeout_s: float = 5.0, max_propose_entries: int | None = None,
                 disk: DiskGuard | None = None, retention: RetentionPolicy | None = None):
        self.node = node
        self.retention = retention       # None: the log is never cut (tests)
        # The store volume's fill limit: a leader refuses sends at it, a follower the leader's
        # appends (it keeps answering everything else, so no election follows).
        self.disk = disk
        if disk is not None:
            node.refuse_appends = self._refuse_appends
        self.store: EntryStore = node.store
        self.peer_api_addrs = dict(peer_api_addrs)
        self.store_ip = socket.inet_aton(store_host)
        self.store_port = store_port
        self.append_timeout_s = append_timeout_s
        self.max_propose_entries = max_propose_entries or node.raft_config.max_batch_entries
        node.listener = self
        self._applied_table = QueueOffsetTable()
        # data file start -> (the entry before the file's first, the applied table as of it):
        # retention's candidate bases; _fold_file: the file of the last entry folded in
        self._file_tables: dict[int, tuple[int, dict]] = {}
        self._fold_file = -1
        # Committed entries the applied table has not folded: known corrupt when they were
        # applied (replay skips them) and not repaired since. A table as of a later entry
        # lacks them, so no file table is taken past the first of them.
        self._unfolded: set[int] = set()
        # Told the log's new start position when an InstallBase resets this replica (the
        # broker drops its consume queues of the old log and dispatch jumps there).
        self.reset_listeners: list[Callable[[int], None]] = []
        # The broker's replicated state (topics, consumer offsets) for a base: taken when
        # retention cuts the log, given to a replica reset to the base (set by the broker).
        self.export_broker_state: Callable[[], dict] | None = None
        self.import_broker_state: Callable[[dict], None] | None = None
        self._table = QueueOffsetTable()       # leader only: includes uncommitted entries
        self._applied_index = 0
        self._commit_index = 0
        self._committed_pos = 0
        self._writable_term: int | None = None  # term in which this node accepts writes
        self._tail_pos = 0                      # leader: where the next proposed entry goes
        self._pending: collections.deque[_Pending] = collections.deque()
        self._sweep_timer: asyncio.TimerHandle | None = None     # times out submitted writes (_sweep_waiters)
        self._commit_changed = asyncio.Event()
        self._role = Role.FOLLOWER
        self._leader_id: str | None = None
        self._term = 0
        self.leader_changes = 0          # times a new leader became known (metrics)
        # Corrupt committed entries (dledger/repair.py): not served, not dispatched past, no campaign
        # while any is known; repaired in place from a peer.
        self.corruption = CorruptionRegistry()
        self.corruption.listeners.append(self._on_corrupt)
        self.repairer = R.Repairer(self, self.corruption,
                                   [k for k in peer_api_addrs if k != getattr(node, "node_id", None)])
        node.side_handler = self.repairer.on_message   # FetchEntries/-Response: the Raft peer channel
        self._repair_task: asyncio.Task | None = None
        self._disk_task: asyncio.Task | None = None
        self.disk_watch_s = _DISK_WATCH_S
        self.handover_retry_s = _HANDOVER_RETRY_S
        self._handover_at = float("-inf")     # when a full leader last handed leadership over
        self._handover_to: str | None = None  # and to whom (the next try goes to another peer)
        self._scan_floor = 0             # the dispatcher has dispatched everything below (scan, wait_committed)

    # --- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        await self.node.start()
        self._repair_task = asyncio.create_task(self.repairer.run(), name=f"repair-{self.node.node_id}")
        if self.disk is not None:
            self._disk_task = asyncio.create_task(self._watch_disk(), name=f"disk-{self.node.node_id}")
        if self.corruption:
            await self._await_repair(_STARTUP_REPAIR_WAIT_S)

    async def _await_repair(self, timeout_s: float) -> None:
        """Recovery found damage: give the repair a bounded moment before the broker dispatches, so the
        consume queues need not be held (and rebuilt) at the damaged entry."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.corruption and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        if self.corruption:
            log.warning("dledger %s: %d corrupt range(s) not repaired within %.1f s of start; dispatch holds "
                        "before the first one until it is", self.node.node_id, len(self.corruption), timeout_s)

    async def stop(self) -> None:
        self._fail_pending(0, "node stopping")
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        for task in (self._repair_task, self._disk_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._repair_task = self._disk_task = None
        await self.node.stop()

    # --- corruption (dledger/repair.py) ----------------------------------------------------
    def scrub_source(self) -> R.EntryScrubSource:
        return R.EntryScrubSource(self)

    def _on_corrupt(self, r: CorruptRange) -> None:
        core = self.node.core
        if core is not None:
            core.campaign_blocked = True
        self.repairer.wake()
        if self._role is Role.LEADER:
            asyncio.get_running_loop().call_soon(self._hand_over_for_corruption)

    def _hand_over_for_corruption(self) -> None:
        if self.corruption:
            self._hand_over_leadership("corrupt committed data here")

    def _hand_over_leadership(self, why: str, skip: str | None = None) -> str | None:
        """A leader that should not lead hands over to its most caught-up peer (to another than
        `skip` when there is one); returns the target."""
        core = self.node.core
        if core is None or core.role is not Role.LEADER:
            return None
        peers = sorted((p for p in core.peers if core.match_index(p) is not None),
                       key=lambda p: core.match_index(p) or 0, reverse=True)
        if not peers:
            return None
        target = next((p for p in peers if p != skip), peers[0])
        try:
            self.node.transfer_leadership(target)
        except (CoreNotLeader, ValueError, AssertionError, StoreFatal) as e:
            log.warning("dledger %s: could not hand leadership over: %s", self.node.node_id, e)
            return None
        log.warning("dledger %s: %s; leadership handed to %s", self.node.node_id, why, target)
        return target

    # --- a full disk ------------------------------------------------------------------------
    async def _watch_disk(self) -> None:
        while True:
            await asyncio.sleep(self.disk_watch_s)
            self._look_at_disk(time.monotonic())

    def _look_at_disk(self, now: float) -> None:
        """A node whose disk is full declines leadership transfers (it could take no write); a
        full leader hands leadership to a peer, another one each try, at most every
        handover_retry_s (a peer as full declines, and the transfer times out)."""
        core = self.node.core
        if core is None or self.disk is None:
            return
        full = self.disk.full()
        core.decline_transfers = full
        if full and core.role is Role.LEADER and now - self._handover_at >= self.handover_retry_s:
            self._handover_at = now
            self._handover_to = self._hand_over_leadership(f"{self.disk.reason()}: sends refused here",
                                                           skip=self._handover_to)

    def on_repaired(self, r: CorruptRange, rec, raw: bytes, how: str) -> None:
        self.corruption.clear(r.start, how)
        if rec.magic == L.ENTRY_MAGIC_NORMAL and rec.index <= self._applied_index \
                and len(raw) - HEADER_SIZE >= L.MESSAGE_OVERHEAD:
            _fold_record(self._applied_table, raw[HEADER_SIZE:])   # skipped at replay; max() makes it idempotent
        self._unfolded.discard(r.index)
        self._damage_closed(r)
        self._commit_changed.set()       # the dispatcher may continue past the repaired range
        self._commit_changed = asyncio.Event()

    def _forget_damage_below(self, start: int) -> None:
        """Retention deleted the files below `start`: corrupt ranges in them are gone with them
        (unrepaired: once every peer has cut past an entry, none can send it). Without this a
        range no peer keeps would block campaigns and be retried forever."""
        for r in [r for r in self.corruption.ranges() if r.end <= start]:
            self.corruption.forget(r.start, "its file was deleted by retention")
            self._damage_closed(r)

    def _damage_closed(self, r: CorruptRange) -> None:
        """`r` left the registry (repaired, or deleted with its file): the store forgets it, and
        the campaign gate reopens once no range is left."""
        self.store.damaged.pop(r.index, None)
        if not self.corruption and self.node.core is not None:
            self.node.core.campaign_blocked = False

    def _damage(self, pos: int, raw: bytes, found_by: str, index: int | None) -> CorruptData:
        problem = R.body_crc_problem(raw) if len(raw) >= HEADER_SIZE else None
        seg = self.store.data.segment_for(pos)
        size = int.from_bytes(raw[4:8], "big", signed=True) if len(raw) >= 8 else 0
        try:   # trust the header's index only if the index file puts that entry here
            rec = self.store.entry_at(index) if index is not None else None
            index, size = (index, rec.size) if rec is not None and rec.pos == pos else (None, size)
        except (KeyError, StoreFatal):
            index = None
        self.corruption.report(CorruptRange(seg.path if seg is not None else self.store.data.directory, pos,
                                            pos + max(size, HEADER_SIZE), problem[0] if problem else None,
                                            problem[1] if problem else None, found_by,
                                            "entry body crc mismatch" if problem else "entry header damaged", index))
        return CorruptData(pos + HEADER_SIZE, "entry failed its CRC check; not served until repaired from a peer")

    # Queue offsets come from the log's own entries, never from the consume queues: the broker
    # may start before its dispatcher has caught up (a start on a full disk).
    queue_offsets_from_log = True

    def init_queue_offsets(self, table: dict) -> None:
        """Accepted and ignored: the DLedger log derives queue offsets from its own entries."""

    # --- ReadyListener -------------------------------------------------------------------
    def on_recovered(self, node: RaftNode) -> None:
        s = self.store
        for d in sorted(s.damaged.values(), key=lambda d: d.index):
            self.corruption.report(R.damage_range(s, d, "recovery"))
        known = min(max(s.meta.committed, s.first_index() - 1), s.last_index())
        self._applied_index = s.first_index() - 1
        self._applied_table = QueueOffsetTable(self._base_table())
        self._file_tables, self._fold_file, self._unfolded = {}, -1, set()
        self._replay(self._applied_table, self._applied_index + 1, known, mark_files=True)
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

    def _base_table(self) -> dict:
        return _decode_base_state(self.store.base_app_state, self.store.first_index() - 1)[0]

    def _on_reset(self, base_index: int) -> None:
        """InstallBase: the log restarts after the leader's base, with the leader's table as of it."""
        self._applied_index = max(self._applied_index, base_index)
        self._commit_index = max(self._commit_index, base_index)
        self._committed_pos = self.store.start_pos
        table, broker = _decode_base_state(self.store.base_app_state, base_index)
        self._applied_table = QueueOffsetTable(table)
        self._file_tables, self._fold_file, self._unfolded = {}, -1, set()
        log.warning("dledger %s: log reset to the leader's base %d at %d; queue offsets continue from its "
                    "table (%d queues)", self.node.node_id, base_index, self.store.start_pos, len(self._applied_table))
        for listener in list(self.reset_listeners):
            listener(self.store.start_pos)
        if broker and self.import_broker_state is not None:
            self.import_broker_state(broker)

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
        self._replay(self._applied_table, self._applied_index + 1, committed, mark_files=True)
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

    def _replay(self, table: QueueOffsetTable, lo: int, hi: int, mark_files: bool = False) -> None:
        """Fold NORMAL entries lo..hi (inclusive) into `table` (corrupt ones when repaired);
        `mark_files`: `table` is the applied one, copied where a data file starts."""
        skip = sorted(r.index for r in self.corruption.ranges() if r.index is not None) if self.corruption else []
        if mark_files:
            self._unfolded.update(k for k in skip if lo <= k <= hi)
        i = lo
        while i <= hi:
            if skip and skip[0] <= i:
                i = max(i, skip.pop(0) + 1)
                continue
            stop = min(hi + 1, skip[0]) if skip else hi + 1
            # Recent entries straight from the store's cache (no byte budget to count: they are
            # in memory already), older ones read from disk in bounded batches.
            batch = self.store.cached_entries(i, stop) or self.store.entries(i, stop, _REPLAY_BATCH_BYTES)
            if mark_files:
                self._fold_marking_files(table, batch)
            else:
                _fold_entries(table, batch)
            i += len(batch)

    def _fold_marking_files(self, table: QueueOffsetTable, batch: list) -> None:
        """Fold `batch` into the applied table, copying the table as of each entry that is
        the last before a data file (one `entry_at` per batch unless a file starts in it)."""
        seg, entry_at = self.store.segment_size, self.store.entry_at

        def file_of(j: int) -> int:
            return entry_at(batch[j].index).pos // seg

        j, n = 0, len(batch)
        while j < n:
            if file_of(n - 1) == self._fold_file:
                _fold_entries(table, batch[j:])
                return
            f = file_of(j)
            if f != self._fold_file:
                base = batch[j].index - 1
                if base >= self.store.first_index() and min(self._unfolded, default=base + 1) > base:
                    self._file_tables[f * seg] = (base, table.snapshot())
                self._fold_file = f
            lo, hi = j, n - 1            # the last entry of the batch still in file f
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if file_of(mid) == f else (lo, mid - 1)
            _fold_entries(table, batch[j:lo + 1])
            j = lo + 1

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
        status, now, placed = await self.append_packed(drafts)
        return [PutResult(status, phys, size, qoff, now) for phys, size, qoff in placed]

    async def append_packed(self, drafts: Sequence[MessageDraft]) -> tuple[PutStatus, int, list[tuple[int, int, int]]]:
        """`append` without a result object per message: the batch's status and store time,
        and `(physical_offset, size, queue_offset)` per draft (the broker's batched path)."""
        if not drafts:
            self._check_writable()
            return PutStatus.SEND_OK, int(time.time() * 1000), []
        fut = asyncio.get_running_loop().create_future()
        now, results = self._propose_batch(drafts, fut)
        self.node.run_round()       # persisted and pushed now; its commit can resolve `fut`
        try:
            # The future itself, under asyncio.timeout: its commit wakes this task in the next
            # loop turn (wait_for over a shield took three), and a cancel always surfaces. On
            # timeout the future is cancelled: _apply_commits skips it.
            async with asyncio.timeout(self.append_timeout_s):
                await fut
        except TimeoutError:
            return PutStatus.FLUSH_SLAVE_TIMEOUT, now, results
        return PutStatus.SEND_OK, now, results

    def submit_packed(self, drafts: Sequence[MessageDraft],
                      on_done: Callable[[PutStatus | BaseException, int, list[tuple[int, int, int]]], None]) -> None:
        """`append_packed` without a task: proposes now (raising what append_packed raises before
        anything is proposed) and calls `on_done(status, store time, placed)` once, from the
        Raft round that applies the commit, so the producer's answer leaves in the loop turn
        the majority's ack arrived (awaiting a future took one more turn, and a task to start
        another); `on_done(FLUSH_SLAVE_TIMEOUT, ...)` after append_timeout_s, or
        `on_done(error, ...)` when the write is lost (leadership, truncation, store failure).
        `on_done` runs inside the round: it must be short and must not propose."""
        if not drafts:
            raise ValueError("submit_packed needs at least one draft")
        proposed: tuple[int, list[tuple[int, int, int]]] = (0, [])

        def done(error: BaseException | None) -> None:
            now, results = proposed
            if error is None:
                on_done(PutStatus.SEND_OK, now, results)
            elif isinstance(error, TimeoutError):
                on_done(PutStatus.FLUSH_SLAVE_TIMEOUT, now, results)
            else:
                on_done(error, now, [])

        waiter = _Waiter(done, time.monotonic() + self.append_timeout_s)
        proposed = self._propose_batch(drafts, waiter)
        self.node.run_round()       # may complete the write at once (a group of one): `proposed` is set
        if self._sweep_timer is None and not waiter.done():
            self._sweep_timer = asyncio.get_running_loop().call_later(WAITER_SWEEP_S, self._sweep_waiters)

    def _sweep_waiters(self) -> None:
        """Time out the submitted writes past their deadline (FLUSH_SLAVE_TIMEOUT); again every
        WAITER_SWEEP_S while any is pending. One timer per log, not one per write. Deadlines
        follow submission order, so the sweep stops at the first one still to come."""
        self._sweep_timer = None
        now, waiting = time.monotonic(), False
        for p in list(self._pending):
            w = p.future
            if type(w) is not _Waiter or w.done():
                continue
            if w.deadline > now:
                waiting = True
                break
            w.set_exception(TimeoutError())
        if waiting:
            self._sweep_timer = asyncio.get_running_loop().call_later(WAITER_SWEEP_S, self._sweep_waiters)

    def _check_writable(self) -> None:
        if self.node.fatal is not None:
            raise StoreFatal(f"the DLedger store stopped: {self.node.fatal}")
        if not self.is_writable:
            raise NotLeader(leader=self.leader())
        if self.disk is not None:
            self.disk.check("sends refused until space returns")
        self.node.check_not_stalled()

    def _propose_batch(self, drafts: Sequence[MessageDraft],
                       waiter: "asyncio.Future | _Waiter") -> tuple[int, list[tuple[int, int, int]]]:
        """Place, propose and register `drafts` (at least one) with `waiter`; (store time, placed).
        Raises before anything is proposed. The caller runs the round that persists them."""
        self._check_writable()
        now = int(time.time() * 1000)
        bodies, results, qoffs, tail = self._encode(drafts, now)
        try:
            self._check_room(len(bodies))
            first, last = self._propose(bodies)
        except CoreNotLeader as e:   # e.g. a leadership transfer in progress: nothing was proposed
            self.node.wake()
            self._table.rewind(drafts, qoffs)
            raise NotLeader(str(e), leader=self.peer_api_addrs.get(e.leader) if e.leader else None) from None
        except (ProposalDropped, ReplicationBusy) as e:
            self.node.wake()        # a chunk proposed before the one refused is persisted all the same
            self._table.rewind(drafts, qoffs)
            raise ReplicationBusy(str(e)) from None
        self._tail_pos = tail
        self._pending.append(_Pending(first, last, self._writable_term, waiter))
        return now, results

    def _check_room(self, n: int) -> None:
        """Refuse, before anything is proposed, a batch the core would drop part-way through
        (max_uncommitted_entries): all of a batch is proposed, or none of it."""
        core = self.node.core
        if core is None:
            return
        uncommitted = core.last_index - core.commit_index
        limit = self.node.raft_config.max_uncommitted_entries
        if uncommitted + n > limit:
            raise ReplicationBusy(f"{uncommitted} entries await a majority; {n} more would exceed "
                                  f"max_uncommitted_entries {limit}; retry shortly")

    def _encode(self, drafts: Sequence[MessageDraft], now: int):
        """Records with their final offsets; positions follow the store's placement rule.

        Returns (bodies, [(phys, size, queue offset)], queue offsets, tail). One tight loop:
        queue offsets for the whole batch at once, the header packed inline (the bytes of
        `encode_record`), `place_entry` called only when a file may roll. On any error the
        queue offsets are given back."""
        qoffs = self._table.assign_batch(drafts)
        try:
            bodies, results, tail = self._encode_records(drafts, qoffs, now)
        except struct.error as e:
            self._table.rewind(drafts, qoffs)
            raise InvalidMessage(f"a message field is out of range: {e}") from None
        except BaseException:
            self._table.rewind(drafts, qoffs)
            raise
        return bodies, results, qoffs, tail

    def _encode_records(self, drafts: Sequence[MessageDraft], qoffs: list[int], now: int):
        seg = self.store.segment_size
        tail = self._tail_pos
        pack, magic, ip, port = L.MESSAGE_HEADER.pack, L.MESSAGE_MAGIC, self.store_ip, self.store_port
        blank = L.ENTRY_BLANK.size
        bodies: list[bytes] = []
        results: list[tuple[int, int, int]] = []
        add_body, add_result = bodies.append, results.append
        for d, qo in zip(drafts, qoffs):
            size = d.total_size
            assert size > 0, "draft not sealed"
            entry_size = HEADER_SIZE + size
            if entry_size + blank <= seg - tail % seg:
                phys = tail + HEADER_SIZE           # fits in the current file (place_entry's rule)
            else:
                phys = place_entry(tail, entry_size, seg) + HEADER_SIZE
            add_body(pack(size, magic, d.body_crc, d.queue_id, d.flag, qo, phys, d.sys_flag, d.born_timestamp,
                          d.born_ip, d.born_port, now, ip, port, d.reconsume_times, d.prepared_tx_offset,
                          len(d.body)) + d.tail)
            add_result((phys, size, qo))
            tail = phys + size
        return bodies, results, tail

    def _propose(self, bodies: list[bytes]) -> tuple[int, int]:
        """Propose in core-sized chunks. Nothing can change the role between chunks (no await)."""
        first = last = -1
        for i in range(0, len(bodies), self.max_propose_entries):
            f, last = self.node.propose(bodies[i:i + self.max_propose_entries], wake=False)
            first = f if first < 0 else first
        return first, last

    # --- retention ------------------------------------------------------------------------------
    @property
    def disk_reserve(self):
        """The store's DiskReserve (None without one): the broker puts it back once there is room."""
        return self.store.reserve

    async def retention_tick(self, now: datetime | None = None, manual: bool = False) -> RetentionDecision | None:
        """Delete expired head data files (the broker calls this every ~10 s; `manual`: at any
        hour); see the module docstring. None when retention is off or nothing may go yet."""
        store, policy = self.store, self.retention
        if policy is None or self.node.fatal is not None or self.node.core is None:
            return None
        if self.node.truncating:    # the log's end is moving on a worker thread: next time
            return None
        ratio = 0.0
        if self.disk is not None:
            self.disk.recheck()
            ratio = self.disk.ratio()
        safe_index = min(self._applied_index, store.flushed_index, store.meta.durable_mark, store.last_index() - 1)
        if safe_index < store.first_index():
            return None
        safe_upto = min(self._end_of(safe_index), self._scan_floor)
        ages = segment_ages([(sg.base, sg.path) for sg in store.data.segments], store.segment_size, store.end_pos,
                            store.fs.mtime)
        decision = decide(policy, now or datetime.now(), ages, ratio, safe_upto, manual)
        if not decision.delete_bases:
            return decision
        # The cut is a file start, where a first entry begins; the files below end at or before
        # safe_upto, so the entry before it is applied, fsynced and dispatched.
        found = self._file_tables.get(decision.delete_upto)
        if found is None:
            log.warning("dledger %s: retention would cut below %d but has no queue-offset table for it; "
                        "waiting for the next file", self.node.node_id, decision.delete_upto)
            return None
        base, table = found
        broker = self.export_broker_state() if self.export_broker_state is not None else {}
        new = store.plan_base(base, _encode_base_state(table, broker))
        removed: list[str] = []
        if new is not None:
            # The new base's state file and meta take four fsyncs, after any flush in progress:
            # on a worker thread, as the flushes (docs/raft.md, "Disk waits stay off the event loop").
            # No flush starts until the cut is made: the cut closes files on the loop, and would
            # wait there for a flush's fsync of them.
            async with self.node.flushes_held():
                try:
                    await asyncio.to_thread(store.write_base, new)
                except DiskFull as e:   # no room for the new base's state file: nothing was deleted
                    log.warning("dledger %s: retention could not write the new base: %s", self.node.node_id, e)
                    return None
                removed = store.cut_below_base(new)
            if store.reserve is not None:
                await asyncio.to_thread(store.reserve.ensure, True)   # a spent reserve comes back after a cut
        for k in [k for k in self._file_tables if k <= decision.delete_upto]:
            del self._file_tables[k]
        self._forget_damage_below(store.start_pos)
        if self.disk is not None:
            self.disk.recheck()
        log.info("dledger %s: retention deleted %d file(s) (%s); the log now starts at entry %d, position %d",
                 self.node.node_id, len(removed), decision.reason, base + 1, store.start_pos)
        return decision

    # --- reads ------------------------------------------------------------------------------
    @property
    def committed_position(self) -> int:
        """Committed end, held before a corrupt range the dispatcher has not passed yet."""
        if self.corruption:
            r = self.corruption.first_at_or_after(self._scan_floor)
            if r is not None and r.start < self._committed_pos:
                return max(r.start, self._scan_floor)
        return self._committed_pos

    @property
    def commit_index(self) -> int:
        return self._commit_index

    @property
    def min_position(self) -> int:
        return self.store.start_pos

    @property
    def min_physical_offset(self) -> int:
        return self.store.start_pos + HEADER_SIZE

    def scan(self, position: int, max_bytes: int) -> ScanBatch:
        """Committed NORMAL bodies from `position` (an entry or blank start), ~max_bytes of them."""
        spans, pos = self.scan_spans(position, max_bytes)
        return ScanBatch(tuple([ScannedRecord(phys, buf[at:at + size]) for buf, at, phys, size in spans]), pos)

    def scan_spans(self, position: int, max_bytes: int) -> tuple[list[tuple[bytes, int, int, int]], int]:
        """`scan` without a copy per record (the dispatcher's batched path): `(buffer, start,
        physical_offset, size)` per NORMAL body, the body being `buffer[start:start + size]`,
        and the position to continue from."""
        self._scan_floor = max(self._scan_floor, position)
        limit = self.committed_position
        pos = max(position, self.store.start_pos)
        if not self.corruption:
            # Recent entries straight from the store's cache: the very bytes written, no read
            # and no header walk (the dispatcher checks every record's own header).
            cached = self.store.cached_spans(pos, limit, max_bytes)
            if cached is not None and cached[1] > pos:
                return cached
        records: list[tuple[bytes, int, int, int]] = []
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
                    records.append((buf, at + HEADER_SIZE, pos + at + HEADER_SIZE, size - HEADER_SIZE))
                at += size
                used += size
            if at == 0:  # one entry larger than what we read: read it whole
                magic, size = L.ENTRY_BLANK.unpack_from(data.read(pos, L.ENTRY_BLANK.size))
                entry = data.read(pos, size)
                if len(entry) < size:
                    break
                if magic == L.ENTRY_MAGIC_NORMAL:
                    records.append((entry, HEADER_SIZE, pos + HEADER_SIZE, size - HEADER_SIZE))
                at, used = size, used + size
            pos += at
        return records, pos

    def read(self, physical_offset: int, size: int) -> bytes:
        """The record at `physical_offset`, its entry's bodyCrc checked before it leaves the node."""
        if physical_offset < self.min_physical_offset or physical_offset + size > self._committed_pos:
            raise KeyError(physical_offset)
        pos = physical_offset - HEADER_SIZE
        if self.corruption:
            self.corruption.check(pos, physical_offset + size)
        raw = self.store.read_body(pos, size + HEADER_SIZE)
        if len(raw) != size + HEADER_SIZE:
            raise KeyError(physical_offset)
        if int.from_bytes(raw[4:8], "big") != size + HEADER_SIZE or R.body_crc_problem(raw) is not None:
            raise self._damage(pos, raw, "read", int.from_bytes(raw[8:16], "big"))
        return raw[HEADER_SIZE:]

    def read_record(self, physical_offset: int) -> bytes:
        """The record at `physical_offset` without knowing its size (query by id or key)."""
        pos = physical_offset - HEADER_SIZE
        if pos < self.store.start_pos or physical_offset > self._committed_pos:
            raise KeyError(physical_offset)
        head = self.store.read_body(pos, HEADER_SIZE)
        if len(head) != HEADER_SIZE:
            raise KeyError(physical_offset)
        magic, size, index, _term, rec_pos = L.ENTRY_HEADER.unpack_from(head)[:5]
        if magic != L.ENTRY_MAGIC_NORMAL or rec_pos != pos or size <= HEADER_SIZE or pos + size > self._committed_pos:
            raise KeyError(physical_offset)   # not an entry start: a wrong id, not damage
        return self.read(physical_offset, size - HEADER_SIZE)

    async def wait_committed(self, beyond_position: int, timeout_s: float) -> int:
        # The dispatcher waits here once it has dispatched up to `beyond_position`: that is its
        # floor too. (Scans alone left it at the start of the last batch, so an idle log kept
        # the files that batch spanned from retention until new writes came.)
        self._scan_floor = max(self._scan_floor, beyond_position)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.committed_position <= beyond_position:
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
        return self.committed_position

    def queue_offset_of(self, topic: str, queue_id: int) -> int:
        table = self._table if self._writable_term is not None else self._applied_table
        return table.get(topic, queue_id)

    # --- status -------------------------------------------------------------------------------
    def role(self) -> str:
        """The role this node serves in; see `_held_core`."""
        core = self._held_core()
        return _ROLE_NAMES[core.role if core is not None else self._role]

    def members(self) -> dict[str, str]:
        return dict(self.peer_api_addrs)

    def leader(self) -> str | None:
        core = self._held_core()
        leader_id = core.leader_id if core is not None else self._leader_id
        return self.peer_api_addrs.get(leader_id) if leader_id else None

    def _held_core(self):
        """The core while its Raft state is held (a full disk, or a new term and vote being
        written: RaftNode.holds_ready), else None. The listener hears nothing then, but a
        leader that stepped down in memory (a newer term not stored yet) serves no writes: its
        role and leader are the core's, not the last heard, so that no role is reported with
        a term it does not go with."""
        core = self.node.core
        return core if core is not None and self.node.holds_ready else None

    @property
    def fatal(self) -> BaseException | None:
        """Set once the Raft node stopped (store failure or a failed Raft loop); the server
        stops the process on it (node.server._watch_fatal)."""
        return self.node.fatal

    def _refuse_appends(self) -> str | None:
        """Why this follower must not store the leader's entries now (RaftNode.refuse_appends)."""
        return self.disk.reason() if self.disk is not None and self.disk.full() else None

    @property
    def dispatch_linger_s(self) -> float:
        """A follower learns commits push by push (one message each when producers send one at
        a time): its dispatcher gathers a few into one batch (node/store/dispatcher.py
        LINGER_BELOW_BYTES). A leader's consume queues are its consumers': no wait there."""
        return 0.0 if self._writable_term is not None else FOLLOWER_DISPATCH_LINGER_S

    @property
    def is_writable(self) -> bool:
        core = self._held_core()
        return self._writable_term is not None and (core is None or core.role is Role.LEADER)

    def status(self) -> dict:
        st = self.node.status()
        st.update({"mode": self.mode, "role": self.role(), "leader": self.leader(), "leader_id": self._leader_id,
                   "applied_index": self._applied_index, "committed_position": self._committed_pos,
                   "writable": self.is_writable, "pending_appends": len(self._pending),
                   "corrupt_ranges": len(self.corruption),
                   "disk_usage_ratio": round(self.disk.ratio(), 4) if self.disk is not None else None,
                   "campaign_blocked": bool(self.node.core is not None and self.node.core.campaign_blocked)})
        return st


def _encode_base_state(table: dict, broker: dict) -> bytes:
    """The broker's part of a base state: msgpack {"queues": [[topic, queue id, next offset], ...],
    "broker": the broker's replicated state}. The queue table is the one as of the base; the
    broker's state may be newer (its records past the base are applied again on top: last write wins)."""
    return msgpack.packb({"queues": sorted([t, q, n] for (t, q), n in table.items()), "broker": broker},
                         use_bin_type=True)


def _decode_base_state(raw: bytes, base_index: int) -> tuple[dict, dict]:
    """(queue table, broker state) of a base state; b"" is none. StoreFatal if unreadable."""
    if not raw:
        return {}, {}
    try:
        state = msgpack.unpackb(raw, raw=False, use_list=False, strict_map_key=False)
        table = {(t, q): n for t, q, n in state["queues"]}
        broker = state.get("broker") or {}
        if not all(type(t) is str and type(q) is int and type(n) is int and n >= 0 for (t, q), n in table.items()):
            raise ValueError("a queue row is not (topic, queue id, offset >= 0)")
        if not isinstance(broker, dict):
            raise ValueError("the broker's state is not a map")
    except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as e:
        raise StoreFatal(f"the state of base {base_index} is unreadable: {e}") from e
    return table, broker


def _fold_entries(table: QueueOffsetTable, entries: Sequence) -> None:
    """`_fold_records` over the NORMAL entries of a batch that can hold a record."""
    normal, overhead = EntryType.NORMAL, L.MESSAGE_OVERHEAD
    _fold_records(table, [e.body for e in entries if e.type is normal and len(e.body) >= overhead])


def _fold_records(table: QueueOffsetTable, bodies: Sequence[bytes]) -> None:
    """`_fold_record` over a batch (every committed entry passes here): one narrow unpack
    (queue id, queue offset, body length) per record, the highest queue offset per queue kept
    locally, the table touched once per queue. The same result: folding takes a maximum, so
    the order does not matter."""
    unpack = _QUEUE_FIELDS.unpack_from
    topic_at = L.MESSAGE_HEADER.size
    top: dict[tuple[bytes, int], int] = {}
    get = top.get
    for body in bodies:
        qid, qoff, _sys_flag, body_len = unpack(body, _MSG_QID_AT)
        if qoff < 0:
            continue  # prepared / rolled-back transaction message: takes no queue offset
        at = topic_at + body_len
        key = (body[at + 1:at + 1 + body[at]], qid)
        if qoff > get(key, -1):
            top[key] = qoff
    for (topic_b, qid), qoff in top.items():
        topic = topic_b.decode("ascii", "replace")
        if qoff + 1 > table.get(topic, qid):
            table.set(topic, qid, qoff + 1)


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

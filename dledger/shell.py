"""RaftNode: the asyncio shell that drives one RaftCore.

A round feeds the core what arrived (peer messages, ticks, proposals) and then handles
every Ready in the fixed order (etcd's RawNode usage, DESIGN 4). Rounds run on the loop,
never two at once: in the transport's read callback when peer messages arrive, in the
proposer's own turn after a leader's proposal (`run_round`), and in the node's task for
ticks and everything else:

    persist   reset / truncate (durable) -> append -> hard state (atomic meta)
              SYNC_FLUSH: entries count as persisted only once the group-commit
              flusher has fsynced them (see below)
    send      queue the Ready's messages on the transport
    apply     the listener (DLedgerLog) learns commits, role and truncations
    advance   core.advance(ready)

Handling a Ready never awaits, so nothing can feed the core while a Ready is
outstanding (the core asserts this) and one Ready carries every entry proposed
since the last one: one write per segment and one fsync for all of them (group
commit).

Repair messages (`messages.REPAIR_MESSAGES`: FetchEntries and its answer) are not Raft
state transitions: `_on_message` hands them straight to `side_handler` (set by
DLedgerLog to dledger/repair.py's Repairer) and `send_side` queues the answers, so the
core never sees them and they share the authenticated, optionally TLS peer channel.

Flush policy:
- SYNC_FLUSH: a group-commit task fsyncs the data on a worker thread, one fsync at a
  time, each covering everything written before it began; `advance` is told only the
  fsynced index, so followers acknowledge and the leader counts itself only for fsynced
  entries (the rest are reported by an extra, possibly empty, Ready when they land).
  The index file is derived (recovery rebuilds it) and is fsynced with each checkpoint.
- ASYNC_FLUSH: written entries count as persisted; a background task fsyncs every
  `async_flush_interval_ms`, on a worker thread. A power loss on a majority of the group at once can
  lose acknowledged writes (up to one interval of them). A process crash loses
  nothing: the page cache survives it.

Both policies checkpoint the durable mark into meta every `checkpoint_interval_ms`
(see EntryStore.checkpoint), which lets recovery tell a torn tail from lost data.

A new term or vote: the Ready's hard state must be durable before any of its messages
leaves (a vote given twice in one term breaks Raft). Its meta write (two fsyncs, 1.5 s
seen on a contended disk) runs on a worker thread while the node holds that Ready: the
core gets no input and proposals are refused with NotLeader (there is no leader of the
new term yet), but the loop serves everything else meanwhile (pulls, the API, the
transport filling the inbox). When the write lands the Ready completes as if just taken.
A follower's truncation (the entries a new leader does not have) is held the same way:
it must be durable before the Ready's entries are written over it and before any ack
leaves (RocketMQ #10666), and it takes two fsyncs or more, after any flush in progress.
The cut runs on a worker thread (then the Ready's hard state, if it has one); the
store's reads meanwhile are of committed entries, below the cut. So does a reset to a
leader's base (InstallBase: the base's state file, meta, every data and index file
replaced): `EntryStore.prepare_reset` writes them on a worker thread while the store
still serves its old log (readers keep their descriptors of the removed files), then
`commit_reset` switches on the loop, with no flush in flight (`_disk_gate`).

The node's clock (its ticks) stands still while that write is under way, and for as long
again once it has landed. A node that cannot act must not time out for it (etcd's ticker
drops ticks while its Ready loop waits on the disk the same way). The pause after the write
covers the votes: a candidate whose own write took W expects its voters' writes (the same
kind of disk, often the same contention) to take about W too. Counting that time instead
made every candidate time out before any vote could come back once the writes took longer
than an election timeout: the terms climbed and no leader was elected.

A full disk: when a Ready's entries or hard state meet ENOSPC (EntryStore raises DiskFull
and leaves the store as it was), the node holds that Ready and retries it on every tick,
feeding the core nothing and sending nothing meanwhile (proposals are refused with
DiskFull). To the group this is a paused process, which Raft tolerates: a stalled leader
is replaced, a stalled follower stops acking; once the entries are written the Ready
completes as if it had just been taken, and the node carries on. DLedgerLog's disk guard
refuses writes before the disk is this full; the stall covers what gets past it. A reset to
the leader's base whose state file and meta meet ENOSPC (after the reserve) is held and tried
again every RESET_RETRY_S the same way (`_reset_when_room`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from dledger.core import NotLeader, RaftConfig, RaftCore, Ready, Role
from dledger.entry_store import EntryStore
from dledger.messages import REPAIR_MESSAGES, Append, EntryType, TimeoutNow
from dledger.transport import Transport, TransportConfig
from node.log_throttle import LogThrottle
from node.store import cold_reads
from node.store.errors import DiskFull, StoreError, StoreFatal

log = logging.getLogger(__name__)

SYNC_FLUSH = "SYNC_FLUSH"
ASYNC_FLUSH = "ASYNC_FLUSH"
REFUSAL_LOG_INTERVAL_S = 10.0   # at most one warning per this long about refused appends
MAX_FILLS = 2                   # pushes' old entries being read by workers at once (node/store/cold_reads.py)
ROUND_SEND_BYTES = 1 << 20       # a round ends once it has queued this much (it then wakes the next)
SLOW_WRITE_PAUSE_MAX_S = 10.0   # the longest the clock stands still after a slow term-and-vote write
RESET_RETRY_S = 1.0             # a reset that met a full disk is tried again this often


class _Stalled(Exception):
    """A Ready's entries or hard state met a full disk; the Ready stays outstanding (RaftNode._handle)."""


class _Held(Exception):
    """A Ready's hard state is being written on a worker thread; the Ready stays outstanding."""


@dataclass(frozen=True)
class ShellConfig:
    # Length of one core tick, ms. RaftConfig counts ticks: with the defaults (election
    # 6-12 ticks, heartbeat 2) a dead leader is replaced in ~0.3-0.6 s plus a pre-vote round.
    tick_ms: int = 50
    # SYNC_FLUSH or ASYNC_FLUSH (see the module docstring).
    flush_disk_type: str = ASYNC_FLUSH
    # ASYNC_FLUSH: fsync period, ms (RocketMQ flushIntervalCommitLog).
    async_flush_interval_ms: int = 500
    # Period of the durable-mark checkpoint in meta (two fsyncs each), ms.
    checkpoint_interval_ms: int = 1000
    # Peer messages buffered between two core rounds; the oldest are dropped beyond.
    max_inbox_msgs: int = 100_000
    # Peer messages stepped before the next Ready is handled (bounds latency of a round).
    max_steps_per_round: int = 4096

    def validate(self) -> None:
        if self.flush_disk_type not in (SYNC_FLUSH, ASYNC_FLUSH):
            raise ValueError(f"ShellConfig.flush_disk_type must be SYNC_FLUSH or ASYNC_FLUSH, got {self.flush_disk_type!r}")
        for name in ("tick_ms", "async_flush_interval_ms", "checkpoint_interval_ms", "max_inbox_msgs",
                     "max_steps_per_round"):
            if getattr(self, name) < 1:
                raise ValueError(f"ShellConfig.{name} must be >= 1")


class ReadyListener(Protocol):
    def on_recovered(self, node: "RaftNode") -> None:
        """The store is open; the core exists; nothing has run yet."""

    def on_truncated(self, from_index: int) -> None:
        """Entries >= from_index are gone (truncate or reset)."""

    def on_ready(self, ready: Ready) -> None:
        """Role, term and commit of this Ready, in order, once it is persisted and advanced and
        the round's messages are written (before a later Ready of the round truncates or
        resets the store). Must not feed the core."""

    def on_fatal(self, error: BaseException) -> None:
        """The node stopped because the store failed."""


class RaftNode:
    """One Raft member: core + entry store + transport, on the running event loop."""

    def __init__(self, node_id: str, group: str, peers: dict[str, tuple[str, int]], store: EntryStore,
                 raft_config: RaftConfig | None = None, shell_config: ShellConfig | None = None,
                 transport_config: TransportConfig | None = None, rng: random.Random | None = None):
        assert node_id in peers, "peers lists every member, this node included"
        self.node_id = node_id
        self.group = group
        self.peers = dict(peers)
        self.store = store
        self.raft_config = raft_config or RaftConfig()
        self.config = shell_config or ShellConfig()
        self.config.validate()
        self.transport_config = transport_config or TransportConfig()
        self.rng = rng or random.Random()
        self.listener: ReadyListener | None = None
        # Receives REPAIR_MESSAGES (sender, msg) on the loop; must not block. None: dropped.
        self.side_handler: Callable[[str, object], None] | None = None
        # Why the leader's appends must not be stored now (a full disk), or None. A refused
        # Append is dropped before the core sees it, as if lost: the leader pushes it again
        # after its push timeout, and heartbeats and probes are still answered, so nobody
        # starts an election over it. While it says why, a TimeoutNow is declined too.
        self.refuse_appends: Callable[[], str | None] | None = None
        self._refusal_warnings = LogThrottle(REFUSAL_LOG_INTERVAL_S)
        # The Ready whose entries met a full disk, retried on every tick (module docstring).
        self._stalled: Ready | None = None
        self._stalled_at = self._stall_tried_at = 0.0
        self.stall_reason: str | None = None
        # The Ready whose truncation and/or term and vote a worker thread is writing, and
        # whether they have landed.
        self._held: Ready | None = None
        self._held_written = False
        self._held_write: asyncio.Task | None = None
        # Taken around the flusher's and group commit's store calls, by a held reset from its
        # file work to its switch, and by retention's cut: neither waits on the loop for an fsync.
        self._disk_gate = asyncio.Lock()
        self._prepared_reset = None                  # a held reset's files, written; switched in the next round
        self.core: RaftCore | None = None
        self.transport: Transport | None = None
        self.fatal: BaseException | None = None
        self.metrics: collections.Counter = collections.Counter()
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self._wake = asyncio.Event()
        self._ticks_due = 0
        self._clock_paused_until = 0.0               # monotonic; see the module docstring
        self._tasks: list[asyncio.Task] = []
        self._running = False
        self._in_round = False                       # a round is under way (run_round must not nest)
        self._last_checkpoint = 0.0
        # SYNC_FLUSH group commit: set when written entries await an fsync; _durable_grew
        # when one finished and the core has not been told yet.
        self._flush_wanted = asyncio.Event()
        self._durable_grew = False
        self._fills: set[asyncio.Task] = set()      # old entries for a push being read by a worker
        self._fetched = False                        # one ended: tell the core in the next round

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Recover the store, build the core, listen, start ticking. The recovery (every entry
        read and its CRCs checked) and the listener's replay of the committed log run on a
        worker thread, seconds for a large log: nothing else uses the store or the listener
        yet, and the event loop stays free."""
        await asyncio.to_thread(self.store.recover)
        self.core = RaftCore(self.node_id, list(self.peers), self.store, self.rng, self.raft_config)
        if self.listener is not None:
            await asyncio.to_thread(self.listener.on_recovered, self)
        self.transport = Transport(self.node_id, self.group, self.peers[self.node_id], self.peers,
                                   self._on_message, self.transport_config, self.rng,
                                   on_received=self._on_received)
        await self.transport.start()
        self._running = True
        self.store.cold_reader = self._on_cold
        self._tasks = [asyncio.create_task(self._run(), name=f"raft-{self.node_id}"),
                       asyncio.create_task(self._ticker(), name=f"raft-tick-{self.node_id}"),
                       asyncio.create_task(self._flusher(), name=f"raft-flush-{self.node_id}")]
        if self.config.flush_disk_type == SYNC_FLUSH:
            self._tasks.append(asyncio.create_task(self._group_commit(), name=f"raft-commit-{self.node_id}"))

    async def stop(self) -> None:
        """Stop ticking and talking; flush and checkpoint; close the files."""
        self._running = False
        self.store.cold_reader = None
        for t in [*self._tasks, *self._fills]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._fills, return_exceptions=True)
        self._tasks = []
        if self._held_write is not None:      # its thread runs on: the files stay open for it
            await asyncio.wait([self._held_write])
        if self._prepared_reset is not None:  # written, never switched to: the next start recovers it
            for seg in (self._prepared_reset.data, self._prepared_reset.index):
                seg.handle.close()
            self._prepared_reset = None
            self._disk_gate.release()
        if self.transport is not None:
            await self.transport.stop()
        if self.fatal is None and self.core is not None:
            try:
                self.store.flush()
                self.store.checkpoint(self.core.commit_index)
            except StoreError as e:
                log.error("raft %s: flush at stop failed: %s", self.node_id, e)
        self.store.close()

    # --- inputs ---------------------------------------------------------------------------
    def propose(self, bodies: list[bytes], type: EntryType = EntryType.NORMAL, wake: bool = True) -> tuple[int, int]:
        """Hand bodies to the core (raises core.NotLeader); the next round persists them. With
        `wake=False` the caller runs that round itself (`run_round`)."""
        core = self._live_core()
        self.check_not_stalled()
        self._check_not_held()
        first, last = core.propose(bodies, type)
        if wake:
            self._wake.set()
        return first, last

    def run_round(self) -> None:
        """Run a round now, in the caller's loop turn (a leader's proposal is persisted and pushed
        before the caller awaits its commit, instead of one loop turn later in the Raft task). A
        round cannot run inside another (a listener's callback that proposes): then the Raft task
        runs it next."""
        if self._in_round or not self._running:
            self._wake.set()
            return
        self._guarded_round()

    def transfer_leadership(self, target: str) -> None:
        core = self._live_core()
        self.check_not_stalled()
        self._check_not_held()
        core.transfer_leadership(target)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def check_not_stalled(self) -> None:
        if self._stalled is not None:
            raise DiskFull(f"raft {self.node_id} is stalled on a full disk: {self.stall_reason}")

    @property
    def holds_ready(self) -> bool:
        """A Ready is held: its entries or hard state met a full disk, or its truncation or its
        term and vote are being written. The core has moved on in memory; the listener has not
        heard of it yet."""
        return self._stalled is not None or self._held is not None

    def flushes_held(self) -> asyncio.Lock:
        """`async with` it: no flush or checkpoint of the store runs inside, so a change of the
        file sets made on the loop there never waits for an fsync (retention's cut)."""
        return self._disk_gate

    @property
    def truncating(self) -> bool:
        """A worker thread is cutting the log (a held Ready's truncation or reset)."""
        held = self._held
        return self._prepared_reset is not None or held is not None and not self._held_written \
            and (held.truncate_from is not None or held.reset_base is not None)

    def _check_not_held(self) -> None:
        if self._held is not None:
            what = ("a reset to the leader's base" if self._held.reset_base is not None else
                    "a truncation" if self._held.truncate_from is not None else "term and vote")
            raise NotLeader(self._held.leader_id, f"term {self._held.term}: {what} being stored")

    def _live_core(self) -> RaftCore:
        if self.fatal is not None:
            raise StoreFatal(f"raft node {self.node_id} stopped: {self.fatal}")
        assert self.core is not None, "start() first"
        return self.core

    def send_side(self, peer_id: str, msg: object) -> None:
        """Queue a repair message (never blocks; the transport drops the oldest when full)."""
        if self.transport is None or not self._running:
            raise ConnectionError(f"raft node {self.node_id} is not running")
        self.transport.send(peer_id, msg)

    def _on_message(self, sender: str, msg: object) -> None:
        if type(msg) in REPAIR_MESSAGES:
            handler = self.side_handler
            if handler is None:
                self.metrics["side_dropped"] += 1
                return
            try:
                handler(sender, msg)
            except Exception:  # noqa: BLE001 - a repair bug must not close the Raft connection
                self.metrics["side_failed"] += 1
                log.exception("raft %s: handling %s from %s failed", self.node_id, type(msg).__name__, sender)
            return
        if type(msg) is Append and self.refuse_appends is not None:
            why = self.refuse_appends()
            if why is not None:
                self._refused(sender, why)
                return
        elif type(msg) is TimeoutNow and self.refuse_appends is not None and self.core is not None:
            # A node that could store nothing declines leadership (core.decline_transfers), as its
            # disk is now, not as of the last periodic look.
            self.core.decline_transfers = self.refuse_appends() is not None
        if len(self._inbox) >= self.config.max_inbox_msgs:
            self._inbox.popleft()
            self.metrics["inbox_dropped"] += 1
        self._inbox.append((sender, msg))
        # No wake-up here: the transport calls _on_received once a read's frames are all in.

    def _on_received(self) -> None:
        """What one read brought is in the inbox: run the round now, in the transport's loop
        turn, instead of waking the Raft task for the next turn. A follower's ack and a
        leader's commit leave one loop turn sooner. A round never awaits, so no other round
        can be under way; a stalled node's round returns at once and the tick retries."""
        if self._inbox and self._running:
            self._guarded_round()

    def _on_cold(self, fetch: Callable[[], None]) -> None:
        """The core wanted old entries for a push (a follower far behind): a worker reads them
        (node/store/cold_reads.py), then the core pushes again (entries_fetched).
        At most MAX_FILLS at once; a push refused meanwhile is retried when one ends."""
        if len(self._fills) >= MAX_FILLS or not self._running:
            return
        self.metrics["push_reads_deferred"] += 1
        task = asyncio.get_running_loop().create_task(self._fill(fetch))
        self._fills.add(task)
        task.add_done_callback(self._fills.discard)

    async def _fill(self, fetch: Callable[[], None]) -> None:
        try:
            await cold_reads.fill(fetch)
        except OSError as e:
            # Let the push read on the loop again, where a read error is handled as before.
            log.warning("raft %s: reading old entries for a push failed (%r); such reads wait on the "
                        "event loop from now on", self.node_id, e)
            self.store.cold_reader = None
        self._fetched = True        # told to the core by a round (never with a Ready outstanding)
        self._wake.set()

    def _refused(self, sender: str, why: str) -> None:
        self.metrics["appends_refused"] += 1
        held = self._refusal_warnings.due(time.monotonic())
        if held is not None:
            log.warning("raft %s: %s: refused %d append(s) from %s since the last warning; they are "
                        "stored once space returns", self.node_id, why, held + 1, sender)

    # --- the loop -------------------------------------------------------------------------
    async def _run(self) -> None:
        while self._running:
            await self._wake.wait()
            self._wake.clear()
            if not self._guarded_round():
                return

    def _guarded_round(self) -> bool:
        """One round; False once the node has died of it."""
        self._in_round = True
        try:
            self._round()
        except StoreError as e:
            self._die(e)
            return False
        except Exception as e:  # noqa: BLE001 - any bug here must stop the node loudly
            # A Ready may be outstanding now, so the core cannot be fed again: without
            # this, the task ended silently and every later propose hit the core's
            # "call advance() first" assertion (an HTTP 500 per send, forever).
            log.exception("raft %s: the Raft loop failed; stopping the node", self.node_id)
            self._die(e)
            return False
        finally:
            self._in_round = False
        return True

    def _round(self) -> None:
        """Feed the core what arrived, handle Readies until there are none, send what they
        hold, then hand them to the listener (which applies commits). A follower's ack and a
        leader's pushes thus leave before the commits are applied, not after."""
        core = self.core
        assert core is not None
        if self._held is not None and not self._held_written:
            return      # its term and vote are still being written
        if self._stalled is not None and time.monotonic() - self._stall_tried_at < self.config.tick_ms / 1000:
            return      # one try per tick: a failed one costs a truncate and an fsync
        handled: list[Ready] = []
        # A round ends once it has queued ROUND_SEND_BYTES (pushes to a follower far behind)
        # and the next one is scheduled: producers and pulls are served in between.
        send_budget_end = self.transport.queued_bytes + ROUND_SEND_BYTES
        try:
            if self._held is not None:
                held, self._held, self._held_written = self._held, None, False
                if self._prepared_reset is not None:
                    self._commit_reset(held)
                self._handle(held, handled, hard_state_written=True)
            elif self._stalled is not None:
                self._stall_tried_at = time.monotonic()
                if self._prepared_reset is not None:     # its term and vote met a full disk
                    self._commit_reset(self._stalled)
                self._handle(self._stalled, handled)     # raises _Stalled while the disk is full
            while self._ticks_due or self._inbox or self._durable_grew or self._fetched or core.has_ready():
                if self.transport.queued_bytes >= send_budget_end:
                    self._wake.set()
                    break
                if self._fetched:
                    self._fetched = False
                    core.entries_fetched()
                if self._durable_grew:
                    # The group-commit flusher made more entries durable: report it (an empty
                    # Ready is legal here) so the leader counts itself and followers ack.
                    self._durable_grew = False
                    if self.store.flushed_index > core.durable_index:
                        self._handle(core.ready(), handled)
                ticks, self._ticks_due = self._ticks_due, 0
                for _ in range(min(ticks, 10)):  # after a stall, do not fire a burst of elections
                    core.tick()
                for _ in range(min(len(self._inbox), self.config.max_steps_per_round)):
                    sender, msg = self._inbox.popleft()
                    core.step(sender, msg)
                while core.has_ready() and self.transport.queued_bytes < send_budget_end:
                    self._handle(core.ready(), handled)
        except (_Stalled, _Held):
            pass    # inputs wait in the (bounded) inbox; the Ready is completed by a later round
        self.transport.flush()      # this round's messages leave now, not a loop turn later
        self._apply(handled)

    def _apply(self, handled: list[Ready]) -> None:
        """The listener gets the handled Readies, in order (and the list is emptied)."""
        listener = self.listener
        if listener is not None:
            for rd in handled:
                listener.on_ready(rd)
        handled.clear()

    def _handle(self, rd: Ready, handled: list[Ready], hard_state_written: bool = False) -> None:
        """persist -> send -> advance (no awaits: the core stays consistent); `rd` joins
        `handled`, for the listener once the round's messages are written. A Ready with a
        hard state to write is held (raises _Held) and completed by a later round, called
        with `hard_state_written`."""
        core, store = self.core, self.store
        assert core is not None and self.transport is not None
        retry = rd is self._stalled
        if not (retry or hard_state_written):   # a held Ready made its cuts before it was held
            if rd.truncate_from is not None or rd.reset_base is not None:
                self._apply(handled)            # the listener hears of the Readies before it first
                self._hold(rd, cut=True)
        try:
            if rd.entries and not ((retry or hard_state_written) and store.last_index() >= rd.entries[-1].index):
                store.append(rd.entries)
                self.metrics["entries_written"] += len(rd.entries)
        except DiskFull as e:
            self._stall(rd, e)
            raise _Stalled from None
        if rd.hard_state is not None and not hard_state_written:
            self._hold(rd, cut=False)
        if retry:
            log.warning("raft %s: the held Ready written after %.1f s stalled on a full disk; resuming",
                        self.node_id, time.monotonic() - self._stalled_at)
            self._stalled, self.stall_reason = None, None
        sync = self.config.flush_disk_type == SYNC_FLUSH
        if rd.entries and sync:
            self._flush_wanted.set()  # the group-commit flusher fsyncs them off the loop
        send = self.transport.send
        for dest, msg in rd.messages:
            send(dest, msg)
        handled.append(rd)
        # SYNC_FLUSH: only what the flusher has fsynced counts (for our own vote in the
        # commit and for the acks a follower sends); the rest is reported when it lands.
        core.advance(rd, store.flushed_index if sync else None)

    def _hold(self, rd: Ready, cut: bool) -> None:
        """Hold `rd` while a worker thread writes its truncation (`cut`) and its hard state."""
        self._held, self._held_written = rd, False
        self._held_write = asyncio.create_task(self._write_held(rd, cut), name=f"raft-held-{self.node_id}")
        raise _Held

    async def _write_held(self, rd: Ready, cut: bool) -> None:
        """The held Ready's reset and truncation (durable; then the listener hears of each) and
        its term and vote, each written on a worker thread; then the next round completes the
        Ready (or, on a full disk for the term and vote, holds it as stalled and retries each
        tick)."""
        t0 = time.perf_counter()
        if cut:
            try:
                if rd.reset_base is not None:
                    if not await self._reset_when_room(rd.reset_base):
                        return          # stopping: the next start recovers the old log or the new base
                else:
                    await asyncio.to_thread(self.store.truncate_from, rd.truncate_from)
            except StoreError as e:
                self._held = None
                self._die(e)
                return
            if rd.reset_base is None:
                self.metrics["truncations"] += 1
                self.metrics["truncation_us_max"] = max(self.metrics["truncation_us_max"],
                                                        int((time.perf_counter() - t0) * 1e6))
                if self.listener is not None:
                    self.listener.on_truncated(rd.truncate_from)
        if rd.hard_state is not None:
            t1 = time.perf_counter()
            try:
                await asyncio.to_thread(self.store.set_hard_state, rd.hard_state)
            except DiskFull as e:
                self._held = None
                self._stall(rd, e)
            except StoreError as e:
                self._held = None
                self._die(e)
                return
            self.metrics["hard_state_writes"] += 1
            self.metrics["hard_state_write_us_max"] = max(self.metrics["hard_state_write_us_max"],
                                                          int((time.perf_counter() - t1) * 1e6))
        if self._held is rd:
            self._held_written = True
        self._clock_paused_until = time.monotonic() + min(time.perf_counter() - t0, SLOW_WRITE_PAUSE_MAX_S)
        self._wake.set()

    async def _prepare_reset(self, base: tuple) -> None:
        """InstallBase: the new base's files written on a worker thread (the store serves its
        old log meanwhile). The round that completes the Ready switches the store to them
        (`_commit_reset`), in the loop turn in which the listener learns of the reset. No
        flush runs from here to the switch (`_disk_gate`, held until then)."""
        t0 = time.perf_counter()
        await self._disk_gate.acquire()
        try:
            self._prepared_reset = await asyncio.to_thread(self.store.prepare_reset, *base)
        except BaseException:
            self._disk_gate.release()
            raise
        self.metrics["resets"] += 1
        self.metrics["reset_us_max"] = max(self.metrics["reset_us_max"], int((time.perf_counter() - t0) * 1e6))

    async def _reset_when_room(self, base: tuple) -> bool:
        """`_prepare_reset`, tried again every RESET_RETRY_S while even the reserve leaves no
        room for the new base's state file and meta: the old log's files, which the reset
        frees, stay open until its switch. The Ready stays held meanwhile (to the group, a
        paused follower) and the node's status names the stall. False if the node stops first."""
        since = None
        while True:
            try:
                await self._prepare_reset(base)
            except DiskFull as e:
                if not self._running:
                    return False
                if since is None:
                    since = time.monotonic()
                    self.metrics["disk_stalls"] += 1
                    log.error("raft %s: %s; the reset waits for room (tried every %.0f s; no messages in or "
                              "out meanwhile, as if paused)", self.node_id, e, RESET_RETRY_S)
                self.stall_reason = str(e)
                await asyncio.sleep(RESET_RETRY_S)
                continue
            if since is not None:
                log.warning("raft %s: the reset written after %.1f s on a full disk; resuming", self.node_id,
                            time.monotonic() - since)
                self.stall_reason = None
            return True

    def _commit_reset(self, rd: Ready) -> None:
        """The held reset's switch (and any truncation with it, a no-op past the new base), then
        the listener hears of them; the flushers may run again."""
        prepared, self._prepared_reset = self._prepared_reset, None
        try:
            self.store.commit_reset(prepared)
            if rd.truncate_from is not None:
                self.store.truncate_from(rd.truncate_from)
        finally:
            self._disk_gate.release()
        if self.listener is not None:
            self.listener.on_truncated(rd.reset_base[0] + 1)
            if rd.truncate_from is not None:
                self.listener.on_truncated(rd.truncate_from)

    def _stall(self, rd: Ready, e: DiskFull) -> None:
        if self._stalled is None:
            self._stalled, self._stalled_at, self.stall_reason = rd, time.monotonic(), str(e)
            self._stall_tried_at = self._stalled_at
            self.metrics["disk_stalls"] += 1
            log.error("raft %s: %s; holding the Raft state until they can be written (no messages in or "
                      "out meanwhile, as if paused; retried every tick)", self.node_id, e)

    def _die(self, e: BaseException) -> None:
        log.critical("raft %s: stopping the node: %s: %s", self.node_id, type(e).__name__, e)
        self.fatal = e
        self._running = False
        if self.listener is not None:
            self.listener.on_fatal(e)

    async def _ticker(self) -> None:
        loop = asyncio.get_running_loop()
        period = self.config.tick_ms / 1000
        next_at = loop.time() + period
        while self._running:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            next_at += period
            if self._held is not None or time.monotonic() < self._clock_paused_until:
                self.metrics["ticks_paused"] += 1
                continue        # a term and vote being written, or just written slowly
            self._ticks_due += 1
            self._wake.set()

    async def _group_commit(self) -> None:
        """SYNC_FLUSH: one fsync at a time on a worker thread, each covering every entry
        written before it started (group commit). The index file is derived data (recovery
        rebuilds it from the data files), so only the data is fsynced here; the index is
        fsynced with each checkpoint. The loop keeps serving while the disk works."""
        while self._running:
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            if self.fatal is not None or self.core is None:
                return
            t0 = time.perf_counter()
            try:
                async with self._disk_gate:
                    await asyncio.to_thread(self.store.flush, False)
            except StoreError as e:
                self._die(e)
                return
            self.metrics["fsyncs"] += 1
            self.metrics["fsync_us_total"] += int((time.perf_counter() - t0) * 1e6)
            if self.store.flushed_index > self.core.durable_index:
                self._durable_grew = True
                self._wake.set()

    async def _flusher(self) -> None:
        """ASYNC_FLUSH: fsync periodically. Both modes: checkpoint the durable mark.

        The fsyncs and the checkpoint's meta write run on a worker thread (EntryStore.flush
        and checkpoint hold its flush_lock), so the event loop keeps serving requests and
        replication while the disk works: an fsync on the loop stalled every in-flight
        request by its duration, and a leader's stalled heartbeats for 300 ms start an
        election (a meta write took up to 99 ms behind a background writer here)."""
        asynchronous = self.config.flush_disk_type == ASYNC_FLUSH
        period = (self.config.async_flush_interval_ms if asynchronous else self.config.checkpoint_interval_ms) / 1000
        while self._running:
            await asyncio.sleep(period)
            if self.fatal is not None or self.core is None:
                return
            try:
                now = time.monotonic()
                due = now - self._last_checkpoint >= self.config.checkpoint_interval_ms / 1000
                if asynchronous or due:
                    t0 = time.perf_counter()
                    async with self._disk_gate:
                        await asyncio.to_thread(self.store.flush)
                    self.metrics["background_fsyncs"] += 1
                    self.metrics["background_fsync_us_total"] += int((time.perf_counter() - t0) * 1e6)
                if not self._running or self.fatal is not None:
                    return
                if due:
                    self._last_checkpoint = now
                    t0 = time.perf_counter()
                    async with self._disk_gate:
                        wrote = await asyncio.to_thread(self.store.checkpoint, self.core.commit_index)
                    if wrote:
                        us = int((time.perf_counter() - t0) * 1e6)
                        self.metrics["checkpoints"] += 1
                        self.metrics["checkpoint_us_max"] = max(self.metrics["checkpoint_us_max"], us)
            except StoreError as e:
                self._die(e)
                return

    # --- views ------------------------------------------------------------------------------
    @property
    def role(self) -> Role:
        assert self.core is not None
        return self.core.role

    def status(self) -> dict:
        core = self.core
        if core is None:
            return {"node_id": self.node_id, "state": "stopped"}
        out = {
            "node_id": self.node_id, "group": self.group, "term": core.term, "role": core.role.name,
            "leader": core.leader_id, "commit_index": core.commit_index, "first_index": core.first_index,
            "last_index": core.last_index, "durable_index": core.durable_index,
            "needs_catchup_to": core.needs_catchup_to, "fatal": str(self.fatal) if self.fatal else None,
            "appends_refused": self.metrics["appends_refused"], "stalled_on_disk": self.stall_reason,
            "checkpoints": self.metrics["checkpoints"], "checkpoint_ms_max": self.metrics["checkpoint_us_max"] / 1000,
            "term_vote_writes": self.metrics["hard_state_writes"],
            "term_vote_write_ms_max": self.metrics["hard_state_write_us_max"] / 1000,
            "truncations": self.metrics["truncations"],
            "truncation_ms_max": self.metrics["truncation_us_max"] / 1000,
            "resets": self.metrics["resets"],
            "reset_ms_max": self.metrics["reset_us_max"] / 1000,
            "ticks_paused": self.metrics["ticks_paused"],
        }
        if core.role is Role.LEADER:
            out["peers"] = {p: {"match_index": core.match_index(p),
                                "state": (core.peer_state(p).name if core.peer_state(p) else None),
                                "connected": bool(self.transport and self.transport.is_connected(p))}
                            for p in core.peers}
        if self.transport is not None:
            out["transport"] = dict(self.transport.metrics)
        return out

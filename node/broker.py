"""The broker: RocketMQ's send / pull / offsets / query semantics over a ReplicatedLog.

Everything that must survive failover goes through the log: messages, and (ours)
topic configs and clustering consumer offsets, appended as small msgpack records
to the system topics RMQ_SYS_TOPIC_CONFIG and RMQ_SYS_CONSUMER_OFFSET. The
dispatcher hands each committed system record to `_apply_topic_config` /
`_apply_consumer_offset`, on the leader and on every replica alike, so the state
every node holds is a function of the committed log. The JSON files in `config/`
are snapshots that make restarts fast; at start the broker replays the system
queues past the snapshot, so a snapshot older than the log is never a loss.

Reads (pull, queries) only see what the dispatcher has put in the consume queues,
and the dispatcher only reads committed data.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import msgpack

from node import limits
from node.config import BrokerConfig
from node.consumer_groups import DLQ_PREFIX, RETRY_PREFIX
from node.fence import WRITABLE_ROLES
from node.log_throttle import LogThrottle
from node.metrics import TrafficStats
from node.replicated_log import PutStatus, ReplicatedLog
from node.store import layout as L
from node.store import message as M
from node.store.cold_reads import read_without_stalling
from node.store.errors import (ApplyTimeout, BadRequest, CorruptRecord, InvalidMessage, MessageNotFound,
                               MessageTooLarge, NoPermission, NotLeader, StoreError, TopicNotExist, is_enospc)
from node.store.message import MessageDraft, StoredMessage
from node.store.retention import MAX_MANUAL_DELETE_PASSES
from node.store.scrub import CorruptData, CorruptionRegistry, report_read_failure, scrubber_for

log = logging.getLogger(__name__)

SYS_TOPIC_CONFIG = "RMQ_SYS_TOPIC_CONFIG"
SYS_CONSUMER_OFFSET = "RMQ_SYS_CONSUMER_OFFSET"
SYSTEM_PREFIX = "RMQ_SYS_"
PERM_READ = 4
PERM_WRITE = 2
PERM_DEFAULT = PERM_READ | PERM_WRITE
MAX_QUEUES_PER_TOPIC = 1024
MAX_QUERY_RESULTS = 64                 # RocketMQ caps a key query at 64 (maxMsgsNumBatch)
MAX_PULL_BYTES = 4 * 1024 * 1024       # a pull stops adding messages past this (at least one is sent)
SYSTEM_APPLY_TIMEOUT_S = 10.0          # how long a commit waits for its record to be applied
REPLAY_BATCH_UNITS = 1024
PUT_WAIT_WINDOW_S = 10.0               # clusterList #PCWait: the longest log append within this window
RESERVE_CHECK_S = 1.0                  # a disk reserve given up on a full disk is put back within this of room
RETENTION_TICKS = 10                   # retention runs every this many reserve checks (~10 s)
SNAPSHOT_WARNING_S = 60.0              # a snapshot not written for a full disk: at most one warning per this
SYSTEM_QUEUE = 0

PULL_FOUND = "FOUND"
PULL_NO_NEW_MSG = "NO_NEW_MSG"
PULL_NO_MATCHED_MSG = "NO_MATCHED_MSG"
PULL_OFFSET_ILLEGAL = "OFFSET_ILLEGAL"


# --- what the broker needs of its collaborators ---------------------------------------------
class OffsetSnapshotStore(Protocol):
    """Persists consumer offsets as `topic@group -> {queue_id: offset}` (consumerOffset.json)."""

    def load(self) -> dict[str, dict[int, int]]: ...
    def save(self, table: dict[str, dict[int, int]]) -> None: ...


class TopicSnapshotStore(Protocol):
    """Persists topic configs as `topic -> {read_queue_nums, write_queue_nums, perm}` (topics.json)."""

    def load(self) -> dict[str, dict[str, int]]: ...
    def save(self, table: dict[str, dict[str, int]]) -> None: ...


# --- values --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TopicConfig:
    topic: str
    read_queue_nums: int
    write_queue_nums: int
    perm: int = PERM_DEFAULT

    def to_dict(self) -> dict[str, Any]:
        return {"topic": self.topic, "read_queue_nums": self.read_queue_nums,
                "write_queue_nums": self.write_queue_nums, "perm": self.perm}


@dataclass(slots=True)
class OutgoingMessage:
    """One message of a send request, as the API parsed it (types already checked)."""

    body: bytes
    tags: str | None = None
    keys: list[str] = field(default_factory=list)
    properties: dict[str, str] = field(default_factory=dict)
    queue_id: int | None = None
    born_timestamp: int = 0


@dataclass(frozen=True, slots=True)
class SendResult:
    status: str
    msg_id: str
    offset_msg_id: str
    queue_id: int
    queue_offset: int

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "msg_id": self.msg_id, "offset_msg_id": self.offset_msg_id,
                "queue_id": self.queue_id, "queue_offset": self.queue_offset}


@dataclass(frozen=True, slots=True)
class PullResult:
    status: str
    next_offset: int
    min_offset: int
    max_offset: int
    messages: list[StoredMessage]


@dataclass(frozen=True, slots=True)
class Subscription:
    """RocketMQ SubscriptionData: `*` (or empty) = all, else `TagA || TagB`."""

    tags: frozenset[str]
    codes: frozenset[int]

    @property
    def matches_all(self) -> bool:
        return not self.tags

    @classmethod
    def parse(cls, expression: str | None) -> "Subscription":
        text = (expression or "").strip()
        if text in ("", "*"):
            return cls(frozenset(), frozenset())
        tags = frozenset(t.strip() for t in text.split("||") if t.strip())
        if not tags:
            raise BadRequest(f"tag expression {expression!r} names no tag")
        return cls(tags, frozenset(M.tags_code(t) for t in tags))


# --- checks ----------------------------------------------------------------------------------
def check_user_topic(topic: Any) -> str:
    """A topic a client may name: valid, and not one of the broker's own."""
    if not isinstance(topic, str):
        raise BadRequest("topic must be a string")
    try:
        M.validate_topic(topic)
    except InvalidMessage as e:
        raise BadRequest(str(e)) from None
    if topic.startswith(SYSTEM_PREFIX):
        raise BadRequest(f"topic {topic!r} is reserved for the broker (prefix {SYSTEM_PREFIX})")
    return topic


def check_group(group: Any) -> str:
    if not isinstance(group, str) or not group:
        raise BadRequest("group must be a non-empty string")
    if len(group) > L.MAX_GROUP_CHARS or not M.TOPIC_RE.match(group):
        raise BadRequest(f"group {group!r} must be 1..{L.MAX_GROUP_CHARS} chars of [%|a-zA-Z0-9_-]")
    return group


def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be {lo}..{hi}, got {value}")
    return value


def _check_writable_topic(cfg: TopicConfig) -> None:
    if not cfg.perm & PERM_WRITE:
        raise NoPermission(f"topic {cfg.topic!r} is not writable (perm {cfg.perm})")


def _place(out: list, spans: list[tuple[int, int, int]], rows: list) -> None:
    """Each accepted request's rows into its place in `out` (Broker._coalesce)."""
    for at, first, n in spans:
        out[at] = rows[first:first + n]


async def wait_future(fut: asyncio.Future, timeout_s: float) -> bool:
    """Wait for `fut` up to `timeout_s`; True if it completed. A timer resolves it instead of
    asyncio.wait_for, whose 3.11 version can swallow a cancellation racing the timeout."""
    loop = asyncio.get_running_loop()
    timed_out = False

    def expire() -> None:
        nonlocal timed_out
        if not fut.done():
            timed_out = True
            fut.set_result(None)

    handle = loop.call_later(max(0.0, timeout_s), expire)
    try:
        await fut
    finally:
        handle.cancel()
    return not timed_out


class _Waiters:
    """Long-poll waiters per (topic, queue), bounded in number; woken by the dispatcher."""

    def __init__(self, cap: int):
        self.cap = cap
        self.count = 0
        self._by_queue: dict[tuple[str, int], set[asyncio.Future]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.get_ident()

    def full(self) -> bool:
        return self.count >= self.cap

    async def wait(self, key: tuple[str, int], timeout_s: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._by_queue.setdefault(key, set()).add(fut)
        self.count += 1
        try:
            await wait_future(fut, timeout_s)  # timing out is the normal end of a long poll
        finally:
            self.count -= 1
            waiting = self._by_queue.get(key)
            if waiting is not None:
                waiting.discard(fut)
                if not waiting:
                    del self._by_queue[key]

    def notify(self, topic: str, queue_id: int, _new_max: int = 0) -> None:
        """Dispatcher listener; safe to call from another thread."""
        if self._loop is not None and threading.get_ident() != self._thread:
            self._loop.call_soon_threadsafe(self._wake, (topic, queue_id))
        else:
            self._wake((topic, queue_id))

    def _wake(self, key: tuple[str, int]) -> None:
        for fut in self._by_queue.get(key, ()):
            if not fut.done():
                fut.set_result(None)

    def wake_all(self) -> None:
        for key in list(self._by_queue):
            self._wake(key)


class _AppliedMark:
    """Highest physical offset of a system record applied; commits wait until theirs is."""

    def __init__(self) -> None:
        self.applied = -1
        self._waiting: list[tuple[int, asyncio.Future]] = []

    def advance(self, phys: int) -> None:
        if phys <= self.applied:
            return
        self.applied = phys
        still = []
        for target, fut in self._waiting:
            if target <= phys:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((target, fut))
        self._waiting = still

    async def wait(self, phys: int, timeout_s: float) -> None:
        if phys <= self.applied:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((phys, fut))
        try:
            if not await wait_future(fut, timeout_s):
                raise ApplyTimeout(f"record at {phys} was committed but not applied within {timeout_s}s; "
                                   f"retrying is safe")
        finally:
            self._waiting = [(t, f) for t, f in self._waiting if f is not fut]


# Consumer-offset snapshots carry the replay point of the system queue under this key
# (same `topic@group -> {queue: offset}` shape, so consumerOffset.json stays RocketMQ's).
REPLAY_MARK_KEY = f"{SYS_CONSUMER_OFFSET}@%REPLAY%"


class Broker:
    """RocketMQ broker semantics. Every public coroutine raises StoreError subclasses only."""

    def __init__(self, config: BrokerConfig, rlog: ReplicatedLog, cq_store: Any, index: Any, dispatcher: Any,
                 topic_store: TopicSnapshotStore, offset_store: OffsetSnapshotStore, *,
                 clock_ms: Callable[[], int] = lambda: int(time.time() * 1000)):
        self.config = config
        self.log = rlog
        self.cq_store = cq_store
        self.index = index
        self.dispatcher = dispatcher
        self.topic_store = topic_store
        self.offset_store = offset_store
        self.clock_ms = clock_ms
        self.topics: dict[str, TopicConfig] = {}
        self._topics_pending: set[str] = set()              # new topics being created (maxTopics)
        self._groups_pending: set[str] = set()              # new groups' first offset commits (maxConsumerGroups)
        self.offsets: dict[str, dict[int, int]] = {}      # "topic@group" -> queue -> offset
        self._offsets_dirty = False
        self._snapshot_warnings = LogThrottle(SNAPSHOT_WARNING_S)
        self._offset_replay_from = 0                        # next system-queue offset to replay
        self._deleted: dict[str, int] = {}                  # deleted topic -> log position of the deletion
        self._put_wait = (0.0, float("-inf"))              # (longest recent log append s, when: monotonic)
        self._oldest = (-1, 0)                             # (log min position, its record's store time)
        self._round_robin: dict[str, itertools.count] = {}
        self._waiters = _Waiters(config.long_polling_max_waiters)
        self._applied = _AppliedMark()
        self._tasks: list[asyncio.Task] = []
        self._store_ip = M.host_bytes(config.broker_ip1)
        # offsetMsgId = these 16 hex digits (store ip and port) + the physical offset's 16.
        self._offset_id_prefix = M.encode_offset_msg_id(self._store_ip, config.listen_port, 0)[:16]
        self.ready = False
        self.messages_in = 0                               # user messages acked (metrics)
        self.traffic = TrafficStats()                      # per-topic in/out counts (metrics, TPS)
        self.fatal: BaseException | None = None            # set when a background task dies
        self.loop_watchdog = None                           # node/loop_watchdog.py, set by serve()
        self._snapshot_lock = threading.Lock()              # one snapshot write at a time (a thread's, stop's)
        self.manual_delete_passes = 0                       # retention passes left that ignore deleteWhen
        self._retention_now = asyncio.Event()               # an admin asked for a retention pass
        # Known corrupt ranges (node/store/scrub.py): the log's own registry when it has one (DLedger).
        registry = getattr(rlog, "corruption", None)
        self.corruption: CorruptionRegistry = registry if registry is not None else CorruptionRegistry()
        self.scrubber = scrubber_for(rlog, self.corruption, config.store_scrub_interval_ms,
                                     config.store_scrub_rate_mb) if config.store_scrub_rate_mb > 0 else None
        from node.client_api import ClientServices        # (late: it imports this module)
        self.services = ClientServices(self)               # delay, transactions, group members

    # --- lifecycle ---------------------------------------------------------------------------
    def system_handlers(self) -> dict[str, Callable[[StoredMessage], None]]:
        """Give these to the Dispatcher: it calls them for each committed system record."""
        return {SYS_TOPIC_CONFIG: self._apply_topic_config, SYS_CONSUMER_OFFSET: self._apply_consumer_offset}

    async def start(self) -> None:
        """Log first, then derived state, then background work; ready only after catch-up."""
        self._waiters.bind(asyncio.get_running_loop())
        await self.log.start()
        self._load_snapshots()  # before dispatch: records dispatched now apply on top of it
        # The dispatcher recovers the consume queues itself (cut past the log end, drop expired),
        # off the loop where it can: the log (Raft, an HA link) already runs on it.
        await self.dispatcher.startup_recover_in_background(self.log.committed_position)
        self._load_deletions()  # before dispatch: re-dispatch must not resurrect deleted topics
        try:
            await self.dispatcher.catch_up_yielding()
        except OSError as e:
            # A start on a full disk (random-fault runs: an index file could not be created, the
            # node did not start). The node starts and the background dispatcher finishes once
            # there is room. A log that folds its own queue offsets (DLedger) takes writes at
            # once; one that takes them from the consume queues (standalone, classic) refuses
            # them (507, retriable) until the dispatcher has caught up (_release_held_writes).
            from_log = getattr(self.log, "queue_offsets_from_log", False)
            hold = getattr(self.log, "hold_writes", None)
            if not is_enospc(e) or not (from_log or hold is not None):
                raise
            log.warning("dispatch catch-up at start paused at log position %d of %d: disk full (%s); the "
                        "dispatcher goes on once there is room%s", self.dispatcher.position,
                        self.log.committed_position, e, "" if from_log else "; writes are refused until then")
            if not from_log:
                hold(f"the consume queues are behind the log (a start on a full disk paused their catch-up "
                     f"at {self.dispatcher.position} of {self.log.committed_position}): writes are refused "
                     f"until the dispatcher has caught up")
        init = getattr(self.log, "init_queue_offsets", None)
        if init is not None and not self._writes_held():
            init(self.cq_store.max_offsets())
        self._replay_system_queues()
        self.dispatcher.add_listener(self._waiters.notify)
        self._tasks = [asyncio.create_task(self._guard("dispatcher", self.dispatcher.run)),
                       asyncio.create_task(self._guard("retention", self._retention_loop)),
                       asyncio.create_task(self._guard("offset-snapshot", self._snapshot_loop)),
                       asyncio.create_task(self._guard("schedule", self.services.schedule.run))]
        if self.scrubber is not None:
            self._tasks.append(asyncio.create_task(self._guard("scrubber", self.scrubber.run)))
        self.ready = True
        client = getattr(self.log, "controller_client", None)
        if client is not None:   # classic HA with a controller: apply the topics its heartbeats carry
            client.topic_sink = self.apply_controller_topics
        log.info("broker ready", extra={"topics": len(self.topics), "committed": self.log.committed_position})

    async def stop(self) -> None:
        """Reverse of start: stop taking pulls, stop tasks, snapshot, stop the log."""
        self.ready = False
        self._waiters.wake_all()
        stop = getattr(self.dispatcher, "stop", None)
        if stop is not None:
            await _maybe_await(stop())
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        # The last snapshots and queue flush on a worker: the log still runs (Raft, HA) meanwhile.
        await self._save_snapshots_in_background()
        flush = getattr(self.cq_store, "flush_all", None)
        if flush is not None:
            await asyncio.to_thread(flush)
        await self.log.stop()
        close = getattr(self.cq_store, "close", None)
        if close is not None:
            close()

    async def _guard(self, name: str, factory: Callable[[], Any]) -> None:
        """Run a background task; a crash marks the broker fatal instead of vanishing silently."""
        try:
            await factory()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of a background task is fatal here
            log.exception("background task %s failed; the node stops serving", name)
            self.fatal = e
            self.ready = False

    def delete_expired_manually(self) -> int:
        """mqadmin's deleteExpiredCommitLog (RocketMQ's executeDeleteFilesManually): the next
        MAX_MANUAL_DELETE_PASSES retention passes delete expired files whatever deleteWhen says,
        the first of them now. Returns that number of passes."""
        self.manual_delete_passes = MAX_MANUAL_DELETE_PASSES
        self._retention_now.set()
        log.info("executeDeleteFilesManually was invoked: the next %d retention passes delete expired files "
                 "at any hour", MAX_MANUAL_DELETE_PASSES)
        return MAX_MANUAL_DELETE_PASSES

    async def _retention_loop(self) -> None:
        """Every RESERVE_CHECK_S a reserve given up on a full disk is put back if the disk has room
        again; every RETENTION_TICKS of those, or at once when an admin asks, retention runs."""
        tick = getattr(self.log, "retention_tick", None)
        reserve = getattr(self.log, "disk_reserve", None)
        n = 0
        while True:
            try:
                async with asyncio.timeout(RESERVE_CHECK_S):
                    await self._retention_now.wait()
                n = 0                               # asked: retention now, the next pass a full period on
            except TimeoutError:
                n += 1
            self._retention_now.clear()
            if reserve is not None:
                reserve.restore_if_room()
            self._release_held_writes()
            if n % RETENTION_TICKS:
                continue
            manual = self.manual_delete_passes > 0
            if manual:
                self.manual_delete_passes -= 1
            if tick is not None:
                await _maybe_await(tick(manual=manual))
            # Consume queues and index files follow the commitlog's head.
            min_phys = self.log.min_physical_offset
            self.cq_store.delete_expired(min_phys)
            expire_index = getattr(self.index, "delete_expired", None)
            if expire_index is not None:
                expire_index(min_phys)

    def _writes_held(self) -> bool:
        return bool(getattr(self.log, "writes_held", None))

    def _release_held_writes(self) -> None:
        """Writes held at start (the dispatch catch-up met a full disk) go on once the dispatcher
        has reached the committed end: the consume queues then give every queue's next offset."""
        if not self._writes_held() or self.dispatcher.position < self.log.committed_position:
            return
        self.log.init_queue_offsets(self.cq_store.max_offsets())
        log.info("dispatch caught up with the log at %d: writes accepted again", self.dispatcher.position)

    async def _snapshot_loop(self) -> None:
        interval = self.config.flush_consumer_offset_interval_ms / 1000.0
        while True:
            await asyncio.sleep(interval)
            if self._offsets_dirty:
                await self._save_snapshots_in_background()

    # --- snapshots and replay ----------------------------------------------------------------
    def _load_snapshots(self) -> None:
        for topic, cfg in self.topic_store.load().items():
            self.topics[topic] = TopicConfig(topic, int(cfg["read_queue_nums"]), int(cfg["write_queue_nums"]),
                                             int(cfg.get("perm", PERM_DEFAULT)))
        table = self.offset_store.load()
        mark = table.pop(REPLAY_MARK_KEY, {})
        self._offset_replay_from = int(mark.get(SYSTEM_QUEUE, 0))
        self.offsets = {k: {int(q): int(o) for q, o in v.items()} for k, v in table.items()}

    def _save_snapshots(self) -> bool:
        """topics.json and consumerOffset.json from memory. They are caches of what the log holds
        (a start replays the system records past the mark), so on a full disk the write is left
        for later: a warning (at most one a minute), the snapshot still due, the node serving.
        Before, the ENOSPC ended the snapshot task and with it the node. False when not written."""
        return self._write_snapshots(*self._snapshot_docs())

    async def _save_snapshots_in_background(self) -> bool:
        """_save_snapshots with the writes (four fsyncs) on a worker thread: on the event loop
        they took up to 330 ms behind another writer, and a leader silent that long loses its
        followers."""
        return await asyncio.to_thread(self._write_snapshots, *self._snapshot_docs())

    def _snapshot_docs(self) -> tuple[dict, dict]:
        """On the loop: copies of the tables as of now. What changes after this is due next time."""
        self._offsets_dirty = False
        topics = {t: {"read_queue_nums": c.read_queue_nums, "write_queue_nums": c.write_queue_nums,
                      "perm": c.perm} for t, c in self.topics.items()}
        table = {k: dict(v) for k, v in self.offsets.items()}
        cq = self.cq_store.get(SYS_CONSUMER_OFFSET, SYSTEM_QUEUE)
        # Everything below the system queue's end has been applied, so replay can start there.
        table[REPLAY_MARK_KEY] = {SYSTEM_QUEUE: cq.max_offset if cq is not None else 0}
        return topics, table

    def _write_snapshots(self, topics: dict, table: dict) -> bool:
        """May run on a worker thread: the snapshot stores are touched only here (and at load)."""
        with self._snapshot_lock:
            try:
                self.topic_store.save(topics)
                self.offset_store.save(table)
            except OSError as e:
                if not is_enospc(e):
                    raise
                self._offsets_dirty = True
                held = self._snapshot_warnings.due(time.monotonic())
                if held is not None:
                    log.warning("disk full: topic and consumer-offset snapshots not written (%s); the log keeps "
                                "them and the next snapshot tries again (%d such since the last warning)", e, held)
                return False
            return True

    def export_replicated_state(self) -> dict:
        """Topics and consumer offsets as a DLedger base carries them (see DLedgerLog retention)."""
        return {"topics": [[t, c.read_queue_nums, c.write_queue_nums, c.perm] for t, c in self.topics.items()],
                "offsets": [[k, q, o] for k, v in self.offsets.items() for q, o in v.items()]}

    def import_replicated_state(self, state: dict) -> None:
        """This replica's log was reset to the leader's base: the records that set topics and
        offsets before it are gone from here, so take the leader's tables (the records past the
        base are applied again on top as they commit) and store them."""
        try:
            topics = {str(t): TopicConfig(str(t), int(r), int(w), int(p)) for t, r, w, p in state.get("topics", ())}
            offsets: dict[str, dict[int, int]] = {}
            for key, q, o in state.get("offsets", ()):
                offsets.setdefault(str(key), {})[int(q)] = int(o)
        except (TypeError, ValueError) as e:
            log.error("ignoring the leader's topics and offsets at a log reset: malformed (%s)", e)
            return
        self.topics, self.offsets = topics, offsets
        self._save_snapshots()
        log.warning("took %d topics and %d consumer offsets from the leader's base", len(topics),
                    sum(len(v) for v in offsets.values()))

    def _replay_system_queues(self) -> None:
        """Re-apply system records past the snapshots (idempotent: last write in log order wins)."""
        n = self._replay_queue(SYS_TOPIC_CONFIG, 0, self._apply_topic_config)
        n += self._replay_queue(SYS_CONSUMER_OFFSET, self._offset_replay_from, self._apply_consumer_offset)
        if n:
            log.info("replayed %d system records past the config snapshots", n)

    def _replay_queue(self, topic: str, start: int, apply: Callable[[StoredMessage], None]) -> int:
        cq = self.cq_store.get(topic, SYSTEM_QUEUE)
        if cq is None:
            return 0
        offset, end, n = max(start, cq.min_offset), cq.max_offset, 0
        while offset < end:
            units = cq.get_range(offset, REPLAY_BATCH_UNITS)
            if not units:
                break  # a hole in the queue: nothing more to replay safely
            for phys, size, _tags in units:
                msg = self._read_unit(phys, size)
                if msg is not None:
                    apply(msg)
                    n += 1
            offset += len(units)
        return n

    # --- system records ----------------------------------------------------------------------
    def _apply_topic_config(self, msg: StoredMessage) -> None:
        # Marked applied first: waiters resume only after this handler returns, and a
        # malformed record must not leave its committer waiting for the timeout.
        self._applied.advance(msg.physical_offset)
        rec = _unpack_system(msg)
        if rec is None:
            return
        try:
            cfg = TopicConfig(str(rec["topic"]), int(rec["read_queue_nums"]), int(rec["write_queue_nums"]),
                              int(rec.get("perm", PERM_DEFAULT)))
        except (KeyError, TypeError, ValueError):
            log.error("ignoring malformed topic-config record at %d", msg.physical_offset)
            return
        if rec.get("deleted"):
            self.topics.pop(cfg.topic, None)
            self._drop_topic_data(cfg.topic, msg.physical_offset)
        else:
            self.topics[cfg.topic] = cfg
        self._offsets_dirty = True

    def _drop_topic_data(self, topic: str, deleted_at: int) -> None:
        """RocketMQ deleteTopic: the topic's consume queues and consumer offsets go; its records
        stay in the commitlog until retention, but nothing below `deleted_at` (the deletion
        record's position) is dispatched or applied for it again. Offsets are purged only
        when this deletion is new: replaying a known one must not drop the offsets of a
        topic created again since (those come from records past `deleted_at`)."""
        if deleted_at > self._deleted.get(topic, -1):
            self._deleted[topic] = deleted_at
            self._purge_offsets(topic)
        drop = getattr(self.dispatcher, "drop_topic", None)
        if drop is not None:
            drop(topic, deleted_at)

    def _purge_offsets(self, topic: str) -> None:
        for key in [k for k in self.offsets if k.rpartition("@")[0] == topic]:
            del self.offsets[key]
        self._offsets_dirty = True

    def _load_deletions(self) -> None:
        """Deletions already in the topic-config queue, applied before re-dispatch. The
        offsets snapshot may predate a deletion (a crash before the next save): it does
        when its last applied consumer-offset record lies below the deletion record."""
        cq = self.cq_store.get(SYS_TOPIC_CONFIG, SYSTEM_QUEUE)
        if cq is None:
            return
        offset, end = cq.min_offset, cq.max_offset
        found: dict[str, int] = {}
        while offset < end:
            units = cq.get_range(offset, REPLAY_BATCH_UNITS)
            if not units:
                break
            for phys, size, _tags in units:
                msg = self._read_unit(phys, size)
                rec = _unpack_system(msg) if msg is not None else None
                if rec is not None and rec.get("deleted") and isinstance(rec.get("topic"), str):
                    found[rec["topic"]] = max(phys, found.get(rec["topic"], -1))
            offset += len(units)
        offsets_cq = self.cq_store.get(SYS_CONSUMER_OFFSET, SYSTEM_QUEUE)
        last = offsets_cq.get(self._offset_replay_from - 1) if offsets_cq is not None else None
        snapshot_phys = last[0] if last is not None else -1
        for topic, at in found.items():
            self._deleted[topic] = at
            if snapshot_phys < at:
                self._purge_offsets(topic)
            drop = getattr(self.dispatcher, "drop_topic", None)
            if drop is not None:
                drop(topic, at)
        if found:
            log.info("deleted topics known before dispatch", extra={"topics": sorted(found)})

    def _apply_consumer_offset(self, msg: StoredMessage) -> None:
        self._applied.advance(msg.physical_offset)
        rec = _unpack_system(msg)
        if rec is None:
            return
        if msg.physical_offset < self._deleted.get(str(rec.get("topic")), -1):
            return      # an offset of a topic deleted after it was committed
        try:
            key = f"{rec['topic']}@{rec['group']}"
            self.offsets.setdefault(key, {})[int(rec["queue_id"])] = int(rec["offset"])
        except (KeyError, TypeError, ValueError):
            log.error("ignoring malformed consumer-offset record at %d", msg.physical_offset)
            return
        self._offsets_dirty = True

    async def _append_system(self, topic: str, record: dict) -> PutStatus:
        """Append one system record and wait until the dispatcher has applied it here. Its put
        status: a SYNC_MASTER's FLUSH_SLAVE_TIMEOUT or SLAVE_NOT_AVAILABLE means stored and
        applied here, its replication not confirmed (as for a message)."""
        draft = MessageDraft(topic=topic, queue_id=SYSTEM_QUEUE, body=msgpack.packb(record), properties={},
                             born_timestamp=self.clock_ms()).seal(self.config.max_message_size)
        (result,) = await self.log.append([draft])
        await self._applied.wait(result.physical_offset, SYSTEM_APPLY_TIMEOUT_S)
        return result.status

    # --- topics --------------------------------------------------------------------------------
    async def create_topic(self, topic: Any, queues: Any = None, perm: Any = None, *,
                           read_queues: Any = None, write_queues: Any = None, capped: bool = True) -> TopicConfig:
        """Create or update (RocketMQ updateTopic is an upsert). Replicated through the log.
        `capped`: a new topic beyond maxTopics is refused (LimitExceeded); the controller's are not."""
        topic = check_user_topic(topic)
        default = self.config.default_topic_queue_nums if queues is None else queues
        n = check_int("queues", default, 1, MAX_QUEUES_PER_TOPIC)
        r = check_int("read_queues", n if read_queues is None else read_queues, 1, MAX_QUEUES_PER_TOPIC)
        w = check_int("write_queues", n if write_queues is None else write_queues, 1, MAX_QUEUES_PER_TOPIC)
        p = check_int("perm", PERM_DEFAULT if perm is None else perm, 0, PERM_DEFAULT)
        if p & ~PERM_DEFAULT:
            raise BadRequest(f"perm must combine read (4) and write (2), got {p}")
        cfg = TopicConfig(topic, r, w, p)
        if self.topics.get(topic) != cfg:
            with limits.reserve("topics", topic, self.topics, self._topics_pending,
                                self.config.max_topics if capped else 0):
                await self._append_system(SYS_TOPIC_CONFIG, cfg.to_dict())
        return self.topics[topic]

    async def apply_controller_topics(self, wanted: dict[str, tuple[int, int]]) -> list[str]:
        """Create, or grow to `queues`, the topics the controller holds for this group
        (`{topic: (queues, perm)}`), and take the controller's perm for them (the controller is
        where their perm is changed); never deletes or shrinks. Only a writer (standalone,
        master, leader) writes; its replicas get the topics through the log. Returns the
        topics created, grown or re-permed."""
        done: list[str] = []
        for topic, (queues, perm) in sorted(wanted.items()):
            if not self.ready or self.log.role() not in ("STANDALONE", "MASTER", "LEADER"):
                break
            cur = self.topics.get(topic)
            if cur is not None and min(cur.read_queue_nums, cur.write_queue_nums) >= queues and cur.perm == perm:
                continue
            try:
                if cur is None:
                    await self.create_topic(topic, queues, perm, capped=False)
                else:   # grow the queues and/or take the controller's perm; never shrink
                    await self.create_topic(topic, perm=perm, read_queues=max(cur.read_queue_nums, queues),
                                            write_queues=max(cur.write_queue_nums, queues))
            except NotLeader:
                break
            except StoreError as e:
                log.warning("controller topic %r not applied: %s", topic, e)
                continue
            done.append(topic)
        if done:
            log.info("applied controller topics", extra={"topics": done})
        return done

    def list_topics(self) -> list[TopicConfig]:
        return [self.topics[t] for t in sorted(self.topics)]

    def topic(self, topic: Any) -> TopicConfig:
        topic = check_user_topic(topic)
        cfg = self.topics.get(topic)
        if cfg is None:
            raise TopicNotExist(f"topic {topic!r} does not exist")
        return cfg

    def topic_status(self, topic: Any) -> list[dict[str, int]]:
        """Per queue: min_offset, max_offset, last_updated (store time of the newest message)."""
        cfg = self.topic(topic)
        out = []
        for qid in range(max(cfg.read_queue_nums, cfg.write_queue_nums)):
            lo, hi = self._queue_bounds(cfg.topic, qid)
            last = 0
            if hi > lo:
                msg = self._message_at(cfg.topic, qid, hi - 1)
                last = msg.store_timestamp if msg is not None else 0
            out.append({"queue_id": qid, "min_offset": lo, "max_offset": hi, "last_updated": last})
        return out

    def _queue_bounds(self, topic: str, qid: int) -> tuple[int, int]:
        cq = self.cq_store.get(topic, qid)
        return (cq.min_offset, cq.max_offset) if cq is not None else (0, 0)

    # --- send ------------------------------------------------------------------------------------
    async def send(self, topic: Any, messages: Sequence[OutgoingMessage]) -> list[SendResult]:
        """Append a batch atomically (one log append); results in request order."""
        return [SendResult(*row) for row in await self.send_rows(topic, messages)]

    async def send_rows(self, topic: Any, messages: Sequence[OutgoingMessage]) -> list[tuple[str, str, str, int, int]]:
        """`send`, with each result as a `(status, msg_id, offset_msg_id, queue_id, queue_offset)`
        tuple (SendResult's fields in order): the batched HTTP path renders these directly."""
        cfg = await self._topic_for_send(topic)
        drafts, body_bytes = self._request_drafts(cfg, messages, self.clock_ms())
        return await self._append_rows(cfg, drafts, body_bytes)

    async def send_coalesced(self, topic: Any, requests: Sequence[Sequence[OutgoingMessage]]
                             ) -> list[list[tuple[str, str, str, int, int]] | StoreError]:
        """Several send requests for one topic as one log append (the produce stream's path:
        the requests that arrived together on a connection). Each request is checked on its own,
        as `send_rows` would check it: a refused request gets its error in its place and the
        others are appended. Each request's messages stay contiguous and in order, so each is
        as atomic as a `send_rows` batch. An error of the topic or of the append itself is
        raised: it is every request's answer."""
        cfg = await self._topic_for_send(topic)
        out, spans, drafts, body_bytes = self._coalesce(cfg, requests)
        if drafts:
            _place(out, spans, await self._append_rows(cfg, drafts, body_bytes))
        return out

    def submit_coalesced(self, topic: Any, requests: Sequence[Sequence[OutgoingMessage]],
                         on_done: Callable[[list | BaseException], None]) -> bool:
        """`send_coalesced` without a task, where the log proposes without one (DLedger's
        `submit_packed`) and the topic exists; False, having done nothing, where it cannot (the
        caller then awaits send_coalesced). `on_done` gets what send_coalesced would return, or
        the error it would raise; it may run before this returns. An error found before the
        append (the topic's name or permission, the log refusing) is raised here."""
        submit = getattr(self.log, "submit_packed", None)
        if submit is None:
            return False
        cfg = self.topics.get(check_user_topic(topic))
        if cfg is None:
            return False            # created first, which awaits
        _check_writable_topic(cfg)
        out, spans, drafts, body_bytes = self._coalesce(cfg, requests)
        if not drafts:
            on_done(out)
            return True
        t0 = time.monotonic()

        def appended(status: Any, _ts: int, placed: list[tuple[int, int, int]]) -> None:
            if isinstance(status, BaseException):
                on_done(status)
                return
            _place(out, spans, self._appended(cfg, drafts, body_bytes, t0, itertools.repeat(status.value), placed))
            on_done(out)
        submit(drafts, appended)
        return True

    def _coalesce(self, cfg: TopicConfig, requests: Sequence[Sequence[OutgoingMessage]]):
        """The requests' drafts as one batch: (answers so far, with each refused request's error
        in its place; (answer index, first draft, drafts) per accepted request; the drafts;
        their body bytes)."""
        now_ms = self.clock_ms()
        out: list[list[tuple[str, str, str, int, int]] | StoreError] = []
        spans: list[tuple[int, int, int]] = []     # (index in out, first draft, drafts)
        drafts: list[MessageDraft] = []
        body_bytes = 0
        for messages in requests:
            try:
                ds, nbytes = self._request_drafts(cfg, messages, now_ms)
            except StoreError as e:
                out.append(e)
                continue
            spans.append((len(out), len(drafts), len(ds)))
            out.append([])
            drafts += ds
            body_bytes += nbytes
        return out, spans, drafts, body_bytes

    def _request_drafts(self, cfg: TopicConfig, messages: Sequence[OutgoingMessage],
                        now_ms: int) -> tuple[list[MessageDraft], int]:
        """One request's sealed drafts (its count checked, one queue for those that name none)."""
        if not messages:
            raise BadRequest("messages must hold at least one message")
        if len(messages) > self.config.max_batch_messages:
            raise BadRequest(f"{len(messages)} messages in one request; the limit is {self.config.max_batch_messages}")
        default_qid = next(self._round_robin.setdefault(cfg.topic, itertools.count())) % cfg.write_queue_nums
        return self._drafts(cfg, messages, default_qid, now_ms)

    async def _append_rows(self, cfg: TopicConfig, drafts: list[MessageDraft],
                           body_bytes: int) -> list[tuple[str, str, str, int, int]]:
        packed = getattr(self.log, "append_packed", None)
        t0 = time.monotonic()
        if packed is not None:   # one status and store time for the whole batch, (phys, size, qoff) each
            status, _ts, placed = await packed(drafts)
            statuses: Any = itertools.repeat(status.value)
        else:
            results = await self.log.append(drafts)
            statuses = [r.status.value for r in results]
            placed = [(r.physical_offset, r.size, r.queue_offset) for r in results]
        return self._appended(cfg, drafts, body_bytes, t0, statuses, placed)

    def _appended(self, cfg: TopicConfig, drafts: list[MessageDraft], body_bytes: int, t0: float, statuses: Any,
                  placed: Sequence[tuple[int, int, int]]) -> list[tuple[str, str, str, int, int]]:
        """The rows of an append that began at `t0` (monotonic), counted in the broker's figures."""
        t1 = time.monotonic()
        if t1 - t0 >= self._put_wait[0] or t1 - self._put_wait[1] > PUT_WAIT_WINDOW_S:
            self._put_wait = (t1 - t0, t1)
        assert len(placed) == len(drafts), "log returned a result per draft"
        self.messages_in += len(drafts)
        self.traffic.sent(cfg.topic, len(drafts), body_bytes)
        return self._send_rows(drafts, statuses, placed)

    def _drafts(self, cfg: TopicConfig, messages: Sequence[OutgoingMessage], default_qid: int,
                now_ms: int) -> tuple[list[MessageDraft], int]:
        """Sealed drafts of a batch and their total body bytes. A message with only a body, a
        tag and maybe a queue id and born time (the batched producer's shape) takes the
        cached-suffix path; any other goes through `_draft`. Both check the same things."""
        max_size = self.config.max_message_size
        write_queues = cfg.write_queue_nums
        topic = cfg.topic
        plain = MessageDraft.sealed_plain
        drafts: list[MessageDraft] = []
        add = drafts.append
        body_bytes = 0
        for i, m in enumerate(messages):
            body = m.body
            n = len(body)
            body_bytes += n
            qid = m.queue_id
            if m.properties or m.keys or n > max_size or (qid is not None and type(qid) is not int) \
                    or (m.tags is not None and type(m.tags) is not str):
                add(self._draft(cfg, m, i, default_qid, now_ms))
                continue
            if qid is None:
                qid = default_qid
            elif not 0 <= qid < write_queues:
                add(self._draft(cfg, m, i, default_qid, now_ms))   # words the error
                continue
            try:
                add(plain(topic, qid, body, m.tags or None, m.born_timestamp or now_ms or self.clock_ms()))
            except InvalidMessage as e:
                raise BadRequest(f"messages[{i}]: {e}") from None
        return drafts, body_bytes

    def _send_rows(self, drafts: list[MessageDraft], statuses: Any,
                   placed: Sequence[tuple[int, int, int]]) -> list[tuple[str, str, str, int, int]]:
        prefix = self._offset_id_prefix
        uniq_key, real_qid = M.PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX, M.PROPERTY_REAL_QUEUE_ID
        rows = []
        add = rows.append
        for d, status, (phys, _size, qoff) in zip(drafts, statuses, placed):
            assert phys >= 0, "a stored message has a physical offset"
            offset_id = prefix + format(phys, "016X")
            props = d.properties
            if uniq_key in props or real_qid in props:
                # the user's queue, not the schedule/half one; the producer's UNIQ_KEY as msg_id
                add((status, props.get(uniq_key) or offset_id, offset_id,
                     int(props.get(real_qid, d.queue_id)), qoff))
            else:
                add((status, offset_id, offset_id, d.queue_id, qoff))
        return rows

    async def _topic_for_send(self, topic: Any) -> TopicConfig:
        topic = check_user_topic(topic)
        cfg = self.topics.get(topic)
        if cfg is None:
            if not self.config.auto_create_topic_enable:
                raise TopicNotExist(f"topic {topic!r} does not exist (autoCreateTopicEnable=false)")
            cfg = await self.create_topic(topic)
        _check_writable_topic(cfg)
        return cfg

    def _draft(self, cfg: TopicConfig, m: OutgoingMessage, i: int, default_qid: int,
               now_ms: int | None = None) -> MessageDraft:
        where = f"messages[{i}]"
        if len(m.body) > self.config.max_message_size:
            raise MessageTooLarge(f"{where}: body is {len(m.body)} bytes; maxMessageSize is "
                                  f"{self.config.max_message_size}")
        qid = default_qid if m.queue_id is None else check_int(f"{where}.queue_id", m.queue_id, 0, 1 << 30)
        if qid >= cfg.write_queue_nums:
            raise BadRequest(f"{where}: queue_id {qid} is out of range; topic {cfg.topic!r} has "
                             f"{cfg.write_queue_nums} write queues")
        props = dict(m.properties)
        if m.tags:
            props[M.PROPERTY_TAGS] = m.tags
        if m.keys:
            props[M.PROPERTY_KEYS] = M.KEY_SEPARATOR.join(m.keys)
        topic = cfg.topic
        if M.PROPERTY_DELAY_TIME_LEVEL in props or M.PROPERTY_TRANSACTION_PREPARED in props:
            topic, qid, props = self.services.route_special(topic, qid, props, where)  # delay / half message
        draft = MessageDraft(topic=topic, queue_id=qid, body=m.body, properties=props,
                             born_timestamp=m.born_timestamp or now_ms or self.clock_ms())
        try:
            return draft.seal(self.config.max_message_size)
        except InvalidMessage as e:
            raise BadRequest(f"{where}: {e}") from None

    # --- pull ------------------------------------------------------------------------------------
    async def pull(self, topic: Any, queue_id: Any, offset: Any, max_msgs: Any = None,
                   tags: str | None = None, wait_ms: Any = 0, group: Any = None) -> PullResult:
        """DefaultMessageStore.getMessage, plus long polling when the queue has nothing new.
        `group`, the consumer group pulling (PullMessageRequestHeader's consumerGroup), is
        optional: it counts what the group got for statsAll (`stats_all`).

        A slave (classic) or follower (DLedger) serves pulls only with slaveReadEnable=true, as
        RocketMQ's PullMessageProcessor rejects them otherwise; here the refusal is NOT_LEADER
        naming the master, which clients follow."""
        role = self.log.role()
        if role not in WRITABLE_ROLES and not self.config.slave_read_enable:
            raise NotLeader(f"this node is a {role}: pulls are served by the master "
                            f"(slaveReadEnable=false)", leader=self.log.leader())
        cfg = self.topic(topic)
        if not cfg.perm & PERM_READ:
            raise NoPermission(f"topic {cfg.topic!r} is not readable (perm {cfg.perm})")
        cap = self.config.max_transfer_count_on_message_in_memory
        qid = check_int("queue_id", queue_id, 0, MAX_QUEUES_PER_TOPIC)
        if qid >= cfg.read_queue_nums:
            raise BadRequest(f"queue_id {qid} is out of range; topic {cfg.topic!r} has {cfg.read_queue_nums} "
                             f"read queues")
        offset = check_int("offset", offset, 0, 1 << 62)
        n = check_int("max", cap if max_msgs is None else max_msgs, 1, 1 << 30)
        wait = check_int("wait_ms", wait_ms, 0, 1 << 30)
        sub = Subscription.parse(tags)
        group = check_group(group) if group is not None else None
        n = min(n, cap)
        wait = min(wait, self.config.long_polling_max_wait_ms) if self.config.long_polling_enable else 0
        deadline = time.monotonic() + wait / 1000.0
        while True:
            # Reads of old bytes (a consumer far behind) are made by a worker (node/store/cold_reads.py).
            result = await read_without_stalling(self._pull_once, cfg.topic, qid, offset, n, sub)
            if result.messages:
                self.traffic.pulled(cfg.topic, len(result.messages), sum(len(m.body) for m in result.messages),
                                    group)
            remaining = deadline - time.monotonic()
            if result.status != PULL_NO_NEW_MSG or remaining <= 0 or self._waiters.full() or not self.ready:
                return result
            if self._queue_bounds(cfg.topic, qid)[1] > result.max_offset:
                continue  # a message landed between the read and now
            await self._waiters.wait((cfg.topic, qid), remaining)

    def _pull_once(self, topic: str, qid: int, offset: int, n: int, sub: Subscription) -> PullResult:
        """One look at the queue. Only reads: it may be tried twice (node/store/cold_reads.py)."""
        lo, hi = self._queue_bounds(topic, qid)
        if offset < lo:
            return PullResult(PULL_OFFSET_ILLEGAL, lo, lo, hi, [])
        if offset > hi:
            return PullResult(PULL_OFFSET_ILLEGAL, hi, lo, hi, [])
        if offset == hi:
            return PullResult(PULL_NO_NEW_MSG, offset, lo, hi, [])
        messages, next_offset = self._collect(self.cq_store.get(topic, qid), offset, hi, n, sub)
        status = PULL_FOUND if messages else PULL_NO_MATCHED_MSG
        return PullResult(status, next_offset, lo, hi, messages)

    def _collect(self, cq: Any, offset: int, hi: int, n: int, sub: Subscription) -> tuple[list[StoredMessage], int]:
        """Walk units from `offset`: at most n matches, maxFilterMessageCount units, MAX_PULL_BYTES."""
        out: list[StoredMessage] = []
        scan_left = self.config.max_filter_message_count if not sub.matches_all else n
        size = 0
        min_phys = self.log.min_physical_offset
        while offset < hi and scan_left > 0 and len(out) < n and size < MAX_PULL_BYTES:
            units = cq.get_range(offset, min(scan_left, REPLAY_BATCH_UNITS))
            if not units:
                break
            for phys, unit_size, code in units:
                if len(out) >= n or size >= MAX_PULL_BYTES:
                    break
                offset += 1
                scan_left -= 1
                if phys < min_phys or (sub.codes and code not in sub.codes):
                    continue  # expired from the log, or a tag the subscription does not want
                try:
                    msg = self._read_unit_checked(phys, unit_size)
                except CorruptData:
                    if out:
                        return out, offset - 1   # serve what is intact; the next pull reports the damage
                    raise
                if msg is None or (sub.tags and msg.tags not in sub.tags):
                    continue  # hash collision: the tag string decides, like RocketMQ's consumer
                out.append(msg)
                size += unit_size
        return out, offset

    # --- consumer offsets (clustering) -------------------------------------------------------------
    async def commit_offset(self, group: Any, topic: Any, queue_id: Any, offset: Any) -> PutStatus:
        """Replicated through the log; returns once applied here, so a read sees it, with the
        record's put status (SEND_OK, or a SYNC_MASTER's slave status: see _append_system)."""
        group = check_group(group)
        cfg = self.topic(topic)
        qid = check_int("queue_id", queue_id, 0, MAX_QUEUES_PER_TOPIC)
        if qid >= max(cfg.read_queue_nums, cfg.write_queue_nums):
            raise BadRequest(f"queue_id {qid} is out of range for topic {cfg.topic!r}")
        hi = self._queue_bounds(cfg.topic, qid)[1]
        offset = check_int("offset", offset, 0, 1 << 62)
        if offset > hi:
            raise BadRequest(f"offset {offset} is past the queue's max offset {hi}")
        with self._group_slot(group, cfg.topic):
            return await self._append_system(SYS_CONSUMER_OFFSET, {"group": group, "topic": cfg.topic,
                                                                   "queue_id": qid, "offset": offset})

    def _group_slot(self, group: str, topic: str) -> Any:
        """maxConsumerGroups around a commit of `group`'s offsets on `topic`."""
        if f"{topic}@{group}" in self.offsets:     # the group is tracked already: nothing to scan
            return contextlib.nullcontext()
        return limits.reserve("consumer_groups", group, self.tracked_groups(), self._groups_pending,
                              self.config.max_consumer_groups)

    def tracked_groups(self) -> set[str]:
        """Consumer groups this node tracks (maxConsumerGroups): with committed offsets or live members."""
        groups = {key.rpartition("@")[2] for key in self.offsets if not key.startswith(SYSTEM_PREFIX)}
        groups.update(self.services.groups.groups)
        return groups

    def admit_group(self, group: str) -> None:
        """A heartbeat of a group with no live members: refused when it is new and the node is full."""
        limits.check_new_name("consumer_groups", group, self.tracked_groups(), self.config.max_consumer_groups,
                              self._groups_pending)

    def get_offsets(self, group: Any, topic: Any = None) -> dict[str, dict[int, int]]:
        """topic -> {queue_id: committed offset} for `group` (one topic when given)."""
        group = check_group(group)
        wanted = None if topic is None else self.topic(topic).topic
        out: dict[str, dict[int, int]] = {}
        for key, queues in self.offsets.items():
            t, _, g = key.rpartition("@")
            if g == group and (wanted is None or t == wanted):
                out[t] = dict(sorted(queues.items()))
        if wanted is not None:
            out.setdefault(wanted, {})
        return out

    def list_groups(self) -> list[str]:
        """Consumer groups with committed offsets on this node."""
        return sorted({key.rpartition("@")[2] for key in self.offsets if not key.startswith(SYSTEM_PREFIX)})

    def group_progress(self, group: Any, topic: Any = None) -> list[dict[str, int | str]]:
        """mqadmin consumerProgress rows: every queue of each topic the group committed offsets for."""
        group = check_group(group)
        rows: list[dict[str, int | str]] = []
        for t, committed in sorted(self.get_offsets(group, topic).items()):
            cfg = self.topics.get(t)
            if cfg is None:
                continue   # offsets of a deleted topic
            for qid in range(max(cfg.read_queue_nums, cfg.write_queue_nums)):
                lo, hi = self._queue_bounds(t, qid)
                off = committed.get(qid, lo)
                last = self._message_at(t, qid, off - 1) if off > lo else None
                rows.append({"topic": t, "queue_id": qid, "broker_offset": hi, "consumer_offset": off,
                             "diff": max(0, hi - off), "last_timestamp": last.store_timestamp if last else 0})
        return rows

    def stats_all(self, topic: Any = None) -> list[dict[str, Any]]:
        """mqadmin statsAll's figures as this node has them: per topic (not %RETRY% or %DLQ%,
        nor system topics) the messages sent here, the last minute's TPS and the last day's
        count; per consumer group of it (offsets committed, or pulls that named the group) what
        it pulled here, the same two, and its accumulation (messages past its offsets)."""
        names = [check_user_topic(topic)] if topic is not None else sorted(self.topics)
        by_topic: dict[str, dict[str, dict[int, int]]] = {}
        for key, table in self.offsets.items():
            t, _, g = key.rpartition("@")
            by_topic.setdefault(t, {})[g] = table
        pulling = self.traffic.groups_pulling()
        rows = []
        for t in names:
            cfg = self.topics.get(t)
            if cfg is None:
                if topic is not None:
                    raise TopicNotExist(f"topic {t!r} does not exist")
                continue
            if t.startswith((RETRY_PREFIX, DLQ_PREFIX, SYSTEM_PREFIX)):
                continue
            in_tps, in_day = self.traffic.put_stats(t)
            committed = by_topic.get(t, {})
            groups = []
            for g in sorted(set(committed) | pulling.get(t, set())):
                out_tps, out_day = self.traffic.get_stats(t, g)
                accumulation = 0
                for qid in range(max(cfg.read_queue_nums, cfg.write_queue_nums)):
                    lo, hi = self._queue_bounds(t, qid)
                    accumulation += max(0, hi - committed.get(g, {}).get(qid, lo))
                groups.append({"group": g, "accumulation": accumulation, "out_tps": round(out_tps, 2),
                               "out_msg_24h": out_day})
            rows.append({"topic": t, "in_tps": round(in_tps, 2), "in_msg_24h": in_day, "groups": groups})
        return rows

    def offset_by_time(self, topic: str, qid: int, timestamp_ms: int) -> int:
        """First queue offset whose store time is >= timestamp_ms (the max offset if none):
        RocketMQ getOffsetInQueueByTime, a binary search over the consume queue."""
        lo, hi = self._queue_bounds(topic, qid)
        a, b = lo, hi
        while a < b:   # invariant: every offset < a is older than the time; every offset >= b is not
            mid = (a + b) // 2
            msg = self._message_at(topic, qid, mid)
            if msg is None or msg.store_timestamp < timestamp_ms:
                a = mid + 1
            else:
                b = mid
        return a

    async def search_offset(self, topic: Any, queue_id: Any, timestamp_ms: Any) -> int:
        """RocketMQ searchOffset (SEARCH_OFFSET_BY_TIMESTAMP): the first queue offset stored at
        or after `timestamp_ms`; the queue's max offset if none is."""
        cfg = self.topic(topic)
        qid = check_int("queue_id", queue_id, 0, MAX_QUEUES_PER_TOPIC)
        if qid >= max(cfg.read_queue_nums, cfg.write_queue_nums):
            raise BadRequest(f"queue_id {qid} is out of range; topic {cfg.topic!r} has "
                             f"{max(cfg.read_queue_nums, cfg.write_queue_nums)} queues")
        ts = check_int("timestamp", timestamp_ms, 0, 1 << 62)
        return await read_without_stalling(self.offset_by_time, cfg.topic, qid, ts)

    async def reset_offsets_by_time(self, group: Any, topic: Any, timestamp_ms: Any) -> list[dict[str, int]]:
        """mqadmin resetOffsetByTime: move the group's offset on every queue of `topic` to `timestamp_ms`;
        -1 moves it to each queue's max offset, past every message stored (skipAccumulatedMessage)."""
        group = check_group(group)
        cfg = self.topic(topic)
        ts = check_int("timestamp", timestamp_ms, -1, 1 << 62)
        out = []
        with self._group_slot(group, cfg.topic):
            for qid in range(max(cfg.read_queue_nums, cfg.write_queue_nums)):
                off = self._queue_bounds(cfg.topic, qid)[1] if ts == -1 else \
                    await read_without_stalling(self.offset_by_time, cfg.topic, qid, ts)
                await self._append_system(SYS_CONSUMER_OFFSET, {"group": group, "topic": cfg.topic,
                                                                "queue_id": qid, "offset": off})
                out.append({"queue_id": qid, "offset": off})
        return out

    async def delete_topic(self, topic: Any) -> TopicConfig:
        """mqadmin deleteTopic: the topic config, its consume queues and its consumer offsets go
        (replicated: every replica applies the record); its commitlog records age out with retention."""
        cfg = self.topic(topic)
        await self._append_system(SYS_TOPIC_CONFIG, {**cfg.to_dict(), "deleted": True})
        return cfg

    # --- queries -------------------------------------------------------------------------------------
    def query_by_id(self, offset_msg_id: Any) -> StoredMessage:
        if not isinstance(offset_msg_id, str):
            raise BadRequest("offsetMsgId must be a string")
        try:
            _ip, _port, phys = M.decode_offset_msg_id(offset_msg_id)
        except InvalidMessage as e:
            raise BadRequest(str(e)) from None
        msg = self._read_at(phys)
        if msg is None or msg.offset_msg_id != offset_msg_id.upper() or msg.topic.startswith(SYSTEM_PREFIX):
            raise MessageNotFound(f"no message with offsetMsgId {offset_msg_id} on this node")
        return msg

    async def query_by_key(self, topic: Any, key: Any, begin_ms: Any = 0, end_ms: Any = None,
                           max_num: Any = 32) -> list[StoredMessage]:
        """mqadmin queryMsgByKey: messages of `topic` carrying `key` (UNIQ_KEY or a KEYS word)
        stored in [begin_ms, end_ms], oldest first. Index files and messages are read off the
        event loop where they may wait for the disk."""
        cfg = self.topic(topic)
        if not isinstance(key, str) or not key or len(key) > 1024:
            raise BadRequest("key must be a non-empty string of at most 1024 chars")
        begin = check_int("begin", begin_ms, 0, 1 << 62)
        end = check_int("end", self.clock_ms() if end_ms is None else end_ms, 0, 1 << 62)
        n = check_int("max", max_num, 1, MAX_QUERY_RESULTS)
        if end < begin:
            raise BadRequest(f"end ({end}) is before begin ({begin})")
        found = await self.index.query_off_loop(cfg.topic, key, begin, end, n)
        return await read_without_stalling(self._messages_with_key, cfg.topic, key, begin, end, found[:n])

    def _messages_with_key(self, topic: str, key: str, begin: int, end: int, candidates: list[int]
                           ) -> list[StoredMessage]:
        out = []
        for phys in candidates:
            msg = self._read_at(phys)
            # The index hashes keys, so check what it pointed at really carries the key.
            if msg is not None and msg.topic == topic and key in _index_keys(msg) \
                    and begin <= msg.store_timestamp <= end and phys >= self._deleted.get(topic, -1):
                out.append(msg)
        out.sort(key=lambda m: m.physical_offset)
        return out

    def query_by_queue_offset(self, topic: Any, queue_id: Any, queue_offset: Any) -> StoredMessage:
        cfg = self.topic(topic)
        qid = check_int("queue_id", queue_id, 0, MAX_QUEUES_PER_TOPIC)
        qoff = check_int("queue_offset", queue_offset, 0, 1 << 62)
        msg = self._message_at(cfg.topic, qid, qoff, strict=True)
        if msg is None:
            lo, hi = self._queue_bounds(cfg.topic, qid)
            raise MessageNotFound(f"no message at {cfg.topic}/{qid} offset {qoff} (queue holds [{lo}, {hi}))")
        return msg

    # --- reading ---------------------------------------------------------------------------------------
    def _message_at(self, topic: str, qid: int, qoff: int, strict: bool = False) -> StoredMessage | None:
        cq = self.cq_store.get(topic, qid)
        unit = cq.get(qoff) if cq is not None else None
        if unit is None or unit[0] < self.log.min_physical_offset:
            return None
        return self._read_unit_checked(unit[0], unit[1]) if strict else self._read_unit(unit[0], unit[1])

    def _read_unit(self, phys: int, size: int) -> StoredMessage | None:
        """The record a consume-queue unit points at; None if it expired meanwhile or fails its CRC
        (then already reported: ERROR line, metric, /health). For internal readers."""
        try:
            return self._read_unit_checked(phys, size)
        except CorruptData:
            return None

    def _read_unit_checked(self, phys: int, size: int) -> StoredMessage | None:
        """Like _read_unit, but a record whose CRC fails raises CorruptData (consumer-facing reads)."""
        # Never serve, and never step past, a record whose CRC fails: the pull fails (retriable)
        # and the damage is logged, counted and shown in /health (node/store/scrub.py).
        self.corruption.check(phys, phys + size)
        try:
            return M.decode_record(self.log.read(phys, size))
        except KeyError:
            return None
        except CorruptRecord as e:
            raise report_read_failure(self.log, self.corruption, phys, e) from None

    def _read_at(self, phys: int) -> StoredMessage | None:
        """The record starting at `phys` without knowing its size (offsetMsgId, index hits)."""
        if phys < 0:
            return None
        self.corruption.check(phys, phys + 1)
        reader = getattr(self.log, "read_record", None)
        try:
            if reader is not None:
                return M.decode_record(reader(phys))
            # Fallback through the Protocol: scan one record from its log position.
            delta = L.ENTRY_HEADER.size if self.log.mode == "dledger" else 0
            batch = self.log.scan(phys - delta, 1)
        except CorruptRecord as e:
            if reader is None:   # the framing found no record at phys: a wrong id, not damage
                return None
            raise report_read_failure(self.log, self.corruption, phys, e) from None
        except (KeyError, ValueError, AssertionError):
            return None
        if not batch.records or batch.records[0].physical_offset != phys:
            return None
        try:
            return M.decode_record(batch.records[0].data)
        except CorruptRecord as e:
            raise report_read_failure(self.log, self.corruption, phys, e) from None

    # --- status -----------------------------------------------------------------------------------------
    @property
    def long_poll_waiters(self) -> int:
        return self._waiters.count

    def health(self) -> dict[str, Any]:
        st = self.log.status()
        out = {"status": "UP" if self.ready and self.fatal is None else "DOWN", "mode": self.log.mode,
               "role": self.log.role(), "group": self.config.group, "node_id": self.config.node_id,
               "committed_offset": self.log.committed_position, "corrupt": self.corruption.as_list()}
        for k in ("term", "leader"):
            if st.get(k) is not None:
                out[k] = st[k]
        if "leader" not in out and self.log.leader() is not None:
            out["leader"] = self.log.leader()
        if self.config.stream_listen_port:
            out["stream_port"] = self.config.stream_listen_port   # the produce stream (node/produce_stream.py)
        return out

    def cluster(self) -> dict[str, Any]:
        return {"cluster": self.config.broker_cluster_name, "group": self.config.group,
                "node_id": self.config.node_id, "mode": self.log.mode, "role": self.log.role(),
                "leader": self.log.leader(), "committed_offset": self.log.committed_position,
                "min_offset": self.log.min_position,
                "dispatch_behind_bytes": int(getattr(self.dispatcher, "behind_bytes", 0)),
                "corrupt": self.corruption.as_list(), "log": self.log.status(),
                "put_wait_ms": self.put_wait_ms(), "earliest_store_timestamp": self.earliest_store_timestamp()}

    def put_wait_ms(self) -> int:
        """The longest log append (replication and flush included) in the last PUT_WAIT_WINDOW_S,
        in ms: what mqadmin clusterList shows as #PCWait (0 when nothing was sent lately)."""
        wait_s, at = self._put_wait
        return int(wait_s * 1000) if time.monotonic() - at <= PUT_WAIT_WINDOW_S else 0

    def earliest_store_timestamp(self) -> int | None:
        """Store time of the oldest record in the log (clusterList #Hour), None when the log is
        empty or its head cannot be read; read once per head position."""
        lo = self.log.min_position
        if lo >= self.log.committed_position:
            return None
        if self._oldest[0] != lo:
            try:
                batch = self.log.scan(lo, 1)
                rec = batch.records[0] if batch.records else None
                ts = L.MESSAGE_HEADER.unpack_from(rec.data, 0)[11] if rec is not None else 0
            except (CorruptRecord, KeyError, ValueError, IndexError, AssertionError) as e:
                log.warning("cannot read the oldest record at log position %d: %s", lo, e)
                return None
            if not ts:
                return None
            self._oldest = (lo, ts)
        return self._oldest[1]


async def _maybe_await(value: Any) -> Any:
    """Collaborators may be sync or async; the broker does not mind which."""
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        return await value
    return value


def _unpack_system(msg: StoredMessage) -> dict | None:
    try:
        rec = msgpack.unpackb(msg.body, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        log.error("ignoring undecodable system record at %d", msg.physical_offset)
        return None
    if not isinstance(rec, dict):
        log.error("ignoring system record at %d: not a map", msg.physical_offset)
        return None
    return rec


def _index_keys(msg: StoredMessage) -> set[str]:
    keys = set(msg.keys)
    uniq = msg.properties.get(M.PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX)
    if uniq:
        keys.add(uniq)
    return keys

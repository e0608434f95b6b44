"""Dispatcher: committed log records -> consume queues, index files, system handlers.

RocketMQ's ReputMessageService. It reads only *committed* records through the
`ReplicatedLog` protocol, from `position` (a log position), in bounded batches:

    wait_committed -> scan(position, batch_bytes) -> per record: CQ unit, index keys
    -> one pwrite per CQ file touched, one pwrite of index entries -> handlers, listeners
    -> position = batch.next_position
    every flush_interval_ms: flush CQs, flush index, THEN save the checkpoint

so the checkpoint's committed_offset never runs ahead of durable CQ/index data.
Re-dispatching a range is harmless: CQ puts compare before they write, index
builds skip messages below the last file's end and queries de-duplicate.

Per record only the 88-byte header, the topic and the properties are parsed (no
CRC: the log checked it on write and on recovery). A record that does not parse
raises CorruptRecord and stops dispatch loudly; nothing is skipped silently.
Records are read in place from the log's `scan_spans` buffers when it has them (no
copy per record). What the properties say (tags code, KEYS, UNIQ_KEY, DELAY) is
remembered per encoded properties (bounded, and never for keyed ones), since a batch
producer's messages mostly carry the same few.

Tags code: String.hashCode of TAGS, except for SCHEDULE_TOPIC_XXXX whose units carry
the delivery time (store_timestamp + delay of the DELAY level), like RocketMQ's
CommitLog.checkMessageAndReturnSize; the delay service scans its queues by that.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import struct
import threading
import time
from typing import Callable, Sequence

from node.log_throttle import LogThrottle
from node.replicated_log import ReplicatedLog, ScanBatch
from node.store import layout as L
from node.store.checkpoint import Checkpoint
from node.store.cold_reads import DiskWait, fill, no_disk_waits, read_without_stalling
from node.store.consume_queue import ConsumeQueue, ConsumeQueueStore
from node.store.errors import CorruptRecord, StoreError
from node.store.index_file import IndexService
from node.store.segment import TailCut
from node.store.message import (PROPERTY_DELAY_TIME_LEVEL, PROPERTY_KEYS, PROPERTY_TAGS,
                                PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX, StoredMessage, decode_properties,
                                decode_record, tags_code)

log = logging.getLogger(__name__)

# A log that commits in small steps (an HA slave: one per received push of at most 32 KiB) may
# ask, through its `dispatch_linger_s`, that the dispatcher wait that long after a commit smaller
# than this before dispatching, so that one batch (one CQ write per queue, one index write)
# covers several commits. RocketMQ's ReputMessageService polls every 1 ms.
LINGER_BELOW_BYTES = 256 * 1024

SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"
# messageDelayLevel "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h", level 1 first.
DEFAULT_DELAY_LEVELS_MS: tuple[int, ...] = tuple(s * 1000 for s in (
    1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200))
DEFAULT_BATCH_BYTES = 4 * 1024 * 1024
MAX_CACHED_NAMES = 10_000       # bound on the topic and tag caches
DISK_FULL_RETRY_S = 1.0         # a batch refused with ENOSPC is dispatched again after this
DISK_FULL_LOG_INTERVAL_S = 10.0  # at most one disk-full warning this often

_HEADER = L.MESSAGE_HEADER
_DISPATCH_FIELDS = L.MESSAGE_DISPATCH_FIELDS
_PROPS_LEN = L.PROPERTIES_LEN
_CQ_UNIT = L.CQ_UNIT
_MAGIC = L.MESSAGE_MAGIC
_TX_MASK = L.SYSFLAG_TRANSACTION_MASK
_TX_ROLLBACK = L.SYSFLAG_TRANSACTION_ROLLBACK_TYPE
_TX_PREPARED = L.SYSFLAG_TRANSACTION_PREPARED_TYPE
_NO_PROPS: tuple[int, None, None, None] = (0, None, None, None)   # facts of a record without properties
_MAX_CACHED_PROPS_BYTES = 512   # longer encoded properties are decoded every time, not remembered

Listener = Callable[[str, int, int], None]
SystemHandler = Callable[[StoredMessage], None]


class _Topic:
    """What the dispatcher needs about one topic, computed once per topic name."""

    __slots__ = ("name", "is_schedule", "handler", "dead_below")

    def __init__(self, name: str, handler: SystemHandler | None, dead_below: int = -1):
        self.name = name
        self.is_schedule = name == SCHEDULE_TOPIC
        self.handler = handler
        self.dead_below = dead_below    # records below this log position belong to a deleted topic


class _Run:
    """Consecutive units for one queue within a batch: their fields gathered, then packed in one
    struct call and written with one pwrite per file."""

    __slots__ = ("cq", "first", "count", "fields")

    def __init__(self, cq: ConsumeQueue, first: int, phys: int, size: int, code: int):
        self.cq = cq
        self.first = first
        self.count = 1
        self.fields = [phys, size, code]      # CQ_UNIT fields of each unit, flat

    def packed(self) -> bytes:
        n = self.count
        s = _RUN_STRUCTS.get(n)
        if s is None:
            if len(_RUN_STRUCTS) >= _MAX_RUN_STRUCTS:
                _RUN_STRUCTS.clear()
            s = _RUN_STRUCTS[n] = struct.Struct(_CQ_ORDER + _CQ_FIELDS * n)
        return s.pack(*self.fields)


_CQ_ORDER, _CQ_FIELDS = _CQ_UNIT.format[0], _CQ_UNIT.format[1:]   # byte order, one unit's fields
_RUN_STRUCTS: dict[int, struct.Struct] = {}     # units per run -> Struct of that many CQ units
_MAX_RUN_STRUCTS = 1024


class Dispatcher:
    def __init__(self, log_: ReplicatedLog, cq_store: ConsumeQueueStore, index_service: IndexService | None,
                 checkpoint: Checkpoint, *, batch_bytes: int = DEFAULT_BATCH_BYTES, flush_interval_ms: int = 1000,
                 system_handlers: dict[str, SystemHandler] | None = None,
                 delay_levels_ms: Sequence[int] = DEFAULT_DELAY_LEVELS_MS,
                 clock: Callable[[], float] = time.monotonic):
        assert batch_bytes > 0
        assert flush_interval_ms > 0
        self.log = log_
        self.cq_store = cq_store
        self.index = index_service
        self.checkpoint = checkpoint
        self.batch_bytes = batch_bytes
        self.flush_interval_ms = flush_interval_ms
        self.system_handlers = dict(system_handlers or {})
        self.delay_levels_ms = tuple(delay_levels_ms)
        self._clock = clock
        self.position = 0               # next log position to dispatch
        self.flushed_position = 0       # everything before it is in fsynced CQs and index
        self._listeners: list[Listener] = []
        self._topics: dict[bytes, _Topic] = {}
        self._tags: dict[str, int] = {}
        self._props: dict[bytes, tuple[int, str | None, str | None, str | None]] = {}
        self._queues: dict[tuple[bytes, int], ConsumeQueue] = {}
        self.deleted: dict[str, int] = {}   # deleted topic -> log position of its deletion
        self._last_store_ts = 0
        self._task: asyncio.Task | None = None
        self.failed: BaseException | None = None
        self.dispatched_records = 0     # metrics
        self.handler_errors = 0
        self.disk_full_errors = 0       # CQ/index/checkpoint writes refused with ENOSPC (retried)
        self._sync_lock = threading.Lock()
        self._deferred: list[Callable[[], None]] | None = None   # changes held while recovering off the loop
        self._recovered: asyncio.Event | None = None     # set once a recovery in the background is done
        # Queue cuts made durable on a worker (cut_queues); dispatch waits for the last one.
        self._cuts: asyncio.Task | None = None
        self._cut_generation = 0        # bumped by a rewind: a flush staged before it saves no checkpoint
        self._disk_full_warnings = LogThrottle(DISK_FULL_LOG_INTERVAL_S)

    # --- observers ----------------------------------------------------------------------------
    @property
    def behind_bytes(self) -> int:
        return max(0, self.log.committed_position - self.position)

    def add_listener(self, cb: Listener) -> None:
        """cb(topic, queue_id, new_max_offset) after units land (wakes long-polling pulls)."""
        self._listeners.append(cb)

    def remove_listener(self, cb: Listener) -> None:
        self._listeners.remove(cb)

    # --- startup ------------------------------------------------------------------------------
    def startup_recover(self, log_end_physical: int) -> int:
        """Make CQs and index agree with the recovered log; choose where dispatch starts.

        Units and index entries at or past the log's end are dropped (the log's tail was
        cut); expired CQ heads are removed; dispatch resumes at the checkpoint's
        position, clamped into the log's retained, committed range.
        """
        lo, hi, min_phys = self._log_positions()
        return self._start_at(lo, hi, log_end_physical, *self._recover_files(log_end_physical, min_phys))

    async def startup_recover_in_background(self, log_end_physical: int) -> int:
        """startup_recover, its file work on a worker thread: every queue's directory listed
        and its last file read, units past the end cut, expired files dropped, index files
        checked. With a few thousand queues that held the event loop for seconds, while a
        DLedger node's Raft (started first) or a slave's HA link was already running on it.

        The log's positions are read once, here, before the thread starts: the checkpoint's
        position is clamped into the same committed range the units were cut to, however far
        the log moves meanwhile. A reset or truncation of the log that arrives meanwhile
        reaches the queues through `when_recovered`, after the recovery, in order."""
        lo, hi, min_phys = self._log_positions()
        self._deferred = []
        self._recovered = asyncio.Event()
        try:
            found = await asyncio.to_thread(self._recover_files, log_end_physical, min_phys)
            self._start_at(lo, hi, log_end_physical, *found)
        finally:
            deferred, self._deferred = self._deferred, None
            self._recovered.set()
        for fn in deferred:
            fn()
        return self.position

    def when_recovered(self, fn: Callable[[], None]) -> None:
        """Run `fn` (a change of the queues and of the dispatch position that follows a change
        of the log) now, or once a recovery in the background is done."""
        if self._deferred is not None:
            self._deferred.append(fn)
        else:
            fn()

    async def queues_settled(self) -> None:
        """Once the changes asked so far are in the queues and durable: a recovery in the
        background done (when_recovered), then the queue cuts in flight (cut_queues)."""
        if self._recovered is not None:
            await self._recovered.wait()
        await self._cuts_done()

    def _log_positions(self) -> tuple[int, int, int]:
        """(first retained, committed, first physical): what a recovery clamps and cuts to."""
        return self.log.min_position, self.log.committed_position, self.log.min_physical_offset

    def _recover_files(self, log_end_physical: int, min_phys: int) -> tuple[int, list[str]]:
        self.cq_store.recover_all()
        cut = self.cq_store.truncate_past_physical(log_end_physical)
        self.cq_store.delete_expired(min_phys)
        repaired = self.index.load(log_end_physical) if self.index is not None else []
        self.checkpoint.load()
        return cut, repaired

    def _start_at(self, lo: int, hi: int, log_end_physical: int, cut: int, repaired: list[str]) -> int:
        start = min(max(self.checkpoint.committed_offset, lo), hi)
        if start != self.checkpoint.committed_offset:
            log.warning("dispatch: checkpoint position %d is outside the log [%d, %d]; starting at %d",
                        self.checkpoint.committed_offset, lo, hi, start)
        self.position = self.flushed_position = start
        if self.index is not None:
            self.index.redispatch_from = start     # log position <= physical offset of its message
        log.info("dispatch: start at position %d (%d bytes behind); dropped %d CQ units past %d; "
                 "repaired index files %s", start, hi - start, cut, log_end_physical, repaired)
        return start

    def catch_up(self) -> int:
        """Dispatch until position reaches the committed position seen at the call, then flush.

        Used at startup before the node accepts writes. Returns records dispatched.
        """
        target = self.log.committed_position
        records = 0
        while self.position < target:
            records += self.dispatch_once()
        self.flush()
        return records

    async def catch_up_yielding(self) -> int:
        """`catch_up` for a node whose log already runs on the event loop (a DLedger node's Raft
        starts before the broker catches up): the loop gets a turn after each batch, old bytes
        are read by a cold-read worker, the flush's fsyncs run on a worker thread. A whole log to
        re-dispatch (consume queues deleted for a rebuild) takes minutes, and Raft's heartbeats
        must go on meanwhile. It also stops if the log's committed position falls below the
        target meanwhile (a reset)."""
        target = self.log.committed_position
        records = 0
        while self.position < min(target, self.log.committed_position):
            records += await self._dispatch_next()
            await asyncio.sleep(0)
        await self.flush_in_background()
        return records

    # --- the loop -----------------------------------------------------------------------------
    def start(self) -> asyncio.Task:
        assert self._task is None, "dispatcher already started"
        self._task = asyncio.get_running_loop().create_task(self.run(), name="dispatcher")
        return self._task

    def skip_to(self, position: int) -> None:
        """Nothing below `position` is in the log any more (this replica's log restarted further
        on): dispatch continues from there."""
        self.position = max(self.position, position)
        self.flushed_position = max(self.flushed_position, position)

    def cut_queues(self, end_phys: int, rewind_to: int | None = None) -> int:
        """The log's tail at `end_phys` was cut (a slave's truncation; 0: the whole log, a
        reset to a leader's base): drop the consume-queue units pointing at or past it and,
        with `rewind_to`, dispatch again from that log position. On the loop the cut is made
        in memory only, so no pull sees a dropped unit; its file work (a truncate and an
        fsync per queue cut, seconds on a slow disk with a few hundred queues) runs on a worker
        thread while dispatch waits for it. The checkpoint is then lowered to `rewind_to` if
        it was past it, and a flush staged before this saves none. Returns the units dropped."""
        dropped, tails = self.cq_store.detach_past_physical(end_phys)
        if self.index is not None:
            self.index.log_cut_at(end_phys)
        if rewind_to is not None:
            self.position = min(self.position, rewind_to)
            self.flushed_position = min(self.flushed_position, rewind_to)
            self._cut_generation += 1
        before = self._cuts
        self._cuts = asyncio.get_running_loop().create_task(self._cut_durably(before, tails, rewind_to),
                                                            name="consume-queue-cut")
        return dropped

    async def _cut_durably(self, before: asyncio.Task | None, tails: list[TailCut], rewind_to: int | None) -> None:
        if before is not None:
            await before        # in the order asked; a cut that failed (StoreFatal) fails the ones after it
        await asyncio.to_thread(self._make_cuts_durable, tails, rewind_to)

    def _make_cuts_durable(self, tails: list[TailCut], rewind_to: int | None) -> None:
        with self._sync_lock:       # after a flush in flight, which may have saved a later position
            for tail in tails:
                tail.make_durable()
            if rewind_to is not None and self.checkpoint.committed_offset > rewind_to:
                self._save_checkpoint(rewind_to, None)

    async def _cuts_done(self) -> None:
        """Wait for the queue cuts in flight (their error is this caller's, e.g. StoreFatal)."""
        while self._cuts is not None:
            cuts = self._cuts
            try:
                await asyncio.shield(cuts)
            finally:
                if self._cuts is cuts and cuts.done():
                    self._cuts = None

    async def stop(self) -> None:
        """Cancel the loop; it flushes and checkpoints on the way out."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    async def run(self) -> None:
        """Dispatch committed records as they come; flush every flush_interval_ms. The flush's
        fsyncs run on a worker thread while dispatch goes on (RocketMQ's ReputMessageService
        and FlushConsumeQueueService are two threads too): a committed message becomes
        pullable without waiting for an fsync, which took hundreds of ms on a busy disk."""
        interval = self.flush_interval_ms / 1000
        next_flush = self._clock() + interval
        flushing: asyncio.Task | None = None        # at most one flush at a time
        try:
            while True:
                if self.position >= self.log.committed_position:
                    due = next_flush - self._clock() if flushing is None else interval
                    await self.log.wait_committed(self.position, max(0.001, min(1.0, due)))
                    linger = getattr(self.log, "dispatch_linger_s", 0.0)
                    if linger and 0 < self.log.committed_position - self.position < LINGER_BELOW_BYTES:
                        await asyncio.sleep(linger)    # let a trickle of small commits gather into one batch
                try:
                    if self.position < self.log.committed_position:
                        await self._dispatch_next()
                    if flushing is not None and flushing.done():
                        done, flushing = flushing, None
                        done.result()                  # its error is this loop's (ENOSPC: below)
                    if flushing is None and self._clock() >= next_flush:
                        next_flush = self._clock() + interval
                        flushing = asyncio.ensure_future(self.flush_in_background())
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    self._disk_full(e)
                    await asyncio.sleep(DISK_FULL_RETRY_S)
                    continue
                await asyncio.sleep(0)  # let pulls and appends run between batches
        except asyncio.CancelledError:
            await self._final_flush()   # after a flush in flight: it waits for its thread (_sync_lock)
            raise
        except Exception as e:  # noqa: BLE001 - logged with its context, then re-raised
            self.failed = e
            log.error("dispatch stopped at log position %d (%d bytes behind): %s", self.position,
                      self.behind_bytes, e)
            raise
        finally:
            if flushing is not None and not flushing.done():
                flushing.cancel()       # its thread finishes on its own

    def _disk_full(self, e: OSError) -> None:
        """A consume-queue, index or checkpoint write found the disk full. The batch is not
        counted as dispatched (position stays), so it is dispatched again once there is
        room: CQ units already written are compared, not appended twice (put_units), index
        entries already built are skipped and the buffered ones rewritten at the same place
        (build_index, write_pending). Pulls see the queues as they were; nothing is lost."""
        self.disk_full_errors += 1
        if self._disk_full_warnings.due(self._clock()) is not None:
            log.warning("dispatch paused at log position %d (%d bytes behind): disk full (%s); retrying "
                        "every %.0f s (%d disk-full errors so far)", self.position, self.behind_bytes, e,
                        DISK_FULL_RETRY_S, self.disk_full_errors)

    async def _final_flush(self) -> None:
        """The last flush, at stop: its fsyncs on a worker too (a shutdown's stall of 591 ms on
        a slow disk held every other task of the node, Raft's and HA's included). After the
        queue cuts in flight: the queues close after this."""
        try:
            await self._cuts_done()
            await self.flush_in_background()
        except (StoreError, OSError) as e:
            log.error("dispatch: final flush at position %d failed: %s", self.position, e)

    def flush(self) -> bool:
        """CQs, then index, then the checkpoint (it may only describe durable data).
        False when there was nothing to flush or the checkpoint was not saved."""
        staged = self._stage_flush()
        return staged is not None and self._flushed(staged[0], self._sync(*staged))

    async def flush_in_background(self) -> bool:
        """flush(), its fsyncs and the checkpoint's write on a worker thread, as RocketMQ's
        FlushConsumeQueueService does: they took up to a few hundred ms behind another writer,
        and on the event loop that silenced Raft heartbeats and HA pushes (an election)."""
        staged = self._stage_flush()
        return staged is not None and self._flushed(staged[0], await asyncio.to_thread(self._sync, *staged))

    def _stage_flush(self) -> tuple[int, int, int] | None:
        """On the loop: what the flush covers; the index's buffered entries written out."""
        if self.flushed_position == self.position:
            return None
        if self.index is not None:
            self.index.write_out()
        return self.position, self._last_store_ts, self._cut_generation

    def _sync(self, position: int, store_ts: int, generation: int) -> bool:
        """fsync CQs and index, then save the checkpoint. May run on a worker thread: CQ
        appends and index builds go on beside it (SegmentedFile and IndexService lock out
        only closing a file); `_sync_lock` keeps two flushes (the loop's last one at stop)
        from writing the checkpoint at once. A flush staged before a rewind (cut_queues)
        saves no checkpoint: its position may lie past the cut."""
        with self._sync_lock:
            self.cq_store.flush_all()
            if self.index is not None:
                self.index.sync()
            if generation != self._cut_generation:
                return False
            return self._save_checkpoint(position, store_ts)

    def _save_checkpoint(self, position: int, store_ts: int | None) -> bool:
        """Under `_sync_lock`: the checkpoint at `position` (and `store_ts`, when given)."""
        cp = self.checkpoint
        cp.committed_offset = position
        if store_ts is not None:
            cp.logics_msg_timestamp = cp.index_msg_timestamp = store_ts
        try:
            cp.save()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            # write_atomic left the old checkpoint whole (temp file, then rename): recovery
            # starts a little earlier (a checkpoint past the log's end is clamped to it), nothing
            # is lost. Keep serving; the next flush retries.
            log.warning("checkpoint not saved at position %d: disk full (%s); retrying at the next flush",
                        position, e)
            return False
        return True

    def _flushed(self, position: int, ok: bool) -> bool:
        if ok:
            self.flushed_position = max(self.flushed_position, position)
        return ok

    # --- one batch ----------------------------------------------------------------------------
    def dispatch_once(self) -> int:
        """Dispatch one bounded batch from `position`; return the records dispatched."""
        assert self._cuts is None, "queue cuts in flight: dispatch with _dispatch_next"
        position = self.position
        return self._dispatch_scanned(position, *self._scan(position))

    async def _dispatch_next(self) -> int:
        """dispatch_once, with its read of old log bytes (a re-dispatch from far back after a
        restart) made by a cold-read worker, not on the loop (node/store/cold_reads.py).
        Not before the queue cuts in flight are durable (cut_queues)."""
        if self._cuts is not None:
            await self._cuts_done()
        position = self.position
        spans, next_position = await read_without_stalling(self._scan, position)
        if self.position != position:       # reset meanwhile (a truncation): scan again
            return 0
        try:
            return self._dispatch_scanned(position, spans, next_position, may_wait=False)
        except DiskWait as e:
            # A queue's or the index's new file would fsync its directory here, on the loop
            # (DeferredDirSync.off_loop_first): a worker does that first, and the batch is
            # dispatched again from `position`, as after a full disk (_disk_full).
            assert e.fetch is not None, e
            await fill(e.fetch)
            return 0

    def _dispatch_scanned(self, position: int, spans: Sequence[tuple[bytes, int, int, int]],
                          next_position: int, may_wait: bool = True) -> int:
        assert next_position > position or self.log.committed_position <= position, (
            f"log.scan made no progress at {position} below committed {self.log.committed_position}")
        try:
            n = self._dispatch_spans(spans, may_wait)
        except CorruptRecord as e:
            self.failed = e
            log.error("dispatch: corrupt record in the committed log, batch at position %d: %s; "
                      "dispatch stops here", position, e)
            raise
        self.position = next_position
        return n

    def _scan(self, position: int) -> tuple[Sequence[tuple[bytes, int, int, int]], int]:
        """`(buffer, start, physical_offset, size)` per committed record from `position`: the
        log's copy-free `scan_spans` when it has one, else its `scan` (the Protocol's)."""
        spans = getattr(self.log, "scan_spans", None)
        if spans is not None:
            return spans(position, self.batch_bytes)
        batch: ScanBatch = self.log.scan(position, self.batch_bytes)
        return [(r.data, 0, r.physical_offset, len(r.data)) for r in batch.records], batch.next_position

    def _dispatch_batch(self, batch: ScanBatch) -> int:
        """Dispatch the records of a `ScanBatch` (the Protocol's shape)."""
        return self._dispatch_spans([(r.data, 0, r.physical_offset, len(r.data)) for r in batch.records])

    def _dispatch_spans(self, spans: Sequence[tuple[bytes, int, int, int]], may_wait: bool = True) -> int:
        """Write the records' units and index entries (`may_wait=False`: DiskWait where a
        write would wait, before it changes anything a second try does not repair), then
        call the system records' handlers and wake the queues' listeners."""
        if may_wait:
            touched, calls = self._write_spans(spans)
        else:
            with no_disk_waits():
                touched, calls = self._write_spans(spans)
        for handler, data, phys in calls:
            self._call_handler(handler, data, phys)
        for cq in touched:
            self._notify(cq)
        self.dispatched_records += len(spans)
        return len(spans)

    def _write_spans(self, spans: Sequence[tuple[bytes, int, int, int]]
                     ) -> tuple[list[ConsumeQueue], list[tuple[SystemHandler, bytes, int]]]:
        """Each record `buf[at:at + size]`, read in place: its CQ unit joins its queue's run,
        its keys go to the index, a system record is queued for its handler (returned with
        the queues written). One loop with its names bound locally (every dispatched record
        passes here), one narrow header unpack per record."""
        runs: dict[tuple[bytes, int], _Run] = {}
        calls: list[tuple[SystemHandler, bytes, int]] = []
        unpack, head, props_len_of = _DISPATCH_FIELDS.unpack_from, _HEADER.size, _PROPS_LEN.unpack_from
        topics, props_cache, index = self._topics, self._props, self.index
        store_ts = None
        for buf, at, phys, size in spans:
            total, magic, queue_id, queue_offset, phys_field, sys_flag, store_ts, body_len = unpack(buf, at)
            if magic != _MAGIC or total != size or phys_field != phys:
                raise CorruptRecord(phys, f"header says magic {magic:#x} size {total} offset {phys_field}; "
                                          f"scan gave {size} bytes at {phys}")
            end = at + total
            p = at + head + body_len
            if body_len < 0 or p + 3 > end:
                raise CorruptRecord(phys, f"bad body length {body_len}")
            topic_end = p + 1 + buf[p]
            topic_b = buf[p + 1:topic_end]
            (props_len,) = props_len_of(buf, topic_end)
            if topic_end + 2 + props_len != end:
                raise CorruptRecord(phys, "record size does not match its fields")
            topic = topics.get(topic_b) or self._topic(topic_b)
            if props_len:
                raw = buf[topic_end + 2:end]
                facts = props_cache.get(raw) or self._props_facts(raw)
            else:
                facts = _NO_PROPS
            tx = sys_flag & _TX_MASK
            if tx != _TX_PREPARED and tx != _TX_ROLLBACK and phys >= topic.dead_below:
                if topic.is_schedule and facts[3]:
                    code = self.delivery_time(facts[3], store_ts)
                else:
                    code = facts[0]
                key = (topic_b, queue_id)
                run = runs.get(key)
                if run is not None and run.first + run.count == queue_offset:
                    run.fields += (phys, total, code)
                    run.count += 1
                else:
                    if run is not None:
                        self._write_run(run)     # out of order within a batch: write what we have
                    runs[key] = _Run(self._queue(topic, topic_b, queue_id), queue_offset, phys, total, code)
            if index is not None and tx != _TX_ROLLBACK and (facts[1] or facts[2]):
                index.build_index(topic.name, facts[1], facts[2], phys, store_ts)
            if topic.handler is not None:
                calls.append((topic.handler, buf[at:end], phys))
        if store_ts is not None:
            self._last_store_ts = store_ts
        touched = [self._write_run(run) for run in runs.values()]
        if index is not None:
            index.write_pending()
        return touched, calls

    def _props_facts(self, raw: bytes) -> tuple[int, str | None, str | None, str | None]:
        """(tags code, KEYS, UNIQ_KEY, DELAY) of encoded properties. Remembered (bounded) only
        when the record has no key: keyed properties are nearly always unique."""
        props = decode_properties(raw)
        tags = props.get(PROPERTY_TAGS)
        facts = (self._tags_code_of(tags) if tags else 0, props.get(PROPERTY_KEYS) or None,
                 props.get(PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX) or None, props.get(PROPERTY_DELAY_TIME_LEVEL) or None)
        if facts[1] is None and facts[2] is None and len(raw) <= _MAX_CACHED_PROPS_BYTES:
            if len(self._props) >= MAX_CACHED_NAMES:
                self._props.clear()
            self._props[raw] = facts
        return facts

    def _tags_code(self, topic: _Topic, props: dict[str, str], store_ts: int) -> int:
        """The CQ unit's tags code of a record of `topic` with `props` (see the module doc)."""
        if topic.is_schedule:
            level = props.get(PROPERTY_DELAY_TIME_LEVEL)
            if level:
                return self.delivery_time(level, store_ts)
        tags = props.get(PROPERTY_TAGS)
        return self._tags_code_of(tags) if tags else 0

    def _tags_code_of(self, tags: str) -> int:
        code = self._tags.get(tags)
        if code is None:
            if len(self._tags) >= MAX_CACHED_NAMES:
                self._tags.clear()
            code = self._tags[tags] = tags_code(tags)
        return code

    def delivery_time(self, level: str, store_ts: int) -> int:
        """store_ts + delay of `level` (clamped to the table), as RocketMQ computeDeliverTimestamp."""
        try:
            n = int(level)
        except ValueError:
            log.warning("dispatch: bad %s %r on a %s message; using its store time",
                        PROPERTY_DELAY_TIME_LEVEL, level, SCHEDULE_TOPIC)
            return store_ts
        if n <= 0 or not self.delay_levels_ms:
            return store_ts
        return store_ts + self.delay_levels_ms[min(n, len(self.delay_levels_ms)) - 1]

    def _topic(self, topic_b: bytes) -> _Topic:
        name = topic_b.decode("ascii", "replace")
        if len(self._topics) >= MAX_CACHED_NAMES:
            self._topics.clear()
            self._queues.clear()
        t = self._topics[topic_b] = _Topic(name, self.system_handlers.get(name), self.deleted.get(name, -1))
        return t

    def drop_topic(self, topic: str, below_phys: int) -> list[int]:
        """`topic` was deleted by the record at log position `below_phys`: its records below
        that position never get consume-queue units again (not on re-dispatch after a
        restart either, as long as the owner tells us before dispatching), the cached
        handles of its queues are closed and its consume queues removed. Returns the
        queue ids removed. Idempotent."""
        floor = self.log.min_physical_offset
        if len(self.deleted) >= MAX_CACHED_NAMES:   # positions the log no longer holds are moot
            self.deleted = {t: p for t, p in self.deleted.items() if p > floor}
        dead = max(below_phys, self.deleted.get(topic, -1))
        self.deleted[topic] = dead
        for t in self._topics.values():
            if t.name == topic:
                t.dead_below = dead
        for key in [k for k, cq in self._queues.items() if cq.topic == topic]:
            del self._queues[key]
        return self.cq_store.remove_topic(topic, below_phys)

    def _queue(self, topic: _Topic, topic_b: bytes, queue_id: int) -> ConsumeQueue:
        key = (topic_b, queue_id)
        cq = self._queues.get(key)
        if cq is None:
            cq = self._queues[key] = self.cq_store.find_or_create(topic.name, queue_id)
        return cq

    def _write_run(self, run: _Run) -> ConsumeQueue:
        run.cq.put_units(run.first, run.packed())
        return run.cq

    def _call_handler(self, handler: SystemHandler, data: bytes, phys: int) -> None:
        # A failing handler must not wedge dispatch for every other queue; it is logged
        # and counted (handler_errors), and the handler's owner can re-read from its CQ.
        msg = decode_record(data, 0, check_crc=False)
        try:
            handler(msg)
        except Exception:       # noqa: BLE001 - foreign code; logged with context, counted
            self.handler_errors += 1
            log.exception("dispatch: system handler for %s failed on the message at %d", msg.topic, phys)

    def _notify(self, cq: ConsumeQueue) -> None:
        if not self._listeners:
            return
        max_offset = cq.max_offset
        for cb in self._listeners:
            try:
                cb(cq.topic, cq.queue_id, max_offset)
            except Exception:   # noqa: BLE001 - a listener's bug must not stop dispatch
                log.exception("dispatch: listener %r failed for %s/%d", cb, cq.topic, cq.queue_id)

"""`LocalLog`: the standalone ReplicatedLog (one node, no replication).

Committed means durable under the flush policy:
- SYNC_FLUSH: a producer is acked after an fsync covers its records (group commit: one
  flusher fsyncs whatever is written and resolves every waiter it covers), and
  committed = flushed, so consumers never see bytes a crash could take back. An ack not
  covered within `sync_flush_timeout_ms` reports FLUSH_DISK_TIMEOUT (the data is written
  and will still be flushed; the producer just does not know it is durable).
- ASYNC_FLUSH: acked at once, committed = written, flushed every `flush_interval_ms`;
  a power loss can lose up to one interval of acked messages (RocketMQ's trade-off).
An fsync error is fatal (fsyncgate): the log refuses every later append and reports the
error in `status()`; the node is expected to exit and recover.

fsync runs in a worker thread so the event loop keeps accepting appends and timing out
waiters meanwhile. `_io_lock` keeps file structure (truncate, delete, close) away from a
flush in progress; plain appends inside the current file need no lock.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Sequence

from node.replicated_log import PutResult, PutStatus, ScanBatch
from node.store import abort
from node.store.commitlog import CommitLog
from node.store.disk_guard import DiskGuard
from node.store.errors import DiskFull, InvalidMessage, StoreFatal
from node.store.fileio import FileSystem
from node.store.message import MessageDraft, host_bytes
from node.store.queue_offsets import QueueOffsetTable
from node.store.recovery import RecoveryReport, recover
from node.store.reserve import DiskReserve
from node.store.retention import RetentionDecision, RetentionPolicy
from node.wakeup import Wakeup

log = logging.getLogger(__name__)

SYNC_FLUSH = "SYNC_FLUSH"
ASYNC_FLUSH = "ASYNC_FLUSH"


class LocalLogConfigError(InvalidMessage):
    code = "CONFIG_ERROR"


@dataclass(frozen=True, slots=True)
class LocalLogConfig:
    segment_size_bytes: int = 1 << 30           # mappedFileSizeCommitLog; a record must fit in one file
    flush_disk_type: str = ASYNC_FLUSH          # flushDiskType: SYNC_FLUSH acks after fsync
    flush_interval_ms: int = 500                # flushIntervalCommitLog: ASYNC_FLUSH fsync period
    sync_flush_timeout_ms: int = 5000           # syncFlushTimeout: then FLUSH_DISK_TIMEOUT
    store_ip: str = "127.0.0.1"                 # IPv4 stamped into STOREHOSTADDRESS and offsetMsgId
    store_port: int = 10911                     # listenPort stamped next to it
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    max_pending_sync_acks: int = 65_536         # appends awaiting an fsync; beyond, appenders wait
    refuse_check_interval_ms: int = 1000        # how stale the disk-usage ratio may be
    reserve_bytes: int = 0                      # diskReserveBytes (node/store/reserve.py); 0 = none

    def validate(self) -> None:
        if self.segment_size_bytes < 4096:
            raise LocalLogConfigError("segment_size_bytes must be >= 4096")
        if self.flush_disk_type not in (SYNC_FLUSH, ASYNC_FLUSH):
            raise LocalLogConfigError(f"flush_disk_type must be SYNC_FLUSH or ASYNC_FLUSH, "
                                      f"got {self.flush_disk_type!r}")
        if self.flush_interval_ms <= 0:
            raise LocalLogConfigError("flush_interval_ms must be > 0")
        if self.sync_flush_timeout_ms <= 0:
            raise LocalLogConfigError("sync_flush_timeout_ms must be > 0")
        if not 0 < self.store_port < 65536:
            raise LocalLogConfigError("store_port must be 1..65535")
        if self.max_pending_sync_acks <= 0:
            raise LocalLogConfigError("max_pending_sync_acks must be > 0")
        if self.reserve_bytes < 0:
            raise LocalLogConfigError("reserve_bytes must be >= 0")
        self.retention.validate()


class LocalLog:
    """Standalone ReplicatedLog over one CommitLog in `<store_root>/commitlog/`."""

    mode = "standalone"

    def __init__(self, fs: FileSystem, store_root: str, config: LocalLogConfig | None = None,
                 checkpoint_committed_offset: int | None = None):
        self.config = config or LocalLogConfig()
        self.config.validate()
        self.fs = fs
        self.store_root = store_root
        self.checkpoint_committed_offset = checkpoint_committed_offset
        self.commitlog = CommitLog(fs, os.path.join(store_root, "commitlog"), self.config.segment_size_bytes,
                                   host_bytes(self.config.store_ip), self.config.store_port)
        self.queue_offsets = QueueOffsetTable()
        self.recovery: RecoveryReport | None = None
        self.fatal: StoreFatal | None = None
        self._sync = self.config.flush_disk_type == SYNC_FLUSH
        self._committed = 0
        self._started = False
        self._stopping = False
        self._io_lock = asyncio.Lock()
        self._flush_wanted = asyncio.Event()
        # (end offset, future) per SYNC_FLUSH append, in offset order.
        self._acks: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self._grown = Wakeup()                      # fired when committed grows
        self._flusher: asyncio.Task | None = None
        self.disk = DiskGuard(fs, store_root, self.config.retention.disk_space_warning_level_ratio,
                              self.config.refuse_check_interval_ms)
        self.reserve = DiskReserve(fs, store_root, self.config.reserve_bytes)
        self.fsyncs = 0
        self.writes_held: str | None = None   # why appends are refused until init_queue_offsets

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        assert not self._started
        self.fs.makedirs(self.store_root)
        abnormal = abort.exists(self.fs, self.store_root)
        # The files opened and the recovery's walk (records read, CRCs checked) on a worker
        # thread: nothing else uses the commitlog yet, and the event loop stays free.
        await asyncio.to_thread(self.commitlog.load)
        self.recovery = await asyncio.to_thread(recover, self.commitlog, self.checkpoint_committed_offset, abnormal)
        # The first write of a start: on a disk full to the last block it takes the reserve's
        # room, and the writes after it (checkpoint, configs) have that room too.
        self.reserve.using(lambda: abort.create(self.fs, self.store_root), "the abort marker at start")
        self.reserve.ensure()
        self._committed = self.commitlog.max_offset
        self._started = True
        loop_fn = self._group_commit_loop if self._sync else self._periodic_flush_loop
        self._flusher = asyncio.get_running_loop().create_task(loop_fn(), name="commitlog-flusher")
        log.info("local log started", extra={"flush_disk_type": self.config.flush_disk_type,
                                             "committed": self._committed, "abnormal": abnormal})

    async def stop(self) -> None:
        """Flush, close and remove the abort marker (only if everything is durable)."""
        if not self._started:
            return
        self._stopping = True
        self._flush_wanted.set()
        if self._flusher is not None:
            # Not cancelled: a cancelled to_thread would leave an fsync running on files we close.
            await self._flusher
        async with self._io_lock:
            if self.fatal is None:
                try:
                    self._on_flushed(await asyncio.to_thread(self._flush_counted))
                except StoreFatal as e:
                    self._fail(e)
            self._fail_pending(StoreFatal("the log is stopping"))
            self.commitlog.close()
        if self.fatal is None:   # a clean stop; after a fatal error, keep it (its directory fsync on a worker)
            await asyncio.to_thread(abort.remove, self.fs, self.store_root)
        self._started = False
        log.info("local log stopped", extra={"committed": self._committed, "fatal": str(self.fatal or "")})

    def role(self) -> str:
        return "STANDALONE"

    def leader(self) -> str | None:
        return None

    def members(self) -> dict[str, str]:
        return {}

    def status(self) -> dict:
        return {
            "mode": self.mode, "role": self.role(), "flush_disk_type": self.config.flush_disk_type,
            "committed_offset": self._committed, "flushed_offset": self.commitlog.flushed_offset,
            "written_offset": self.commitlog.max_offset, "min_offset": self.commitlog.min_offset,
            "pending_sync_acks": len(self._acks), "fsyncs": self.fsyncs,
            "accepting_writes": self.fatal is None and self._started and not self._stopping and not self.writes_held,
            "writes_held": self.writes_held,
            "fatal_error": str(self.fatal) if self.fatal else None,
            "disk_usage_ratio": round(self.disk.last_ratio, 4),
        }

    # --- append ---------------------------------------------------------------------------
    async def append(self, drafts: Sequence[MessageDraft]) -> list[PutResult]:
        if not drafts:
            return []
        status, ts, placed = await self.append_packed(drafts)
        return [PutResult(status, p, s, q, ts) for p, s, q in placed]

    async def append_packed(self, drafts: Sequence[MessageDraft]) -> tuple[PutStatus, int, list[tuple[int, int, int]]]:
        """`append` without a result object per message: the batch's status and store time,
        and `(physical_offset, size, queue_offset)` per draft (the broker's batched path)."""
        if not drafts:
            return PutStatus.SEND_OK, int(time.time() * 1000), []
        self._check_writable()
        if self._sync:
            while len(self._acks) >= self.config.max_pending_sync_acks:  # bounded: wait for fsyncs
                await self._wait_growth(self.config.sync_flush_timeout_ms / 1000)
                self._check_writable()
        ts = int(time.time() * 1000)
        if self.commitlog.batch_may_roll(drafts):
            async with self._io_lock:   # a failed batch that rolled deletes a file: not under a flush
                self._check_writable()
                placed = self._write(drafts, ts)
        else:
            placed = self._write(drafts, ts)
        if not self._sync:
            self._set_committed(self.commitlog.max_offset)
            return PutStatus.SEND_OK, ts, placed
        return await self._await_flush(self.commitlog.max_offset), ts, placed

    def _check_writable(self) -> None:
        if self.fatal is not None:
            raise StoreFatal(f"the log stopped after a fatal error: {self.fatal}")
        if not self._started or self._stopping:
            raise StoreFatal("the log is not running")
        if self.writes_held is not None:
            raise DiskFull(self.writes_held)
        self.disk.check()

    def _write(self, drafts: Sequence[MessageDraft], ts: int) -> list[tuple[int, int, int]]:
        try:
            return self.commitlog.append_batch(drafts, self.queue_offsets, ts)
        except DiskFull:
            self.disk.recheck()   # look at the disk again before the next append
            raise
        except StoreFatal as e:
            self._fail(e)
            raise

    async def _await_flush(self, end: int) -> PutStatus:
        """Wait until an fsync covers `end` (SYNC_FLUSH); SEND_OK or FLUSH_DISK_TIMEOUT."""
        if self.commitlog.flushed_offset >= end:
            return PutStatus.SEND_OK
        if self.fatal is not None:   # the flusher is gone: nobody would ever resolve the ack
            raise StoreFatal(f"the log stopped after a fatal error: {self.fatal}")
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_retrieve)
        self._acks.append((end, fut))
        self._flush_wanted.set()
        try:
            async with asyncio.timeout(self.config.sync_flush_timeout_ms / 1000):   # woken in the next loop turn
                await fut
        except TimeoutError:
            log.warning("flush disk timeout", extra={"end": end, "flushed": self.commitlog.flushed_offset})
            return PutStatus.FLUSH_DISK_TIMEOUT
        return PutStatus.SEND_OK   # a failed fsync raised StoreFatal out of the await

    # --- flushing -------------------------------------------------------------------------
    def _flush_counted(self) -> int:
        """Runs in a worker thread. Counted so tests and status() can see group commit work."""
        before = self.commitlog.flushed_offset
        flushed = self.commitlog.flush()
        if flushed > before:
            self.fsyncs += 1
        return flushed

    async def _flush_once(self) -> None:
        async with self._io_lock:
            if self.fatal is not None:
                return
            try:
                flushed = await asyncio.to_thread(self._flush_counted)
            except StoreFatal as e:
                self._fail(e)
                return
        self._on_flushed(flushed)

    async def _group_commit_loop(self) -> None:
        """SYNC_FLUSH: fsync whatever is written whenever someone waits; one fsync serves all."""
        while self.fatal is None and not self._stopping:
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            while self.fatal is None and self._acks and self.commitlog.flushed_offset < self.commitlog.max_offset:
                await self._flush_once()
            if self._acks and self.fatal is None:
                self._on_flushed(self.commitlog.flushed_offset)

    async def _periodic_flush_loop(self) -> None:
        """ASYNC_FLUSH: fsync every flush_interval_ms."""
        while self.fatal is None and not self._stopping:
            try:   # asyncio.timeout, not wait_for: 3.11's wait_for can lose stop()'s cancel
                async with asyncio.timeout(self.config.flush_interval_ms / 1000):
                    await self._flush_wanted.wait()
            except TimeoutError:
                pass
            self._flush_wanted.clear()
            if self._stopping:
                return
            if self.commitlog.flushed_offset < self.commitlog.max_offset:
                await self._flush_once()

    def _on_flushed(self, flushed: int) -> None:
        acks = self._acks
        while acks and acks[0][0] <= flushed:
            _, fut = acks.popleft()
            if not fut.done():
                fut.set_result(flushed)
        if self._sync:
            self._set_committed(flushed)

    def _fail(self, error: StoreFatal) -> None:
        """Stop accepting writes for good; no pending producer is acked."""
        if self.fatal is None:
            self.fatal = error
            log.critical("commitlog fatal error: the node must exit", extra={"error": str(error)})
        self._fail_pending(error)

    def _fail_pending(self, error: StoreFatal) -> None:
        while self._acks:
            _, fut = self._acks.popleft()
            if not fut.done():
                fut.set_exception(error)
        self._flush_wanted.set()

    # --- committed position and reads -----------------------------------------------------
    def _set_committed(self, offset: int) -> None:
        if offset <= self._committed:
            return
        self._committed = offset
        self._grown.fire()

    async def _wait_growth(self, timeout_s: float) -> None:
        await self._grown.wait(timeout_s)

    # --- for a log built on top of this one (ha.HALog: a slave appends pushed bytes) ----------
    @property
    def io_lock(self) -> asyncio.Lock:
        """Held around segment structure changes (create, reset, truncate) and flushes."""
        return self._io_lock

    @property
    def sync_flush(self) -> bool:
        return self._sync

    async def flush_now(self) -> None:
        """fsync what is written (a failure sets `fatal`)."""
        await self._flush_once()

    def fail(self, error: StoreFatal) -> None:
        self._fail(error)

    def advance_committed(self, offset: int) -> None:
        """Raise the committed position (never lowers it) and wake waiters."""
        self._set_committed(offset)

    def rewind_committed(self, offset: int) -> None:
        """After a durable truncation to `offset`: nothing past it is committed any more."""
        if self._committed > offset:
            self._committed = offset

    @property
    def committed_position(self) -> int:
        return self._committed

    @property
    def min_position(self) -> int:
        return self.commitlog.min_offset

    @property
    def min_physical_offset(self) -> int:
        return self.commitlog.min_offset

    async def wait_committed(self, beyond_position: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self._committed <= beyond_position and self._started:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await self._wait_growth(left)
        return self._committed

    def scan(self, position: int, max_bytes: int) -> ScanBatch:
        # Framing only: everything below the committed offset was verified by recovery or
        # written by this process; the dispatcher checks each field it uses, readers
        # (pull, query) check the CRC when they decode.
        return self.commitlog.scan(position, max_bytes, limit=self._committed, verify=False)

    def scan_spans(self, position: int, max_bytes: int) -> tuple[list[tuple[bytes, int, int, int]], int]:
        """`scan` as `(chunk, start, physical_offset, size)` per record, no copy per record
        (the dispatcher's batched path); same framing checks."""
        return self.commitlog.scan_spans(position, max_bytes, limit=self._committed, verify=False)

    def read(self, physical_offset: int, size: int) -> bytes:
        if physical_offset + size > self._committed:
            raise KeyError(f"record at {physical_offset} (+{size}) is not committed "
                           f"(committed offset {self._committed})")
        return self.commitlog.read(physical_offset, size)

    # --- queue offsets --------------------------------------------------------------------
    def init_queue_offsets(self, table: dict[tuple[str, int], int]) -> None:
        """Set the next queue offset of every queue (after consume-queue recovery); appends
        held by `hold_writes` go on."""
        self.queue_offsets.load(table)
        self.writes_held = None

    def hold_writes(self, why: str) -> None:
        """Refuse appends (DiskFull, retriable) until `init_queue_offsets`: the broker started
        before its consume queues caught up with the log, so the next queue offsets are unknown."""
        self.writes_held = why

    def queue_offset_of(self, topic: str, queue_id: int) -> int:
        return self.queue_offsets.get(topic, queue_id)

    # --- retention ------------------------------------------------------------------------
    @property
    def disk_reserve(self) -> DiskReserve:
        return self.reserve

    async def retention_tick(self, now: datetime | None = None, manual: bool = False) -> RetentionDecision:
        """Delete expired head segments (the broker calls this every ~10 s; `manual`: at any hour)."""
        now = now or datetime.now()
        async with self._io_lock:   # never delete a file under a flush in progress
            self.disk.recheck()
            ratio = self.disk.ratio()
            safe = min(self._committed, self.commitlog.flushed_offset)
            decision = self.commitlog.delete_expired(self.config.retention, now, ratio, safe_upto=safe, manual=manual)
        if decision.delete_bases:
            self.reserve.ensure(freed=True)   # put back from the room the deletion made
        return decision


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a failed ack as seen: a producer that timed out no longer awaits it."""
    if not fut.cancelled():
        fut.exception()

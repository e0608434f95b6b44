"""`HALog`: the ReplicatedLog of classic master/slave mode (mode "classic").

It composes a `LocalLog` (the local write path: commitlog, recovery, flush policy, group
commit) and adds the replication rule on top:

- MASTER: appends go through LocalLog; ASYNC_MASTER acks at once, SYNC_MASTER waits for a
  slave ack past the batch end (FLUSH_SLAVE_TIMEOUT after 5 s; SLAVE_NOT_AVAILABLE at once
  when no slave is within 256 MiB). committed = LocalLog's committed (written, or flushed
  under SYNC_FLUSH): consumers of a master see a message once it is stored locally, as in
  RocketMQ's classic mode; see `status()["sync_master"]`.
- SLAVE: `append` raises NotLeader(leader=master API address). Pushed bytes are appended raw
  at exactly their offset; committed = the end of the last complete record received (and
  fsynced under SYNC_FLUSH), so the slave's dispatcher builds its own consume queues and
  never sees half a record.
- Role changes (controller): slave -> master drops any half-received record, appends
  <epoch, max offset> to the epoch file, then accepts writes; master -> slave stops writes
  at once, then the HA client reconciles with the new master's epochs and truncates
  durably (commitlog zeroed + fsynced, epoch file rewritten atomically, queue offsets
  rewound, truncate listeners told) before it reports any offset.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from ha.epoch import EpochEntry, EpochFile, find_consistent_point, with_ends
from ha.protocol import HAProtocolError
from ha.replication import HAServiceCore, HATimings, PushVerdict, WaitState
from ha.shell import HAClient, HAService, now_ms
from node.local_log import LocalLog, LocalLogConfig
from node.replicated_log import PutResult, PutStatus, ScanBatch
from node.store import layout as L
from node.store.errors import CorruptRecord, DiskFull, NotLeader, StoreFatal, is_enospc
from node.store.fileio import FileSystem
from node.store.message import MessageDraft
from node.wakeup import Wakeup

log = logging.getLogger(__name__)

MASTER = "MASTER"
SLAVE = "SLAVE"
SLAVE_DISPATCH_LINGER_S = 0.001       # a slave dispatches what 1 ms of pushes brought, as one batch
_MAX_RECORDS_PER_ADVANCE = 100_000      # boundary tracking work per call; the rest waits for the next batch
_TRUNCATE_SCAN_BYTES = 4 * 1024 * 1024  # chunk when reading a tail about to be truncated
_ADVANCE_CHUNK_BYTES = 1024 * 1024      # slave: bytes read per pread when walking received records
MAX_GROUP_BROKERS = 64                  # brokers of the group kept from the controller's list (members())
_H = L.MESSAGE_FIELD_OFFSET
_TX_SKIPPED = (L.SYSFLAG_TRANSACTION_PREPARED_TYPE, L.SYSFLAG_TRANSACTION_ROLLBACK_TYPE)


@dataclass(frozen=True, slots=True)
class HALogConfig:
    broker_id: int = 0                      # brokerId; the slave announces it in the HA handshake
    initial_role: str = MASTER              # MASTER | SLAVE (brokerRole); with a controller: SLAVE until told
    sync_master: bool = False               # SYNC_MASTER rule while this broker is master
    controller_mode: bool = False           # roles come from the controller (controllerAddr set)
    ha_listen_host: str = "0.0.0.0"
    ha_listen_port: int = 10912             # haListenPort (0 = any free port, for tests)
    ha_master_address: str = ""             # haMasterAddress: static slave's master HA host:port
    master_api_address: str | None = None   # static slave: the master's API address (NotLeader hint)
    self_api_address: str = ""              # this broker's API host:port (leader() when master)
    self_ha_address: str = ""               # this broker's advertised HA host:port (for the controller)
    election_priority: int = 0              # lower is preferred by the controller
    all_ack_in_sync_state_set: bool = False  # allAckInSyncStateSet
    min_in_sync_replicas: int = 1           # minInSyncReplicas (with all_ack_in_sync_state_set)
    controller_addrs: tuple[str, ...] = ()  # controllerAddr: heartbeat these (roles then come from them)
    group: str = ""                         # brokerName, as the controller knows the group
    # Controller mode: a master that has not heard the leader controller confirm it for this
    # long stops writing and steps down. Keep it below the controller's heartbeat timeout
    # (3 s by default) so a partitioned master stops before a new one can be elected.
    controller_lease_ms: int = 2_000
    timings: HATimings = field(default_factory=HATimings)
    # Cluster secret and TLS for the HA port and controller calls (node.peer_auth.PeerSecurity); None = off.
    security: object = field(default=None, compare=False)

    def validate(self) -> None:
        if self.initial_role not in (MASTER, SLAVE):
            raise ValueError(f"HALogConfig.initial_role must be MASTER or SLAVE, got {self.initial_role!r}")
        if self.initial_role == SLAVE and not self.controller_mode and not self.ha_master_address:
            raise ValueError("HALogConfig.ha_master_address is required for a slave without a controller")
        if self.min_in_sync_replicas < 1:
            raise ValueError("HALogConfig.min_in_sync_replicas must be >= 1")
        if self.controller_lease_ms <= 0:
            raise ValueError("HALogConfig.controller_lease_ms must be > 0")
        self.timings.validate()


class HALog:
    """Classic HA ReplicatedLog over a LocalLog in `<store_root>/commitlog/`."""

    mode = "classic"

    def __init__(self, fs: FileSystem, store_root: str, local_config: LocalLogConfig, config: HALogConfig,
                 checkpoint_committed_offset: int | None = None):
        config.validate()
        self.cfg = config
        self.fs = fs
        self.local = LocalLog(fs, store_root, local_config, checkpoint_committed_offset)
        self.commitlog = self.local.commitlog
        self.segment_size = self.commitlog.segment_size
        self.epochs = EpochFile(fs, store_root)
        # Once started, the epoch file changes only on this one thread (_epochs_write).
        self._epoch_io: ThreadPoolExecutor | None = None
        self.core = HAServiceCore(master_id=config.broker_id, timings=config.timings,
                                  all_ack_in_sync_state_set=config.all_ack_in_sync_state_set,
                                  min_in_sync_replicas=config.min_in_sync_replicas)
        self._role = SLAVE if config.controller_mode else config.initial_role
        self._accepting = False
        self.epoch = 0                          # master epoch we last acted on (controller mode)
        self._master_api = config.master_api_address
        self._group_apis: dict[int, str] = {}   # controller mode: brokerId -> API address, as the controller knows them
        self.service: HAService | None = None
        self.client: HAClient | None = None
        self._boundary = 0                      # slave: end of the last complete record received
        self._slave_committed = 0               # slave: committed position (boundary, flushed if SYNC_FLUSH)
        self._pending_epochs: list[EpochEntry] = []   # slave: master epochs whose bytes have not arrived yet
        # SYNC_MASTER waiters: (end offset, sequence, future), a heap by end offset.
        self._waiters: list[tuple[int, int, asyncio.Future]] = []
        self._waiter_seq = itertools.count()
        self._grown = Wakeup()                 # fired when the slave's committed position grows
        self._role_lock = asyncio.Lock()
        self._truncation: asyncio.Task | None = None   # the last truncation asked (_truncate)
        # e.g. consume queues; an awaitable returned is awaited before the truncation returns
        self.truncate_listeners: list[Callable[[int], Awaitable[None] | None]] = []
        # Told the new first offset when the slave's log restarts further on (an empty slave starting
        # at the master's last segment; a slave below the master's retention): dispatch jumps there.
        self.reset_listeners: list[Callable[[int], None]] = []
        self.controller_client = None           # ha.controller_server.ControllerClient when controller_addrs
        self._lease_ms = -1                     # monotonic ms of the leader controller's last confirmation
        self._lease_task: asyncio.Task | None = None
        self.step_downs = 0                     # times this master stopped writing after losing the controller
        self._report_seq = 0                    # heartbeats of this promotion (core.session)
        self._lease_warned = False              # the lease-vs-controller-timeout warning was logged
        self._started = False

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.local.start()
        self._epoch_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epoch-file")
        self.epochs.load()
        # A crash between a commitlog truncation and the epoch file's rewrite leaves epochs past the end.
        self.epochs.drop_beyond(self.commitlog.max_offset)
        self.epoch = self.epochs.last_epoch
        self._boundary = self._slave_committed = self.commitlog.max_offset
        self._started = True
        if self._role == MASTER:
            self.core.become_master(self.commitlog.max_offset)
            await self._start_master()
        elif self.cfg.ha_master_address and not self.cfg.controller_mode:
            self._start_client(self.cfg.ha_master_address)
        if self.cfg.controller_addrs:
            from ha.controller_server import ControllerClient   # aiohttp client: only with a controller
            self.controller_client = ControllerClient(list(self.cfg.controller_addrs),
                                                      lambda: self.controller_heartbeat(self.cfg.group),
                                                      self.on_controller_reply, security=self.cfg.security)
            self.controller_client.start()
            self._lease_task = asyncio.get_running_loop().create_task(self._lease_loop(), name="ha-lease")
        log.info("HA log started as %s", self._role, extra={"max_offset": self.commitlog.max_offset,
                                                           "epoch": self.epochs.last_epoch})

    async def stop(self) -> None:
        self._accepting = False
        if self._lease_task is not None:
            self._lease_task.cancel()
            await asyncio.gather(self._lease_task, return_exceptions=True)
            self._lease_task = None
        if self.controller_client is not None:
            await self.controller_client.stop()
            self.controller_client = None
        await self._stop_service()
        await self._stop_client()
        if self._epoch_io is not None:
            await asyncio.to_thread(self._epoch_io.shutdown)   # the writes asked land first
            self._epoch_io = None
        await self.local.stop()
        self._started = False

    @property
    def fatal(self) -> StoreFatal | None:
        return self.local.fatal

    def role(self) -> str:
        """The role this broker serves in, as /health, /cluster and clients see it: MASTER only
        once writes are accepted. A master being promoted (its epoch not yet written, writes
        answered NOT_LEADER) or stopping still says SLAVE, so whoever sees MASTER can write."""
        return MASTER if self._role == MASTER and self._accepting else SLAVE

    @property
    def dispatch_linger_s(self) -> float:
        """A slave commits per received push (<= 32 KiB): its dispatcher gathers a few (see
        node/store/dispatcher.py LINGER_BELOW_BYTES). A master's commits are its producers'."""
        return 0.0 if self._role == MASTER else SLAVE_DISPATCH_LINGER_S

    def leader(self) -> str | None:
        return (self.cfg.self_api_address or None) if self._role == MASTER else self._master_api

    def members(self) -> dict[str, str]:
        """The group's brokers as the controller last listed them (nothing without a controller)."""
        return {f"{self.cfg.group}-{b}": a for b, a in sorted(self._group_apis.items())}

    def status(self) -> dict:
        st = dict(self.local.status())
        st.update(mode=self.mode, role=self.role(), committed_offset=self.committed_position,
                  accepting_writes=self._accepting and st.get("accepting_writes", False),
                  sync_master=self.cfg.sync_master, master_epoch=self.epoch, epochs=self._epoch_pairs(),
                  leader=self.leader(), ha_slave_ack_offset=self.core.best_ack())
        if self._role == MASTER and self.core.slaves:
            st["ha_lag_bytes"] = self.commitlog.max_offset - self.core.best_ack()
        if self.service is not None:
            st["ha_connections"] = self.service.status()
        if self.client is not None:
            st["ha_client"] = self.client.status()
        st["ha_runtime"] = self.ha_runtime_info()
        return st

    def ha_runtime_info(self) -> dict:
        """RocketMQ HARuntimeInfo: what `mqstore haStatus` prints."""
        if self._role == MASTER:
            conns = self.service.status() if self.service is not None else []
            return {"master": True, "master_addr": self.cfg.self_api_address,
                    "master_commit_log_max_offset": self.commitlog.max_offset, "slave_num": len(conns),
                    "in_sync_slave_num": sum(1 for c in conns if c["in_sync"]), "ha_connection_info": conns}
        client = self.client.status() if self.client is not None else {}
        return {"master": False, "master_addr": self._master_api or "", "master_ha_addr": client.get("master_ha_addr", ""),
                "connected": client.get("connected", False), "max_offset": self.commitlog.max_offset,
                "committed_offset": self._slave_committed,
                "transferred_bytes_per_s": client.get("transferred_bytes_per_s", 0.0),
                "last_read_ms": client.get("last_read_ms", 0), "last_write_ms": client.get("last_write_ms", 0),
                "master_offset_seen": client.get("master_offset_seen", -1)}

    def _epoch_pairs(self) -> list[tuple[int, int]]:
        return [(e.epoch, e.start_offset) for e in self.epochs.entries]

    # --- master: append ------------------------------------------------------------------------
    async def _check_master(self) -> None:
        if self._lease_expired():
            await self._step_down()
        if self._role != MASTER or not self._accepting:
            raise NotLeader(f"broker {self.cfg.broker_id} is a {self._role.lower()}, not accepting writes",
                            leader=self.leader() if self._role != MASTER else None)

    async def append_packed(self, drafts: Sequence[MessageDraft]) -> tuple[PutStatus, int, list[tuple[int, int, int]]]:
        """`append` without a result object per message (the broker's batched path, as
        LocalLog.append_packed): one status and store time for the batch, `(physical_offset,
        size, queue_offset)` per draft. SYNC_MASTER waits once, for the batch end."""
        await self._check_master()
        status, ts, placed = await self.local.append_packed(drafts)
        if self.service is not None:
            self.service.notify_append()
        if not self.cfg.sync_master or not placed:
            return status, ts, placed
        phys, size, _ = placed[-1]              # records are placed in order: the last one ends the batch
        slaves = await self._wait_slaves(phys + size)
        return (slaves if status is PutStatus.SEND_OK else status), ts, placed

    async def append(self, drafts: Sequence[MessageDraft]) -> list[PutResult]:
        await self._check_master()
        results = await self.local.append(drafts)
        if self.service is not None:
            self.service.notify_append()
        if not self.cfg.sync_master or not results:
            return results
        end = max(r.physical_offset + r.size for r in results)
        status = await self._wait_slaves(end)
        if status is PutStatus.SEND_OK:
            return results
        return [dataclasses.replace(r, status=status) if r.status is PutStatus.SEND_OK else r for r in results]

    async def _wait_slaves(self, end: int) -> PutStatus:
        """SYNC_MASTER: wait (bounded by the slave ack timeout) for a slave ack past `end`.

        Waiters sit in a heap by end offset; `_release_waiters` (after each batch of slave
        reports) pops only those the acks now cover, so the ack path never walks the others."""
        ticket = self.core.begin(end, now_ms())
        deadline = time.monotonic() + self.cfg.timings.slave_ack_timeout_ms / 1000
        loop = asyncio.get_running_loop()
        while ticket.state is WaitState.WAITING:
            fut = loop.create_future()
            entry = (end, next(self._waiter_seq), fut)
            heapq.heappush(self._waiters, entry)
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await fut
            except TimeoutError:
                pass
            finally:
                if not fut.done() or fut.cancelled():   # timed out or cancelled: still in the heap
                    self._drop_waiter(entry)
            self.core.check(ticket, now_ms())
        if ticket.state is not WaitState.ACKED:
            log.warning("SYNC_MASTER: %s for end offset %d (best slave ack %d)", ticket.state.value, end,
                        self.core.best_ack())
        return {WaitState.ACKED: PutStatus.SEND_OK, WaitState.FLUSH_SLAVE_TIMEOUT: PutStatus.FLUSH_SLAVE_TIMEOUT,
                WaitState.SLAVE_NOT_AVAILABLE: PutStatus.SLAVE_NOT_AVAILABLE}[ticket.state]

    def _release_waiters(self) -> None:
        """Wake the SYNC_MASTER waiters whose end offset the slave acks now cover (heap order)."""
        waiters = self._waiters
        if not waiters:
            return
        covered = self.core.covered_offset()
        while waiters and waiters[0][0] <= covered:
            fut = heapq.heappop(waiters)[2]
            if not fut.done():
                fut.set_result(None)

    def _wake_all_waiters(self) -> None:
        """Every waiter re-checks now (role change, service stop); those still waiting re-enter."""
        waiters, self._waiters = self._waiters, []
        for _, _, fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _drop_waiter(self, entry: tuple) -> None:
        try:
            self._waiters.remove(entry)
        except ValueError:
            return
        heapq.heapify(self._waiters)

    # --- MasterSource (for HAService) ---------------------------------------------------------
    def ha_max_offset(self) -> int:
        return self.commitlog.max_offset

    def ha_min_offset(self) -> int:
        return self.commitlog.min_offset

    def ha_read(self, offset: int, size: int) -> bytes:
        return self.commitlog.files.read(offset, size)

    def ha_epochs(self) -> list[tuple[int, int]]:
        return self._epoch_pairs()

    # --- SlaveSink (for HAClient) ---------------------------------------------------------------
    async def ha_append(self, verdict: PushVerdict, offset: int, data: bytes) -> None:
        """Append pushed bytes at exactly `offset` (the slave's max offset, or a reset point)."""
        if self._role != SLAVE:
            raise HAProtocolError("not a slave any more")
        if verdict is PushVerdict.RESET_AND_APPEND:
            await self._reset_to(offset)
        await self._append_raw(offset, data)

    async def _append_raw(self, offset: int, data: bytes) -> None:
        files = self.commitlog.files
        assert offset == self.commitlog.max_offset, "the HA client checks the offset before appending"
        seg = files.last()
        if seg is None or seg.remaining == 0:
            async with self.local.io_lock:   # creating a file is structure: not under a flush in progress
                try:
                    seg = files.ensure_writable(offset)
                except OSError as e:
                    if not is_enospc(e):
                        raise
                    raise DiskFull(f"slave disk full creating the file at {offset} (ENOSPC); "
                                   f"replication resumes from there once space returns") from e
        if seg.end != offset or len(data) > seg.remaining:
            # The master never sends bytes across a segment: this is a peer with another segment size.
            raise HAProtocolError(f"push [{offset}, +{len(data)}) does not fit segment at {seg.base} "
                                  f"(mappedFileSizeCommitLog must match the master's)")
        try:
            seg.append(data)
        except OSError as e:
            if is_enospc(e):
                # A full disk pauses replication instead of stopping the node (as the master's
                # own appends): what landed is cut away, durably, the link drops and the client
                # asks for the same bytes again from `offset` after its backoff.
                async with self.local.io_lock:
                    files.truncate(offset)
                raise DiskFull(f"slave disk full writing {len(data)} bytes at {offset} (ENOSPC); "
                               f"replication resumes from there once space returns") from e
            self.local.fail(StoreFatal(f"slave append failed: {e}"))
            raise StoreFatal(f"slave append failed: {e}") from e

    async def _reset_to(self, offset: int) -> None:
        """An empty slave starts its log where the master starts sending (its last segment's base)."""
        assert self.commitlog.max_offset == 0 or self.commitlog.max_offset == self.commitlog.min_offset
        await self._restart_files(offset)
        self._boundary = self._slave_committed = offset
        for listener in list(self.reset_listeners):
            listener(offset)
        log.info("slave log starts at the master's offset %d", offset)

    async def _restart_files(self, offset: int) -> None:
        """An empty log's files restarted at `offset`: the removals and the new file, each
        durable, on a worker thread (no reader needs the old ones: the log is empty)."""
        files = self.commitlog.files
        async with self.local.io_lock:
            seg = await asyncio.to_thread(files.prepare_reset, offset)
            files.commit_reset(seg, offset)

    async def ha_after_batch(self) -> None:
        """After each read from the master, before the report: fsync under SYNC_FLUSH."""
        if self.local.sync_flush:
            await self.local.flush_now()
            if self.local.fatal is not None:
                raise self.local.fatal

    async def ha_settle(self) -> None:
        """Before the report: advance the committed boundary over the complete records received
        (flushed ones under SYNC_FLUSH; each record's framing checked) and adopt the epochs they
        start."""
        limit = self.commitlog.flushed_offset if self.local.sync_flush else self.commitlog.max_offset
        self._advance_boundary(limit)
        if self._pending_epochs and self.commitlog.max_offset > self._pending_epochs[0].start_offset:
            await self._adopt_pending_epochs()

    def _advance_boundary(self, limit: int) -> None:
        """Move the boundary over complete records below `limit`, keeping queue offsets current.

        Reads the new bytes in large chunks (one pread per chunk, never across a segment) and
        walks the record headers in memory; queue offsets are gathered per queue and written to
        the table once per call."""
        b = self._boundary
        highest: dict[tuple[bytes, int], int] = {}
        budget = _MAX_RECORDS_PER_ADVANCE
        size = _ADVANCE_CHUNK_BYTES
        while b + L.BLANK.size <= limit and budget > 0:
            buf = self.commitlog.files.read(b, min(limit - b, size))
            if len(buf) < L.BLANK.size:
                raise CorruptRecord(b, "slave log has a hole where a record should start")
            used, need, budget = self._walk_records(buf, b, limit, highest, budget)
            if used:
                b, size = b + used, _ADVANCE_CHUNK_BYTES
            elif need > len(buf) and b + need <= limit:
                size = need     # one record larger than a chunk: read it whole
            else:
                break           # not one complete record more below `limit`
        if highest:
            table = self.local.queue_offsets
            for (raw, queue_id), nxt in highest.items():
                topic = raw.decode("ascii", "replace")
                if nxt > table.get(topic, queue_id):
                    table.set(topic, queue_id, nxt)
        if b > self._boundary:
            self._boundary = b
            self._slave_committed = b
            self.local.advance_committed(b)   # keeps LocalLog's retention bound (safe_upto) moving
            self._grown.fire()

    def _walk_records(self, buf: bytes, base: int, limit: int, highest: dict[tuple[bytes, int], int],
                      budget: int) -> tuple[int, int, int]:
        """Complete records at the start of `buf` (read at `base`): (bytes they span, size of the
        first record that is not complete in `buf` or 0, budget left)."""
        seg_size, n, i = self.segment_size, len(buf), 0
        # Names bound once: every record a slave receives passes through this loop.
        blank_size, unpack_blank, blank_magic, msg_magic, overhead = \
            L.BLANK.size, L.BLANK.unpack_from, L.BLANK_MAGIC, L.MESSAGE_MAGIC, L.MESSAGE_OVERHEAD
        unpack_queue, qid_at, topic_at, tx_mask = \
            L.MESSAGE_QUEUE_FIELDS.unpack_from, _H["queue_id"], L.MESSAGE_HEADER.size, L.SYSFLAG_TRANSACTION_MASK
        tx_prepared, tx_rollback = _TX_SKIPPED
        get = highest.get
        while i + blank_size <= n and budget > 0:
            total, magic = unpack_blank(buf, i)
            if magic == blank_magic:
                if total != seg_size - (base + i) % seg_size:
                    raise CorruptRecord(base + i, f"slave received a blank of {total} bytes that misses the file end")
                if base + i + total > limit:
                    return i, 0, budget
                return i + total, 0, budget    # the file ends here; the next read starts the next file
            if magic != msg_magic or total < overhead:
                raise CorruptRecord(base + i, f"slave received a bad record header (magic {magic:#x}, size {total})")
            if i + total > n:
                return i, total, budget
            # The record takes its queue offset: remember the next one, keyed by (topic bytes, queue id).
            queue_id, queue_offset, sys_flag, body_len = unpack_queue(buf, i + qid_at)
            tx = sys_flag & tx_mask
            if queue_offset >= 0 and tx != tx_prepared and tx != tx_rollback:
                t = i + topic_at + body_len
                key = (buf[t + 1:t + 1 + buf[t]], queue_id)
                if queue_offset >= get(key, -1):
                    highest[key] = queue_offset + 1
            budget -= 1
            i += total
        return i, 0, budget

    async def _adopt_pending_epochs(self) -> None:
        """Record a master epoch in our own file once we hold bytes from it (so elections see it)."""
        due = [e for e in self._pending_epochs if e.start_offset < self.commitlog.max_offset]
        await self._epochs_write(self._append_epochs, due)
        del self._pending_epochs[:len(due)]

    def _append_epochs(self, entries: list[EpochEntry]) -> None:
        for e in entries:
            self.epochs.append(e.epoch, e.start_offset)

    async def _epochs_write(self, change: Callable[..., None], *args) -> None:
        """A change of the epoch file (each write two fsyncs: the file, its directory) on its own
        worker thread: off the event loop, where one took 256 ms behind another writer, and one
        at a time in the order asked. Shielded: a change whose caller is cancelled (a slave
        session ended by a promotion) still lands, before the promotion's own."""
        assert self._epoch_io is not None, "start() first"
        await asyncio.shield(asyncio.get_running_loop().run_in_executor(self._epoch_io, change, *args))

    async def ha_reconcile(self, master_epochs: list[tuple[int, int]], master_max: int, master_min: int = 0) -> None:
        """Before the first report to a master: truncate (durably) to where our logs agree."""
        if self._role != SLAVE:
            raise HAProtocolError("not a slave any more")
        theirs = [EpochEntry(e, s) for e, s in master_epochs]
        local_max = self.commitlog.max_offset
        point = self._consistent_point(theirs, master_max)
        if point < local_max:
            log.warning("slave truncating its tail: %d -> %d (master max %d)", local_max, point, master_max)
            await self.truncate(point)
        if 0 < self.commitlog.max_offset < master_min:
            await self._restart_at(master_min)
        mine = [e for e in theirs if e.start_offset < self.commitlog.max_offset]
        if mine and [(e.epoch, e.start_offset) for e in mine] != self._epoch_pairs()[:len(mine)]:
            await self._epochs_write(self.epochs.replace, mine)
        elif not mine and self.epochs.entries and theirs:
            await self._epochs_write(self.epochs.replace, [])
        self._pending_epochs = [e for e in theirs if e.start_offset >= self.commitlog.max_offset]

    async def _restart_at(self, master_min: int) -> None:
        """The master no longer keeps the bytes we need next (retention): drop our log and
        start again at the master's first retained segment. Consume queues are cut by the
        truncate listeners; the messages in between are gone from this replica."""
        log.error("slave at %d is below the master's first retained offset %d: restarting its log there",
                  self.commitlog.max_offset, master_min)
        await self.truncate(self.commitlog.min_offset)
        await self._restart_files(master_min)
        self._boundary = self._slave_committed = master_min
        for listener in list(self.reset_listeners):
            listener(master_min)
        self.local.rewind_committed(master_min)
        self.local.advance_committed(master_min)

    def _consistent_point(self, theirs: list[EpochEntry], master_max: int) -> int:
        local_max = self.commitlog.max_offset
        if not theirs or not self.epochs.entries:
            # No history on one side (static classic mode, or a fresh slave): the master's end bounds us.
            return min(local_max, master_max)
        point = find_consistent_point(self.epochs.with_ends(local_max), with_ends(theirs, master_max))
        if point < 0:
            log.error("slave shares no epoch with the master: dropping its whole log",
                      extra={"local": self._epoch_pairs(), "master": [(e.epoch, e.start_offset) for e in theirs]})
            return self.commitlog.min_offset
        return min(point, local_max)

    # --- truncation -----------------------------------------------------------------------------
    async def truncate(self, offset: int) -> None:
        """Durably drop every byte at or past `offset`: commitlog, epochs, queue offsets, listeners."""
        assert self._role == SLAVE, "only a slave truncates (a master's tail is the truth)"
        await self._truncate(offset)

    async def _truncate(self, offset: int) -> None:
        """The file work (the tail's scan for its queue offsets, the zeroing, the fsyncs, the
        removals) runs on worker threads: an old master's tail may be hundreds of MB, and each
        fsync took up to 0.3 s on a busy disk, on the event loop that serves the node. Readers
        stop at `offset` first (committed is lowered before anything is cut); nothing appends
        meanwhile (the caller holds the role: no HA session is reporting), and `io_lock` keeps
        a flush and retention's deletions away.

        The work is one task, shielded: a caller cancelled meanwhile (a session ended by a
        promotion) leaves it to finish, and a role change waits for it (_stop_client), so it
        is never half done when the next role starts, nor its epoch write after that role's."""
        offset = max(offset, self.commitlog.min_offset)
        self._boundary = min(self._boundary, offset)
        self._slave_committed = min(self._slave_committed, offset)
        self.local.rewind_committed(offset)
        before = self._truncation
        task = asyncio.get_running_loop().create_task(self._truncate_durably(before, offset), name="ha-truncate")
        self._truncation = task
        await asyncio.shield(task)

    async def _truncate_durably(self, before: asyncio.Task | None, offset: int) -> None:
        if before is not None:
            await asyncio.wait([before])
        try:
            async with self.local.io_lock:
                rewind = await asyncio.to_thread(self._tail_queue_offsets, offset)
                tail = self.commitlog.detach_tail(offset)
                report = await asyncio.to_thread(tail.make_durable)  # before anything goes on (RocketMQ #10666)
        except StoreFatal as e:
            self.local.fail(e)
            raise
        for (topic, qid), first in rewind.items():
            if first < self.local.queue_offsets.get(topic, qid):
                self.local.queue_offsets.set(topic, qid, first)
        settled = [asyncio.ensure_future(w) for w in (listener(offset) for listener in list(self.truncate_listeners))
                   if w is not None]
        # After the state above, with no await between (a crash before this write leaves epochs
        # past the log's end, which start() drops).
        await self._epochs_write(self.epochs.truncate_suffix, offset)
        for wait in settled:
            await wait
        log.warning("truncated commitlog to %d", offset, extra={"zeroed_bytes": report.zeroed_bytes,
                                                                "removed_files": report.removed_files})

    async def _truncation_done(self) -> None:
        """Wait for a truncation in flight (one whose caller was cancelled); its error was the caller's."""
        task = self._truncation
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
            if self._truncation is task:
                self._truncation = None

    def _tail_queue_offsets(self, offset: int) -> dict[tuple[str, int], int]:
        """First queue offset per queue among the records about to be truncated."""
        out: dict[tuple[str, int], int] = {}
        pos, end = offset, self.commitlog.max_offset
        for _ in range(1 + (end - offset) // L.MESSAGE_OVERHEAD):   # bounded: every pass advances
            if pos >= end:
                break
            try:
                batch = self.commitlog.scan(pos, _TRUNCATE_SCAN_BYTES, check_crc=False)
            except (CorruptRecord, KeyError):
                break   # a half-received record at the end: nothing after it was dispatched
            if not batch.records:
                break
            for rec in batch.records:
                f = L.MESSAGE_HEADER.unpack_from(rec.data, 0)
                body_len = f[16]
                tlen = rec.data[L.MESSAGE_HEADER.size + body_len]
                topic = rec.data[L.MESSAGE_HEADER.size + body_len + 1:][:tlen].decode("ascii", "replace")
                if f[5] >= 0:
                    key = (topic, f[3])
                    out[key] = min(out.get(key, f[5]), f[5])
            pos = batch.next_position
        return out

    # --- role changes ---------------------------------------------------------------------------
    async def become_master(self, epoch: int = 0) -> None:
        """Promotion: drop a half-received record, record the epoch, then accept writes."""
        async with self._role_lock:
            if self._role == MASTER and self._accepting and epoch <= self.epoch:
                return      # (a promotion that failed half-way is taken again)
            was = self._role
            self._role = MASTER   # no push is applied from here on (ha_append checks the role)
            # Reported with the role from here on: the controller gave this epoch to this broker, and
            # the old epoch beside MASTER would claim a term another master held (a claim check's
            # "two masters at one epoch") while the steps below await.
            self.epoch = max(self.epoch, epoch)
            await self._stop_client()
            if was == SLAVE and self.commitlog.max_offset > self._boundary:
                await self._truncate(self._boundary)   # half a record from the old master
            self.local.advance_committed(self.commitlog.max_offset)
            # The session is newer than any before it, in this process or an earlier one.
            session = max(time.time_ns() // 1000, self.core.session + 1)
            self.core.become_master(self.commitlog.max_offset, session=session,
                                    new_epoch=epoch > self.epochs.last_epoch)
            self._report_seq = 0
            if epoch > self.epochs.last_epoch:
                await self._epochs_write(self._start_epoch, epoch, self.commitlog.max_offset)   # writes open after it
            # epoch == last epoch: a master restarting within its own epoch continues it.
            await self._start_master()
            log.warning("became MASTER (was %s) at epoch %d, offset %d", was, epoch, self.commitlog.max_offset)

    def _start_epoch(self, epoch: int, start_offset: int) -> None:
        self.epochs.drop_beyond(start_offset)
        self.epochs.append(epoch, start_offset)

    async def become_slave(self, master_ha_addr: str, master_api_addr: str | None, epoch: int = 0) -> None:
        """Demotion or re-pointing: stop writes at once, then follow `master_ha_addr`."""
        async with self._role_lock:
            if self._role == SLAVE and self.client is not None and self.client.master_addr == master_ha_addr:
                self._master_api = master_api_addr
                self.epoch = max(self.epoch, epoch)
                return
            was = self._role
            self._role = SLAVE
            self._accepting = False
            self._master_api = master_api_addr
            self.epoch = max(self.epoch, epoch)
            await self._stop_service()
            await self._stop_client()
            # A former master's committed bytes are the baseline; reconcile will truncate what diverged.
            self._boundary = self._slave_committed = self.local.committed_position
            self._start_client(master_ha_addr)
            log.warning("became SLAVE of %s (was %s) at epoch %d", master_ha_addr, was, epoch)

    async def _start_master(self) -> None:
        if self.service is None:
            self.service = HAService(self, self.core, self.cfg.ha_listen_host, self.cfg.ha_listen_port,
                                     self.cfg.timings, on_ack=self._release_waiters,
                                     **({"security": self.cfg.security} if self.cfg.security else {}))
            await self.service.start()
        self._accepting = True

    async def _stop_service(self) -> None:
        if self.service is not None:
            svc, self.service = self.service, None
            await svc.stop()
        self._wake_all_waiters()

    def _start_client(self, master_ha_addr: str) -> None:
        assert self.client is None
        self.client = HAClient(master_ha_addr, self, self.cfg.broker_id, self.cfg.timings,
                               **({"security": self.cfg.security} if self.cfg.security else {}))
        self.client.start()

    async def _stop_client(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.stop()
        await self._truncation_done()

    @property
    def ha_port(self) -> int | None:
        return self.service.port if self.service is not None else None

    # --- controller -----------------------------------------------------------------------------
    def _lease_expired(self) -> bool:
        return (self.controller_client is not None and self._role == MASTER
                and now_ms() - self._lease_ms > self.cfg.controller_lease_ms)

    async def _lease_loop(self) -> None:
        """A master cut off from the controller stops writing: the controller may be electing
        another master right now, and two writable masters would fork the log."""
        while True:
            await asyncio.sleep(min(0.25, self.cfg.controller_lease_ms / 4000))
            if self._lease_expired():
                await self._step_down(if_lease_expired=True)

    async def _step_down(self, if_lease_expired: bool = False) -> None:
        async with self._role_lock:
            if self._role != MASTER:
                return
            if if_lease_expired and not self._lease_expired():
                return      # renewed while waiting for the lock (it logged "no word for 0 ms")
            self._role = SLAVE
            self._accepting = False
            self._master_api = None
            await self._stop_service()
            self._boundary = self._slave_committed = self.local.committed_position
            self.step_downs += 1
            log.error("no word from the leader controller for %d ms: stepped down, writes refused "
                      "until the controller names a master", now_ms() - self._lease_ms)

    def controller_heartbeat(self, group: str) -> dict:
        """What this broker tells the controller every second."""
        hb = {"group": group, "broker_id": self.cfg.broker_id, "addr": self.cfg.self_api_address,
              "ha_addr": self.cfg.self_ha_address, "epoch": self.epochs.last_epoch,
              "max_offset": self.committed_position, "priority": self.cfg.election_priority,
              "mode": "classic", "in_sync": []}
        if self._role == MASTER:
            in_sync = self.core.in_sync_broker_ids(self.commitlog.max_offset, now_ms())
            self._report_seq += 1
            pending = self.core.report(self._report_seq, in_sync)
            hb.update(in_sync=sorted(in_sync), session=self.core.session, seq=self._report_seq, pending=pending)
        return hb

    def _check_lease_against(self, controller_timeout_ms) -> None:
        """Say once, loudly, when the lease outlives the controller's heartbeat timeout: the
        controller could then elect a new master while this one still writes."""
        if (not isinstance(controller_timeout_ms, int) or self._lease_warned
                or self.cfg.controller_lease_ms < controller_timeout_ms):
            return
        self._lease_warned = True
        log.error("controllerLeaseTimeoutMills=%d is not below the controller's heartbeat timeout of %d ms: "
                  "a master cut off from the controller may still write after another is elected",
                  self.cfg.controller_lease_ms, controller_timeout_ms)

    async def on_controller_reply(self, reply: dict) -> None:
        """Act on the controller's view: promote, demote, re-point, or update the SyncStateSet."""
        epoch = int(reply.get("epoch") or 0)
        self._check_lease_against(reply.get("heartbeat_timeout_ms"))
        if epoch < self.epoch:
            return   # a lagging controller's stale answer
        addrs = reply.get("broker_addrs")
        if isinstance(addrs, dict):
            self._group_apis = {int(b): a for b, a in list(addrs.items())[:MAX_GROUP_BROKERS]
                                if str(b).isdigit() and isinstance(a, str) and a}
        master_id = reply.get("master_id")
        if master_id is None:
            return   # nobody is master yet: keep what we are (a master stays one until replaced)
        if master_id == self.cfg.broker_id:
            if reply.get("controller_leader"):
                self._lease_ms = now_ms()   # only the leader controller's word renews the lease
            elif self._role != MASTER:
                return                      # a follower controller's view may be stale: wait for the leader
            await self.become_master(epoch)
            sss = frozenset(int(b) for b in reply.get("sync_state_set", []))
            was = self.core.sync_state_set
            if self.core.on_controller_view(sss, int(reply.get("sss_session") or 0), int(reply.get("sss_seq") or 0),
                                            frozenset(int(b) for b in reply.get("brokers") or ())) and sss != was:
                log.info("SyncStateSet now %s (was %s)", sorted(sss), sorted(was or ()))
            self._release_waiters()   # a smaller SyncStateSet may cover waiters now
        elif reply.get("master_ha_addr"):
            await self.become_slave(reply["master_ha_addr"], reply.get("master_addr"), epoch)

    # --- reads ----------------------------------------------------------------------------------
    @property
    def committed_position(self) -> int:
        return self.local.committed_position if self._role == MASTER else self._slave_committed

    @property
    def min_position(self) -> int:
        return self.commitlog.min_offset

    @property
    def min_physical_offset(self) -> int:
        return self.commitlog.min_offset

    def scan(self, position: int, max_bytes: int) -> ScanBatch:
        # Framing only, as LocalLog.scan: a master wrote these bytes itself; a slave checked each
        # record's framing as it arrived (_walk_records); the dispatcher checks each field it
        # uses and readers (pull, query) check the CRC when they decode.
        return self.commitlog.scan(position, max_bytes, limit=self.committed_position, verify=False)

    def scan_spans(self, position: int, max_bytes: int) -> tuple[list[tuple[bytes, int, int, int]], int]:
        """`scan` as `(chunk, start, physical_offset, size)` per record, no copy per record
        (the dispatcher's batched path, as LocalLog.scan_spans); same framing checks."""
        return self.commitlog.scan_spans(position, max_bytes, limit=self.committed_position, verify=False)

    def read(self, physical_offset: int, size: int) -> bytes:
        if physical_offset + size > self.committed_position:
            raise KeyError(f"record at {physical_offset} (+{size}) is not committed "
                           f"(committed offset {self.committed_position})")
        return self.commitlog.read(physical_offset, size)

    async def wait_committed(self, beyond_position: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self.committed_position <= beyond_position and self._started:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._role == MASTER:
                await self.local.wait_committed(beyond_position, left)
            else:
                await self._grown.wait(min(left, 0.5))   # re-check the role at least every 0.5 s
        return self.committed_position

    def init_queue_offsets(self, table: dict[tuple[str, int], int]) -> None:
        self.local.init_queue_offsets(table)

    def hold_writes(self, why: str) -> None:
        self.local.hold_writes(why)

    @property
    def writes_held(self) -> str | None:
        return self.local.writes_held

    def queue_offset_of(self, topic: str, queue_id: int) -> int:
        return self.local.queue_offset_of(topic, queue_id)

    async def retention_tick(self, now=None, manual: bool = False):
        return await self.local.retention_tick(now, manual)

    @property
    def disk_reserve(self):
        return self.local.disk_reserve


def ha_log_from_broker_config(config, fs: FileSystem, local_config: LocalLogConfig,
                              checkpoint_committed_offset: int | None = None) -> HALog:
    """Build an HALog from a node.config.BrokerConfig (called from node.server.build_log)."""
    controller = bool(config.controller_addr)
    role = SLAVE if config.broker_role == "SLAVE" else MASTER
    timings = HATimings(max_gap_not_in_sync_bytes=config.ha_max_gap_not_in_sync_bytes,
                        slave_ack_timeout_ms=config.ha_slave_ack_timeout_ms,
                        max_time_slave_not_catchup_ms=config.ha_max_time_slave_not_catchup_ms,
                        max_connections=config.ha_max_connections)
    master_host = config.ha_master_address.rpartition(":")[0]
    return HALog(fs, config.store_root, local_config, HALogConfig(
        broker_id=config.broker_id, initial_role=role,
        # With a controller any broker may be promoted; SYNC_MASTER semantics unless ASYNC_MASTER was asked for.
        sync_master=config.broker_role != "ASYNC_MASTER",
        controller_mode=controller, ha_listen_host=config.bind_address, ha_listen_port=config.ha_listen_port,
        ha_master_address=config.ha_master_address,
        master_api_address=f"{master_host}:{config.listen_port}" if master_host else None,
        self_api_address=f"{config.broker_ip1}:{config.listen_port}",
        self_ha_address=f"{config.broker_ip1}:{config.ha_listen_port}",
        election_priority=(config.broker_election_priority if config.broker_election_priority >= 0
                           else config.broker_id),
        all_ack_in_sync_state_set=config.all_ack_in_sync_state_set,
        min_in_sync_replicas=config.min_in_sync_replicas, timings=timings,
        controller_lease_ms=config.controller_lease_timeout_ms,
        controller_addrs=tuple(a.strip() for a in config.controller_addr.replace(",", ";").split(";") if a.strip()),
        group=config.group, security=_peer_security(config)), checkpoint_committed_offset)


def _peer_security(config):
    from node.peer_auth import peer_security_from_config
    return peer_security_from_config(config, (config.bind_address,))

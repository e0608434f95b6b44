"""Consumers (asyncio): a pull consumer with explicit offsets, and RocketMQ's push consumer.

Push consumer (`AsyncConsumer`), RocketMQ's DefaultMQPushConsumer on HTTP long polling:
- Clustering: every member heartbeats its subscriptions to each broker group
  (`POST /groups/{g}/heartbeat`); after each beat it allocates the topic's read queues among
  the live members with AllocateMessageQueueAveragely and starts/stops per-queue pull loops.
  Offsets live on the broker: kept in memory as messages are consumed, committed every
  `auto_commit_interval_s` (5 s), on `commit()`, when a queue moves away, and on close.
  A listener returning RECONSUME_LATER (or raising) sends the message back
  (`POST /groups/{g}/retry`): it returns from `%RETRY%<group>`, which every member also
  subscribes to, after the next delay level, with reconsume_times raised; after
  `max_reconsume_times` (16) it goes to `%DLQ%<group>`.
- Broadcasting: every consumer takes every queue; offsets in a local `offsets.json`. Its
  members heartbeat too (the broker lists them: consumerConnection), but take no part in a
  split of the queues.
- The committed offset of a queue is the lowest offset still being consumed (a message that
  fails never lets the offset pass it), so consumption is at-least-once.
- Flow control: a queue is not pulled while it holds `pull_threshold_for_queue` (1000)
  messages or `pull_threshold_size_for_queue_mib` (100) MiB not yet consumed; at most
  `consume_thread_max` (20) listener calls run at once.
- Ordered (`orderly=True`, RocketMQ's MessageListenerOrderly): a queue is consumed only
  while this member holds its lock on the broker (`POST /groups/{g}/lock`, renewed every
  `lock_renew_interval_s`; the lock lives `rebalanceLockMaxLiveTimeMs` on the broker and, on
  the client, that long after the request that got it was sent). Each queue has one consume
  task that hands the listener its messages in queue order, one batch at a time. A failed
  batch is retried in place after `suspend_current_queue_time_s` (the queue waits), and after
  `max_reconsume_times` attempts each message goes to `%DLQ%<group>`. A queue that moves away
  is finished (the message being consumed completes), committed, then unlocked, so the next
  owner starts where this one stopped.
- Without a listener, `async for msg in consumer` yields messages one by one; a message
  counts as consumed when the loop asks for the next one, unless `reconsume_later(msg)` was
  called for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import os
import socket
import time
from typing import Any, Callable, Sequence

from mqstore import __version__
from mqstore.client.errors import MQBrokerError, MQClientError, MQConfigError
from mqstore.client.message import (PROPERTY_RETRY_TOPIC, RETRY_PREFIX, ConsumeFromWhere, ConsumeStatus, MessageExt,
                                    MessageModel, MessageQueue, PullResult, PullStatus)
from mqstore.client.offsets import LocalFileOffsetStore, RemoteOffsetStore
from mqstore.client.route import RouteTable
from mqstore.client.transport import Transport

log = logging.getLogger(__name__)

FLOW_CONTROL_DELAY_S = 0.05          # RocketMQ PULL_TIME_DELAY_MILLS_WHEN_FLOW_CONTROL
PULL_ERROR_DELAY_S = 0.5
RECONSUME_LOCAL_DELAY_S = 1.0        # when send-back fails, consume again here after this
SHUTDOWN_WAIT_S = 5.0
MAX_PULL_BATCH = 32


def allocate_averagely(queues: Sequence[MessageQueue], members: Sequence[str], me: str) -> list[MessageQueue]:
    """RocketMQ's AllocateMessageQueueAveragely over sorted queues and sorted member ids."""
    queues, members = sorted(queues), sorted(members)
    if me not in members or not queues:
        return []
    n, m, index = len(queues), len(members), members.index(me)
    mod = n % m
    if n <= m:
        avg = 1
    else:
        avg = n // m + 1 if mod > 0 and index < mod else n // m
    start = index * avg if mod > 0 and index < mod else index * avg + mod
    count = min(avg, n - start)
    return [queues[(start + i) % n] for i in range(max(0, count))]


def default_client_id(instance_name: str = "DEFAULT") -> str:
    """ip@instance; the DEFAULT instance becomes pid#nanotime (RocketMQ changeInstanceNameToPID)."""
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = "127.0.0.1"
    if instance_name == "DEFAULT":
        instance_name = f"{os.getpid()}#{time.monotonic_ns()}"
    return f"{ip}@{instance_name}"


class _Client:
    group: str | None = None      # a consumer's group, named on each pull (the broker's statsAll counts it)

    def __init__(self, brokers: Any, controller: Any, request_timeout_s: float):
        self.transport = Transport(request_timeout_s)
        self.routes = RouteTable(self.transport, brokers=brokers, controller=controller)

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self):
        await self.transport.start()
        await self.routes.learn_name()
        return self

    async def close(self) -> None:
        await self.transport.close()

    async def fetch_queues(self, topic: str) -> list[MessageQueue]:
        """The topic's readable queues (fresh from the route source)."""
        return list((await self.routes.route(topic, refresh=True)).read_queues)

    async def pull(self, mq: MessageQueue, offset: int, max_nums: int = 32, expression: str = "*",
                   wait_ms: int = 0) -> PullResult:
        if not 1 <= max_nums <= 1024:
            raise MQConfigError("max_nums must be 1..1024")
        g = self.routes.group(mq.broker_name)
        doc = await self.transport.call(g, "GET", f"/topics/{mq.topic}/queues/{mq.queue_id}/messages",
                                        params={"offset": offset, "max": max_nums, "tags": expression,
                                                "wait_ms": wait_ms, **({"group": self.group} if self.group else {})},
                                        timeout_s=self.transport.request_timeout_s + wait_ms / 1000.0)
        return PullResult(PullStatus(doc["status"]), int(doc["next_offset"]), int(doc["min_offset"]),
                          int(doc["max_offset"]), [MessageExt.from_wire(m, mq.broker_name) for m in doc["messages"]])

    async def queue_bounds(self, mq: MessageQueue) -> tuple[int, int]:
        """(min_offset, max_offset) of a queue; max is the next offset to be written."""
        doc = await self.transport.call(self.routes.group(mq.broker_name), "GET", f"/topics/{mq.topic}")
        for q in doc.get("queues", []):
            if int(q["queue_id"]) == mq.queue_id:
                return int(q["min_offset"]), int(q["max_offset"])
        raise MQClientError(f"queue {mq} not found on broker group {mq.broker_name!r}")

    async def search_offset(self, mq: MessageQueue, timestamp_ms: int) -> int:
        """The first queue offset stored at or after `timestamp_ms` (ms since the epoch); the
        queue's max offset if none is (RocketMQ searchOffset)."""
        doc = await self.transport.call(self.routes.group(mq.broker_name), "GET",
                                        f"/topics/{mq.topic}/queues/{mq.queue_id}/offset",
                                        params={"timestamp": timestamp_ms})
        return int(doc["offset"])


class AsyncPullConsumer(_Client):
    """Explicit offsets: fetch queues, pull from an offset, commit to the broker if you like."""

    def __init__(self, group: str, *, brokers: Any = None, controller: Any = None, request_timeout_s: float = 5.0):
        super().__init__(brokers, controller, request_timeout_s)
        self.group = group
        self.offsets = RemoteOffsetStore(self.transport, self.routes, group)

    async def commit(self, mq: MessageQueue, offset: int) -> None:
        self.offsets.update(mq, offset)
        await self.offsets.persist([mq])

    async def committed(self, mq: MessageQueue) -> int | None:
        return await self.offsets.read(mq)


class _ProcessQueue:
    """Messages of one queue pulled but not yet consumed (RocketMQ ProcessQueue)."""

    def __init__(self, mq: MessageQueue, offset: int):
        self.mq = mq
        self.next_offset = offset
        self.msgs: dict[int, int] = {}       # queue offset -> body size
        self.bytes = 0
        self.max_seen = -1
        self.dropped = False
        self.task: asyncio.Task | None = None
        self.consume_task: asyncio.Task | None = None      # orderly: the queue's one consumer
        self.buffer: dict[int, MessageExt] = {}             # orderly: pulled, not yet consumed
        self.wake = asyncio.Event()
        self.lock_until = 0.0                               # orderly: monotonic end of our lock

    def add(self, msgs: Sequence[MessageExt]) -> None:
        for m in msgs:
            if m.queue_offset not in self.msgs:
                self.msgs[m.queue_offset] = m.body_size
                self.bytes += m.body_size
            self.max_seen = max(self.max_seen, m.queue_offset)

    def remove(self, msgs: Sequence[MessageExt]) -> int:
        """Drop consumed messages; the offset that is safe to commit now."""
        for m in msgs:
            size = self.msgs.pop(m.queue_offset, None)
            if size is not None:
                self.bytes -= size
        return min(self.msgs) if self.msgs else self.max_seen + 1


class AsyncConsumer(_Client):
    """The push consumer. Give a listener, or iterate with `async for`."""

    def __init__(self, group: str, *, brokers: Any = None, controller: Any = None,
                 topics: dict[str, str] | Sequence[str] | str | None = None,
                 listener: Callable[[list[MessageExt]], Any] | None = None,
                 message_model: MessageModel | str = MessageModel.CLUSTERING,
                 consume_from_where: ConsumeFromWhere | str = ConsumeFromWhere.CONSUME_FROM_LAST_OFFSET,
                 consume_thread_max: int = 20, consume_message_batch_max_size: int = 1, pull_batch_size: int = 32,
                 pull_threshold_for_queue: int = 1000, pull_threshold_size_for_queue_mib: int = 100,
                 max_reconsume_times: int = 16, heartbeat_interval_s: float = 5.0,
                 auto_commit_interval_s: float = 5.0, enable_auto_commit: bool = True, long_poll_ms: int = 2000,
                 instance_name: str = "DEFAULT", client_id: str | None = None,
                 offset_store_dir: str | None = None, request_timeout_s: float = 5.0, orderly: bool = False,
                 lock_renew_interval_s: float = 20.0, suspend_current_queue_time_s: float = 1.0):
        super().__init__(brokers, controller, request_timeout_s)
        _check_range("consume_thread_max", consume_thread_max, 1, 1000)
        _check_range("consume_message_batch_max_size", consume_message_batch_max_size, 1, 1024)
        _check_range("pull_batch_size", pull_batch_size, 1, MAX_PULL_BATCH)
        _check_range("pull_threshold_for_queue", pull_threshold_for_queue, 1, 65535)
        _check_range("pull_threshold_size_for_queue_mib", pull_threshold_size_for_queue_mib, 1, 1024)
        _check_range("max_reconsume_times", max_reconsume_times, 0, 64)
        _check_range("long_poll_ms", long_poll_ms, 0, 30_000)
        if heartbeat_interval_s <= 0 or auto_commit_interval_s <= 0:
            raise MQConfigError("heartbeat_interval_s and auto_commit_interval_s must be > 0")
        if not 0 < lock_renew_interval_s <= 3600 or not 0 <= suspend_current_queue_time_s <= 60:
            raise MQConfigError("lock_renew_interval_s must be in (0, 3600] and suspend_current_queue_time_s in [0, 60]")
        if orderly and listener is None:
            raise MQConfigError("an orderly consumer needs a listener")
        if orderly and MessageModel(message_model) is not MessageModel.CLUSTERING:
            raise MQConfigError("orderly consumption needs CLUSTERING (queue locks are per group)")
        self.orderly = bool(orderly)
        self.lock_renew_interval_s = lock_renew_interval_s
        self.suspend_current_queue_time_s = suspend_current_queue_time_s
        self.group = group
        self.message_model = MessageModel(message_model)
        self.consume_from_where = ConsumeFromWhere(consume_from_where)
        self.listener = listener
        self.consume_thread_max = consume_thread_max
        self.consume_message_batch_max_size = consume_message_batch_max_size if listener is not None else 1
        self.pull_batch_size = pull_batch_size
        self.pull_threshold_for_queue = pull_threshold_for_queue
        self.pull_threshold_size_bytes = pull_threshold_size_for_queue_mib * 1024 * 1024
        self.max_reconsume_times = max_reconsume_times
        self.heartbeat_interval_s = heartbeat_interval_s
        self.auto_commit_interval_s = auto_commit_interval_s
        self.enable_auto_commit = enable_auto_commit
        self.long_poll_ms = long_poll_ms
        self.client_id = client_id or default_client_id(instance_name)
        self.subscriptions: dict[str, str] = {}
        self._running = False
        for t, expr in _topics(topics).items():
            self.subscribe(t, expr)
        if self.message_model is MessageModel.BROADCASTING:
            base = offset_store_dir or os.path.join(os.path.expanduser("~"), ".mqstore_offsets")
            self.offsets: Any = LocalFileOffsetStore(base, self.client_id, group, self.routes.aliases)
        else:
            self.offsets = RemoteOffsetStore(self.transport, self.routes, group)
        self.process_queues: dict[MessageQueue, _ProcessQueue] = {}
        self._slots: asyncio.Semaphore | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._tasks: list[asyncio.Task] = []
        self._consuming: set[asyncio.Task] = set()
        self._inbox: asyncio.Queue | None = None
        self._current: tuple[MessageExt, asyncio.Future] | None = None
        self._later: set[int] = set()          # id() of iterated messages marked RECONSUME_LATER
        self._running = False
        self._assign_lock = asyncio.Lock()      # rebalance and lock renewal change the owned queues one at a time
        self.lock_refusals = 0                 # orderly: lock requests answered "not yet" by a new leader
        self.rebalances = 0                    # how many times the assignment changed
        self.consumed = 0                      # listener calls that returned CONSUME_SUCCESS (messages)

    # --- setup --------------------------------------------------------------------------------
    def subscribe(self, topic: str, expression: str = "*") -> None:
        if self._running:
            raise MQClientError("subscribe before start()")
        if not isinstance(topic, str) or not topic:
            raise MQConfigError("topic must be a non-empty string")
        self.subscriptions[topic] = expression or "*"

    @property
    def clustering(self) -> bool:
        return self.message_model is MessageModel.CLUSTERING

    def _all_subscriptions(self) -> dict[str, str]:
        subs = dict(self.subscriptions)
        if self.clustering and not self.orderly:     # orderly retries in place, in order
            subs[RETRY_PREFIX + self.group] = "*"
        return subs

    async def start(self) -> "AsyncConsumer":
        if not self.subscriptions:
            raise MQConfigError("subscribe to at least one topic before start()")
        await super().start()
        self._slots = asyncio.Semaphore(self.consume_thread_max)
        self._executor = concurrent.futures.ThreadPoolExecutor(self.consume_thread_max,
                                                               thread_name_prefix=f"consume-{self.group}")
        if self.listener is None:
            self._inbox = asyncio.Queue(maxsize=self.consume_thread_max)
        self._running = True
        try:
            await self.rebalance()
        except MQClientError as e:
            log.warning("consumer %s: first rebalance failed, retrying in the background: %s", self.client_id, e)
        self._tasks = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._commit_loop())]
        if self.orderly:
            self._tasks.append(asyncio.create_task(self._renew_loop()))
        return self

    async def close(self) -> None:
        if not self._running:
            await super().close()
            return
        self._running = False
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._current is not None and not self._current[1].done():
            self._current[1].set_result(self._status_of_current())
        for pq in list(self.process_queues.values()):
            pq.dropped = True
            pq.wake.set()
            if pq.task is not None:
                pq.task.cancel()
        await asyncio.gather(*(pq.task for pq in self.process_queues.values() if pq.task), return_exceptions=True)
        ordered = [pq.consume_task for pq in self.process_queues.values() if pq.consume_task]
        if ordered:                             # each finishes the message in hand, then stops
            await asyncio.wait(ordered, timeout=SHUTDOWN_WAIT_S)
        if self._inbox is not None:            # iterated messages not handed out: not consumed
            while not self._inbox.empty():
                _msgs, fut = self._inbox.get_nowait()
                fut.set_result(None)
        if self._consuming:
            await asyncio.wait(self._consuming, timeout=SHUTDOWN_WAIT_S)
        try:
            await self.offsets.persist()
        except MQClientError as e:
            log.warning("consumer %s: final offset commit failed: %s", self.client_id, e)
        if self.orderly:                        # a listener still running keeps its queue until the lock ends
            await self._unlock([mq for mq, pq in self.process_queues.items()
                                if pq.consume_task is None or pq.consume_task.done()])
        await self._unregister()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        await super().close()

    async def commit(self) -> int:
        """Commit consumed offsets now; returns how many queues were written."""
        return await self.offsets.persist()

    # --- membership and rebalance -----------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        while self._running:
            await asyncio.sleep(self.heartbeat_interval_s)
            try:
                await self.rebalance()
            except MQClientError as e:
                log.info("consumer %s: heartbeat/rebalance failed: %s", self.client_id, e)

    async def _commit_loop(self) -> None:
        while self._running:
            await asyncio.sleep(self.auto_commit_interval_s)
            if not self.enable_auto_commit:
                continue
            try:
                await self.offsets.persist()
            except MQClientError as e:
                log.info("consumer %s: offset commit failed: %s", self.client_id, e)

    async def _heartbeat(self) -> dict[str, dict[str, list[str]]]:
        """Beat to every broker group; broker name -> topic -> member ids."""
        subs = self._all_subscriptions()
        ttl = int(min(300_000, max(1_000, self.heartbeat_interval_s * 3000)))
        beat = {"client_id": self.client_id, "topics": sorted(subs), "ttl_ms": ttl, "subscriptions": subs,
                "consume_type": "CONSUME_PASSIVELY", "message_model": self.message_model.value,
                "consume_from_where": self.consume_from_where.value, "language": "PYTHON", "version": __version__}
        out = {}
        for name, g in sorted(self.routes.groups.items()):
            try:
                doc = await self.transport.call(g, "POST", f"/groups/{self.group}/heartbeat", beat)
            except MQClientError as e:
                log.info("consumer %s: heartbeat to %s failed: %s", self.client_id, name, e)
                continue
            out[name] = doc.get("members", {})
        return out

    async def _unregister(self) -> None:
        for g in self.routes.groups.values():
            try:
                await self.transport.call(g, "DELETE", f"/groups/{self.group}/members/{self.client_id}",
                                          timeout_s=2.0)
            except MQClientError as e:
                log.info("consumer %s: leaving group on %s failed: %s", self.client_id, g.name, e)

    async def rebalance(self) -> None:
        """Heartbeat, then take the queues allocated to this member and release the others."""
        async with self._assign_lock:
            await self._rebalance()

    async def _rebalance(self) -> None:
        routed: dict[str, tuple[MessageQueue, ...]] = {}
        for topic in self._all_subscriptions():     # routes first: they name the groups to beat to
            try:
                routed[topic] = (await self.routes.route(topic, refresh=True)).read_queues
            except MQBrokerError as e:
                if e.code != "TOPIC_NOT_EXIST":
                    raise
        members = await self._heartbeat()       # broadcasting members beat too: consumerConnection lists them
        wanted: set[MessageQueue] = set()
        for topic, queues in routed.items():
            if not queues:
                continue
            if self.clustering:
                by = members.get(queues[0].broker_name, {})
                ids = by.get(topic) or []
                wanted.update(allocate_averagely(queues, ids, self.client_id))
            else:
                wanted.update(queues)
        current = set(self.process_queues)
        if wanted == current:
            return
        self.rebalances += 1
        for mq in sorted(current - wanted):
            await self._release(mq)
        new = sorted(wanted - current)
        until: dict[MessageQueue, float] = {}
        if self.orderly and new:
            until = await self._lock(new)
            new = [mq for mq in new if mq in until]
        for mq in new:
            offset = await self._start_offset(mq)
            pq = self.process_queues[mq] = _ProcessQueue(mq, offset)
            pq.task = asyncio.create_task(self._pull_loop(pq))
            if self.orderly:
                pq.lock_until = until[mq]
                pq.consume_task = asyncio.create_task(self._consume_orderly(pq))
        log.info("consumer %s: now owns %d queues", self.client_id, len(self.process_queues))

    async def _release(self, mq: MessageQueue, unlock: bool = True) -> None:
        pq = self.process_queues.pop(mq, None)
        if pq is None:
            return
        pq.dropped = True
        pq.wake.set()
        if pq.task is not None:
            pq.task.cancel()
        finished = True
        if pq.consume_task is not None:        # orderly: let the message in hand complete first
            done, _ = await asyncio.wait([pq.consume_task], timeout=SHUTDOWN_WAIT_S)
            finished = bool(done)
        try:
            await self.offsets.persist([mq])
        except MQClientError as e:
            log.info("consumer %s: commit of released %s failed: %s", self.client_id, mq, e)
        self.offsets.remove(mq)
        if self.orderly and unlock and finished:   # unfinished: the lock expires on its own
            await self._unlock([mq])

    # --- queue locks (orderly) ---------------------------------------------------------------
    @staticmethod
    def _by_group(mqs: Sequence[MessageQueue]) -> dict[str, list[MessageQueue]]:
        out: dict[str, list[MessageQueue]] = {}
        for mq in mqs:
            out.setdefault(mq.broker_name, []).append(mq)
        return out

    async def _lock(self, mqs: Sequence[MessageQueue]) -> dict[MessageQueue, float]:
        """Lock (or renew) queues on their brokers: granted queue -> monotonic time our lock ends."""
        out: dict[MessageQueue, float] = {}
        for name, group_mqs in self._by_group(mqs).items():
            sent = time.monotonic()
            try:
                doc = await self.transport.call(self.routes.group(name), "POST", f"/groups/{self.group}/lock",
                                                {"client_id": self.client_id,
                                                 "queues": [{"topic": m.topic, "queue_id": m.queue_id}
                                                            for m in group_mqs]})
            except MQClientError as e:
                log.info("consumer %s: lock on %s failed: %s", self.client_id, name, e)
                continue
            if int(doc.get("retry_after_ms", 0)) > 0:
                self.lock_refusals += 1            # a new leader's quiet time: no grants yet
            granted = {(q["topic"], int(q["queue_id"])) for q in doc.get("locked", [])}
            end = sent + int(doc.get("expires_in_ms", 0)) / 1000.0
            out.update((m, end) for m in group_mqs if (m.topic, m.queue_id) in granted)
        return out

    async def _unlock(self, mqs: Sequence[MessageQueue]) -> None:
        for name, group_mqs in self._by_group(mqs).items():
            try:
                await self.transport.call(self.routes.group(name), "POST", f"/groups/{self.group}/unlock",
                                          {"client_id": self.client_id,
                                           "queues": [{"topic": m.topic, "queue_id": m.queue_id} for m in group_mqs]},
                                          timeout_s=2.0)
            except MQClientError as e:
                log.info("consumer %s: unlock on %s failed (the lock will expire): %s", self.client_id, name, e)

    async def _renew_loop(self) -> None:
        """Renew every held lock; a queue whose lock was refused stops here (rebalance may lock it again)."""
        while self._running:
            await asyncio.sleep(self.lock_renew_interval_s)
            async with self._assign_lock:
                await self._renew()

    async def _renew(self) -> None:
        held = list(self.process_queues)
        if held:
            until = await self._lock(held)
            for mq in held:
                pq = self.process_queues.get(mq)
                if pq is None:
                    continue
                if mq in until:
                    pq.lock_until = until[mq]
                elif time.monotonic() >= pq.lock_until or await self._refused(mq):
                    log.info("consumer %s: lost the lock of %s", self.client_id, mq)
                    await self._release(mq, unlock=False)

    async def _refused(self, mq: MessageQueue) -> bool:
        """Did the broker answer and refuse (rather than not answer)? Only then is the queue given up early."""
        try:
            doc = await self.transport.call(self.routes.group(mq.broker_name), "GET", f"/groups/{self.group}/locks",
                                            timeout_s=2.0)
        except MQClientError:
            return False
        return not any(q["topic"] == mq.topic and int(q["queue_id"]) == mq.queue_id
                       and q["client_id"] == self.client_id for q in doc.get("locks", []))

    async def _consume_orderly(self, pq: _ProcessQueue) -> None:
        """The queue's one consumer: messages in queue order, the next batch only after the last succeeded."""
        attempts = 0
        while self._running and not pq.dropped:
            if not pq.buffer:
                pq.wake.clear()
                try:   # asyncio.timeout, not wait_for: on 3.11 that can lose close()'s cancel
                    async with asyncio.timeout(1.0):
                        await pq.wake.wait()
                except TimeoutError:
                    pass
                continue
            if time.monotonic() >= pq.lock_until:        # not (or no longer) ours: wait for a renewal
                await asyncio.sleep(min(0.1, self.lock_renew_interval_s))
                continue
            batch = [pq.buffer[o] for o in sorted(pq.buffer)[:self.consume_message_batch_max_size]]
            assert self._slots is not None
            async with self._slots:
                status = await self._invoke(batch)
            if status is ConsumeStatus.CONSUME_SUCCESS:
                attempts = 0
                self.consumed += len(batch)
            else:
                attempts += 1
                if attempts <= self.max_reconsume_times:
                    await asyncio.sleep(self.suspend_current_queue_time_s)
                    continue
                if not all([await self._send_back(m, -1) for m in batch]):   # to the DLQ
                    await asyncio.sleep(self.suspend_current_queue_time_s)
                    continue
                attempts = 0
            for m in batch:
                pq.buffer.pop(m.queue_offset, None)
            self.offsets.update(pq.mq, pq.remove(batch))

    async def _start_offset(self, mq: MessageQueue) -> int:
        stored = await self.offsets.read(mq)
        if stored is not None and stored >= 0:
            return stored
        if mq.topic.startswith(RETRY_PREFIX) or self.consume_from_where is ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET:
            return (await self.queue_bounds(mq))[0]
        return (await self.queue_bounds(mq))[1]

    # --- pulling ----------------------------------------------------------------------------
    async def _pull_loop(self, pq: _ProcessQueue) -> None:
        expr = self._all_subscriptions().get(pq.mq.topic, "*")
        while self._running and not pq.dropped:
            if len(pq.msgs) >= self.pull_threshold_for_queue or pq.bytes >= self.pull_threshold_size_bytes:
                await asyncio.sleep(FLOW_CONTROL_DELAY_S)
                continue
            try:
                r = await self.pull(pq.mq, pq.next_offset, self.pull_batch_size, expr, self.long_poll_ms)
            except MQClientError as e:
                log.info("consumer %s: pull %s@%d failed: %s", self.client_id, pq.mq, pq.next_offset, e)
                await asyncio.sleep(PULL_ERROR_DELAY_S)
                continue
            if pq.dropped:
                return
            if r.status is PullStatus.FOUND and r.messages:
                pq.add(r.messages)
                pq.next_offset = r.next_offset
                if self.orderly:
                    pq.buffer.update((m.queue_offset, m) for m in r.messages)
                    pq.wake.set()
                    continue
                step = self.consume_message_batch_max_size
                for i in range(0, len(r.messages), step):
                    self._spawn_consume(pq, r.messages[i:i + step])
            else:
                pq.next_offset = r.next_offset
                if not pq.msgs:
                    self.offsets.update(pq.mq, r.next_offset)
                if r.status is PullStatus.OFFSET_ILLEGAL:
                    log.warning("consumer %s: offset illegal on %s; moved to %d", self.client_id, pq.mq,
                                r.next_offset)

    # --- consuming ----------------------------------------------------------------------------
    def _spawn_consume(self, pq: _ProcessQueue, msgs: list[MessageExt], delay_s: float = 0.0) -> None:
        task = asyncio.create_task(self._consume(pq, msgs, delay_s))
        self._consuming.add(task)
        task.add_done_callback(self._consuming.discard)

    async def _consume(self, pq: _ProcessQueue, msgs: list[MessageExt], delay_s: float) -> None:
        if delay_s:
            await asyncio.sleep(delay_s)
        assert self._slots is not None
        async with self._slots:
            if pq.dropped or not self._running:
                return
            for m in msgs:
                if m.topic.startswith(RETRY_PREFIX):
                    m.topic = m.properties.get(PROPERTY_RETRY_TOPIC, m.topic)
            status = await self._invoke(msgs)
            if status is None:
                return                                # iteration stopped before this message was taken
            failed: list[MessageExt] = []
            if status is not ConsumeStatus.CONSUME_SUCCESS:
                if self.clustering:
                    failed = [m for m in msgs if not await self._send_back(m)]
                else:
                    log.warning("consumer %s: broadcasting drops %d messages the listener failed", self.client_id,
                                len(msgs))
            else:
                self.consumed += len(msgs)
            done = [m for m in msgs if m not in failed]
            if done:
                self.offsets.update(pq.mq, pq.remove(done))
            if failed:
                self._spawn_consume(pq, failed, RECONSUME_LOCAL_DELAY_S)

    async def _invoke(self, msgs: list[MessageExt]) -> ConsumeStatus | None:
        if self.listener is None:
            assert self._inbox is not None
            fut = asyncio.get_running_loop().create_future()
            await self._inbox.put((msgs, fut))
            return await fut
        try:
            if inspect.iscoroutinefunction(self.listener):
                out = await self.listener(msgs)
            else:
                loop = asyncio.get_running_loop()
                out = await loop.run_in_executor(self._executor, self.listener, msgs)
        except Exception:  # noqa: BLE001 - a listener's exception means RECONSUME_LATER, as in RocketMQ
            log.exception("consumer %s: listener raised; messages will be consumed again", self.client_id)
            return ConsumeStatus.RECONSUME_LATER
        try:
            return ConsumeStatus(out)
        except ValueError:
            log.error("consumer %s: listener returned %r; treated as RECONSUME_LATER", self.client_id, out)
            return ConsumeStatus.RECONSUME_LATER

    async def _send_back(self, m: MessageExt, delay_level: int = 0) -> bool:
        try:
            await self.transport.call(self.routes.group(m.broker_name), "POST", f"/groups/{self.group}/retry",
                                      {"offset_msg_id": m.offset_msg_id, "delay_level": delay_level,
                                       "max_reconsume_times": self.max_reconsume_times})
            return True
        except MQClientError as e:
            log.warning("consumer %s: send-back of %s failed (will consume it again here): %s", self.client_id,
                        m.msg_id, e)
            return False

    # --- iteration -------------------------------------------------------------------------------
    def __aiter__(self) -> "AsyncConsumer":
        if self.listener is not None:
            raise MQClientError("this consumer has a listener; iterate only a consumer created without one")
        return self

    async def __anext__(self) -> MessageExt:
        if not self._running:
            raise StopAsyncIteration
        self._ack_current()
        assert self._inbox is not None
        msgs, fut = await self._inbox.get()
        self._current = (msgs[0], fut)
        return msgs[0]

    async def getone(self, timeout_s: float | None = None) -> MessageExt | None:
        """The next message (acknowledging the previous one), or None after `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self.__anext__()
        except TimeoutError:
            return None

    def reconsume_later(self, msg: MessageExt) -> None:
        """Mark the message just iterated as failed: it comes back through the retry topic."""
        self._later.add(id(msg))

    def _status_of_current(self) -> ConsumeStatus:
        assert self._current is not None
        msg = self._current[0]
        if id(msg) in self._later:
            self._later.discard(id(msg))
            return ConsumeStatus.RECONSUME_LATER
        return ConsumeStatus.CONSUME_SUCCESS

    def _ack_current(self) -> None:
        if self._current is not None:
            msg, fut = self._current
            if not fut.done():
                fut.set_result(self._status_of_current())
            self._current = None


def _check_range(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise MQConfigError(f"{name} must be an integer in {lo}..{hi}, got {value!r}")


def _topics(topics: Any) -> dict[str, str]:
    if topics is None:
        return {}
    if isinstance(topics, str):
        return {topics: "*"}
    if isinstance(topics, dict):
        return dict(topics)
    return {t: "*" for t in topics}

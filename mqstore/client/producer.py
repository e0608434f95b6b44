"""The asyncio producer: route lookup, queue selection, retries, latency fault tolerance.

`AsyncProducer.send` picks a queue (round-robin, a selector, or a sharding key), sends,
and on a retriable failure tries again up to `retry_times_when_send_failed` (2) more times,
on another broker group when there is one (RocketMQ's DefaultMQProducer). With
`send_latency_fault_enable`, a group that was slow or failed is avoided for a while
(RocketMQ's MQFaultStrategy tables). Each message gets a client-side UNIQ_KEY (its msg_id).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import zlib
from typing import Any, Awaitable, Callable, Sequence

from mqstore.client.errors import MQBrokerError, MQClientError, MQConfigError
from mqstore.client.message import (PROPERTY_UNIQ_KEY, UNIQ_IDS, Message, MessageQueue, SendResult)
from mqstore.client.route import RouteTable
from mqstore.client.transport import Transport

log = logging.getLogger(__name__)

# MQFaultStrategy: a send that took >= LATENCY_MAX[i] ms makes its group unavailable for
# NOT_AVAILABLE_DURATION[i] ms; a failed send counts as 30 s of latency.
LATENCY_MAX_MS = (50, 100, 550, 1000, 2000, 3000, 15000)
NOT_AVAILABLE_DURATION_MS = (0, 0, 30000, 60000, 120000, 180000, 600000)
FAILURE_LATENCY_MS = 30000
MAX_ONEWAY_IN_FLIGHT = 1024
MAX_BATCH_MESSAGES = 1024

Selector = Callable[[Sequence[MessageQueue], Message, Any], MessageQueue]


class LatencyFaultTolerance:
    """Per broker group: when it becomes available again (monotonic ms)."""

    def __init__(self, latency_max_ms: Sequence[int] = LATENCY_MAX_MS,
                 not_available_ms: Sequence[int] = NOT_AVAILABLE_DURATION_MS,
                 clock_ms: Callable[[], float] = lambda: time.monotonic() * 1000):
        assert len(latency_max_ms) == len(not_available_ms)
        self.latency_max_ms = tuple(latency_max_ms)
        self.not_available_ms = tuple(not_available_ms)
        self.clock_ms = clock_ms
        self.available_at: dict[str, float] = {}

    def update(self, broker_name: str, latency_ms: float, isolation: bool = False) -> None:
        latency = FAILURE_LATENCY_MS if isolation else latency_ms
        duration = 0
        for i in range(len(self.latency_max_ms) - 1, -1, -1):
            if latency >= self.latency_max_ms[i]:
                duration = self.not_available_ms[i]
                break
        self.available_at[broker_name] = self.clock_ms() + duration

    def is_available(self, broker_name: str) -> bool:
        return self.clock_ms() >= self.available_at.get(broker_name, 0)


def sharding_selector(queues: Sequence[MessageQueue], msg: Message, key: Any) -> MessageQueue:
    """The same sharding key always lands on the same queue (while the queue count holds)."""
    return queues[zlib.crc32(str(key).encode("utf-8")) % len(queues)]


class AsyncProducer:
    def __init__(self, group: str = "DEFAULT_PRODUCER", *, brokers: Any = None, controller: Any = None,
                 retry_times_when_send_failed: int = 2, send_latency_fault_enable: bool = False,
                 send_timeout_s: float = 3.0, max_message_size: int = 4 * 1024 * 1024,
                 fault_tolerance: LatencyFaultTolerance | None = None):
        if not isinstance(retry_times_when_send_failed, int) or not 0 <= retry_times_when_send_failed <= 16:
            raise MQConfigError("retry_times_when_send_failed must be 0..16")
        if send_timeout_s <= 0:
            raise MQConfigError("send_timeout_s must be > 0")
        self.group = group
        self.retry_times_when_send_failed = retry_times_when_send_failed
        self.send_latency_fault_enable = send_latency_fault_enable
        self.send_timeout_s = send_timeout_s
        self.max_message_size = max_message_size
        self.transport = Transport(send_timeout_s)
        self.routes = RouteTable(self.transport, brokers=brokers, controller=controller)
        self.fault = fault_tolerance or LatencyFaultTolerance()
        self._rr = itertools.count()
        self._oneway = asyncio.Semaphore(MAX_ONEWAY_IN_FLIGHT)
        self._background: set[asyncio.Task] = set()
        self._started = False

    async def start(self) -> "AsyncProducer":
        await self.transport.start()
        await self.routes.learn_name()
        self._started = True
        return self

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.transport.close()
        self._started = False

    async def __aenter__(self) -> "AsyncProducer":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # --- queue selection ---------------------------------------------------------------------
    def select_queue(self, queues: Sequence[MessageQueue], last_broker: str | None) -> MessageQueue:
        """Round-robin, skipping the group that just failed and (with fault tolerance) slow groups."""
        assert queues
        start = next(self._rr)
        n = len(queues)
        for i in range(n):
            mq = queues[(start + i) % n]
            if mq.broker_name == last_broker and any(q.broker_name != last_broker for q in queues):
                continue
            if not self.send_latency_fault_enable or self.fault.is_available(mq.broker_name):
                return mq
        others = [q for q in queues if q.broker_name != last_broker] or list(queues)
        return others[start % len(others)]

    # --- send ------------------------------------------------------------------------------------
    async def send(self, msg: Message, *, queue: MessageQueue | None = None, selector: Selector | None = None,
                   arg: Any = None, sharding_key: Any = None) -> SendResult:
        (result,) = await self._send([msg], queue, selector, arg, sharding_key)
        return result

    async def send_batch(self, msgs: Sequence[Message], *, queue: MessageQueue | None = None,
                         selector: Selector | None = None, arg: Any = None,
                         sharding_key: Any = None) -> list[SendResult]:
        """One request, one queue, stored atomically; all messages must share a topic."""
        if not msgs:
            raise MQConfigError("send_batch needs at least one message")
        if len(msgs) > MAX_BATCH_MESSAGES:
            raise MQConfigError(f"send_batch takes at most {MAX_BATCH_MESSAGES} messages")
        if len({m.topic for m in msgs}) != 1:
            raise MQConfigError("all messages of a batch must have the same topic")
        if any(m.delay_level for m in msgs):
            raise MQConfigError("a batch cannot hold delayed messages (as in RocketMQ)")
        return await self._send(list(msgs), queue, selector, arg, sharding_key)

    async def send_oneway(self, msg: Message) -> None:
        """Send without waiting for the result (errors are logged); at most 1024 in flight."""
        await self._oneway.acquire()

        async def run() -> None:
            try:
                await self.send(msg)
            except MQClientError as e:
                log.warning("oneway send to %s failed: %s", msg.topic, e)
            finally:
                self._oneway.release()
        self._spawn(run())

    def send_async(self, msg: Message, on_success: Callable[[SendResult], Any] | None = None,
                   on_exception: Callable[[BaseException], Any] | None = None, **kw: Any) -> asyncio.Task:
        """Send in the background; the callback gets the SendResult (or the exception)."""
        async def run() -> SendResult | None:
            try:
                r = await self.send(msg, **kw)
            except MQClientError as e:
                if on_exception is None:
                    raise
                await _call(on_exception, e)
                return None
            if on_success is not None:
                await _call(on_success, r)
            return r
        return self._spawn(run())

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _send(self, msgs: list[Message], queue: MessageQueue | None, selector: Selector | None, arg: Any,
                    sharding_key: Any) -> list[SendResult]:
        if not self._started:
            raise MQClientError("producer not started (use `async with` or await start())")
        limit = self.max_message_size
        for m in msgs:
            if len(m.body) > limit:
                raise MQConfigError(f"message body is {len(m.body)} bytes; max_message_size is {limit}")
        fresh = [m for m in msgs if PROPERTY_UNIQ_KEY not in m.properties]
        for m, uid in zip(fresh, UNIQ_IDS.next_many(len(fresh))):
            m.properties[PROPERTY_UNIQ_KEY] = uid
        topic = msgs[0].topic
        fixed = queue is not None or selector is not None or sharding_key is not None
        attempts = 1 + self.retry_times_when_send_failed
        last_broker: str | None = None
        last_error: MQClientError | None = None
        deadline = time.monotonic() + self.send_timeout_s * attempts
        for attempt in range(attempts):
            route = await self.routes.route(topic)    # cached: a failed group stays routed, the fault table avoids it
            queues = route.write_queues
            if not queues:
                raise MQClientError(f"topic {topic!r} has no writable queue")
            if queue is not None:
                mq = queue
            elif selector is not None:
                mq = selector(queues, msgs[0], arg)
            elif sharding_key is not None:
                mq = sharding_selector(queues, msgs[0], sharding_key)
            else:
                mq = self.select_queue(queues, last_broker)
            t0 = time.monotonic()
            try:
                results = await self._send_to(mq, msgs, min(self.send_timeout_s, max(0.1, deadline - t0)))
            except MQClientError as e:
                self.fault.update(mq.broker_name, 0, isolation=True)
                if not e.retriable or time.monotonic() >= deadline:
                    raise
                log.info("send to %s failed (attempt %d of %d): %s", mq, attempt + 1, attempts, e)
                last_error, last_broker = e, mq.broker_name
                if fixed:
                    await asyncio.sleep(0.05)
                continue
            self.fault.update(mq.broker_name, (time.monotonic() - t0) * 1000)
            return results
        assert last_error is not None
        raise last_error

    async def _send_to(self, mq: MessageQueue, msgs: list[Message], timeout_s: float) -> list[SendResult]:
        group = self.routes.group(mq.broker_name)
        doc = {"messages": [m.to_wire(mq.queue_id) for m in msgs]}
        try:
            reply = await self.transport.call(group, "POST", f"/topics/{mq.topic}/messages", doc, timeout_s=timeout_s,
                                              stream_topic=mq.topic)
        except MQBrokerError as e:
            if e.code in ("TOPIC_NOT_EXIST", "BAD_REQUEST", "NO_PERMISSION"):
                self.routes.invalidate(mq.topic)      # the route may be stale (queue count or permission changed)
            raise
        if mq.queue_id < 0:
            self.routes.invalidate(mq.topic)   # the broker created or chose: learn the real route next time
        return [SendResult.from_wire(r, mq.broker_name) for r in reply["results"]]


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    out = fn(*args)
    if asyncio.iscoroutine(out):
        return await out
    return out

"""The no-loss recipe, end to end, against a 3-node DLedger group with SYNC_FLUSH.

Recipe (docs/client.md): the producer sends synchronously and, when a send still fails after
the SDK's own retries, sends the same Message object again (it keeps its msg_id); the
consumer commits offsets by hand (`enable_auto_commit=False`, `commit()` after work is done)
and is idempotent — it remembers msg_ids and skips repeats.
Goal: kill -9 the leader mid-run; every produced message is consumed at least once, none is
lost, and the duplicates (re-sends whose first attempt was stored, re-deliveries from the
committed offset) are counted and printed.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from mqstore import AsyncAdmin, AsyncConsumer, AsyncProducer, ConsumeStatus, Message, MQClientError, SendStatus
from tests.client.conftest import eventually, run
from tests.client.nodes import DLedgerTrio

pytestmark = pytest.mark.timeout(180)

SENDERS = 4
PER_SENDER = 100
APP_ATTEMPTS = 6            # sends of one message by the application, each with the SDK's own retries


async def send_reliably(p: AsyncProducer, msg: Message, stats: dict) -> str:
    """Sync send with retries: the same Message again (same msg_id) until SEND_OK, bounded."""
    last: Exception | None = None
    for attempt in range(APP_ATTEMPTS):
        try:
            r = await p.send(msg)
            if r.status is SendStatus.SEND_OK:
                return r.msg_id
            last = RuntimeError(f"status {r.status}")
        except MQClientError as e:
            last = e
        stats["app_retries"] += 1
        await asyncio.sleep(min(2.0, 0.2 * 2 ** attempt))
    raise AssertionError(f"message {msg.body!r} not acknowledged after {APP_ATTEMPTS} sends: {last}")


def test_no_message_is_lost_through_a_leader_kill_with_sync_flush(tmp_path):
    trio = DLedgerTrio(tmp_path, extra="flushDiskType=SYNC_FLUSH\n").start()
    topic, group = "NoLoss", "NoLossG"
    seen: dict[str, int] = {}             # msg_id -> deliveries
    processed: list[bytes] = []           # the idempotent consumer's effects, once per msg_id
    stats = {"app_retries": 0}

    async def listener(msgs):
        for m in msgs:
            seen[m.msg_id] = seen.get(m.msg_id, 0) + 1
            if seen[m.msg_id] == 1:       # dedup by msg_id: the effect happens once
                processed.append(m.body)
        return ConsumeStatus.CONSUME_SUCCESS

    async def go():
        async with AsyncAdmin(brokers=trio.addrs) as admin:
            await admin.create_topic(topic, 4)
        consumer = await AsyncConsumer(group, brokers=trio.addrs, topics=topic, listener=listener,
                                       enable_auto_commit=False, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                                       heartbeat_interval_s=0.5, long_poll_ms=300, request_timeout_s=3.0).start()
        running = True

        async def committer() -> None:        # manual commit: after the listener has done its work
            while running:
                await asyncio.sleep(0.5)
                try:
                    await consumer.commit()
                except MQClientError:
                    pass                      # retried at the next round; uncommitted work is re-delivered
        commits = asyncio.create_task(committer())
        acked: set[str] = set()
        try:
            async with AsyncProducer(brokers=trio.addrs, retry_times_when_send_failed=2, send_timeout_s=4.0,
                                     send_latency_fault_enable=True) as p:
                async def sender(k: int) -> None:
                    for i in range(PER_SENDER):
                        acked.add(await send_reliably(p, Message(topic, f"s{k}-{i}"), stats))
                tasks = [asyncio.create_task(sender(k)) for k in range(SENDERS)]
                await eventually(lambda: len(acked) >= SENDERS * PER_SENDER // 4, 60, what="a quarter sent")
                old = trio.leader()
                t_kill = time.monotonic()
                await asyncio.to_thread(trio.kill9, old)
                await asyncio.gather(*tasks)
                send_done = time.monotonic() - t_kill
            assert len(acked) == SENDERS * PER_SENDER
            await eventually(lambda: acked <= set(seen), 60, what="every acknowledged message consumed")
        finally:
            running = False
            await commits
            await consumer.close()
        new = trio.leader()
        assert new != old
        return send_done

    try:
        send_done = run(go(), 170)
    finally:
        trio.close()
    want = {f"s{k}-{i}".encode() for k in range(SENDERS) for i in range(PER_SENDER)}
    assert set(processed) == want, f"{len(want - set(processed))} messages lost"
    assert len(processed) == len(want)                # the idempotent effect happened once per message
    duplicate_deliveries = sum(n - 1 for n in seen.values())
    print(f"\nno-loss: produced {len(want)}, consumed {len(set(processed))} distinct, lost 0, "
          f"duplicate deliveries {duplicate_deliveries}, "
          f"application re-sends {stats['app_retries']}, sends finished {send_done:.1f}s after the kill")

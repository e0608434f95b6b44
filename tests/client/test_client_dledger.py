"""The client SDK against a real 3-node DLedger group, through a leader kill -9.

Goal: producers and consumers follow NOT_LEADER hints and ride through a leader failover
without losing an acknowledged message; delayed messages are delivered after a failover,
exactly once, because delivery progress is committed in the replicated log together with
the delivered messages. Method: three `python -m node` processes on free ports; the client
is given all three addresses; the leader is killed with SIGKILL while sends are in flight.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from mqstore import AsyncAdmin, AsyncConsumer, AsyncProducer, AsyncPullConsumer, ConsumeStatus, Message, PullStatus
from mqstore import SendStatus
from tests.client.conftest import run
from tests.client.nodes import DLedgerTrio

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def trio(tmp_path):
    t = DLedgerTrio(tmp_path).start()
    yield t
    t.close()


async def drain_ids(addrs, topic: str) -> list[str]:
    out = []
    async with AsyncPullConsumer("drain", brokers=addrs) as pc:
        for mq in await pc.fetch_queues(topic):
            off = 0
            while True:
                r = await pc.pull(mq, off, 32)
                if r.status is not PullStatus.FOUND:
                    break
                out += [m.msg_id for m in r.messages]
                off = r.next_offset
    return out


def test_sends_and_consumption_ride_through_a_leader_kill(trio):
    topic, group = "FailoverTopic", "FailoverGroup"

    async def go():
        async with AsyncAdmin(brokers=trio.addrs) as admin:
            await admin.create_topic(topic, 2)
        consumed: set[str] = set()

        async def listener(msgs):
            consumed.update(m.msg_id for m in msgs)
            return ConsumeStatus.CONSUME_SUCCESS
        consumer = await AsyncConsumer(group, brokers=trio.addrs, topics=topic, listener=listener,
                                       consume_from_where="CONSUME_FROM_FIRST_OFFSET", heartbeat_interval_s=0.5,
                                       auto_commit_interval_s=0.5, long_poll_ms=300, request_timeout_s=3.0).start()
        acked: list = []
        latencies: list[float] = []
        async with AsyncProducer("pg", brokers=trio.addrs, send_latency_fault_enable=True,
                                 send_timeout_s=4.0) as p:
            async def sender(k: int) -> None:
                for i in range(60):
                    t0 = time.monotonic()
                    r = await p.send(Message(topic, f"w{k}-{i}".encode()))
                    latencies.append(time.monotonic() - t0)
                    acked.append(r)
            senders = [asyncio.create_task(sender(k)) for k in range(4)]
            while len(acked) < 60:
                await asyncio.sleep(0.01)
            old = trio.leader()
            await asyncio.to_thread(trio.kill9, old)
            await asyncio.gather(*senders)          # no send may fail: retries follow the new leader
            streams = set(p.transport._streams)     # API addresses whose produce stream carried sends
        assert len(acked) == 240
        assert f"127.0.0.1:{trio.api[trio.leader()]}" in streams, streams   # the new leader's too
        not_ok = [(r.status, r.msg_id) for r in acked if r.status is not SendStatus.SEND_OK]
        assert not not_ok, f"sends acknowledged without SEND_OK: {not_ok}"
        new = trio.leader()
        assert new != old
        print(f"\nfailover: longest send {max(latencies):.2f}s; old leader {old}, new {new}")
        ids = {r.msg_id for r in acked}
        # An ack means committed on a majority; pulls see a message once the leader has dispatched
        # it to its consume queue, a moment later. So: every acked message shows up, within a bound.
        deadline = time.monotonic() + 10
        stored = set(await drain_ids(trio.addrs, topic))
        while not ids <= stored and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            stored = set(await drain_ids(trio.addrs, topic))
        assert ids <= stored, f"{len(ids - stored)} acked messages lost"   # all survived the failover
        deadline = time.monotonic() + 20
        try:
            while not ids <= consumed and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:
            await consumer.close()
        assert ids <= consumed, f"{len(ids - consumed)} acked messages never consumed"
    run(go(), 120)


def test_delayed_messages_are_delivered_once_across_a_failover(trio):
    topic = "DelayFailover"

    async def go():
        async with AsyncAdmin(brokers=trio.addrs) as admin:
            await admin.create_topic(topic, 1)
        async with AsyncProducer(brokers=trio.addrs) as p:
            early = [await p.send(Message(topic, f"early{i}", delay_level=1)) for i in range(3)]
            deadline = time.monotonic() + 10
            while len(await drain_ids(trio.addrs, topic)) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert sorted(await drain_ids(trio.addrs, topic)) == sorted(r.msg_id for r in early)
            late = [await p.send(Message(topic, f"late{i}", delay_level=2)) for i in range(3)]   # due in 2 s
            old = trio.leader()
            await asyncio.to_thread(trio.kill9, old)   # before they are due
            trio.leader()
            want = sorted(r.msg_id for r in early + late)
            deadline = time.monotonic() + 20
            while sorted(set(await drain_ids(trio.addrs, topic))) != want and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.5)                   # a re-delivery by the new leader would show by now
            stored = await drain_ids(trio.addrs, topic)
        assert sorted(stored) == want, "each delayed message delivered exactly once"
    run(go(), 90)

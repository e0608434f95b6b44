"""Route lookup through the controller, and retries plus fault tolerance across broker groups.

Goal 1: a client given only a controller address finds a topic's queues and the node that
leads their group (the controller's TopicRouteData), sends there and pulls back.
Method: one controller process and a single-node DLedger group reporting to it (as
tests/integration/test_controller_dledger_routes.py does), on free loopback ports.
Goal 2: with two broker groups and one of them dead, every send still succeeds (retried
on the other group), and with sendLatencyFaultEnable the dead group is tried only once.
Method: two standalone node processes; one is killed after the route is cached.
"""

from __future__ import annotations

import pytest

from mqstore import (AsyncAdmin, AsyncConsumer, AsyncProducer, AsyncPullConsumer, ConsumeStatus, Message, PullStatus,
                     SendStatus)
from tests.client.conftest import eventually, run
from tests.client.nodes import Standalone
from tests.integration.test_ha_processes import Group, http

pytestmark = pytest.mark.timeout(120)


def test_producer_and_consumer_use_the_controllers_routes(tmp_path):
    g = Group(str(tmp_path))
    try:
        g.start_controller()
        api = g.start_dledger_node("dl")
        ctl = f"127.0.0.1:{g.ctl_api}"
        g.wait_registered("broker-a", f"127.0.0.1:{api}")     # the DLedger leader
        st, _ = http("POST", f"http://{ctl}/topics", {"topic": "RoutedTopic", "queues": 2})
        assert st == 201

        async def go():
            async with AsyncAdmin(brokers=f"127.0.0.1:{api}") as admin:   # the group's own topic config
                await admin.create_topic("RoutedTopic", 2)
            async with AsyncProducer(controller=ctl) as p:
                results = [await p.send(Message("RoutedTopic", f"m{i}")) for i in range(4)]
            assert all(r.status is SendStatus.SEND_OK and r.broker_name == "broker-a" for r in results)
            assert sorted(r.queue_id for r in results) == [0, 0, 1, 1]
            async with AsyncPullConsumer("G", controller=ctl) as pc:
                queues = await pc.fetch_queues("RoutedTopic")
                assert [(q.broker_name, q.queue_id) for q in queues] == [("broker-a", 0), ("broker-a", 1)]
                bodies = []
                for q in queues:
                    r = await pc.pull(q, 0)
                    assert r.status is PullStatus.FOUND
                    bodies += [m.body for m in r.messages]
            assert sorted(bodies) == [b"m0", b"m1", b"m2", b"m3"]
            pushed = []

            async def listener(msgs):
                pushed.extend(m.body for m in msgs)
                return ConsumeStatus.CONSUME_SUCCESS
            async with AsyncConsumer("PG", controller=ctl, topics="RoutedTopic", listener=listener,
                                     consume_from_where="CONSUME_FROM_FIRST_OFFSET", long_poll_ms=200) as c:
                await eventually(lambda: len(pushed) == 4, what="push consumer got the routed messages")
                assert len(c.process_queues) == 2     # both queues allocated at start: groups came from the route
            assert sorted(pushed) == [b"m0", b"m1", b"m2", b"m3"]
        run(go())
    finally:
        g.stop_all()


@pytest.mark.parametrize("fault_enable", [True, False])
def test_sends_retry_on_another_group_and_avoid_a_dead_one(tmp_path, fault_enable):
    a, b = Standalone(_mk(tmp_path, "a")).start(), Standalone(_mk(tmp_path, "b")).start()
    try:
        async def go():
            brokers = {"a": a.addr, "b": b.addr}
            async with AsyncAdmin(brokers=brokers) as admin:
                await admin.create_topic("Spread", 2)
            async with AsyncProducer(brokers=brokers, send_latency_fault_enable=fault_enable,
                                     send_timeout_s=2.0) as p:
                await p.routes.route("Spread")                      # route cached with both groups
                tried: list[str] = []
                real = p._send_to

                async def spy(mq, msgs, timeout_s):
                    tried.append(mq.broker_name)
                    return await real(mq, msgs, timeout_s)
                p._send_to = spy
                b.close()                                           # group b dies (kill -9)
                results = [await p.send(Message("Spread", f"m{i}")) for i in range(12)]
            assert all(r.status is SendStatus.SEND_OK and r.broker_name == "a" for r in results)
            return tried.count("b")
        tries_on_dead = run(go())
        if fault_enable:
            assert tries_on_dead == 1           # isolated after its first failure
        else:
            assert tries_on_dead >= 3           # round-robin keeps landing on it, then retries elsewhere
    finally:
        a.close()
        b.close()


def _mk(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    return d

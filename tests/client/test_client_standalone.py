"""The client SDK against a real standalone node process.

Goal: each acceptance behaviour of the SDK, end to end over HTTP+msgpack: send results and
ids, queue selection, pull with explicit offsets, push consumption in clustering (rebalance
as members come and go, offsets on the broker) and broadcasting (offsets.json), retry with
raised reconsume_times and the DLQ after 16, delay levels (also across a restart),
transactions with check-back, the synchronous API, and clear errors for bad input.
Method: one node per module on free ports, a fresh topic and group per test; waits are
bounded polls on observable state.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from mqstore import (Admin, AsyncAdmin, AsyncConsumer, AsyncProducer, AsyncPullConsumer, AsyncTransactionProducer,
                     ConsumeStatus, Consumer, LocalTransactionState, Message, MessageQueue, MQBrokerError, Producer,
                     PullConsumer, PullStatus, SendStatus, TransactionProducer)
from mqstore.client.route import RouteTable
from mqstore.client.transport import Transport
from tests.client.conftest import eventually, run


async def make_topic(addr: str, topic: str, queues: int = 4) -> None:
    async with AsyncAdmin(brokers=addr) as admin:
        await admin.create_topic(topic, queues)


async def drain(addr: str, topic: str, expect: int = 0, timeout_s: float = 10.0) -> list:
    """Every message of the topic, pulling each queue from 0; with `expect`, wait until that many
    are visible (an ack means stored; a pull sees the message once it is dispatched, a moment later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = await _drain_once(addr, topic)
        if len(out) >= expect or time.monotonic() > deadline:
            return out
        await asyncio.sleep(0.05)


async def _drain_once(addr: str, topic: str, group: str = "drain") -> list:
    out = []
    async with AsyncPullConsumer(group, brokers=addr) as pc:
        for mq in await pc.fetch_queues(topic):
            off = 0
            while True:
                r = await pc.pull(mq, off, 32)
                if r.status is not PullStatus.FOUND:
                    break
                out += r.messages
                off = r.next_offset
    return out


async def eventually_async(fetch, pred, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not pred(await fetch()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_send_results_ids_and_queue_selection(node, name):
    topic = name()

    async def go():
        await make_topic(node.addr, topic, 4)
        async with AsyncProducer("pg", brokers=node.addr) as p:
            r = await p.send(Message(topic, b"one", tags="A", keys=["k1"], properties={"p": "v"}))
            assert r.status is SendStatus.SEND_OK and len(r.msg_id) == 32 and len(r.offset_msg_id) == 32
            assert r.msg_id != r.offset_msg_id                       # client-side UNIQ_KEY is the msg_id
            rr = [await p.send(Message(topic, f"rr{i}")) for i in range(8)]
            assert sorted(x.queue_id for x in rr) == [0, 0, 1, 1, 2, 2, 3, 3]   # round-robin
            batch = await p.send_batch([Message(topic, f"b{i}") for i in range(5)])
            assert len({b.queue_id for b in batch}) == 1
            assert [b.queue_offset for b in batch] == list(range(batch[0].queue_offset, batch[0].queue_offset + 5))
            sharded = {(await p.send(Message(topic, b"s"), sharding_key="order-7")).queue_id for _ in range(5)}
            assert len(sharded) == 1
            picked = await p.send(Message(topic, b"sel"), selector=lambda qs, m, arg: qs[arg], arg=2)
            assert picked.queue_id == 2
            fixed = await p.send(Message(topic, b"fixed"), queue=MessageQueue(topic, "broker", 3))
            assert fixed.queue_id == 3
            seen = []
            t = p.send_async(Message(topic, b"cb"), on_success=seen.append)
            await t
            assert seen and seen[0].status is SendStatus.SEND_OK
            await p.send_oneway(Message(topic, b"oneway"))
        async with AsyncAdmin(brokers=node.addr) as admin:
            m = await admin.query_message("broker", r.offset_msg_id)
            assert (m.body, m.msg_id, m.tags, m.keys, m.properties["p"]) == (b"one", r.msg_id, "A", ["k1"], "v")
        bodies = [m.body for m in await drain(node.addr, topic, 23)]
        assert b"oneway" in bodies and b"cb" in bodies and len(bodies) == 1 + 8 + 5 + 5 + 1 + 1 + 1 + 1
    run(go())


def test_pull_consumer_explicit_offsets_and_commit(node, name):
    topic, group = name(), name("G")

    async def go():
        await make_topic(node.addr, topic, 1)
        async with AsyncProducer(brokers=node.addr) as p:
            await p.send_batch([Message(topic, f"m{i}", tags="A" if i % 2 else "B") for i in range(10)])
        async with AsyncPullConsumer(group, brokers=node.addr) as pc:
            (mq,) = await pc.fetch_queues(topic)
            await eventually_async(lambda: pc.queue_bounds(mq), lambda b: b[1] == 10)
            r = await pc.pull(mq, 3, 4)
            assert r.status is PullStatus.FOUND and [m.queue_offset for m in r.messages] == [3, 4, 5, 6]
            assert (r.next_offset, r.min_offset, r.max_offset) == (7, 0, 10)
            assert await pc.search_offset(mq, r.messages[1].store_timestamp) <= 4
            assert await pc.search_offset(mq, 0) == 0
            assert await pc.search_offset(mq, r.messages[-1].store_timestamp + 3_600_000) == 10
            tagged = await pc.pull(mq, 0, 32, expression="A")
            assert [m.body for m in tagged.messages] == [f"m{i}".encode() for i in (1, 3, 5, 7, 9)]
            assert (await pc.pull(mq, 10)).status is PullStatus.NO_NEW_MSG
            assert (await pc.pull(mq, 11)).status is PullStatus.OFFSET_ILLEGAL
            t0 = time.monotonic()
            assert (await pc.pull(mq, 10, wait_ms=300)).status is PullStatus.NO_NEW_MSG
            assert time.monotonic() - t0 >= 0.25                   # long polling held the request
            assert await pc.committed(mq) is None
            await pc.commit(mq, 7)
            assert await pc.committed(mq) == 7
    run(go())


def test_clustering_rebalances_as_members_come_and_go(node, name):
    topic, group = name(), name("G")

    async def go():
        await make_topic(node.addr, topic, 4)
        got: dict[str, list] = {"c1": [], "c2": []}

        def listener_for(key):
            async def listener(msgs):
                got[key].extend(m.body for m in msgs)
                return ConsumeStatus.CONSUME_SUCCESS
            return listener
        kw = dict(brokers=node.addr, topics=topic, consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                  heartbeat_interval_s=0.3, auto_commit_interval_s=0.3, long_poll_ms=200)
        c1 = await AsyncConsumer(group, listener=listener_for("c1"), instance_name="c1", **kw).start()
        assert len(c1.process_queues) == 4 + 0                     # alone: all 4 (retry topic not yet created)
        c2 = await AsyncConsumer(group, listener=listener_for("c2"), instance_name="c2", **kw).start()
        await eventually(lambda: len(c1.process_queues) == 2 and len(c2.process_queues) == 2, what="2+2 split")
        assert not set(c1.process_queues) & set(c2.process_queues)
        async with AsyncProducer(brokers=node.addr) as p:
            sent = [(await p.send(Message(topic, f"m{i}"))) for i in range(40)]
        await eventually(lambda: len(got["c1"]) + len(got["c2"]) >= 40, what="all consumed")
        assert got["c1"] and got["c2"]
        assert sorted(got["c1"] + got["c2"]) == sorted(f"m{i}".encode() for i in range(40))
        await c2.close()                                           # leaves the group: c1 takes all 4 back
        await eventually(lambda: len(c1.process_queues) == 4, what="c1 owns all queues again")
        async with AsyncProducer(brokers=node.addr) as p:
            await p.send_batch([Message(topic, f"late{i}") for i in range(4)], queue=MessageQueue(topic, "broker", 3))
        await eventually(lambda: sum(b.startswith(b"late") for b in got["c1"]) == 4, what="late messages")
        await c1.commit()
        await c1.close()
        async with AsyncAdmin(brokers=node.addr) as admin:
            offsets = await admin.consumer_offsets(group, topic)
        per_queue = {}
        for r in sent:
            per_queue[r.queue_id] = max(per_queue.get(r.queue_id, 0), r.queue_offset + 1)
        per_queue[3] += 4
        assert {mq.queue_id: o for mq, o in offsets.items()} == per_queue
    run(go())


def test_broadcasting_delivers_everything_to_everyone_with_local_offsets(node, name, tmp_path):
    topic, group = name(), name("G")

    async def go():
        await make_topic(node.addr, topic, 2)
        got: dict[str, list] = {"a": [], "b": []}

        def consumer(key):
            async def listener(msgs):
                got[key].extend(m.body for m in msgs)
                return ConsumeStatus.CONSUME_SUCCESS
            return AsyncConsumer(group, brokers=node.addr, topics=topic, listener=listener, instance_name=key,
                                 message_model="BROADCASTING", consume_from_where="CONSUME_FROM_FIRST_OFFSET",
                                 offset_store_dir=str(tmp_path), long_poll_ms=200)
        a, b = await consumer("a").start(), await consumer("b").start()
        async with AsyncAdmin(brokers=node.addr) as admin:      # both listed, as broadcasting members
            (members,) = (await admin.group_members(group)).values()
            assert [(m["client_id"], m["message_model"]) for m in members] == [
                (a.client_id, "BROADCASTING"), (b.client_id, "BROADCASTING")]
        async with AsyncProducer(brokers=node.addr) as p:
            await p.send_batch([Message(topic, f"m{i}") for i in range(10)], queue=MessageQueue(topic, "broker", 0))
            await p.send_batch([Message(topic, f"n{i}") for i in range(6)], queue=MessageQueue(topic, "broker", 1))
        await eventually(lambda: len(got["a"]) == 16 and len(got["b"]) == 16, what="both got all 16")
        path_a = a.offsets.path
        await a.close()
        await b.close()
        assert path_a.endswith(os.path.join(group, "offsets.json")) and os.path.exists(path_a)
        with open(path_a) as f:
            rows = json.load(f)["offsets"]
        assert sorted((r["queue_id"], r["offset"]) for r in rows if r["topic"] == topic) == [(0, 10), (1, 6)]
        async with AsyncAdmin(brokers=node.addr) as admin:        # nothing stored on the broker
            assert await admin.consumer_offsets(group, topic) == {}
        got["a"].clear()
        a2 = await consumer("a").start()                           # same client id: resumes from offsets.json
        async with AsyncProducer(brokers=node.addr) as p:
            await p.send(Message(topic, b"after"), queue=MessageQueue(topic, "broker", 0))
        await eventually(lambda: got["a"] == [b"after"], what="only the new message")
        await asyncio.sleep(0.3)
        assert got["a"] == [b"after"]
        await a2.close()
    run(go())


def test_async_iteration_and_reconsume_later(node, name):
    topic, group = name(), name("G")

    async def go():
        await make_topic(node.addr, topic, 1)
        async with AsyncProducer(brokers=node.addr) as p:
            await p.send_batch([Message(topic, f"m{i}") for i in range(3)])
        seen = []
        async with AsyncConsumer(group, brokers=node.addr, topics=topic, heartbeat_interval_s=0.3,
                                 consume_from_where="CONSUME_FROM_FIRST_OFFSET", long_poll_ms=200) as c:
            async for msg in c:
                seen.append((msg.body, msg.reconsume_times, msg.topic))
                if msg.body == b"m1" and msg.reconsume_times == 0:
                    c.reconsume_later(msg)
                if len(seen) == 4:
                    break
        assert sorted(seen[:3]) == [(b"m0", 0, topic), (b"m1", 0, topic), (b"m2", 0, topic)]
        assert seen[3] == (b"m1", 1, topic)                        # back from %RETRY%, topic restored
    run(go())


def test_consumer_connection_shows_each_member_as_its_heartbeat_describes_it(node, name):
    import io

    from mqstore import __version__, cli
    topic, group = name(), name("G")

    def admin(*argv: str) -> str:
        out = io.StringIO()
        assert cli.main([*argv, "-n", node.addr], out=out) == 0
        return out.getvalue()

    async def go():
        await make_topic(node.addr, topic, 2)
        got = asyncio.Event()
        async with AsyncProducer(brokers=node.addr) as p:
            await p.send(Message(topic, "m", tags="TagA"))

        async def listener(msgs):
            got.set()
            return ConsumeStatus.CONSUME_SUCCESS
        async with AsyncConsumer(group, brokers=node.addr, topics={topic: "TagA || TagB"}, instance_name="cc1",
                                 consume_from_where="CONSUME_FROM_FIRST_OFFSET", listener=listener,
                                 long_poll_ms=200) as c:
            await asyncio.wait_for(got.wait(), 10)
            await eventually_async(c.commit, lambda n: n >= 1)     # the group is listed once it has an offset
            text = await asyncio.to_thread(admin, "consumerConnection", "-g", group)
            row = next(line.split() for line in text.splitlines() if line.startswith(c.client_id))
            assert row[1].startswith("127.0.0.1:") and row[2:] == ["PYTHON", __version__]
            assert f"{topic:<20} TagA || TagB" in text.splitlines()
            assert f"%RETRY%{group}" in text
            assert text.endswith("ConsumeType: CONSUME_PASSIVELY\nMessageModel: CLUSTERING\n"
                                 "ConsumeFromWhere: CONSUME_FROM_FIRST_OFFSET\n")
            listing = await asyncio.to_thread(admin, "consumerProgress")
            assert [line.split()[1:5] for line in listing.splitlines() if line.startswith(group)] == [
                ["1", __version__, "PUSH", "CLUSTERING"]]
        assert "not online" in await asyncio.to_thread(_cli_error, node.addr, group)
    run(go())


def _cli_error(addr: str, group: str) -> str:
    import contextlib
    import io

    from mqstore import cli
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli.main(["consumerConnection", "-g", group, "-n", addr], out=io.StringIO()) == 1
    return err.getvalue()


def test_failed_message_retries_16_times_then_lands_in_dlq(node, name):
    topic, group, other = name(), name("G"), name("G")

    async def go():
        await make_topic(node.addr, topic, 1)
        attempts = []

        def listener(msgs):                                        # a plain function: runs on the thread pool
            for m in msgs:
                attempts.append((m.reconsume_times, m.topic, m.msg_id))
            return ConsumeStatus.RECONSUME_LATER
        async with AsyncProducer(brokers=node.addr) as p:
            sent = await p.send(Message(topic, b"poison", keys=["poison-1"]))
        async with AsyncConsumer(group, brokers=node.addr, topics=topic, listener=listener,
                                 consume_from_where="CONSUME_FROM_FIRST_OFFSET", heartbeat_interval_s=0.3,
                                 long_poll_ms=300) as c:
            async with AsyncAdmin(brokers=node.addr) as admin:
                dlq = []

                async def poll_dlq():
                    while not dlq:
                        dlq.extend(await admin.list_dlq(group))
                        await asyncio.sleep(0.3)
                await asyncio.wait_for(poll_dlq(), 60)
            assert c.consumed == 0
        assert [a[0] for a in attempts] == list(range(17))         # first try + 16 retries
        assert {a[1] for a in attempts} == {topic} and {a[2] for a in attempts} == {sent.msg_id}
        (d,) = dlq
        assert (d.body, d.msg_id, d.reconsume_times, d.topic) == (b"poison", sent.msg_id, 17, f"%DLQ%{group}")
        assert d.properties["RETRY_TOPIC"] == topic
        async with AsyncAdmin(brokers=node.addr) as admin:
            resent = await admin.resend_dlq(d)
        assert resent.msg_id == sent.msg_id
        msgs = await drain(node.addr, topic, 2)
        assert [(m.body, m.msg_id, m.queue_offset) for m in msgs] == [(b"poison", sent.msg_id, 0),
                                                                       (b"poison", sent.msg_id, 1)]
    run(go(), 90)


def test_delay_levels_deliver_late_and_survive_a_restart(node, name):
    topic = name()

    async def go(phase: int):
        if phase == 0:
            await make_topic(node.addr, topic, 1)
            async with AsyncProducer(brokers=node.addr) as p:
                t0 = time.time() * 1000
                r1 = await p.send(Message(topic, b"level1", delay_level=1))   # 1 s
                r2 = await p.send(Message(topic, b"level2", delay_level=2))   # 2 s
                assert r1.queue_id == 0 and r2.queue_id == 0
                assert await drain(node.addr, topic) == []
                first = await drain(node.addr, topic, 1)
                assert first[0].body == b"level1"                         # the shorter delay comes first
                both = await drain(node.addr, topic, 2)
                assert [m.body for m in both] == [b"level1", b"level2"]
                assert both[0].store_timestamp - t0 >= 1000 and both[1].store_timestamp - t0 >= 2000
                assert both[1].store_timestamp - both[0].store_timestamp >= 800
                assert "DELAY" not in both[0].properties and both[0].msg_id == r1.msg_id
                await p.send(Message(topic, b"across-restart", delay_level=2))
        else:
            await drain(node.addr, topic, 3, timeout_s=15)
            await asyncio.sleep(1.5)     # a re-delivery of the earlier ones would show up by now
            assert [m.body for m in await drain(node.addr, topic)] == [b"level1", b"level2", b"across-restart"]
    run(go(0))
    node.restart()                       # SIGTERM inside the 2 s delay, then start again
    run(go(1))


def test_transactions_commit_rollback_and_check_back(node, name):
    topic, pgroup = name(), name("PG")

    async def go():
        await make_topic(node.addr, topic, 1)
        decisions = {b"commit": LocalTransactionState.COMMIT_MESSAGE,
                     b"rollback": LocalTransactionState.ROLLBACK_MESSAGE,
                     b"unknown": LocalTransactionState.UNKNOW, b"raises": None}
        checked = []

        def execute(msg, arg):
            state = decisions[msg.body]
            if state is None:
                raise RuntimeError("local transaction failed")
            return state

        async def check(msg):
            checked.append(msg.body)
            return LocalTransactionState.COMMIT_MESSAGE if msg.body == b"unknown" else \
                LocalTransactionState.ROLLBACK_MESSAGE
        async with AsyncTransactionProducer(pgroup, brokers=node.addr, executor=execute, checker=check,
                                            check_interval_s=0.3, check_immunity_s=0.5) as tp:
            results = {b: await tp.send_message_in_transaction(Message(topic, b)) for b in decisions}
            assert results[b"commit"].local_state is LocalTransactionState.COMMIT_MESSAGE
            assert results[b"raises"].local_state is LocalTransactionState.UNKNOW
            assert [m.body for m in await drain(node.addr, topic, 1)] == [b"commit"]   # half messages are hidden
            deadline = time.monotonic() + 15
            while sorted(set(checked)) != [b"raises", b"unknown"] and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert sorted(set(checked)) == [b"raises", b"unknown"]   # decided ones are never checked
            await asyncio.sleep(0.8)                                    # a few more check rounds
            assert sorted(set(checked)) == [b"raises", b"unknown"] and len(checked) == 2
            again = await tp.end_transaction("broker", results[b"commit"].send_result.offset_msg_id,
                                             LocalTransactionState.COMMIT_MESSAGE)
            assert again["status"] == "ALREADY_DECIDED"
        msgs = await drain(node.addr, topic, 2)
        assert sorted(m.body for m in msgs) == [b"commit", b"unknown"]
        committed = {m.body: m for m in msgs}[b"commit"]
        assert committed.msg_id == results[b"commit"].send_result.msg_id
        assert "TRAN_MSG" not in committed.properties
    run(go())


def test_synchronous_api(node, name, tmp_path):
    topic, group = name(), name("G")
    with Admin(brokers=node.addr) as admin:
        admin.create_topic(topic, 2)
    with Producer("pg", brokers=node.addr) as p:
        results = [p.send(Message(topic, f"s{i}")) for i in range(6)]
        fut = p.send_async(Message(topic, b"async"))
        assert fut.result(10).status is SendStatus.SEND_OK
    assert all(r.status is SendStatus.SEND_OK for r in results)
    with PullConsumer(group, brokers=node.addr) as pc:
        queues = pc.fetch_queues(topic)
        deadline = time.monotonic() + 10
        while sum(pc.queue_bounds(q)[1] for q in queues) < 7 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(len(pc.pull(q, 0).messages) for q in queues) == 7
    got = []
    with Consumer(group, brokers=node.addr, topics=topic, listener=lambda ms: got.extend(ms) or "CONSUME_SUCCESS",
                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", long_poll_ms=200):
        deadline = time.monotonic() + 10
        while len(got) < 7 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(got) == 7
    with Consumer(name("G"), brokers=node.addr, topics=topic,
                  consume_from_where="CONSUME_FROM_FIRST_OFFSET", long_poll_ms=200) as c:
        polled = [c.poll(5) for _ in range(7)]
    assert sorted(m.body for m in polled) == sorted([f"s{i}".encode() for i in range(6)] + [b"async"])
    with TransactionProducer(name("PG"), brokers=node.addr, executor=lambda m, a: "COMMIT_MESSAGE",
                             checker=lambda m: "ROLLBACK_MESSAGE") as tp:
        r = tp.send_message_in_transaction(Message(topic, b"tx"))
    assert r.local_state is LocalTransactionState.COMMIT_MESSAGE


def test_bad_input_gets_clear_errors(node, name):
    topic = name()

    async def go():
        await make_topic(node.addr, topic, 1)
        async with AsyncProducer(brokers=node.addr) as p:
            with pytest.raises(MQBrokerError, match="queue_id"):
                await p.send(Message(topic, b"x"), queue=MessageQueue(topic, "broker", 9))
            with pytest.raises(MQBrokerError, match="reserved"):
                await p.send(Message("RMQ_SYS_TRANS_HALF_TOPIC", b"x"))
            with pytest.raises(MQBrokerError, match="PGROUP"):
                await p.send(Message(topic, b"x", properties={"TRAN_MSG": "true"}))
            with pytest.raises(MQBrokerError, match="DELAY"):
                await p.send(Message(topic, b"x", properties={"DELAY": "soon"}))
            g = p.routes.group("broker")
            with pytest.raises(MQBrokerError, match="offsetMsgId") as e:
                await p.transport.call(g, "POST", "/groups/G/retry", {"offset_msg_id": "zz"})
            assert e.value.code == "BAD_REQUEST" and e.value.http_status == 400
            with pytest.raises(MQBrokerError, match="action"):
                await p.transport.call(g, "POST", "/transactions/end",
                                       {"producer_group": "PG", "offset_msg_id": "0" * 32, "action": "MAYBE"})
            with pytest.raises(MQBrokerError, match="group"):
                await p.transport.call(g, "POST", "/groups/bad group/heartbeat", {"client_id": "c", "topics": []})
            with pytest.raises(MQBrokerError, match="producer_group|group must"):
                await p.transport.call(g, "GET", "/transactions/pending")
    run(go())


def test_flow_control_bounds_in_flight_messages_and_concurrency(node, name):
    topic, group = name(), name("G")

    async def go():
        await make_topic(node.addr, topic, 1)
        async with AsyncProducer(brokers=node.addr) as p:
            await p.send_batch([Message(topic, f"m{i}") for i in range(40)])
        gate = asyncio.Event()
        running, peak, done = [0], [0], []

        async def slow(msgs):
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            await gate.wait()
            running[0] -= 1
            done.extend(msgs)
            return ConsumeStatus.CONSUME_SUCCESS
        async with AsyncConsumer(group, brokers=node.addr, topics=topic, listener=slow, consume_thread_max=2,
                                 pull_threshold_for_queue=5, pull_batch_size=4, long_poll_ms=100,
                                 consume_from_where="CONSUME_FROM_FIRST_OFFSET") as c:
            await eventually(lambda: c.process_queues and running[0] == 2, what="two listener calls running")
            (pq,) = [q for q in c.process_queues.values() if q.mq.topic == topic]
            await asyncio.sleep(0.5)                      # pulling would continue here without flow control
            held = len(pq.msgs)
            assert 5 <= held <= 5 - 1 + 4                # stops once 5 are held (one batch may overshoot)
            assert peak[0] == 2                           # consume_thread_max
            gate.set()
            await eventually(lambda: len(done) == 40, what="all 40 consumed after the gate opens")
            assert peak[0] == 2
    run(go())


CONSUMER_SCRIPT = """
import sys, time
from mqstore import Consumer
c = Consumer(sys.argv[2], brokers=sys.argv[1], topics=sys.argv[3], listener=lambda ms: "CONSUME_SUCCESS",
             heartbeat_interval_s=0.3, instance_name="crashing", long_poll_ms=200)
c.start()
print("started", flush=True)
time.sleep(120)
"""


def test_a_member_that_dies_without_leaving_is_expired_and_its_queues_reassigned(node, name):
    import subprocess
    import sys
    topic, group = name(), name("G")
    run(make_topic(node.addr, topic, 4))
    proc = subprocess.Popen([sys.executable, "-c", CONSUMER_SCRIPT, node.addr, group, topic],
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proc.stdout.readline().strip() == b"started"

        async def go():
            async with AsyncConsumer(group, brokers=node.addr, topics=topic, listener=lambda ms: "CONSUME_SUCCESS",
                                     heartbeat_interval_s=0.3, long_poll_ms=200) as c:
                await eventually(lambda: len(c.process_queues) == 2, what="2 of 4 queues while both live")
                proc.kill()                                   # no goodbye: only its heartbeats stop
                t0 = time.monotonic()
                await eventually(lambda: len(c.process_queues) == 4, what="all 4 queues after expiry")
                return time.monotonic() - t0
        took = run(go())
        assert took >= 0.5                                    # not before its 1 s membership ttl ran out
    finally:
        proc.kill()
        proc.wait(10)


def test_regression_a_bare_address_list_takes_the_group_name_its_node_reports(node, name):
    """Given as a bare address list, the group was called "broker" in every send result, queue
    and message while the node's brokerName (mqadmin's, the CLI's) was another: the client
    now names the group as its node does, and "broker" still resolves as an alias."""
    topic = name()

    async def go():
        await make_topic(node.addr, topic, 2)
        async with AsyncAdmin(brokers=node.addr) as admin:
            real = (await admin.transport.call(admin.routes.group("broker"), "GET", "/health"))["group"]
            assert real and real != "broker"
            assert list(await admin.topic_status(topic)) == [real]
        async with AsyncProducer(brokers=node.addr) as p:
            r = await p.send(Message(topic, b"named"))
            assert r.broker_name == real
            old = await p.send(Message(topic, b"alias"), queue=MessageQueue(topic, "broker", 1))
            assert old.status is SendStatus.SEND_OK and old.queue_id == 1
        async with AsyncPullConsumer("named", brokers=node.addr) as pc:
            queues = await pc.fetch_queues(topic)
            assert {mq.broker_name for mq in queues} == {real}
            pulled = [m for mq in queues for m in (await pc.pull(mq, 0, 32)).messages]
            assert sorted(m.body for m in pulled) == [b"alias", b"named"]
            assert {m.broker_name for m in pulled} == {real}
        t = Transport(5.0)
        await t.start()
        try:
            routes = RouteTable(t, brokers=[node.addr])
            await asyncio.gather(routes.learn_name(), routes.learn_name())   # two lookups at once: one rename
            assert list(routes.groups) == [real] and routes.aliases == {"broker": real}
        finally:
            await t.close()
    run(go())

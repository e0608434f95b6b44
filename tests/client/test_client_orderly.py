"""Ordered consumption: queue locks on the broker and the orderly push consumer.

Goal: per sharding key, messages are consumed in the order they were sent, one at a time,
and never by two consumers at once on the same queue — through a rebalance (a second
consumer joins) and through a DLedger leader kill -9 (the new leader grants no lock for one
lock lifetime, so a lock the old leader granted has expired on its holder first).
Method: the lock table is checked with a fake clock; end to end, every listener call records
(consumer, queue, key, seq, start, end) on one monotonic clock, and the records are checked:
per key no message is consumed before an earlier one (a replay from the committed offset
may repeat messages, never skip ahead), and per queue the intervals of different consumers
never overlap. Brokers run with `rebalanceLockMaxLiveTimeMs=3000` (tests/client/nodes.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from mqstore import AsyncAdmin, AsyncConsumer, AsyncProducer, ConsumeStatus, Consumer, Message, MQConfigError
from node.broker import BadRequest
from node.consumer_groups import QueueLocks
from tests.client.conftest import eventually, run
from tests.client.nodes import DLedgerTrio

pytestmark = pytest.mark.timeout(180)

FAST = dict(heartbeat_interval_s=0.3, auto_commit_interval_s=0.3, lock_renew_interval_s=1.0, long_poll_ms=300,
            consume_from_where="CONSUME_FROM_FIRST_OFFSET", suspend_current_queue_time_s=0.1)


# --- the broker's lock table ---------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def q(topic, qid):
    return {"topic": topic, "queue_id": qid}


def test_queue_locks_grant_refuse_renew_expire_and_unlock():
    clock = Clock()
    locks = QueueLocks(3000, clock)
    locks.reset("term1", clock.t - 10)                      # began long ago: no quiet time left
    assert locks.lock("g", "a", [q("T", 0), q("T", 1)])["locked"] == [q("T", 0), q("T", 1)]
    assert locks.lock("g", "b", [q("T", 1), q("T", 2)])["locked"] == [q("T", 2)]   # T/1 is a's
    assert locks.lock("other", "b", [q("T", 1)])["locked"] == [q("T", 1)]            # groups are separate
    clock.t += 2.0
    assert locks.lock("g", "a", [q("T", 1)])["locked"] == [q("T", 1)]               # renewed to t+3
    clock.t += 2.0                                                                  # T/0 expired, T/1 not
    assert locks.lock("g", "b", [q("T", 0), q("T", 1)])["locked"] == [q("T", 0)]
    assert locks.unlock("g", "b", [q("T", 1)]) == []                                # not b's to release
    assert locks.unlock("g", "a", [q("T", 1)]) == [q("T", 1)]
    assert locks.lock("g", "b", [q("T", 1)])["locked"] == [q("T", 1)]
    assert [(d["topic"], d["queue_id"], d["client_id"]) for d in locks.describe("g")] == \
        [("T", 0, "b"), ("T", 1, "b")]                          # T/2 expired unrenewed


def test_new_leadership_forgets_locks_and_grants_none_for_one_lifetime():
    clock = Clock()
    locks = QueueLocks(3000, clock)
    locks.reset("term1", clock.t - 10)
    assert locks.lock("g", "a", [q("T", 0)])["locked"]
    locks.reset("term2", clock.t)                            # this node just took over
    out = locks.lock("g", "b", [q("T", 0)])
    assert out["locked"] == [] and 2900 <= out["retry_after_ms"] <= 3001
    clock.t += 2.9
    assert locks.lock("g", "b", [q("T", 0)])["locked"] == []
    clock.t += 0.2
    assert locks.lock("g", "b", [q("T", 0)])["locked"] == [q("T", 0)]


def test_bad_lock_requests_get_clear_errors():
    locks = QueueLocks(3000, Clock())
    for cid, queues in [("", [q("T", 0)]), (5, [q("T", 0)]), ("a", "T"), ("a", [{"topic": "T"}]),
                        ("a", [q("T", -1)]), ("a", [q("T", True)]), ("a", [q("bad topic!", 0)]),
                        ("a", [q("T", 0)] * 2000)]:
        with pytest.raises(BadRequest):
            locks.lock("g", cid, queues)


def test_orderly_consumer_settings_are_checked():
    with pytest.raises(MQConfigError, match="listener"):
        AsyncConsumer("g", brokers="127.0.0.1:1", topics="T", orderly=True)
    with pytest.raises(MQConfigError, match="CLUSTERING"):
        AsyncConsumer("g", brokers="127.0.0.1:1", topics="T", orderly=True, listener=print,
                      message_model="BROADCASTING")
    with pytest.raises(MQConfigError, match="lock_renew_interval_s"):
        AsyncConsumer("g", brokers="127.0.0.1:1", topics="T", orderly=True, listener=print, lock_renew_interval_s=0)


# --- end to end ------------------------------------------------------------------------------------
@dataclass
class Rec:
    consumer: str
    queue_id: int
    key: str
    seq: int
    start: float
    end: float


class Recorder:
    def __init__(self, pause_s: float = 0.002):
        self.recs: list[Rec] = []
        self.pause_s = pause_s

    def listener(self, name: str, fail_once: set | None = None):
        async def on(msgs):
            for m in msgs:
                t0 = time.monotonic()
                key, seq = m.body.decode().split(":")
                await asyncio.sleep(self.pause_s)
                if fail_once is not None and m.body not in fail_once:
                    fail_once.add(m.body)
                    return ConsumeStatus.RECONSUME_LATER
                self.recs.append(Rec(name, m.queue_id, key, int(seq), t0, time.monotonic()))
            return ConsumeStatus.CONSUME_SUCCESS
        return on

    def sync_listener(self, name: str):
        def on(msgs):
            for m in msgs:
                t0 = time.monotonic()
                key, seq = m.body.decode().split(":")
                time.sleep(self.pause_s)
                self.recs.append(Rec(name, m.queue_id, key, int(seq), t0, time.monotonic()))
            return ConsumeStatus.CONSUME_SUCCESS
        return on

    def seqs(self) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for r in self.recs:
            out.setdefault(r.key, set()).add(r.seq)
        return out

    def check(self) -> dict[str, int]:
        """Assert order per key and no overlap per queue; returns counts for the report."""
        seen: dict[str, int] = {}
        replays = 0
        for r in sorted(self.recs, key=lambda r: r.start):
            top = seen.get(r.key, -1)
            assert r.seq <= top + 1, f"key {r.key}: seq {r.seq} consumed before seq {top + 1}"
            replays += r.seq <= top
            seen[r.key] = max(top, r.seq)
        by_queue: dict[int, list[Rec]] = {}
        for r in self.recs:
            by_queue.setdefault(r.queue_id, []).append(r)
        for qid, recs in by_queue.items():
            recs.sort(key=lambda r: r.start)
            for a, b in zip(recs, recs[1:]):
                assert a.end <= b.start, f"queue {qid}: {a.consumer} and {b.consumer} consumed at the same time"
        return {"records": len(self.recs), "replays": replays,
                "consumers": len({r.consumer for r in self.recs})}


def test_order_per_key_holds_through_a_rebalance(node, name):
    topic, group = name("Ord"), name("OrdG")
    keys = [f"k{i}" for i in range(8)]
    n_per_key = 40
    rec = Recorder()

    async def go():
        async with AsyncAdmin(brokers=node.addr) as admin:
            await admin.create_topic(topic, 4)
        a = await AsyncConsumer(group, brokers=node.addr, topics=topic, orderly=True, client_id="A",
                                listener=rec.listener("A"), **FAST).start()
        b = None
        try:
            async with AsyncProducer(brokers=node.addr) as p:
                for i in range(n_per_key):
                    for k in keys:
                        await p.send(Message(topic, f"{k}:{i}"), sharding_key=k)
                    if i == n_per_key // 3:      # a second consumer joins mid-stream (sync face)
                        b = await asyncio.to_thread(lambda: Consumer(
                            group, brokers=node.addr, topics=topic, orderly=True, client_id="B",
                            listener=rec.sync_listener("B"), **FAST).start())
            want = set(range(n_per_key))
            await eventually(lambda: all(rec.seqs().get(k) == want for k in keys), 30, what="all consumed")
            await eventually(lambda: len(a.process_queues) == 2, 10, what="A keeps two queues")
        finally:
            await a.close()
            if b is not None:
                await asyncio.to_thread(b.shutdown)
    run(go(), 90)
    counts = rec.check()
    assert counts["consumers"] == 2, counts          # B really took queues over
    print(f"\nrebalance: {counts}")


def test_a_failed_message_is_retried_in_place_before_the_next(node, name):
    topic, group = name("OrdF"), name("OrdFG")
    rec = Recorder()
    failed: set = set()

    async def go():
        async with AsyncAdmin(brokers=node.addr) as admin:
            await admin.create_topic(topic, 1)
        c = await AsyncConsumer(group, brokers=node.addr, topics=topic, orderly=True,
                                listener=rec.listener("A", fail_once=failed), **FAST).start()
        try:
            async with AsyncProducer(brokers=node.addr) as p:
                for i in range(10):
                    await p.send(Message(topic, f"k:{i}"), sharding_key="k")
            await eventually(lambda: rec.seqs().get("k") == set(range(10)), 20, what="all consumed")
        finally:
            await c.close()
    run(go(), 60)
    assert [r.seq for r in rec.recs] == list(range(10))     # each failed once, then consumed, in order
    assert len(failed) == 10


def test_a_held_queue_is_not_granted_to_another_client(node, name):
    """The REST face of the lock: a second client is refused while the first renews."""
    group = name("OrdL")

    async def go():
        async with AsyncConsumer(group, brokers=node.addr, topics="x", orderly=True, listener=print) as c:
            t = c.transport
            g = c.routes.group(next(iter(c.routes.groups)))
            body = {"queues": [q("LockT", 0)]}
            deadline = time.monotonic() + 5      # the node may still be in its quiet time after start
            while not (await t.call(g, "POST", f"/groups/{group}/lock", {"client_id": "x", **body}))["locked"]:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
            other = await t.call(g, "POST", f"/groups/{group}/lock", {"client_id": "y", **body})
            assert other["locked"] == []
            held = await t.call(g, "GET", f"/groups/{group}/locks")
            assert [(h["queue_id"], h["client_id"]) for h in held["locks"]] == [(0, "x")]
            assert (await t.call(g, "POST", f"/groups/{group}/unlock", {"client_id": "x", **body}))["unlocked"]
            assert (await t.call(g, "POST", f"/groups/{group}/lock", {"client_id": "y", **body}))["locked"]
    run(go(), 30)


def test_order_per_key_holds_through_a_leader_kill(tmp_path):
    trio = DLedgerTrio(tmp_path).start()
    topic, group = "OrdFailover", "OrdFailoverG"
    keys = [f"k{i}" for i in range(6)]
    rec = Recorder()

    async def go():
        async with AsyncAdmin(brokers=trio.addrs) as admin:
            await admin.create_topic(topic, 4)
        opts = dict(FAST, request_timeout_s=3.0)
        a = await AsyncConsumer(group, brokers=trio.addrs, topics=topic, orderly=True, client_id="A",
                                listener=rec.listener("A"), **opts).start()
        b = await AsyncConsumer(group, brokers=trio.addrs, topics=topic, orderly=True, client_id="B",
                                listener=rec.listener("B"), **opts).start()
        sent: dict[str, set[int]] = {k: set() for k in keys}
        queue_of: dict[str, set[int]] = {}
        try:
            async with AsyncProducer(brokers=trio.addrs, send_timeout_s=6.0) as p:
                async def sender(k: str) -> None:
                    for i in range(50):
                        r = await p.send(Message(topic, f"{k}:{i}"), sharding_key=k)
                        queue_of.setdefault(k, set()).add(r.queue_id)
                        sent[k].add(i)
                        await asyncio.sleep(0.01)
                senders = [asyncio.create_task(sender(k)) for k in keys]
                await eventually(lambda: len(rec.recs) >= 60, 30, what="consumption under way")
                old = trio.leader()
                await asyncio.to_thread(trio.kill9, old)
                await asyncio.gather(*senders)
            assert all(len(s) == 50 for s in sent.values())
            assert all(len(qs) == 1 for qs in queue_of.values()), f"a key spread over queues: {queue_of}"
            await eventually(lambda: all(rec.seqs().get(k) == sent[k] for k in keys), 60,
                             what="every sent message consumed after the failover")
            assert a.lock_refusals + b.lock_refusals > 0, "the new leader's quiet time was never seen"
        finally:
            await a.close()
            await b.close()
    try:
        run(go(), 150)
    finally:
        trio.close()
    counts = rec.check()
    print(f"\nfailover: {counts}")


def test_sharding_key_sends_use_the_key_queue_even_when_a_follower_is_asked_first(tmp_path):
    """Regression: a follower that has not applied a new topic answers TOPIC_NOT_EXIST (with a
    leader hint); the producer took the topic for unknown and let the broker pick queues, so
    the first messages of each sharding key landed on arbitrary queues and broke key order."""
    import zlib
    trio = DLedgerTrio(tmp_path).start()
    topic = "ShardNew"

    async def go():
        leader = trio.leader()
        followers_first = [a for n, a in zip(trio.IDS, trio.addrs) if n != leader] + \
            [a for n, a in zip(trio.IDS, trio.addrs) if n == leader]
        async with AsyncAdmin(brokers=trio.addrs) as admin:
            await admin.create_topic(topic, 4)
        async with AsyncProducer(brokers=followers_first) as p:
            keys = [f"k{i}" for i in range(8)]
            first = await asyncio.gather(*[p.send(Message(topic, k), sharding_key=k) for k in keys])
            again = await asyncio.gather(*[p.send(Message(topic, k), sharding_key=k) for k in keys])
        want = [zlib.crc32(k.encode()) % 4 for k in keys]
        assert [r.queue_id for r in first] == want
        assert [r.queue_id for r in again] == want
    try:
        run(go(), 60)
    finally:
        trio.close()

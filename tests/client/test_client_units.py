"""Pure parts of the client and of the broker's group table, without processes.

Goal: queue allocation matches RocketMQ's AllocateMessageQueueAveragely, UNIQ_KEY ids have
RocketMQ's shape and do not repeat, latency fault tolerance isolates and recovers on its
clock, bad settings fail with an error naming them, and member heartbeats expire.
"""

from __future__ import annotations

import json
import time

import pytest

from mqstore import (LatencyFaultTolerance, Message, MessageQueue, MQConfigError, allocate_averagely)
from mqstore.client.message import UNIQ_IDS
from mqstore.client.producer import AsyncProducer, sharding_selector
from mqstore.client.offsets import LocalFileOffsetStore
from mqstore.client.route import DEFAULT_GROUP, NAME_LOOKUP_TIMEOUT_S, RouteTable, parse_brokers
from mqstore.client.transport import Transport
from tests.client.conftest import run
from node.consumer_groups import ConsumerGroups


def qs(n: int, topic: str = "T") -> list[MessageQueue]:
    return [MessageQueue(topic, "b", i) for i in range(n)]


@pytest.mark.parametrize("n_queues,members,expected", [
    (8, ["a", "b", "c"], [[0, 1, 2], [3, 4, 5], [6, 7]]),
    (4, ["a", "b"], [[0, 1], [2, 3]]),
    (2, ["a", "b", "c"], [[0], [1], []]),
    (5, ["c", "a", "b"], [[0, 1], [2, 3], [4]]),      # members are sorted first
])
def test_allocate_averagely_matches_rocketmq(n_queues, members, expected):
    got = [[q.queue_id for q in allocate_averagely(qs(n_queues), members, m)] for m in sorted(members)]
    assert got == expected
    flat = [q for part in got for q in part]
    assert sorted(flat) == list(range(n_queues)) and len(flat) == len(set(flat))


def test_allocate_for_a_non_member_is_empty():
    assert allocate_averagely(qs(4), ["a"], "z") == []


def test_uniq_ids_are_32_hex_and_unique():
    ids = [UNIQ_IDS.next() for _ in range(5000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 and i == i.upper() for i in ids)
    assert len({i[:20] for i in ids}) == 1       # ip + pid + client hash prefix is fixed



def test_uniq_ids_of_a_batch_are_unique_and_continue_the_sequence():
    """A batch send takes its ids under one clock read; they must not repeat ids taken one by one."""
    ids = [UNIQ_IDS.next()] + UNIQ_IDS.next_many(64) + [UNIQ_IDS.next()] + UNIQ_IDS.next_many(0)
    assert len(ids) == 66 and len(set(ids)) == 66
    assert all(len(i) == 32 and i == i.upper() and int(i, 16) >= 0 for i in ids)
    counters = [int(i[-4:], 16) for i in ids]
    assert all((b - a) % 0x10000 == 1 for a, b in zip(counters, counters[1:]))

def test_latency_fault_tolerance_isolates_then_recovers():
    now = [0.0]
    f = LatencyFaultTolerance(clock_ms=lambda: now[0])
    f.update("a", 20)
    assert f.is_available("a")
    f.update("a", 600)                 # >= 550 ms -> 30 s away
    assert not f.is_available("a")
    now[0] = 30_001
    assert f.is_available("a")
    f.update("b", 0, isolation=True)   # a failure counts as 30 s of latency -> 600 s away
    now[0] += 599_000
    assert not f.is_available("b")
    now[0] += 2_000
    assert f.is_available("b")


def test_select_queue_skips_isolated_and_last_failed_group():
    p = AsyncProducer(brokers={"a": "127.0.0.1:1", "b": "127.0.0.1:2"}, send_latency_fault_enable=True)
    queues = [MessageQueue("T", g, i) for g in ("a", "b") for i in range(2)]
    p.fault.update("b", 0, isolation=True)
    assert {p.select_queue(queues, None).broker_name for _ in range(20)} == {"a"}
    assert {p.select_queue(queues, "a").broker_name for _ in range(20)} == {"b"}   # retry elsewhere
    p2 = AsyncProducer(brokers="127.0.0.1:1")
    assert [p2.select_queue(qs(3), None).queue_id for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_sharding_key_is_stable():
    queues = qs(8)
    m = Message("T", b"x")
    assert len({sharding_selector(queues, m, "order-42") for _ in range(10)}) == 1


@pytest.mark.parametrize("kwargs,word", [
    ({"topic": "T", "body": b""}, "body"),
    ({"topic": "", "body": b"x"}, "topic"),
    ({"topic": "T", "body": b"x", "delay_level": -1}, "delay_level"),
])
def test_bad_messages_are_refused(kwargs, word):
    with pytest.raises(MQConfigError, match=word):
        Message(**kwargs)


def test_bad_client_settings_name_the_setting():
    with pytest.raises(MQConfigError, match="brokers"):
        parse_brokers(42)
    with pytest.raises(MQConfigError, match="host:port"):
        parse_brokers(["nohostport"])
    with pytest.raises(MQConfigError, match="exactly one"):
        AsyncProducer()
    with pytest.raises(MQConfigError, match="retry_times_when_send_failed"):
        AsyncProducer(brokers="127.0.0.1:1", retry_times_when_send_failed=99)
    from mqstore import AsyncConsumer
    with pytest.raises(MQConfigError, match="pull_batch_size"):
        AsyncConsumer("g", brokers="127.0.0.1:1", topics="T", pull_batch_size=0)


def test_group_members_expire_and_leave():
    now = [100.0]
    g = ConsumerGroups(clock=lambda: now[0])
    assert g.heartbeat("G", "c1", ["T"], 2000) == {"T": ["c1"]}
    assert g.heartbeat("G", "c2", ["T", "U"], 5000) == {"T": ["c1", "c2"], "U": ["c2"]}
    now[0] += 3.0                                   # c1's 2 s ttl passed
    assert g.members_of("G", "T") == ["c2"]
    assert g.unregister("G", "c2") and g.members_of("G", "T") == []
    assert "G" not in g.groups


def test_group_heartbeat_rejects_bad_input():
    from node.store.errors import BadRequest
    g = ConsumerGroups()
    with pytest.raises(BadRequest, match="client_id"):
        g.heartbeat("G", "", ["T"], None)
    with pytest.raises(BadRequest, match="topics"):
        g.heartbeat("G", "c", "T", None)
    with pytest.raises(BadRequest, match="ttl_ms"):
        g.heartbeat("G", "c", ["T"], 10)
    with pytest.raises(BadRequest, match="reserved"):
        g.heartbeat("G", "c", ["RMQ_SYS_TRANS_HALF_TOPIC"], None)


def test_group_heartbeat_keeps_what_the_member_says_of_itself_and_checks_it():
    from node.store.errors import BadRequest
    g = ConsumerGroups()
    said = {"subscriptions": {"T": "TagA || TagB"}, "consume_type": "CONSUME_PASSIVELY",
            "message_model": "CLUSTERING", "consume_from_where": "CONSUME_FROM_FIRST_OFFSET",
            "language": "PYTHON", "version": "0.1.0"}
    g.heartbeat("G", "c1", ["T", "U"], None, said, "10.0.0.1:5000")
    g.heartbeat("G", "c0", ["T"], None)            # an older client says nothing of itself
    c0, c1 = g.describe("G")
    assert c1 == {"client_id": "c1", "topics": ["T", "U"], "expires_in_ms": c1["expires_in_ms"],
                  "addr": "10.0.0.1:5000", **said}
    assert (c0["addr"], c0["language"], c0["subscriptions"], c0["consume_type"]) == ("", "", {}, "")
    for bad, match in (({"subscriptions": {"V": "*"}}, "subscriptions"),           # not a topic it beats for
                       ({"subscriptions": {"T": "x" * 5000}}, "subscriptions"),
                       ({"consume_type": "CONSUME_SOMEHOW"}, "consume_type"),
                       ({"message_model": "clustering"}, "message_model"),
                       ({"consume_from_where": 3}, "consume_from_where"),
                       ({"language": "P\nY"}, "language"), ({"version": "v" * 33}, "version")):
        with pytest.raises(BadRequest, match=match):
            g.heartbeat("G", "c1", ["T", "U"], None, bad)
    assert g.describe("G")[1]["consume_from_where"] == "CONSUME_FROM_FIRST_OFFSET"   # a refused beat changed nothing


def test_openapi_documents_the_client_routes():
    from node.client_api import CLIENT_ROUTES
    from node.openapi import openapi_document
    paths = openapi_document()["paths"]
    for method, path, _ in CLIENT_ROUTES:
        assert method.lower() in paths.get(path, {}), (method, path)


def test_regression_dispatcher_uses_the_configured_delay_levels(tmp_path):
    """Bug: build_broker built the Dispatcher with the default delay table, so schedule-queue
    units carried delivery times of 1s 5s 10s... whatever messageDelayLevel said."""
    from node.config import from_properties
    from node.server import build_broker
    config, _unknown = from_properties({"storePathRootDir": str(tmp_path / "store"), "messageDelayLevel": "3s 1m",
                                        "mappedFileSizeCommitLog": "1048576", "maxMessageSize": "65536",
                                        "maxRequestBytes": "1048576", "maxHashSlotNum": "1000",
                                        "maxIndexNum": "4000"})
    broker = build_broker(config)
    assert broker.dispatcher.delay_levels_ms == (3000, 60000)
    assert broker.services.schedule.levels_ms == (3000, 60000)


def test_local_offsets_written_before_the_group_was_named_move_to_its_name(tmp_path):
    """A broadcasting consumer's offsets.json from before the client named a bare address list's
    group holds rows under DEFAULT_GROUP: they are read for the named group's queues (not lost,
    so consumption resumes there), and once persisted the file holds only the group's name."""
    old = LocalFileOffsetStore(str(tmp_path), "c1", "G")
    old.update(MessageQueue("T", DEFAULT_GROUP, 0), 7)
    old.update(MessageQueue("T", DEFAULT_GROUP, 1), 3)
    run(old.persist())
    aliases: dict[str, str] = {}
    store = LocalFileOffsetStore(str(tmp_path), "c1", "G", aliases)
    assert run(store.read(MessageQueue("T", "broker-a", 0))) is None     # not named yet: no guess
    aliases[DEFAULT_GROUP] = "broker-a"
    assert run(store.read(MessageQueue("T", "broker-a", 0))) == 7
    assert run(store.read(MessageQueue("T", "broker-b", 1))) is None     # another group's queue: no match
    store.update(MessageQueue("T", "broker-a", 0), 9)
    run(store.persist())
    rows = lambda: sorted((r["broker_name"], r["queue_id"], r["offset"])         # noqa: E731
                          for r in json.load(open(store.path))["offsets"])
    assert rows() == [("broker", 1, 3), ("broker-a", 0, 9)]      # queue 1 was not read: kept as it was
    again = LocalFileOffsetStore(str(tmp_path), "c1", "G", {DEFAULT_GROUP: "broker-a"})
    assert run(again.read(MessageQueue("T", "broker-a", 0))) == 9
    assert run(again.read(MessageQueue("T", "broker-a", 1))) == 3
    run(again.persist())
    assert rows() == [("broker-a", 0, 9), ("broker-a", 1, 3)]


def test_an_unreachable_bare_address_list_keeps_its_placeholder_name_and_asks_again():
    async def go():
        t = Transport(10.0)
        await t.start()
        try:
            routes = RouteTable(t, brokers="127.0.0.1:9")     # the discard port: nothing listens
            t0 = time.monotonic()
            await routes.learn_name()
            assert time.monotonic() - t0 < NAME_LOOKUP_TIMEOUT_S + 1.0     # not the request timeout
            assert list(routes.groups) == [DEFAULT_GROUP] and routes.aliases == {}
            assert routes.group(DEFAULT_GROUP).addrs == ["127.0.0.1:9"]
            named = RouteTable(t, brokers={"broker-x": ["127.0.0.1:9"]})
            await named.learn_name()                          # a named group is never renamed (no call)
            assert list(named.groups) == ["broker-x"]
        finally:
            await t.close()
    run(go())


def test_an_offset_commit_a_slave_did_not_confirm_is_kept_in_unconfirmed_until_one_is(caplog):
    """The broker answers an offset commit with its put status; on a SYNC_MASTER without a
    slave it is SLAVE_NOT_AVAILABLE: stored on the master, not replicated. The store keeps
    such queues in `unconfirmed` with one warning, and drops them once a commit is confirmed.
    Before, the SDK dropped the status and nothing told the user."""
    from mqstore.client.offsets import RemoteOffsetStore

    class Answers:
        def __init__(self):
            self.statuses = ["SLAVE_NOT_AVAILABLE", "SLAVE_NOT_AVAILABLE", "SEND_OK"]
            self.bodies = []

        async def call(self, group, method, path, doc=None, params=None):
            self.bodies.append(doc)
            return {"group": "G", **doc, "status": self.statuses.pop(0)}

    class Routes:
        def group(self, name):
            return name

    transport = Answers()
    store = RemoteOffsetStore(transport, Routes(), "G")
    mq = MessageQueue("T", "b", 0)

    async def commits():
        seen = []
        for off in (3, 5, 9):
            store.update(mq, off)
            assert await store.persist() == 1
            seen.append(dict(store.unconfirmed))
        return seen

    seen = run(commits())
    assert seen == [{mq: "SLAVE_NOT_AVAILABLE"}, {mq: "SLAVE_NOT_AVAILABLE"}, {}]
    assert [b["offset"] for b in transport.bodies] == [3, 5, 9]
    assert caplog.text.count("not confirmed by a slave") == 1

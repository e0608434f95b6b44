"""Hard limits on what clients make a node hold: topics (maxTopics), consumer groups
(maxConsumerGroups) and open API connections (maxHttpConnections).

Goal: past each cap a client's attempt is refused (LIMIT_EXCEEDED, or the connection closed
at once), nothing changes, the refusal is counted in rocketmq_limit_rejections_total, what
already exists keeps working, and what arrives through the log or from the controller is
applied regardless. Method: the real aiohttp app over the test_broker harness (as
tests/unit/test_limits.py), and node/api_site.py's LimitedSite on a free loopback port,
plain and TLS (trustme), with raw sockets holding connections open.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ssl

import pytest
from aiohttp import web

from node.api_site import LimitedSite
from node.config import BrokerConfig, ConfigError, from_properties
from node.limits import LimitExceeded, check_new_name, reserve
from node.replicated_log import PutStatus
from tests.integration.test_peer_security import pki  # noqa: F401 - fixture
from tests.unit.test_api import api_test, make_app, setup_topic
from tests.unit.test_broker import make_broker
from tests.unit.test_limits import Counted

BASE = BrokerConfig(maped_file_size_consume_queue=20 * 64, flush_consumer_offset_interval_ms=100)


@pytest.mark.parametrize("key", ["maxTopics", "maxConsumerGroups", "maxHttpConnections"])
def test_the_new_limit_keys_are_validated_and_named(key):
    with pytest.raises(ConfigError, match=key):
        from_properties({key: "0"})
    config, warnings = from_properties({key: "7"})
    assert not warnings and 7 in (config.max_topics, config.max_consumer_groups, config.max_http_connections)


# --- topics ----------------------------------------------------------------------------------------------
async def topic_names(client) -> list[str]:
    return [t["topic"] for t in (await (await client.get("/topics")).json())["topics"]]


@api_test(dataclasses.replace(BASE, max_topics=2))
async def test_a_topic_past_max_topics_is_refused_and_nothing_is_created(client, h):
    await setup_topic(client, h, "A")
    await setup_topic(client, h, "B")
    with Counted("topics"):
        r = await client.post("/topics", json={"topic": "C", "queues": 1})
    doc = await r.json()
    assert r.status == 400 and doc["error"] == "LIMIT_EXCEEDED" and "maxTopics" in doc["message"], doc
    assert await topic_names(client) == ["A", "B"]
    assert "C" not in h.broker.topics and not h.broker._topics_pending
    # An existing topic can still be updated (an upsert is not one more topic).
    r = await client.post("/topics", json={"topic": "A", "queues": 4})
    assert r.status == 200 and (await r.json())["write_queue_nums"] == 4
    # Deleting one makes room again.
    assert (await client.delete("/topics/B")).status == 200
    await setup_topic(client, h, "C")
    assert await topic_names(client) == ["A", "C"]


@api_test(dataclasses.replace(BASE, max_topics=1, auto_create_topic_enable=True))
async def test_auto_create_on_send_past_max_topics_is_refused(client, h):
    r = await client.post("/topics/First/messages", json={"messages": [{"body": "x"}]})
    assert r.status == 200                                       # auto-created: the one allowed
    with Counted("topics"):
        r = await client.post("/topics/Second/messages", json={"messages": [{"body": "x"}]})
    assert r.status == 400 and (await r.json())["error"] == "LIMIT_EXCEEDED"
    assert await topic_names(client) == ["First"]
    assert h.broker.messages_in == 1                              # nothing of the refused send stored


def test_concurrent_creations_cannot_overshoot_max_topics(tmp_path):
    async def go():
        h = make_broker(str(tmp_path), dataclasses.replace(BASE, max_topics=3))
        await h.broker.start()
        try:
            results = await asyncio.gather(*(h.broker.create_topic(f"T{i}", 1) for i in range(8)),
                                           return_exceptions=True)
            refused = [r for r in results if isinstance(r, LimitExceeded)]
            assert len(h.broker.topics) == 3 and len(refused) == 5
            assert all(r.limit == "topics" for r in refused)
        finally:
            await h.broker.stop()
    asyncio.run(go())


def test_topics_from_the_controller_and_from_the_log_are_applied_past_the_cap(tmp_path):
    async def go():
        h = make_broker(str(tmp_path / "a"), dataclasses.replace(BASE, max_topics=10))
        await h.broker.start()
        for name in ("A", "B", "C"):
            await h.broker.create_topic(name, 1)
        await h.broker.stop()
        # The same log read by a node whose cap is lower: every topic in the log is there.
        h2 = make_broker(str(tmp_path / "b"), dataclasses.replace(BASE, max_topics=2), rlog=h.log)
        await h2.broker.start()
        try:
            assert sorted(h2.broker.topics) == ["A", "B", "C"]
            with pytest.raises(LimitExceeded):
                await h2.broker.create_topic("D", 1)
            await h2.broker.create_topic("A", 2)                  # existing topics stay writable
            # The controller's topics are its operator's: created past the cap, no error.
            done = await h2.broker.apply_controller_topics({"Ctl1": (2, 6), "Ctl2": (1, 6)})
            assert done == ["Ctl1", "Ctl2"] and {"Ctl1", "Ctl2"} <= set(h2.broker.topics)
        finally:
            await h2.broker.stop()
    asyncio.run(go())


# --- consumer groups -------------------------------------------------------------------------------------
async def commit(client, group, topic="T", queue_id=0, offset=0):
    r = await client.post(f"/groups/{group}/offsets", json={"topic": topic, "queue_id": queue_id, "offset": offset})
    return r.status, await r.json()


async def heartbeat(client, group, client_id="c1", topics=("T",)):
    r = await client.post(f"/groups/{group}/heartbeat", json={"client_id": client_id, "topics": list(topics)})
    return r.status, await r.json()


@api_test(dataclasses.replace(BASE, max_consumer_groups=2))
async def test_a_new_group_past_max_consumer_groups_is_refused_known_ones_keep_working(client, h):
    await setup_topic(client, h, "T")
    await setup_topic(client, h, "U")
    assert (await commit(client, "G1"))[0] == 200
    assert (await commit(client, "G2"))[0] == 200
    with Counted("consumer_groups"):
        status, doc = await commit(client, "G3")
    assert status == 400 and doc["error"] == "LIMIT_EXCEEDED" and "maxConsumerGroups" in doc["message"], doc
    with Counted("consumer_groups"):
        status, doc = await heartbeat(client, "G3")
    assert status == 400 and doc["error"] == "LIMIT_EXCEEDED"
    with Counted("consumer_groups"):
        r = await client.post("/groups/G3/offsets/reset?topic=T&timestamp=0")
    assert r.status == 400
    assert (await (await client.get("/groups")).json())["groups"] == ["G1", "G2"]
    assert (await (await client.get("/groups/G3/members")).json())["members"] == []
    # Known groups: another queue, another topic, a heartbeat, a reset.
    with Counted("consumer_groups", 0):
        assert (await commit(client, "G1", queue_id=1))[0] == 200
        assert (await commit(client, "G2", topic="U"))[0] == 200
        assert (await heartbeat(client, "G1"))[0] == 200
        assert (await client.post("/groups/G2/offsets/reset?topic=T&timestamp=0")).status == 200


@api_test(dataclasses.replace(BASE, max_consumer_groups=2))
async def test_groups_with_live_members_count_until_their_members_leave(client, h):
    await setup_topic(client, h, "T")
    assert (await heartbeat(client, "Live"))[0] == 200            # members only, no offsets
    assert (await commit(client, "G1"))[0] == 200
    with Counted("consumer_groups"):
        assert (await commit(client, "G2"))[0] == 400
    assert (await client.delete("/groups/Live/members/c1")).status == 200
    assert (await commit(client, "G2"))[0] == 200                 # the slot was freed
    with Counted("consumer_groups"):
        assert (await heartbeat(client, "Live"))[0] == 400


def test_concurrent_first_commits_cannot_overshoot_max_consumer_groups(tmp_path):
    async def go():
        h = make_broker(str(tmp_path), dataclasses.replace(BASE, max_consumer_groups=2))
        await h.broker.start()
        try:
            await h.broker.create_topic("T", 1)
            results = await asyncio.gather(*(h.broker.commit_offset(f"G{i}", "T", 0, 0) for i in range(6)),
                                           return_exceptions=True)
            assert sum(isinstance(r, LimitExceeded) for r in results) == 4
            assert h.broker.list_groups() == sorted(f"G{i}" for i, r in enumerate(results) if r is PutStatus.SEND_OK)
        finally:
            await h.broker.stop()
    asyncio.run(go())


def test_check_new_name_counts_pending_names_once():
    check_new_name("topics", "a", {"a"}, 1)                     # known: never refused
    check_new_name("topics", "b", {"a"}, 0)                     # 0: unbounded
    with pytest.raises(LimitExceeded, match="maxTopics"):
        check_new_name("topics", "c", {"a"}, 2, pending={"a", "b"})
    pending: set[str] = set()
    with reserve("consumer_groups", "g", set(), pending, 1):
        assert pending == {"g"}
        with pytest.raises(LimitExceeded, match="maxConsumerGroups"):
            check_new_name("consumer_groups", "h", set(), 1, pending)
    assert pending == set()


# --- API connections -----------------------------------------------------------------------------------
async def hello(request: web.Request) -> web.Response:
    return web.Response(text="hello")


async def started_site(cap: int, ssl_context=None) -> tuple[web.AppRunner, LimitedSite]:
    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = LimitedSite(runner, "127.0.0.1", 0, max_connections=cap, ssl_context=ssl_context)
    await site.start()
    return runner, site


async def closed_at_once(port: int) -> bool:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await asyncio.wait_for(reader.read(1), 2.0) == b""
    except (asyncio.TimeoutError, ConnectionError):
        return False
    finally:
        writer.close()


async def get_root(port: int, ctx: ssl.SSLContext | None = None) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 5.0)
    writer.close()
    return data


async def until(pred, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_connections_past_max_http_connections_are_closed_at_once_and_counted():
    async def go():
        runner, site = await started_site(2)
        try:
            held = [await asyncio.open_connection("127.0.0.1", site.port) for _ in range(2)]
            await until(lambda: site.open_connections() == 2)
            with Counted("http_connections"):
                assert await closed_at_once(site.port)
            assert site.refused == 1
            held[0][1].close()
            await until(lambda: site.open_connections() == 1)
            assert (await get_root(site.port)).startswith(b"HTTP/1.1 200")   # the slot was given back
            # The held connection still serves.
            held[1][1].write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert (await asyncio.wait_for(held[1][0].read(), 5.0)).endswith(b"hello")
        finally:
            await runner.cleanup()
    asyncio.run(go())


def test_tls_connections_in_the_handshake_count_against_the_cap(pki):
    from node import tls

    async def go():
        srv = tls.server_context(pki["node"], pki["node"], pki["ca"], require_client_cert=False)
        runner, site = await started_site(2, srv)
        try:
            assert site.name.startswith("https://")
            silent = [await asyncio.open_connection("127.0.0.1", site.port) for _ in range(2)]   # no ClientHello
            await until(lambda: site.open_connections() == 2)
            with Counted("http_connections"):
                assert await closed_at_once(site.port)
            for _, w in silent:
                w.close()
            await until(lambda: site.open_connections() == 0)
            reply = await get_root(site.port, tls.client_context(pki["ca"]))
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"hello")
            # Stopping does not wait for a handshake that never comes.
            _, lingering = await asyncio.open_connection("127.0.0.1", site.port)
            await until(lambda: site.open_connections() == 1)
            await asyncio.wait_for(runner.cleanup(), 3.0)
            assert site.open_connections() == 0
            lingering.close()
        finally:
            await runner.cleanup()
    asyncio.run(go())


def test_make_app_serves_through_the_limited_site(tmp_path):
    async def go():
        h = make_broker(str(tmp_path), BASE)
        await h.broker.start()
        runner = web.AppRunner(make_app(h.broker), access_log=None)
        await runner.setup()
        site = LimitedSite(runner, "127.0.0.1", 0, max_connections=1)
        await site.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200")
            with Counted("http_connections"):
                assert await closed_at_once(site.port)                 # the keep-alive one holds the slot
            writer.close()
        finally:
            await runner.cleanup()
            await h.broker.stop()
    asyncio.run(go())

"""HTTP API: every route in JSON and msgpack, error shapes, bad input changes nothing,
long polling over HTTP, and the OpenAPI document covering every route.

Method: the aiohttp app over the test_broker harness (in-memory log, real consume queues),
driven with aiohttp's TestClient inside asyncio.run.
"""

from __future__ import annotations

import asyncio
import base64
import json

import msgpack
from aiohttp.test_utils import TestClient, TestServer

from node.api import ROUTES, make_app
from node.config import BrokerConfig
from node.openapi import openapi_document
from tests.unit.test_broker import make_broker

MP = "application/x-msgpack"


def api_test(config: BrokerConfig | None = None):
    """Decorator: run `async def t(client, h)` against a started broker and app."""
    def wrap(fn):
        def test(tmp_path):
            async def go():
                h = make_broker(str(tmp_path), config)
                await h.broker.start()
                client = TestClient(TestServer(make_app(h.broker)))
                await client.start_server()
                try:
                    await fn(client, h)
                finally:
                    await client.close()
                    await h.broker.stop()
            asyncio.run(go())
        test.__name__ = fn.__name__
        return test
    return wrap


async def post_mp(client, path, doc):
    r = await client.post(path, data=msgpack.packb(doc, use_bin_type=True),
                          headers={"Content-Type": MP, "Accept": MP})
    return r.status, msgpack.unpackb(await r.read(), raw=False, strict_map_key=False)


async def get_mp(client, path):
    r = await client.get(path, headers={"Accept": MP})
    return r.status, msgpack.unpackb(await r.read(), raw=False, strict_map_key=False)


async def setup_topic(client, h, topic="T", queues=2):
    r = await client.post("/topics", json={"topic": topic, "queues": queues})
    assert r.status == 200, await r.text()


@api_test()
async def test_health_cluster_openapi_metrics(client, h):
    r = await client.get("/health")
    doc = await r.json()
    assert r.status == 200 and doc["status"] == "UP" and doc["role"] == "STANDALONE"
    assert set(doc) >= {"status", "mode", "role", "group", "node_id", "committed_offset"}
    assert (await client.get("/cluster")).status == 200
    r = await client.get("/metrics")
    text = await r.text()
    assert r.status == 200 and "rocketmq_commitlog_committed_offset" in text and "rocketmq_dispatch_behind_bytes" in text
    spec = await (await client.get("/openapi.json")).json()
    assert spec["openapi"].startswith("3.1")


def test_openapi_lists_every_route():
    paths = openapi_document()["paths"]
    for method, path, _ in ROUTES:
        assert path in paths, path
        assert method.lower() in paths[path], (method, path)
    assert len({(m, p) for m, p, _ in ROUTES}) == sum(len(v) for v in paths.values())


@api_test()
async def test_topics_json(client, h):
    await setup_topic(client, h, "T", 3)
    doc = await (await client.get("/topics")).json()
    assert doc == {"topics": [{"topic": "T", "read_queue_nums": 3, "write_queue_nums": 3, "perm": 6}]}
    doc = await (await client.get("/topics/T")).json()
    assert [q["queue_id"] for q in doc["queues"]] == [0, 1, 2]
    assert doc["queues"][0] == {"queue_id": 0, "min_offset": 0, "max_offset": 0, "last_updated": 0}
    r = await client.get("/topics/Nope")
    doc = await r.json()
    assert r.status == 404 and doc["error"] == "TOPIC_NOT_EXIST" and doc["retriable"] is False and "leader" in doc


@api_test()
async def test_send_pull_query_json(client, h):
    await setup_topic(client, h)
    r = await client.post("/topics/T/messages", json={"messages": [
        {"body": "héllo", "tags": "A", "keys": ["k1", "k2"], "queue_id": 1},
        {"body_b64": base64.b64encode(b"\xff\x00").decode(), "keys": "k3", "queue_id": 1,
         "properties": {"p": "v"}}]})
    doc = await r.json()
    assert r.status == 200, doc
    res = doc["results"]
    assert [x["queue_offset"] for x in res] == [0, 1] and res[0]["status"] == "SEND_OK"
    assert set(res[0]) == {"status", "msg_id", "offset_msg_id", "queue_id", "queue_offset"}
    await h.settle()
    doc = await (await client.get("/topics/T/queues/1/messages?offset=0&max=10")).json()
    assert doc["status"] == "FOUND" and doc["next_offset"] == 2 and doc["max_offset"] == 2
    m0, m1 = doc["messages"]
    assert m0["body"] == "héllo" and m0["tags"] == "A" and m0["keys"] == ["k1", "k2"]
    assert m1["body_b64"] == base64.b64encode(b"\xff\x00").decode() and "body" not in m1
    assert m1["properties"]["p"] == "v"
    for k in ("msg_id", "offset_msg_id", "topic", "queue_id", "queue_offset", "commitlog_offset", "tags", "keys",
              "properties", "born_timestamp", "store_timestamp", "body", "reconsume_times"):
        assert k in m0
    doc = await (await client.get("/topics/T/queues/1/messages?offset=0&tags=B")).json()
    assert doc["status"] == "NO_MATCHED_MSG" and doc["next_offset"] == 2
    doc = await (await client.get(f"/messages/{res[0]['offset_msg_id']}")).json()
    assert doc["body"] == "héllo" and doc["queue_offset"] == 0
    doc = await (await client.get("/topics/T/messages?key=k3")).json()
    assert [m["queue_offset"] for m in doc["messages"]] == [1]
    doc = await (await client.get("/topics/T/queues/1/messages/1")).json()
    assert doc["commitlog_offset"] == m1["commitlog_offset"]
    r = await client.get("/topics/T/queues/1/messages/2")
    assert r.status == 404 and (await r.json())["error"] == "NO_MESSAGE"


@api_test()
async def test_msgpack_round_trip_same_shapes(client, h):
    status, doc = await post_mp(client, "/topics", {"topic": "M", "queues": 1})
    assert status == 200 and doc["topic"] == "M"
    status, doc = await post_mp(client, "/topics/M/messages", {"messages": [{"body": b"\x00\x01bin", "tags": "t"}]})
    assert status == 200 and doc["results"][0]["queue_offset"] == 0
    await h.settle()
    status, doc = await get_mp(client, "/topics/M/queues/0/messages?offset=0")
    assert status == 200 and doc["messages"][0]["body"] == b"\x00\x01bin"
    status, doc = await get_mp(client, f"/messages/{doc['messages'][0]['offset_msg_id']}")
    assert doc["body"] == b"\x00\x01bin"
    status, doc = await post_mp(client, "/groups/G/offsets", {"topic": "M", "queue_id": 0, "offset": 1})
    assert status == 200 and doc["status"] == "SEND_OK"
    status, doc = await get_mp(client, "/groups/G/offsets?topic=M")
    assert doc == {"group": "G", "offsets": [{"topic": "M", "queue_id": 0, "offset": 1}]}
    status, doc = await post_mp(client, "/topics/M/messages", {"messages": [{"body": 5}]})
    assert status == 400 and doc["error"] == "BAD_REQUEST"


@api_test()
async def test_offsets_json(client, h):
    await setup_topic(client, h)
    r = await client.post("/groups/G/offsets", json={"topic": "T", "queue_id": 0, "offset": 0})
    assert r.status == 200
    doc = await (await client.get("/groups/G/offsets")).json()
    assert doc["offsets"] == [{"topic": "T", "queue_id": 0, "offset": 0}]


@api_test(BrokerConfig(max_message_size=1000, mapped_file_size_commit_log=1 << 20, max_request_bytes=200_000,
                       max_batch_messages=8))
async def test_bad_input_gives_clear_4xx_and_changes_nothing(client, h):
    await setup_topic(client, h)
    before = len(h.log.buf)
    cases = [
        ("post", "/topics", {"data": b"{not json", "headers": {"Content-Type": "application/json"}}, 400),
        ("post", "/topics", {"data": b"\xc1", "headers": {"Content-Type": MP}}, 400),
        ("post", "/topics", {"json": [1, 2]}, 400),
        ("post", "/topics", {"json": {"topic": "bad topic"}}, 400),
        ("post", "/topics", {"json": {"topic": "X", "queues": "4"}}, 400),
        ("post", "/topics", {"json": {"topic": "X", "queues": 0}}, 400),
        ("post", "/topics", {"json": {"topic": "RMQ_SYS_MINE"}}, 400),
        ("post", "/topics/T/messages", {"json": {"messages": "x"}}, 400),
        ("post", "/topics/T/messages", {"json": {"messages": []}}, 400),
        ("post", "/topics/T/messages", {"json": {"messages": [{}]}}, 400),
        ("post", "/topics/T/messages", {"json": {"messages": [{"body": "a", "body_b64": "YQ=="}]}}, 400),
        ("post", "/topics/T/messages", {"json": {"messages": [{"body_b64": "!!"}]}}, 400),
        ("post", "/topics/T/messages", {"json": {"messages": [{"body": ""}]}}, 400),
        ("post", "/topics/T/messages", {"json": {"messages": [{"body": "a", "queue_id": 2}]}}, 400),
        ("post", "/topics/T/messages", {"json": {"messages": [{"body": "a", "queue_id": "0"}]}}, 400),
        ("post", "/topics/T/messages", {"json": {"messages": [{"body": "a", "tags": 3}]}}, 400),
        ("post", "/topics/T/messages", {"json": {"messages": [{"body": "a", "keys": [1]}]}}, 400),
        ("post", "/topics/T/messages", {"json": {"messages": [{"body": "a", "properties": {"a": 1}}]}}, 400),
        ("post", "/topics/T/messages", {"json": {"messages": [{"body": "a"}] * 9}}, 400),
        ("post", "/topics/T/messages", {"json": {"messages": [{"body": "a"}, {"body": "x" * 1001}]}}, 413),
        ("post", "/topics/T/messages", {"data": b"x" * 200_001, "headers": {"Content-Type": "application/json"}}, 413),
        ("post", "/topics/Nope/messages", {"json": {"messages": [{"body": "a"}]}}, 404),
        ("post", "/topics/b%20d/messages", {"json": {"messages": [{"body": "a"}]}}, 400),
        ("get", "/topics/T/queues/0/messages", {}, 400),
        ("get", "/topics/T/queues/0/messages?offset=x", {}, 400),
        ("get", "/topics/T/queues/0/messages?offset=0&max=-1", {}, 400),
        ("get", "/topics/T/queues/0/messages?offset=-1", {}, 400),
        ("get", "/topics/T/queues/0/messages?offset=0&wait_ms=-5", {}, 400),
        ("get", "/topics/T/queues/9/messages?offset=0", {}, 400),
        ("get", "/topics/T/queues/q/messages?offset=0", {}, 400),
        ("get", "/topics/T/queues/0/messages/abc", {}, 400),
        ("post", "/groups/G/offsets", {"json": {"topic": "T", "queue_id": 0, "offset": 5}}, 400),
        ("post", "/groups/G/offsets", {"json": {"topic": "T", "queue_id": 0}}, 400),
        ("post", "/groups/bad%20g/offsets", {"json": {"topic": "T", "queue_id": 0, "offset": 0}}, 400),
        ("post", "/groups/G/offsets", {"json": {"topic": "Nope", "queue_id": 0, "offset": 0}}, 404),
        ("get", "/messages/XYZ", {}, 400),
        ("get", "/messages/" + "0" * 32, {}, 404),
        ("get", "/topics/T/messages", {}, 400),
        ("get", "/topics/T/messages?key=k&max=0", {}, 400),
        ("get", "/topics/T/messages?key=k&begin=10&end=1", {}, 400),
        ("get", "/no/such/route", {}, 404),
        ("delete", "/topics", {}, 405),
    ]
    for method, path, kw, status in cases:
        r = await getattr(client, method)(path, **kw)
        doc = await r.json()
        assert r.status == status, (method, path, kw, r.status, doc)
        assert set(doc) == {"error", "message", "retriable", "leader"} and doc["message"], doc
    assert len(h.log.buf) == before
    assert [t.topic for t in h.broker.list_topics()] == ["T"]


@api_test()
async def test_pull_statuses_over_http(client, h):
    await setup_topic(client, h, "T", 1)
    await client.post("/topics/T/messages", json={"messages": [{"body": str(i)} for i in range(3)]})
    await h.settle()
    doc = await (await client.get("/topics/T/queues/0/messages?offset=3")).json()
    assert (doc["status"], doc["next_offset"]) == ("NO_NEW_MSG", 3)
    doc = await (await client.get("/topics/T/queues/0/messages?offset=7")).json()
    assert (doc["status"], doc["next_offset"], doc["min_offset"], doc["max_offset"]) == ("OFFSET_ILLEGAL", 3, 0, 3)


@api_test()
async def test_long_poll_over_http_wakes_and_times_out(client, h):
    await setup_topic(client, h, "T", 1)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    doc = await (await client.get("/topics/T/queues/0/messages?offset=0&wait_ms=300")).json()
    assert doc["status"] == "NO_NEW_MSG" and 0.28 <= loop.time() - t0 < 2
    poll = asyncio.create_task(client.get("/topics/T/queues/0/messages?offset=0&wait_ms=10000"))
    await asyncio.sleep(0.2)
    assert not poll.done()
    t0 = loop.time()
    await client.post("/topics/T/messages", json={"messages": [{"body": "late"}]})
    r = await asyncio.wait_for(poll, 3)
    doc = await r.json()
    assert doc["status"] == "FOUND" and doc["messages"][0]["body"] == "late" and loop.time() - t0 < 1.5


@api_test()
async def test_error_shape_for_store_errors(client, h):
    from node.store.errors import NotLeader

    async def refuse(drafts):
        raise NotLeader("this node is a follower", leader="10.0.0.2:10911")
    await setup_topic(client, h, "T", 1)
    h.log.append = refuse
    r = await client.post("/topics/T/messages", json={"messages": [{"body": "x"}]})
    doc = await r.json()
    assert r.status == 421 and doc == {"error": "NOT_LEADER", "message": "this node is a follower",
                                       "retriable": True, "leader": "10.0.0.2:10911"}

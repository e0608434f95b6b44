"""The produce stream (node/produce_stream.py, node/stream_frames.py, mqstore/client/stream.py).

Method: the test_broker harness (in-memory log, real consume queues) behind a real
StreamServer on a loopback port, driven by the SDK's StreamConnection or by raw sockets for
what a well-behaved client never sends. Every refusal is checked to change nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqstore import localcluster as lc
from mqstore.client.stream import StreamConnection, StreamRefused
from node import limits
from node import stream_frames as F
from node.acl import NonceCache, parse_acl, sign_headers
from node.auth import AclStore
from node.config import BrokerConfig
from node.produce_stream import AclGate, StreamServer
from node.store import layout as L
from tests.unit.test_broker import make_broker


def stream_test(config: BrokerConfig | None = None, gate=None, loop_factory=None):
    """Decorator: run `async def t(h, port)` with a started broker and stream server (on a
    loop from `loop_factory`, asyncio's by default)."""
    def wrap(fn):
        def test(tmp_path):
            async def go():
                cfg = config or BrokerConfig(maped_file_size_consume_queue=20 * 64,
                                             flush_consumer_offset_interval_ms=100)
                h = make_broker(str(tmp_path), cfg)
                await h.broker.start()
                await h.broker.create_topic("T", 2)
                port = lc.free_port()
                server = StreamServer(h.broker, gate(tmp_path) if gate else None)
                await server.start("127.0.0.1", port)
                h.server = server
                try:
                    await fn(h, port)
                finally:
                    await server.stop()
                    await h.broker.stop()
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                runner.run(go())
        test.__name__ = fn.__name__
        return test
    return wrap


async def bodies(h, topic: str, queue: int) -> list[bytes]:
    """Every message body in one queue, pulled page by page."""
    out, offset = [], 0
    for _ in range(100):
        r = await h.broker.pull(topic, queue, offset, 32)
        if not r.messages:
            return out
        out += [m.body for m in r.messages]
        offset = r.next_offset
    raise AssertionError("more pages than a test writes")


def one(body: bytes = b"m", **kw) -> dict:
    return {"messages": [{"body": body, **kw}]}


async def raw_exchange(port: int, data: bytes, read_for_s: float = 1.0) -> list[tuple[int, int, object]]:
    """Write `data` on a fresh connection; the frames the node answers until it closes or time is up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    got = b""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), read_for_s)
            if not chunk:
                break
            got += chunk
    except asyncio.TimeoutError:
        pass
    writer.close()
    return [(k, rid, F.decode_payload(p)) for k, rid, p in F.FrameReader(1 << 20).feed(got)]


async def answer_hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """What a stand-in node does first: read the client's HELLO and answer HELLO_OK."""
    frames = F.FrameReader(1 << 20).feed(await reader.read(1024))
    writer.write(F.encode(F.HELLO_OK, frames[0][1], {"max_inflight": 8}))


# --- frames ---------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(sorted(F.KINDS)), st.integers(0, 2**32 - 1), st.binary(max_size=300)),
                max_size=20),
       st.lists(st.integers(1, 64), max_size=40))
def test_frames_survive_any_split_of_the_byte_stream(frames, cuts):
    wire = b"".join(L.STREAM_FRAME_HEADER.pack(len(p), k, rid) + p for k, rid, p in frames)
    reader, got, pos = F.FrameReader(1024), [], 0
    for c in cuts:
        got += reader.feed(wire[pos:pos + c])
        pos += c
    got += reader.feed(wire[pos:])
    assert got == frames and reader.buffered == 0


def test_frame_over_the_cap_is_refused_on_its_header():
    reader = F.FrameReader(100)
    with pytest.raises(F.FrameError, match="exceeds the cap") as e:
        reader.feed(L.STREAM_FRAME_HEADER.pack(101, F.SEND, 1))      # no payload needed to decide
    assert e.value.limit == "stream_frame_bytes"


def test_unknown_frame_kind_is_refused():
    with pytest.raises(F.FrameError, match="unknown frame kind 9"):
        F.FrameReader(100).feed(L.STREAM_FRAME_HEADER.pack(0, 9, 1))


# --- sends ----------------------------------------------------------------------------------------
@stream_test()
async def test_pipelined_sends_are_each_answered_and_stored_in_order(h, port):
    conn = await StreamConnection.open("127.0.0.1", port)
    answers = await asyncio.gather(*(conn.send("T", one(f"m{i}".encode(), queue_id=i % 2)) for i in range(300)))
    assert all(status == 200 for status, _ in answers)
    rows = [a["results"][0] for _, a in answers]
    assert [r["status"] for r in rows] == ["SEND_OK"] * 300
    for q in (0, 1):     # each queue's offsets are 0..149 in send order
        assert [r["queue_offset"] for r in rows if r["queue_id"] == q] == list(range(150))
    await h.settle()
    assert await bodies(h, "T", 1) == [f"m{i}".encode() for i in range(1, 300, 2)]
    assert h.server.batches < 300     # sends that arrived together were appended together
    conn.close()


def _uvloop_factory():
    import uvloop
    return uvloop.new_event_loop()


@stream_test(loop_factory=_uvloop_factory)
async def test_regression_the_stream_server_and_the_sdk_connection_run_on_uvloop(h, port):
    """Both protocol classes asserted their transport was an asyncio.Transport, which uvloop's
    are not: an application on uvloop could not connect (AssertionError in connection_made)
    and a node on it reset every stream connection."""
    assert "uvloop" in type(asyncio.get_running_loop()).__module__
    conn = await StreamConnection.open("127.0.0.1", port)
    answers = await asyncio.gather(*(conn.send("T", one(f"u{i}".encode(), queue_id=0)) for i in range(20)))
    assert [a["results"][0]["queue_offset"] for _, a in answers] == list(range(20))
    await h.settle()
    assert await bodies(h, "T", 0) == [f"u{i}".encode() for i in range(20)]
    conn.close()


@stream_test()
async def test_a_refused_send_among_good_ones_gets_its_own_error_and_the_rest_are_stored(h, port):
    conn = await StreamConnection.open("127.0.0.1", port)
    docs = [one(b"a"), one(b"b", queue_id=7), {"messages": []}, one(b"c"),
            {"messages": [{"body": b"d"}, {"body": b"e", "tags": "x||y"}]}]
    answers = await asyncio.gather(*(conn.send("T", d) for d in docs))
    assert [s for s, _ in answers] == [200, 400, 400, 200, 400]
    assert "queue_id 7 is out of range" in answers[1][1]["message"]
    assert answers[4][1]["error"] == "BAD_REQUEST"      # a bad message refuses its whole request
    await h.settle()
    assert sorted(await bodies(h, "T", 0) + await bodies(h, "T", 1)) == [b"a", b"c"]
    conn.close()


@stream_test()
async def test_unknown_topic_and_bad_topic_names_are_refused_per_request(h, port):
    conn = await StreamConnection.open("127.0.0.1", port)
    status, doc = await conn.send("bad topic!", one())
    assert (status, doc["error"]) == (400, "LIMIT_EXCEEDED")
    status, doc = await conn.send("T", one())        # the connection goes on
    assert status == 200
    conn.close()


@stream_test(BrokerConfig(maped_file_size_consume_queue=20 * 64, auto_create_topic_enable=False))
async def test_send_to_a_missing_topic_without_auto_create_is_topic_not_exist(h, port):
    conn = await StreamConnection.open("127.0.0.1", port)
    status, doc = await conn.send("Nope", one())
    assert (status, doc["error"]) == (404, "TOPIC_NOT_EXIST")
    conn.close()


# --- bad input and bounds --------------------------------------------------------------------------
@stream_test(BrokerConfig(maped_file_size_consume_queue=20 * 64, max_request_bytes=4096))
async def test_oversize_frame_closes_the_connection_and_stores_nothing(h, port):
    before, stored = limits.REJECTIONS.get("stream_frame_bytes"), h.broker.log.committed_position
    head = L.STREAM_FRAME_HEADER.pack(1 << 30, F.SEND, 1)       # claims 1 GiB: refused on the header
    got = await raw_exchange(port, head)
    assert [(k, rid) for k, rid, _ in got] == [(F.ERROR, F.CONNECTION)]
    assert got[0][2]["error"] == "LIMIT_EXCEEDED" and "maxRequestBytes" in got[0][2]["message"]
    assert limits.REJECTIONS.get("stream_frame_bytes") == before + 1
    assert h.broker.log.committed_position == stored


@stream_test()
async def test_garbage_bytes_close_the_connection_with_bad_frame(h, port):
    stored = h.broker.log.committed_position
    got = await raw_exchange(port, L.STREAM_FRAME_HEADER.pack(2, 99, 1) + b"xx")      # no such kind
    assert [(k, rid, d["error"]) for k, rid, d in got] == [(F.ERROR, F.CONNECTION, "BAD_FRAME")]
    got = await raw_exchange(port, F.encode(F.RESULT, 5, {}))       # a node's frame kind from a client
    assert got[0][2]["error"] == "BAD_FRAME"
    got = await raw_exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")     # HTTP: its first bytes read
    assert got[0][2]["error"] == "LIMIT_EXCEEDED"                                  # as a 1.2 GB length
    assert h.broker.log.committed_position == stored


@stream_test()
async def test_payload_that_is_not_msgpack_is_that_request_s_error(h, port):
    bad = L.STREAM_FRAME_HEADER.pack(2, F.SEND, 4) + b"\xc1\xc1"
    got = await raw_exchange(port, bad + F.encode(F.SEND, 5, {"topic": "T", **one()}))
    assert [(k, rid) for k, rid, _ in got] == [(F.ERROR, 4), (F.RESULT, 5)]
    assert got[0][2]["error"] == "BAD_REQUEST"


@stream_test(BrokerConfig(maped_file_size_consume_queue=20 * 64, max_stream_connections=1))
async def test_connections_beyond_the_cap_are_closed_on_accept(h, port):
    first = await StreamConnection.open("127.0.0.1", port)
    with pytest.raises(StreamRefused) as e:
        await StreamConnection.open("127.0.0.1", port)
    assert e.value.doc["error"] == "LIMIT_EXCEEDED" and e.value.doc["retriable"] is True
    assert (await first.send("T", one()))[0] == 200
    first.close()
    await asyncio.sleep(0.05)
    again = await StreamConnection.open("127.0.0.1", port)   # room again once one closed
    again.close()


@stream_test(BrokerConfig(maped_file_size_consume_queue=20 * 64, max_inflight_requests_per_client=4))
async def test_window_is_the_node_s_inflight_bound_and_every_send_completes(h, port):
    conn = await StreamConnection.open("127.0.0.1", port)
    assert conn.max_inflight == 4
    seen = []
    real = h.broker.send_coalesced

    async def watch(topic, requests):
        seen.append(len(requests))
        return await real(topic, requests)
    h.broker.send_coalesced = watch
    answers = await asyncio.gather(*(conn.send("T", one()) for _ in range(100)))
    assert [s for s, _ in answers] == [200] * 100
    assert max(seen) <= 4
    conn.close()


def test_a_request_never_answered_times_out_on_the_client():
    async def go():
        async def silent(reader, writer):       # answers HELLO, then never a SEND
            await answer_hello(reader, writer)
            await reader.read(1 << 20)
            await asyncio.sleep(5)
        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = await StreamConnection.open("127.0.0.1", port)
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await conn.send("T", one(), timeout_s=0.2)
        assert 0.15 < time.monotonic() - t0 < 1.5
        assert not conn.pending
        conn.close()
        server.close()
    asyncio.run(go())


def test_a_lost_connection_fails_every_request_in_flight():
    async def go():
        async def drop(reader, writer):
            await answer_hello(reader, writer)
            await reader.read(1 << 20)
            writer.transport.abort()
        server = await asyncio.start_server(drop, "127.0.0.1", 0)
        conn = await StreamConnection.open("127.0.0.1", server.sockets[0].getsockname()[1])
        got = await asyncio.gather(*(conn.send("T", one()) for _ in range(3)), return_exceptions=True)
        assert all(isinstance(g, ConnectionError) for g in got), got
        assert conn.closed
        server.close()
    asyncio.run(go())


# --- ACL ------------------------------------------------------------------------------------------
ACL = {"accounts": [{"accessKey": "publisher", "secretKey": "pub-secret-0123456789", "topicPerms": ["T=PUB"],
                     "defaultTopicPerm": "DENY"}]}


def acl_gate(tmp_path):
    path = tmp_path / "acl.json"
    path.write_text(json.dumps(ACL))
    parse_acl(path.read_text())
    return AclGate(AclStore(str(path), 1000), NonceCache(60_000, 1000), lambda: int(time.time() * 1000))


@stream_test(gate=acl_gate)
async def test_acl_node_needs_a_signed_hello_then_pub_on_each_topic(h, port):
    got = await raw_exchange(port, F.encode(F.SEND, 1, {"topic": "T", **one()}))     # no HELLO
    assert [(k, rid, d["error"]) for k, rid, d in got] == [(F.ERROR, F.CONNECTION, "UNAUTHENTICATED")]
    with pytest.raises(StreamRefused) as e:
        await StreamConnection.open("127.0.0.1", port, access_key="publisher", secret_key="wrong-secret-000000")
    assert e.value.status == 401
    conn = await StreamConnection.open("127.0.0.1", port, access_key="publisher", secret_key="pub-secret-0123456789")
    assert (await conn.send("T", one()))[0] == 200
    await h.broker.create_topic("Other", 1)
    status, doc = await conn.send("Other", one())
    assert (status, doc["error"]) == (403, "NO_PERMISSION")
    conn.close()
    await h.settle()
    assert await bodies(h, "Other", 0) == []


@stream_test(gate=acl_gate)
async def test_a_replayed_hello_is_refused(h, port):
    hello = sign_headers("publisher", "pub-secret-0123456789", F.STREAM_METHOD, F.STREAM_TARGET, None, b"",
                         int(time.time() * 1000))
    first = await raw_exchange(port, F.encode(F.HELLO, 1, hello), 0.3)
    assert first[0][0] == F.HELLO_OK
    again = await raw_exchange(port, F.encode(F.HELLO, 1, hello), 0.3)
    assert again[0][0] == F.ERROR and again[0][2]["error"] == "UNAUTHENTICATED"


# --- the SDK ----------------------------------------------------------------------------------------
def sdk_test(stream_listening: bool):
    """Decorator: `async def t(h, producer, stream_server)`: an HTTP API and, if
    `stream_listening`, a stream server on the port the node's /health names."""
    def wrap(fn):
        def test(tmp_path):
            async def go():
                from aiohttp.test_utils import TestServer
                from mqstore.client import AsyncProducer
                from node.api import make_app
                sport = lc.free_port()
                h = make_broker(str(tmp_path), BrokerConfig(maped_file_size_consume_queue=20 * 64,
                                                            stream_listen_port=sport))
                await h.broker.start()
                await h.broker.create_topic("T", 2)
                http = TestServer(make_app(h.broker), host="127.0.0.1")
                await http.start_server()
                server = StreamServer(h.broker)
                if stream_listening:
                    await server.start("127.0.0.1", sport)
                try:
                    async with AsyncProducer("p", brokers=f"127.0.0.1:{http.port}") as producer:
                        await fn(h, producer, server)
                finally:
                    await server.stop()
                    await http.close()
                    await h.broker.stop()
            asyncio.run(go())
        test.__name__ = fn.__name__
        return test
    return wrap


@sdk_test(stream_listening=True)
async def test_the_sdk_producer_sends_on_the_stream_the_node_names(h, producer, server):
    from mqstore.client import Message
    results = await asyncio.gather(*(producer.send(Message("T", f"s{i}".encode())) for i in range(50)))
    assert {r.status.value for r in results} == {"SEND_OK"}
    assert server.frames_in == 1 + 50 and len(producer.transport._streams) == 1    # HELLO + the sends
    await h.settle()
    assert sorted(await bodies(h, "T", 0) + await bodies(h, "T", 1)) == sorted(f"s{i}".encode() for i in range(50))


@sdk_test(stream_listening=False)
async def test_regression_sdk_falls_back_to_http_when_the_named_stream_port_does_not_answer(h, producer, server):
    # A compose cluster publishes only the API port: /health names a stream port the client
    # cannot reach. The send must still succeed, over HTTP.
    from mqstore.client import Message
    r = await producer.send(Message("T", b"via-http"))
    assert r.status.value == "SEND_OK" and server.frames_in == 0 and not producer.transport._streams
    assert [p for p, _at in producer.transport._stream_ports.values()] == [None]


def test_silent_and_idle_connections_are_closed_and_the_client_reconnects(tmp_path):
    # A connection that never sends a frame, or sends nothing for long, holds one of the
    # maxStreamConnections slots: without these timeouts the cap could fill with idlers.
    async def go():
        h = make_broker(str(tmp_path), BrokerConfig(maped_file_size_consume_queue=20 * 64))
        await h.broker.start()
        await h.broker.create_topic("T", 1)
        port = lc.free_port()
        server = StreamServer(h.broker, first_frame_timeout_s=0.2, idle_timeout_s=1.0, sweep_s=0.05)
        await server.start("127.0.0.1", port)
        try:
            silent = await raw_exchange(port, b"", read_for_s=2.0)
            assert [(k, rid, d["error"], d["retriable"]) for k, rid, d in silent] == \
                [(F.ERROR, F.CONNECTION, "TIMEOUT", True)]
            conn = await StreamConnection.open("127.0.0.1", port)
            for _ in range(4):                       # busy for longer than the idle timeout: kept
                assert (await conn.send("T", one()))[0] == 200
                await asyncio.sleep(0.25)
            await asyncio.sleep(2.0)                 # then idle: closed, retriably
            assert conn.closed and len(server.open) == 0
            from mqstore.client.transport import BrokerGroup, Transport
            from aiohttp.test_utils import TestServer
            from node.api import make_app
            h.broker.config = dataclasses.replace(h.broker.config, stream_listen_port=port)   # /health names it
            http = TestServer(make_app(h.broker), host="127.0.0.1")
            await http.start_server()
            t = Transport(3.0)
            await t.start()
            try:
                group = BrokerGroup("g", [f"127.0.0.1:{http.port}"])
                for _ in range(2):                   # the SDK opens a new stream after an idle close
                    doc = await t.call(group, "POST", "/topics/T/messages", one(), stream_topic="T")
                    assert doc["results"][0]["status"] == "SEND_OK"
                    await asyncio.sleep(2.0)
                assert server.frames_in >= 4 + 2 * 2    # every send went on a stream
            finally:
                await t.close()
                await http.close()
        finally:
            await server.stop()
            await h.broker.stop()
    asyncio.run(go())


def test_regression_a_node_answer_that_is_not_a_map_is_a_bad_response_not_a_crash():
    # A RESULT whose payload is a list, and an ERROR with a string status, from a broken node.
    async def go():
        async def broken(reader, writer):
            await answer_hello(reader, writer)
            sends = []
            while len(sends) < 2:
                sends += F.FrameReader(1 << 20).feed(await reader.read(1 << 20))
            writer.write(F.encode(F.RESULT, sends[0][1], [1, 2]) +
                         F.encode(F.ERROR, sends[1][1], {"error": "X", "status": "teapot"}))
            await asyncio.sleep(1)
        server = await asyncio.start_server(broken, "127.0.0.1", 0)
        conn = await StreamConnection.open("127.0.0.1", server.sockets[0].getsockname()[1])
        (s1, d1), (s2, d2) = await asyncio.gather(conn.send("T", one()), conn.send("T", one()))
        assert (s1, d1["error"]) == (502, "BAD_RESPONSE") and (s2, d2["error"]) == (502, "X")
        conn.close()
        server.close()
    asyncio.run(go())


@stream_test()
async def test_send_with_callback_answers_each_send_once(h, port):
    conn = await StreamConnection.open("127.0.0.1", port)
    got: list = []
    done = asyncio.Event()

    def cb(result, error):
        got.append((result, error))
        if len(got) == 50:
            done.set()
    for i in range(50):
        assert conn.has_room
        conn.send_with_callback("T", one(f"c{i}".encode(), queue_id=0), cb)
    await asyncio.wait_for(done.wait(), 5)
    assert [e for _, e in got] == [None] * 50
    assert sorted(r[1]["results"][0]["queue_offset"] for r, _ in got) == list(range(50))
    await h.settle()
    assert await bodies(h, "T", 0) == [f"c{i}".encode() for i in range(50)]
    conn.close()
    await asyncio.sleep(0.05)
    with pytest.raises(ConnectionResetError):
        conn.send_with_callback("T", one(), cb)


def test_send_with_callback_reports_a_timeout_and_a_lost_connection_as_errors():
    async def go():
        async def silent_then_gone(reader, writer):
            await answer_hello(reader, writer)
            await reader.read(1 << 20)
            await asyncio.sleep(0.6)
            writer.transport.abort()
        server = await asyncio.start_server(silent_then_gone, "127.0.0.1", 0)
        conn = await StreamConnection.open("127.0.0.1", server.sockets[0].getsockname()[1])
        got: list = []
        conn.send_with_callback("T", one(), lambda r, e: got.append(("short", r, e)), timeout_s=0.1)
        conn.send_with_callback("T", one(), lambda r, e: got.append(("long", r, e)), timeout_s=30)
        await asyncio.sleep(1.0)
        kinds = {name: type(e) for name, r, e in got if r is None}
        assert kinds == {"short": asyncio.TimeoutError, "long": ConnectionResetError}, got
        server.close()
    asyncio.run(go())


def test_regression_a_send_with_nothing_in_flight_is_written_at_once():
    """A send that is the connection's only request has nothing to share a write with: it is
    written before `send` returns. Before, it waited a loop turn for the batch flush, so
    every one-at-a-time send paid that turn. Sends made while others are in flight are still
    gathered into one write per turn."""
    class Recording:
        def __init__(self):
            self.writes: list[bytes] = []

        def write(self, data):
            self.writes.append(bytes(data))

        def close(self):
            pass

    async def go():
        conn = StreamConnection()
        t = Recording()
        conn.connection_made(t)
        conn.max_inflight = 64
        first = conn.send("T", one())
        assert len(t.writes) == 1                      # no loop turn has passed
        more = [conn.send("T", one()) for _ in range(3)]
        assert len(t.writes) == 1
        await asyncio.sleep(0)
        assert len(t.writes) == 2
        frames = F.FrameReader(1 << 20).feed(t.writes[1])
        assert [rid for _kind, rid, _p in frames] == [2, 3, 4]
        for fut in (first, *more):
            fut.cancel()
    asyncio.run(go())

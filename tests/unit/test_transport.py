"""Raft transport: frame cap checked before reading, garbage closes the connection,
handshake rejects strangers, bounded send queue, reconnect after the peer restarts, frames
read whole however the bytes arrive (in the connection's own callback, plain or TLS), and a
send outside a Raft round still leaves.

Method: real loopback sockets; raw asyncio streams play the misbehaving peer.
"""

from __future__ import annotations

import asyncio
import logging

import msgpack
import pytest

from dledger import codec, transport
from dledger.messages import Append, Entry, EntryType, Heartbeat
from dledger.transport import HANDSHAKE_MAGIC, PROTOCOL_VERSION, RECEIVE_CHUNK, Transport, TransportConfig, frame
from mqstore.localcluster import free_port
from node.store import layout as L
from tests.integration.test_peer_security import pki  # noqa: F401 - fixture


def hello(group="g", sender="n1") -> bytes:
    return frame(msgpack.packb([HANDSHAKE_MAGIC, PROTOCOL_VERSION, group, sender]))


async def until(cond, timeout=3.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.01)


def make(node, port, peers, got, **cfg):
    return Transport(node, "g", ("127.0.0.1", port), peers,
                     lambda s, m: got.append((s, m)), TransportConfig(**cfg))


async def listening_n0(got, **cfg):
    """n0's transport listening, and a raw client connected to it (playing n1)."""
    port = free_port()
    t = make("n0", port, {"n0": ("127.0.0.1", port), "n1": ("127.0.0.1", 1)}, got, **cfg)
    await t.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return t, port, reader, writer


def test_messages_flow_and_round_trip():
    async def main():
        p0, p1 = free_port(), free_port()
        peers = {"n0": ("127.0.0.1", p0), "n1": ("127.0.0.1", p1)}
        got0, got1 = [], []
        t0, t1 = make("n0", p0, peers, got0), make("n1", p1, peers, got1)
        await t0.start()
        await t1.start()
        msg = Append(2, "n0", 0, 0, (Entry(1, 2, EntryType.NORMAL, b"x" * 1000),), 0)
        for _ in range(100):
            t0.send("n1", msg)
        t1.send("n0", Heartbeat(2, "n1", 0))
        await until(lambda: len(got1) == 100 and len(got0) == 1)
        assert got1[0] == ("n0", msg)
        assert got0[0] == ("n1", Heartbeat(2, "n1", 0))
        await t0.stop()
        await t1.stop()
    asyncio.run(main())


@pytest.mark.parametrize("reading", ["protocol", "stream reader"])
def test_frames_arrive_whole_however_the_bytes_are_cut(reading, monkeypatch):
    """The receiver takes every whole frame of a read at once: frames packed into one write,
    a frame cut at every byte, and a frame larger than one read all arrive, in order. The
    same through the StreamReader, read when its buffer cannot be taken over."""
    if reading == "stream reader":
        monkeypatch.setattr(transport, "_stream_buffer", lambda reader: None)

    async def main():
        got = []
        t, port, reader, writer = await listening_n0(got)
        beats = [Heartbeat(2, "n1", i) for i in range(50)]
        writer.write(hello() + b"".join(frame(codec.encode(m)) for m in beats))       # packed
        cut = frame(codec.encode(Heartbeat(2, "n1", 50)))
        for i in range(len(cut)):                                                    # cut at every byte
            writer.write(cut[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0.001)
        big = Append(2, "n1", 0, 0, tuple(Entry(i + 1, 2, EntryType.NORMAL, bytes([i % 256]) * 4000) for i in range(300)), 0)
        raw = frame(codec.encode(big)) + frame(codec.encode(Heartbeat(2, "n1", 51)))
        assert len(raw) > 2 * RECEIVE_CHUNK
        for i in range(0, len(raw), 70_001):                                         # larger than a read
            writer.write(raw[i:i + 70_001])
            await writer.drain()
        await until(lambda: len(got) == 53)
        assert [m for _s, m in got] == beats + [Heartbeat(2, "n1", 50), big, Heartbeat(2, "n1", 51)]
        assert t.metrics["frames_received"] == 53 and t.metrics["bad_frames"] == 0
        writer.close()
        await t.stop()
    asyncio.run(main())


def test_a_send_outside_a_raft_round_leaves_without_a_flush():
    """Repair messages are sent outside the Raft round that ends with flush(): the transport
    writes them in the next loop turn by itself."""
    async def main():
        p0, p1 = free_port(), free_port()
        peers = {"n0": ("127.0.0.1", p0), "n1": ("127.0.0.1", p1)}
        got1 = []
        t0, t1 = make("n0", p0, peers, []), make("n1", p1, peers, got1)
        await t0.start()
        await t1.start()
        await until(lambda: t0.is_connected("n1"))
        t0.send("n1", Heartbeat(3, "n0", 7))          # no flush() call follows
        await until(lambda: got1 == [("n0", Heartbeat(3, "n0", 7))])
        await t0.stop()
        await t1.stop()
    asyncio.run(main())


def test_frame_cap_checked_before_reading(caplog):
    async def main():
        got = []
        t, port, reader, writer = await listening_n0(got, max_frame_bytes=1024)
        writer.write(hello())
        # Announce 1 GiB and send nothing more: the server must close without waiting for it.
        writer.write(L.FRAME_LEN.pack(1 << 30))
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 2.0)
        assert data == b""
        assert t.metrics["bad_frames"] == 1
        writer.close()
        await t.stop()
        assert got == []
    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert "exceeds the cap" in caplog.text


def test_garbage_frame_closes_connection(caplog):
    async def main():
        got = []
        t, port, reader, writer = await listening_n0(got)
        writer.write(hello() + frame(b"\xc1\xc1 not msgpack"))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 2.0) == b""
        writer.close()
        # A well-formed msgpack value that is not a message is garbage too.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(hello() + frame(msgpack.packb(["Heartbeat", -1, "n1", 0])))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 2.0) == b""
        writer.close()
        assert t.metrics["bad_frames"] == 2 and got == []
        await t.stop()
    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert "undecodable frame" in caplog.text


def test_handshake_rejects_unknown_peer_and_group(caplog):
    async def main():
        port = free_port()
        got = []
        t = make("n0", port, {"n0": ("127.0.0.1", port), "n1": ("127.0.0.1", 1)}, got)
        await t.start()
        for h in (hello(sender="n9"), hello(group="other"), frame(b"junk")):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(h + frame(msgpack.packb(["Heartbeat", 1, "n1", 0])))
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 2.0) == b""
            writer.close()
        assert got == [] and t.metrics["bad_frames"] == 3
        await t.stop()
    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert "unknown peer" in caplog.text and "group" in caplog.text


def test_send_queue_is_bounded_drop_oldest():
    async def main():
        p0 = free_port()
        dead = free_port()   # nobody listens there
        t = make("n0", p0, {"n0": ("127.0.0.1", p0), "n1": ("127.0.0.1", dead)}, [], send_queue_max_msgs=10)
        await t.start()
        for i in range(25):
            t.send("n1", Heartbeat(i + 1, "n0", 0))
        assert len(t._peers["n1"].queue) == 10
        assert t.metrics["dropped_queue_full"] == 15
        t.send("nX", Heartbeat(1, "n0", 0))
        assert t.metrics["dropped_unknown_peer"] == 1
        await t.stop()
    asyncio.run(main())


def test_reconnects_after_peer_restart():
    async def main():
        p0, p1 = free_port(), free_port()
        peers = {"n0": ("127.0.0.1", p0), "n1": ("127.0.0.1", p1)}
        got1 = []
        t0 = make("n0", p0, peers, [], reconnect_backoff_min_ms=10, reconnect_backoff_max_ms=50)
        await t0.start()
        t0.send("n1", Heartbeat(1, "n0", 0))           # queued while n1 is down
        await asyncio.sleep(0.2)
        t1 = make("n1", p1, peers, got1)
        await t1.start()
        await until(lambda: len(got1) == 1)
        await t1.stop()
        await asyncio.sleep(0.05)
        t1 = make("n1", p1, peers, got1)
        await t1.start()
        # The first send after the restart may hit the dead socket; Raft repeats, so do we.
        loop = asyncio.get_running_loop()
        end = loop.time() + 3
        while len(got1) < 2 and loop.time() < end:
            t0.send("n1", Heartbeat(2, "n0", 0))
            await asyncio.sleep(0.05)
        assert got1[-1] == ("n0", Heartbeat(2, "n0", 0))
        assert t0.metrics["reconnects"] >= 1
        await t0.stop()
        await t1.stop()
    asyncio.run(main())


def test_on_received_follows_each_read_s_frames():
    """The Raft node runs its round when a read's frames are all delivered (on_received),
    not a loop turn later: two frames in one write are two on_message calls, then one
    on_received; a read holding only part of a frame delivers nothing and calls nothing."""
    async def main():
        events = []
        port = free_port()
        t = Transport("n0", "g", ("127.0.0.1", port), {"n0": ("127.0.0.1", port), "n1": ("127.0.0.1", 1)},
                      lambda s, m: events.append(("msg", m)), TransportConfig(),
                      on_received=lambda: events.append(("received",)))
        await t.start()
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(hello())
        hb = [Heartbeat(3, "n1", i) for i in range(2)]
        framed = codec.encode_frame(hb[0]) + codec.encode_frame(hb[1])
        writer.write(framed)
        await writer.drain()
        await until(lambda: ("received",) in events)
        assert events == [("msg", hb[0]), ("msg", hb[1]), ("received",)]
        third = codec.encode_frame(Heartbeat(3, "n1", 9))
        writer.write(third[:3])
        await writer.drain()
        await asyncio.sleep(0.1)
        assert len(events) == 3                      # a part of a frame: nothing yet
        writer.write(third[3:])
        await writer.drain()
        await until(lambda: len(events) == 5)
        assert events[3:] == [("msg", Heartbeat(3, "n1", 9)), ("received",)]
        writer.close()
        await t.stop()
    asyncio.run(main())


def test_regression_peer_frames_are_handled_in_the_connection_s_callback_not_a_task_turn():
    """After the handshake a connection's frames go straight from the socket's read callback to
    on_message and on_received. Read through a StreamReader, each read first woke the
    connection's task, one loop turn later: every push a follower got and every ack the
    leader got waited for that turn. Here no task runs the handling."""
    async def main():
        where = []
        port = free_port()
        t = Transport("n0", "g", ("127.0.0.1", port), {"n0": ("127.0.0.1", port), "n1": ("127.0.0.1", 1)},
                      lambda s, m: where.append(("msg", asyncio.current_task())), TransportConfig(),
                      on_received=lambda: where.append(("received", asyncio.current_task())))
        await t.start()
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(hello())
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(codec.encode_frame(Heartbeat(3, "n1", 1)))
        await writer.drain()
        await until(lambda: len(where) == 2)
        assert where == [("msg", None), ("received", None)]
        writer.close()
        await t.stop()
    asyncio.run(main())


def test_frames_sent_with_the_handshake_and_then_eof_all_arrive():
    """Bytes the handshake's reads left buffered are handled first, and an end of stream that
    came with them ends the connection after them, quietly."""
    async def main():
        got = []
        t, port, reader, writer = await listening_n0(got)
        beats = [Heartbeat(2, "n1", i) for i in range(3)]
        writer.write(hello() + b"".join(codec.encode_frame(m) for m in beats))
        writer.write_eof()
        await writer.drain()
        await until(lambda: len(got) == 3)
        assert [m for _s, m in got] == beats
        assert await asyncio.wait_for(reader.read(), 2.0) == b""     # closed by the listener
        await until(lambda: not t._inbound)
        assert t.metrics["bad_frames"] == 0
        writer.close()
        await t.stop()
    asyncio.run(main())


def test_a_frame_over_the_cap_after_good_ones_closes_the_connection_and_keeps_those(caplog):
    async def main():
        got = []
        t, port, reader, writer = await listening_n0(got, max_frame_bytes=1024)
        writer.write(hello())
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(codec.encode_frame(Heartbeat(2, "n1", 1)) + L.FRAME_LEN.pack(4096) + b"x" * 10)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 2.0) == b""
        assert got == [("n1", Heartbeat(2, "n1", 1))] and t.metrics["bad_frames"] == 1
        writer.close()
        await t.stop()
    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert "exceeds the cap" in caplog.text


def test_peers_exchange_frames_over_mutual_tls(pki):
    """The connection's handling moves to its own protocol on a TLS transport too."""
    from node import tls
    from node.peer_auth import PeerSecurity

    async def main():
        p0, p1 = free_port(), free_port()
        peers = {"n0": ("127.0.0.1", p0), "n1": ("127.0.0.1", p1)}
        sec = PeerSecurity(None, tls.server_context(pki["node"], pki["node"], pki["ca"]),
                           tls.client_context(pki["ca"], pki["node"], pki["node"]))
        got0, got1 = [], []
        t0, t1 = make("n0", p0, peers, got0, security=sec), make("n1", p1, peers, got1, security=sec)
        await t0.start()
        await t1.start()
        big = Append(2, "n0", 0, 0, tuple(Entry(i + 1, 2, EntryType.NORMAL, bytes([i % 256]) * 4000)
                                          for i in range(200)), 0)
        for _ in range(5):
            t0.send("n1", big)
        t1.send("n0", Heartbeat(2, "n1", 0))
        await until(lambda: len(got1) == 5 and len(got0) == 1, timeout=5.0)
        assert all(m == big for _s, m in got1) and got0 == [("n1", Heartbeat(2, "n1", 0))]
        await t0.stop()
        await t1.stop()
    asyncio.run(main())

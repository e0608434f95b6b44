"""asyncio TCP between the members of one Raft group.

Each node keeps one outbound connection per peer (it only sends on it) and accepts
inbound connections (it only receives on them). A frame is FRAME_LEN (4 bytes,
big-endian payload length) + a msgpack payload (dledger.codec). The length is
checked against `max_frame_bytes` *before* the payload is read, so a hostile or
broken peer cannot make us allocate gigabytes.

With a cluster secret (node/peer_auth.py) the listener first runs the mutual
challenge-response: nothing from the peer is read as a frame until it has proved it
knows the secret, and the dialler checks the listener's proof before it sends. With TLS
(`PeerSecurity.server_ssl` / `client_ssl`, node/tls.py) all of it runs inside mutual TLS.

After the handshake an inbound connection's bytes go to its own protocol (`_Receiver`): each
read's whole frames reach `on_message`, then `on_received`, in the socket's read callback,
with no task woken in between.

The first frame on a connection is the handshake `["mqstore-raft", version, group,
sender_id]`; a connection from another group or an unknown id is closed. A frame
that does not decode closes the connection with a logged error: after garbage the
framing itself can no longer be trusted.

Sending never blocks the caller: each peer has a bounded queue; when it is full
the oldest message is dropped (counted in `metrics["dropped_queue_full"]`). Raft
tolerates loss: pushes time out and are repeated, heartbeats recur. Outbound
connections reconnect with capped exponential backoff.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import ssl
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

from dledger import codec
from node import limits, peer_auth, tls
from node.store import layout as L

log = logging.getLogger(__name__)

HANDSHAKE_MAGIC = "mqstore-raft"
# 2: Append entries travel as one binary blob with per-entry body CRCs (dledger.codec).
PROTOCOL_VERSION = 2
FLUSH_BUFFER_BYTES = 1 << 20   # flush() leaves a peer whose socket holds this much unsent to its sender task
RECEIVE_CHUNK = 256 * 1024     # a frame missing more than this collects its reads in a list (one join, not a copy per read)


@dataclass(frozen=True)
class TransportConfig:
    # Largest frame payload accepted or sent, bytes; checked before reading.
    max_frame_bytes: int = 64 * 1024 * 1024
    # Messages queued per peer while its connection is down or slow; oldest dropped beyond.
    send_queue_max_msgs: int = 8192
    # Bytes coalesced into one socket write.
    write_batch_max_bytes: int = 8 * 1024 * 1024
    # Reconnect backoff: first delay, doubling up to the cap, with +-20 % jitter.
    reconnect_backoff_min_ms: int = 20
    reconnect_backoff_max_ms: int = 1000
    # A connect or handshake that takes longer than this fails.
    connect_timeout_ms: int = 1000
    handshake_timeout_ms: int = 2000
    # Inbound connections held at once (raftMaxInboundConnections); a group of 5 needs 4 plus
    # reconnect overlap. Beyond it a new connection is closed on accept (node/limits.py).
    max_inbound_connections: int = 32
    # Cluster secret and TLS contexts (node.peer_auth.PeerSecurity); None = plain, unauthenticated.
    security: Any = field(default=None, compare=False)

    def validate(self) -> None:
        for name in ("max_frame_bytes", "send_queue_max_msgs", "write_batch_max_bytes",
                     "reconnect_backoff_min_ms", "reconnect_backoff_max_ms",
                     "connect_timeout_ms", "handshake_timeout_ms", "max_inbound_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"TransportConfig.{name} must be >= 1")
        if self.reconnect_backoff_max_ms < self.reconnect_backoff_min_ms:
            raise ValueError("TransportConfig.reconnect_backoff_max_ms must be >= reconnect_backoff_min_ms")


class FrameError(Exception):
    """A peer broke the framing or handshake; the connection is closed. Remote fault."""

    retriable = False
    local = False


def frame(payload: bytes) -> bytes:
    return L.FRAME_LEN.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """One frame's payload. The length is checked before the payload is read."""
    head = await reader.readexactly(L.FRAME_LEN.size)
    (length,) = L.FRAME_LEN.unpack(head)
    if length > max_bytes:
        raise FrameError(f"frame of {length} bytes exceeds the cap of {max_bytes}")
    return await reader.readexactly(length)


def _stream_buffer(reader: asyncio.StreamReader) -> bytearray | None:
    """The bytes a StreamReader holds unread (CPython's keeps them in `_buffer`), or None."""
    buffered = getattr(reader, "_buffer", None)
    return buffered if isinstance(buffered, bytearray) else None


def _take(queue: collections.deque[bytes], cap: int) -> list[bytes]:
    """Frames from the front of `queue` up to `cap` bytes (at least one)."""
    batch, size = [], 0
    while queue and (not batch or size + len(queue[0]) <= cap):
        f = queue.popleft()
        batch.append(f)
        size += len(f)
    return batch


class _Peer:
    """Outbound side for one peer: queue + connection task."""

    def __init__(self, peer_id: str, host: str, port: int, queue_max: int):
        self.peer_id = peer_id
        self.host = host
        self.port = port
        self.queue: collections.deque[bytes] = collections.deque()
        self.queue_max = queue_max
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.connected = False
        self.writer: asyncio.StreamWriter | None = None    # while connected (flush() writes on it)


class Transport:
    """Frames Raft messages between `self_id` and `peers` ({id: (host, port)})."""

    def __init__(self, self_id: str, group: str, listen: tuple[str, int],
                 peers: dict[str, tuple[str, int]], on_message: Callable[[str, object], None],
                 config: TransportConfig | None = None, rng: random.Random | None = None,
                 on_received: Callable[[], None] | None = None):
        self.config = config or TransportConfig()
        self.config.validate()
        self.self_id = self_id
        self.group = group
        self.listen = listen
        self.on_message = on_message
        self.on_received = on_received      # after each read's frames have gone to on_message
        self.rng = rng or random.Random()
        self._peers = {pid: _Peer(pid, h, p, self.config.send_queue_max_msgs)
                       for pid, (h, p) in peers.items() if pid != self_id}
        self._server: asyncio.base_events.Server | None = None
        self._inbound: set[asyncio.Task] = set()
        self._closing = False
        self._flush_scheduled = False
        self.metrics = collections.Counter()
        self.queued_bytes = 0       # every frame queued so far (the shell bounds a round by it)
        self._security = self.config.security or peer_auth.NO_SECURITY

    # --- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        host, port = self.listen
        self._server = await asyncio.start_server(self._serve, host, port, limit=1 << 20,
                                                  ssl=tls.count_failures(self._security.server_ssl, "raft"))
        for peer in self._peers.values():
            peer.task = asyncio.create_task(self._sender(peer), name=f"raft-send-{self.self_id}->{peer.peer_id}")

    @property
    def bound_port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        tasks = [p.task for p in self._peers.values() if p.task] + list(self._inbound)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    # --- sending -----------------------------------------------------------------------
    def send(self, peer_id: str, msg: object) -> None:
        """Queue `msg` for `peer_id` (never blocks; drops the oldest when full)."""
        peer = self._peers.get(peer_id)
        if peer is None:
            self.metrics["dropped_unknown_peer"] += 1
            return
        framed = codec.encode_frame(msg)
        if len(framed) - L.FRAME_LEN.size > self.config.max_frame_bytes:
            log.error("raft %s: dropping %s of %d bytes to %s (cap %d)", self.self_id, type(msg).__name__,
                      len(framed) - L.FRAME_LEN.size, peer_id, self.config.max_frame_bytes)
            self.metrics["dropped_too_large"] += 1
            return
        if len(peer.queue) >= peer.queue_max:
            peer.queue.popleft()
            self.metrics["dropped_queue_full"] += 1
        peer.queue.append(framed)
        self.queued_bytes += len(framed)
        if not self._flush_scheduled:
            # The Raft loop flushes at the end of its round, before this runs; a send from
            # anywhere else leaves in the next turn. One callback per turn, not a task wake-up
            # per message.
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        self.flush()

    def flush(self) -> None:
        """Write what the queues hold now to every connected peer whose socket is keeping up, in
        this loop turn (the Raft loop calls it after a round); a peer over FLUSH_BUFFER_BYTES
        unsent, or not connected, is left to its sender task, woken here."""
        cap = self.config.write_batch_max_bytes
        for peer in self._peers.values():
            if not peer.queue:
                continue
            w = peer.writer
            if w is None or w.transport.is_closing() or w.transport.get_write_buffer_size() >= FLUSH_BUFFER_BYTES:
                peer.wakeup.set()
                continue
            batch = _take(peer.queue, cap)
            w.write(b"".join(batch))
            self.metrics["frames_sent"] += len(batch)

    def is_connected(self, peer_id: str) -> bool:
        peer = self._peers.get(peer_id)
        return bool(peer and peer.connected)

    async def _sender(self, peer: _Peer) -> None:
        """Connect, handshake, drain the queue; on any failure back off and reconnect."""
        backoff = self.config.reconnect_backoff_min_ms
        while not self._closing:
            writer = None
            try:
                writer = await self._connect(peer)
                peer.connected = True
                peer.writer = writer
                backoff = self.config.reconnect_backoff_min_ms
                await self._drain_queue(peer, writer)
            except peer_auth.PeerAuthError as e:
                peer_auth.FAILURES.record("raft_dial", f"{peer.host}:{peer.port}", str(e))
                self.metrics["auth_failures"] += 1
            except (OSError, asyncio.TimeoutError, ConnectionError) as e:
                if peer.connected:
                    log.warning("raft %s: connection to %s lost: %s", self.self_id, peer.peer_id, e)
                self.metrics["connect_failures"] += 1
            finally:
                peer.connected = False
                peer.writer = None
                if writer is not None:
                    writer.close()
            jitter = 1.0 + (self.rng.random() - 0.5) * 0.4
            await asyncio.sleep(backoff * jitter / 1000)
            backoff = min(backoff * 2, self.config.reconnect_backoff_max_ms)
            self.metrics["reconnects"] += 1

    async def _connect(self, peer: _Peer) -> asyncio.StreamWriter:
        timeout = self.config.connect_timeout_ms / 1000
        sec = self._security
        try:
            async with asyncio.timeout(timeout):     # not wait_for: see _handshake
                reader, writer = await asyncio.open_connection(peer.host, peer.port, ssl=sec.client_ssl)
        except ssl.SSLError as e:     # the listener's certificate is not trusted, or it refused ours
            tls.HANDSHAKE_FAILURES.record("raft_dial", f"{peer.host}:{peer.port}", tls.reason(e))
            raise
        if sec.secret is not None:
            try:
                await peer_auth.connect_peer(reader, writer, sec.secret, "raft", self.self_id,
                                             expect_server_id=peer.peer_id,
                                             timeout_s=self.config.handshake_timeout_ms / 1000)
            except BaseException:
                writer.close()
                raise
        hello = msgpack.packb([HANDSHAKE_MAGIC, PROTOCOL_VERSION, self.group, self.self_id])
        writer.write(frame(hello))
        async with asyncio.timeout(timeout):
            await writer.drain()
        return writer

    async def _drain_queue(self, peer: _Peer, writer: asyncio.StreamWriter) -> None:
        cap = self.config.write_batch_max_bytes
        while True:
            if not peer.queue:
                peer.wakeup.clear()
                await peer.wakeup.wait()
            if not peer.queue:
                continue              # flush() wrote it already
            batch = _take(peer.queue, cap)
            writer.write(b"".join(batch))
            self.metrics["frames_sent"] += len(batch)
            await writer.drain()

    # --- receiving -----------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        addr = writer.get_extra_info("peername")
        if len(self._inbound) >= self.config.max_inbound_connections:
            limits.REJECTIONS.add("raft_connections")
            self.metrics["refused_connections"] += 1
            log.warning("raft %s: refusing connection from %s: %d inbound already", self.self_id, addr,
                        len(self._inbound))
            writer.close()
            return
        self._inbound.add(task)
        try:
            authed = None
            if self._security.secret is not None:   # before any frame is read
                authed = await peer_auth.accept_peer(reader, writer, self._security.secret, "raft", self.self_id,
                                                     self.config.handshake_timeout_ms / 1000)
            sender = await self._handshake(reader)
            if authed is not None and sender != authed:
                raise FrameError(f"peer authenticated as {authed!r} says it is {sender!r}")
            await self._receive(sender, reader, writer)
        except peer_auth.PeerAuthError:
            self.metrics["auth_failures"] += 1   # counted and logged (rate-limited) by peer_auth
        except FrameError as e:
            log.error("raft %s: closing connection from %s: %s", self.self_id, addr, e)
            self.metrics["bad_frames"] += 1
        except codec.CodecError as e:
            log.error("raft %s: closing connection from %s: undecodable frame: %s", self.self_id, addr, e)
            self.metrics["bad_frames"] += 1
        except (asyncio.IncompleteReadError, ConnectionError, OSError, asyncio.TimeoutError):
            pass  # the peer went away; it will reconnect
        except asyncio.CancelledError:
            # stop() cancels readers; finishing normally keeps asyncio's stream callback quiet.
            if not self._closing:
                raise
        finally:
            self._inbound.discard(task)
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader) -> str:
        timeout = self.config.handshake_timeout_ms / 1000
        # asyncio.timeout, not wait_for: 3.11's wait_for returns the result of a read that finished
        # as stop() cancelled the task (the cancel is lost), and the reader then serves on forever.
        async with asyncio.timeout(timeout):
            payload = await read_frame(reader, 1024)
        try:
            hello = msgpack.unpackb(payload, raw=False)
        except (ValueError, msgpack.UnpackException) as e:
            raise FrameError(f"bad handshake: {e}") from e
        if not (isinstance(hello, list) and len(hello) == 4 and hello[0] == HANDSHAKE_MAGIC):
            raise FrameError(f"bad handshake {hello!r:.100}")
        _magic, version, group, sender = hello
        if version != PROTOCOL_VERSION:
            raise FrameError(f"protocol version {version}, we speak {PROTOCOL_VERSION}")
        if group != self.group:
            raise FrameError(f"peer of group {group!r}, we are {self.group!r}")
        # A non-string id (an array is unhashable) is as unknown as a wrong one.
        if not isinstance(sender, str) or sender not in self._peers:
            raise FrameError(f"unknown peer {sender!r:.100}")
        return sender

    async def _receive(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The connection's frames from here on go to a `_Receiver` protocol: each read's whole
        frames are handled in the transport's own callback. A StreamReader woke this task one
        loop turn after the bytes came, and each peer message (a push on a follower, an ack
        on the leader) waited for that turn. What the handshake's reads left buffered is
        handled first. Returns when the connection ends; raises what ended it badly."""
        buffered = _stream_buffer(reader)
        if buffered is None:            # a StreamReader whose buffer we cannot take: keep reading through it
            await self._receive_stream(sender, reader)
            return
        done = asyncio.get_running_loop().create_future()
        receiver = _Receiver(self, sender, done)
        transport = writer.transport
        leftover, eof = bytes(buffered), reader.at_eof() or getattr(reader, "_eof", False)
        buffered.clear()
        transport.set_protocol(receiver)
        receiver.connection_made(transport)
        if leftover:
            receiver.data_received(leftover)
        if eof:
            receiver.connection_lost(None)
        elif getattr(reader, "_paused", False):      # the StreamReader had paused reading: its buffer was full
            transport.resume_reading()
        await done

    async def _receive_stream(self, sender: str, reader: asyncio.StreamReader) -> None:
        """Every whole frame that has arrived, per wake-up, read through a StreamReader (the
        fallback of `_receive`). A frame still arriving is finished with one readexactly."""
        cap, head = self.config.max_frame_bytes, L.FRAME_LEN
        hsize = head.size
        buf = b""
        while True:
            if len(buf) >= hsize:            # a frame whose length (checked) is known: its rest
                buf += await reader.readexactly(hsize + head.unpack_from(buf, 0)[0] - len(buf))
            else:
                chunk = await reader.read(RECEIVE_CHUNK)
                if not chunk:
                    raise asyncio.IncompleteReadError(buf, None)
                buf = buf + chunk if buf else chunk
            buf = self._handle_frames(sender, buf, cap)

    def _handle_frames(self, sender: str, buf: bytes, cap: int) -> bytes:
        """Hand every whole frame at the front of `buf` to on_message, then call on_received if
        there was one; the bytes left (a frame not yet whole). FrameError or CodecError on a
        length over `cap` or an undecodable payload."""
        head = L.FRAME_LEN
        hsize = head.size
        pos, end = 0, len(buf)
        view = memoryview(buf)
        on_message, decode, n = self.on_message, codec.decode, 0
        try:
            while end - pos >= hsize:
                (length,) = head.unpack_from(buf, pos)
                if length > cap:
                    raise FrameError(f"frame of {length} bytes exceeds the cap of {cap}")
                stop = pos + hsize + length
                if stop > end:
                    break
                msg = decode(view[pos + hsize:stop])
                n += 1
                on_message(sender, msg)
                pos = stop
        finally:
            view.release()
            self.metrics["frames_received"] += n
        if pos and self.on_received is not None:
            self.on_received()
        return buf[pos:] if pos else buf


class _Receiver(asyncio.Protocol):
    """The inbound side of one peer connection after its handshake (Transport._receive).

    Bytes are kept only for a frame not yet whole: a short tail is joined with the next read;
    a frame known to need many more reads collects them in a list, joined once (one copy of a
    large push, not one per piece). A frame over the cap or one that does not decode ends the
    connection, as it did read through a StreamReader: `done` carries the error to _serve."""

    def __init__(self, owner: Transport, sender: str, done: asyncio.Future):
        self.owner, self.sender, self.done = owner, sender, done
        self.cap = owner.config.max_frame_bytes
        self.transport: asyncio.BaseTransport | None = None
        self.tail = b""                 # the start of a frame not yet whole
        self.parts: list[bytes] = []    # or, for a frame needing many reads, its pieces so far
        self.have = self.need = 0       # their bytes, and the whole frame's

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        if self.need:
            self.parts.append(data)
            self.have += len(data)
            if self.have < self.need:
                return
            data, self.parts, self.have, self.need = b"".join(self.parts), [], 0, 0
        elif self.tail:
            data, self.tail = self.tail + data, b""
        try:
            rest = self.owner._handle_frames(self.sender, data, self.cap)
        except Exception as e:  # noqa: BLE001 - bad framing, an undecodable frame, or a bug: _serve says which
            self._end(e)
            return
        hsize = L.FRAME_LEN.size
        if len(rest) >= hsize:
            need = hsize + L.FRAME_LEN.unpack_from(rest, 0)[0]
            if need - len(rest) > RECEIVE_CHUNK:
                self.parts, self.have, self.need = [rest], len(rest), need
                return
        self.tail = rest

    def eof_received(self) -> bool:
        return False                    # close: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc if exc is not None else asyncio.IncompleteReadError(self.tail, None))

    def _end(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)
        if self.transport is not None:
            self.transport.close()

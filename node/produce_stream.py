"""The produce stream: a pipelined binary send channel beside the HTTP API.

HTTP/1.1 answers one request at a time per connection, and aiohttp spends far more on a
request than the store spends on a message, so one message per request costs ~100x a
message in a batch. Here a client keeps one connection and writes SEND frames without
waiting (node/stream_frames.py); the node parses every frame that arrived in one read,
appends the sends of each topic as one log batch (Broker.send_coalesced: each request is
still checked and placed as its own batch) and writes their answers in one write when
that batch is acked: committed in DLedger mode, as the flush and HA policy says otherwise.
On a DLedger leader the batch is proposed in the read's own callback and answered from the
Raft round that commits it (Broker.submit_coalesced): no task is started or resumed.

Bounds: `maxStreamConnections` connections (closed on accept beyond it), a connection that
sends no whole frame within 10 s closed, and one idle (nothing in flight, no frame) for 10
minutes closed too (the SDK reconnects when it next sends); a frame's payload at most
`maxRequestBytes`, checked on its header; at most `maxInflightRequestsPerClient`
requests unanswered per connection, beyond which the node stops reading the connection
until answers drain (TCP pushes back on the client); the same when the client does not
read its answers (the transport's write buffer is over its high-water mark).

With `aclEnable=true` the first frame must be a HELLO signed by an account of the ACL file
(the X-MQ-* headers of `STREAM /stream` with an empty body, node/acl.py); each SEND then
needs that account's PUB on its topic, checked against the ACL as it is now. With TLS on
the API (`tlsEnable`), the stream is TLS with the same certificate.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import defaultdict
from typing import Any, Callable, cast

from node import limits
from node import stream_frames as F
from node.acl import Account, AuthError, NonceCache, verify
from node.api import parse_messages
from node.auth import AclStore, authorise, preflight
from node.store.errors import BadRequest, MessageTooLarge, StoreError

log = logging.getLogger(__name__)

SEND_PATTERN = "/topics/{topic}/messages"
FIRST_FRAME_TIMEOUT_S = 10.0  # a connection that sends no whole frame by then is closed
IDLE_TIMEOUT_S = 600.0        # one with nothing in flight and no frame for this long is closed
SWEEP_S = 1.0                 # how often connections are checked against those two
MAX_CACHED_TOPICS = 1024      # topic names a connection remembers as well-formed


class AclGate:
    """The ACL check of a stream: who said HELLO, and may they publish to this topic."""

    def __init__(self, store: AclStore, nonces: NonceCache, wall_clock_ms: Callable[[], int]):
        self.store, self.nonces, self.wall_clock_ms = store, nonces, wall_clock_ms

    def hello(self, headers: Any) -> str:
        """The access key of a good HELLO, else AuthError."""
        if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
            raise AuthError(401, "UNAUTHENTICATED", "HELLO must carry the X-MQ-* signature headers as strings")
        account = verify(self.store.current(), self.nonces, F.STREAM_METHOD, F.STREAM_TARGET, headers, b"",
                         self.wall_clock_ms())
        return account.access_key

    def check_send(self, access_key: str, topic: str) -> None:
        account: Account | None = self.store.current().get(access_key)
        if account is None:
            raise AuthError(401, "UNAUTHENTICATED", f"account {access_key!r} is no longer in the ACL file")
        authorise(account, "POST", SEND_PATTERN, {"topic": topic}, None)


def _error_frame(rid: int, code: str, message: str, status: int, retriable: bool = False,
                 leader: str | None = None) -> bytes:
    return F.encode(F.ERROR, rid, {"error": code, "message": message, "retriable": retriable,
                                   "leader": leader, "status": status})


class StreamServer:
    """Accepts produce streams for one broker; `start()` listens, `stop()` closes everything."""

    def __init__(self, broker: Any, gate: AclGate | None = None, ssl_context: ssl.SSLContext | None = None,
                 first_frame_timeout_s: float = FIRST_FRAME_TIMEOUT_S, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 sweep_s: float = SWEEP_S):
        cfg = broker.config
        self.first_frame_timeout_s, self.idle_timeout_s, self.sweep_s = first_frame_timeout_s, idle_timeout_s, sweep_s
        self._sweeper: asyncio.Task | None = None
        self.broker = broker
        self.gate = gate
        self.ssl_context = ssl_context
        self.limits = limits.Limits.from_config(cfg)
        self.max_frame_bytes = cfg.max_request_bytes
        self.max_inflight = cfg.max_inflight_requests_per_client
        self.connections = limits.ConnectionGate(cfg.max_stream_connections, "stream_connections")
        self.open: set[StreamProtocol] = set()
        self.server: asyncio.AbstractServer | None = None
        self.frames_in = 0
        self.batches = 0

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: StreamProtocol(self), host, port, ssl=self.ssl_context,
                                               reuse_address=True)
        self._sweeper = loop.create_task(self._sweep(), name="produce-stream-sweeper")

    async def _sweep(self) -> None:
        """Close connections that never sent a frame, and idle ones (a slot each: the cap must
        not fill with connections that do nothing). An idle client reconnects when it next sends."""
        while True:
            await asyncio.sleep(self.sweep_s)
            now = time.monotonic()
            for p in list(self.open):
                if p.frames == 0 and now - p.last_frame_at > self.first_frame_timeout_s:
                    p.fail_connection("TIMEOUT", f"no frame within {self.first_frame_timeout_s:g} s of connecting",
                                      408, retriable=True)
                elif p.inflight == 0 and now - p.last_frame_at > self.idle_timeout_s:
                    p.fail_connection("IDLE", f"no request for {self.idle_timeout_s:g} s; reconnect to send", 408,
                                      retriable=True)

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.server is not None:
            self.server.close()
        for p in list(self.open):
            p.close()
        if self.server is not None:
            await self.server.wait_closed()

    def leader_hint(self, e: StoreError) -> str | None:
        return getattr(e, "leader", None) or self.broker.log.leader()


class StreamProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: StreamServer):
        self.server = server
        self.reader = F.FrameReader(server.max_frame_bytes)
        self.transport: asyncio.Transport | None = None
        self.access_key: str | None = None      # set by a good HELLO
        self.admitted = False
        self.inflight = 0
        self.paused_reading = False
        self.paused_writing = False
        self.tasks: set[asyncio.Task] = set()
        self.encoder = F.Encoder()
        self.good_topics: set[str] = set()      # names already checked on this connection
        self.frames = 0                          # whole frames received
        self.last_frame_at = time.monotonic()    # or when the connection was accepted

    # --- connection -----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport of whatever loop runs us (uvloop's do not subclass asyncio's)
        t = self.transport = cast(asyncio.Transport, transport)
        if not self.server.connections.try_enter():
            t.write(_error_frame(F.CONNECTION, "LIMIT_EXCEEDED", "too many produce stream connections "
                                 f"(maxStreamConnections {self.server.connections.cap})", 503, True))
            t.close()
            return
        self.admitted = True
        self.server.open.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.admitted:
            self.admitted = False
            self.server.connections.leave()
            self.server.open.discard(self)
        self.transport = None      # answers still being committed are dropped: the client saw the loss

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def pause_writing(self) -> None:
        self.paused_writing = True
        self._flow()

    def resume_writing(self) -> None:
        self.paused_writing = False
        self._flow()

    def _flow(self) -> None:
        t = self.transport
        if t is None:
            return
        stop = self.paused_writing or self.inflight >= self.server.max_inflight
        if stop and not self.paused_reading:
            t.pause_reading()
            self.paused_reading = True
        elif not stop and self.paused_reading:
            t.resume_reading()
            self.paused_reading = False

    def fail_connection(self, code: str, message: str, status: int, retriable: bool = False) -> None:
        """Write a connection-level ERROR (request id 0) and close."""
        t = self.transport
        if t is not None:
            t.write(_error_frame(F.CONNECTION, code, message, status, retriable))
            t.close()
            self.transport = None

    # --- frames -------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return
        try:
            frames = self.reader.feed(data)
        except F.FrameError as e:
            if e.limit:
                limits.REJECTIONS.add(e.limit)
            self.fail_connection("BAD_FRAME" if e.limit is None else "LIMIT_EXCEEDED", str(e), 413 if e.limit else 400)
            return
        if not frames:
            return
        self.frames += len(frames)
        self.last_frame_at = time.monotonic()
        out: list[bytes] = []                        # answers known at once (errors, HELLO_OK)
        sends: dict[str, list[tuple[int, list]]] = defaultdict(list)
        with limits.applied(self.server.limits):
            for kind, rid, payload in frames:
                if kind == F.HELLO:
                    if not self._hello(rid, payload, out):
                        break
                    continue
                if kind != F.SEND:
                    self.fail_connection("BAD_FRAME", f"a client may send HELLO and SEND frames, not kind {kind}", 400)
                    break
                if self.server.gate is not None and self.access_key is None:
                    self.fail_connection("UNAUTHENTICATED", "this node has aclEnable=true: the first frame must "
                                          "be a signed HELLO", 401)
                    break
                try:
                    topic, messages = self._parse_send(payload)
                except StoreError as e:
                    out.append(self._store_error(rid, e))
                    continue
                except AuthError as e:
                    out.append(_error_frame(rid, e.code, str(e), e.status))
                    continue
                sends[topic].append((rid, messages))
        t = self.transport
        if t is None:
            return
        if out:
            t.write(b"".join(out))
        self.server.frames_in += len(frames)
        for topic, requests in sends.items():
            self.inflight += len(requests)
            if not self._submit(topic, requests):
                task = asyncio.get_running_loop().create_task(self._send(topic, requests))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        self._flow()

    def _hello(self, rid: int, payload: bytes, out: list[bytes]) -> bool:
        try:
            doc = F.decode_payload(payload)
        except F.FrameError as e:
            self.fail_connection("BAD_FRAME", str(e), 400)
            return False
        gate = self.server.gate
        if gate is not None:
            try:
                self.access_key = gate.hello(doc)
            except AuthError as e:
                self.fail_connection(e.code, str(e), e.status)
                return False
        cfg = self.server.broker.config
        out.append(F.encode(F.HELLO_OK, rid, {"node_id": cfg.node_id,
                                              "max_frame_bytes": self.server.max_frame_bytes,
                                              "max_inflight": self.server.max_inflight}))
        return True

    def _parse_send(self, payload: bytes) -> tuple[str, list]:
        try:
            doc = F.decode_payload(payload)
        except F.FrameError as e:
            raise BadRequest(str(e)) from None
        if type(doc) is not dict:
            raise BadRequest("a SEND frame's payload must be a map {topic, messages}")
        topic, items = doc.get("topic"), doc.get("messages")
        if type(topic) is not str:
            raise BadRequest("a SEND frame must name its topic (a string)")
        if topic not in self.good_topics:
            limits.check_path_names({"topic": topic})
            if len(self.good_topics) < MAX_CACHED_TOPICS:
                self.good_topics.add(topic)
        if type(items) is not list:
            raise BadRequest("messages must be a list of message objects")
        limits.check_batch(len(items))
        if self.server.gate is not None:
            assert self.access_key is not None
            self.server.gate.check_send(self.access_key, topic)
        return topic, parse_messages(items)

    def _store_error(self, rid: int, e: StoreError) -> bytes:
        if isinstance(e, limits.LimitExceeded):
            limits.REJECTIONS.add(e.limit)
            return _error_frame(rid, e.code, str(e), e.http_status, e.retriable)
        if isinstance(e, MessageTooLarge):
            limits.REJECTIONS.add("message_size")
        return _error_frame(rid, e.code, str(e), e.http_status, e.retriable, self.server.leader_hint(e))

    def _submit(self, topic: str, requests: list[tuple[int, list]]) -> bool:
        """The requests appended without a task where the broker can (`submit_coalesced`, DLedger):
        proposed in this callback, answered from the Raft round that commits them. False:
        `_send` awaits them in a task instead."""
        submit = getattr(self.server.broker, "submit_coalesced", None)
        if submit is None:
            return False
        try:
            return submit(topic, [m for _rid, m in requests], lambda got: self._answer(requests, got))
        except StoreError as e:
            self._answer(requests, e)
        except Exception as e:  # noqa: BLE001 - the client gets INTERNAL_ERROR; the log gets the trace
            log.exception("produce stream: a send to %s failed", topic)
            self._answer(requests, e)
        return True

    async def _send(self, topic: str, requests: list[tuple[int, list]]) -> None:
        try:
            got: Any = await self.server.broker.send_coalesced(topic, [m for _rid, m in requests])
        except StoreError as e:
            got = e
        except Exception as e:  # noqa: BLE001 - the client gets INTERNAL_ERROR; the log gets the trace
            log.exception("produce stream: a send to %s failed", topic)
            got = e
        self._answer(requests, got)

    def _answer(self, requests: list[tuple[int, list]], got: Any) -> None:
        """Write the requests' answers in one write: `got` is send_coalesced's list (rows or a
        StoreError per request), or the error of them all. Never raises: it runs inside a Raft
        round on the DLedger path."""
        srv = self.server
        try:
            if type(got) is list:
                outcomes: list[Any] = got
            elif isinstance(got, StoreError):
                outcomes = [got] * len(requests)
            else:
                outcomes = [None] * len(requests)
            srv.batches += 1
            frames: list[bytes] = []
            add = frames.append
            encode, result = self.encoder.frame, F.RESULT
            for (rid, _m), one in zip(requests, outcomes):
                if type(one) is list:
                    add(encode(result, rid, {"results": [
                        {"status": st, "msg_id": mid, "offset_msg_id": oid, "queue_id": qid, "queue_offset": qoff}
                        for st, mid, oid, qid, qoff in one]}))
                elif isinstance(one, StoreError):
                    add(self._store_error(rid, one))
                else:
                    add(_error_frame(rid, "INTERNAL_ERROR", "internal error; see the node's log", 500))
            if self.transport is not None:
                self.transport.write(b"".join(frames))
        except Exception:  # noqa: BLE001 - see the docstring; the connection's requests stay counted once
            log.exception("produce stream: answering %d request(s) failed", len(requests))
        finally:
            self.inflight -= len(requests)
            self._flow()


def gate_from_config(config: Any) -> AclGate | None:
    """The stream's ACL check when aclEnable=true (ConfigError if the ACL file is unusable)."""
    if not config.acl_enable:
        return None
    preflight(config)
    return AclGate(AclStore(config.acl_file, config.acl_reload_interval_ms),
                   NonceCache(config.acl_replay_window_ms, config.acl_nonce_cache_size),
                   lambda: int(time.time() * 1000))

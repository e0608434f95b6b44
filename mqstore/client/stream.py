"""The client end of a node's produce stream (node/produce_stream.py, node/stream_frames.py).

One `StreamConnection` per node: sends are written as SEND frames without waiting for
earlier ones (the frames of one event-loop turn in one socket write; a send with no other
request in flight is written at once, as nothing could share its write), each awaits its own
RESULT or ERROR by request id. `send()` answers the
same `(status, doc)` an HTTP POST /topics/{topic}/messages would, so the transport treats
both alike. At most `max_inflight` requests are unanswered at once (the node's own bound,
learnt from HELLO_OK); a caller beyond it waits for room. A lost connection fails every
request in flight with ConnectionError: the node may or may not have stored those
messages, as with an HTTP request that timed out.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import time
from typing import Any, Awaitable, Callable, cast

from node import stream_frames as F
from node.acl import sign_headers

log = logging.getLogger(__name__)

REQUEST_ID_MAX = 0xFFFF_FFFF
DEFAULT_TIMEOUT_S = 10.0
SWEEP_S = 0.05                 # how often a connection looks for requests past their deadline
FLUSH_BYTES = 256 * 1024       # write at once when this much is waiting for the end of the turn


class StreamRefused(Exception):
    """The node refused the HELLO (or the connection): its ERROR `status` and `doc`."""

    def __init__(self, status: int, doc: dict[str, Any]):
        super().__init__(f"{doc.get('error')}: {doc.get('message')}")
        self.status, self.doc = status, doc


def _error_status(doc: dict[str, Any]) -> int:
    """An ERROR answer's HTTP status; 502 when the node sent none that is an error status."""
    status = doc.get("status", 500)
    return status if type(status) is int and status >= 400 else 502


class _Callback:
    """A pending request answered by calling a function: the Future methods this module uses."""

    __slots__ = ("fn", "_done")

    def __init__(self, fn: Callable[[Any, BaseException | None], None]):
        self.fn = fn
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, result: Any) -> None:
        self._done = True
        self._call(result, None)

    def set_exception(self, error: BaseException) -> None:
        self._done = True
        self._call(None, error)

    def _call(self, result: Any, error: BaseException | None) -> None:
        try:
            self.fn(result, error)
        except Exception:  # noqa: BLE001 - a caller's bug must not stop the answers of the others
            log.exception("produce stream: a send callback failed")


class StreamConnection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = F.FrameReader(64 * 1024 * 1024)
        self.pending: dict[int, Any] = {}        # request id -> asyncio.Future or _Callback
        self.max_inflight = 1
        self.max_frame_bytes = 0
        self.node_id = ""
        self._next_id = 0
        self._lost: BaseException | None = None
        self._room = asyncio.Event()
        self._room.set()
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._deadlines: collections.deque[tuple[float, int]] = collections.deque()   # (deadline, request id)
        self._sweeper: asyncio.TimerHandle | None = None
        self._encoder = F.Encoder()
        self._out: list[bytes] = []          # frames written in this turn of the event loop
        self._out_bytes = 0

    @classmethod
    async def open(cls, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None,
                   access_key: str | None = None, secret_key: str | None = None,
                   timeout_s: float = 5.0) -> "StreamConnection":
        """Connect and say HELLO (signed when `access_key` is given); OSError on failure, and
        ConnectionRefusedError with the node's words when it refuses the HELLO."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout_s):   # not wait_for: on 3.11 it can lose a cancel
            _t, conn = await loop.create_connection(cls, host, port, ssl=ssl_context)
        try:
            hello: dict[str, str] = {}
            if access_key:
                hello = sign_headers(access_key, secret_key or "", F.STREAM_METHOD, F.STREAM_TARGET, None, b"",
                                     int(time.time() * 1000))
            if isinstance(conn._lost, StreamRefused):      # refused on accept (e.g. too many connections)
                raise conn._lost
            async with asyncio.timeout(timeout_s):
                status, doc = await conn._request(F.HELLO, hello)
            if status >= 400:
                raise StreamRefused(status, doc)
            conn.max_inflight = max(1, int(doc.get("max_inflight", 1)))
            conn.max_frame_bytes = int(doc.get("max_frame_bytes", 0))
            conn.node_id = str(doc.get("node_id", ""))
        except BaseException:
            conn.close()
            raise
        return conn

    # --- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport of whatever loop runs us (uvloop's do not subclass asyncio's)
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._deadlines.clear()
        self._lost = exc or ConnectionResetError("the node closed the produce stream")
        self._fail_all(self._lost)
        self._can_write.set()
        self._room.set()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
        except F.FrameError as e:
            self._fail_all(ConnectionError(f"bad frame from the node: {e}"))
            self.close()
            return
        pending = self.pending
        for kind, rid, payload in frames:
            try:
                doc = F.decode_payload(payload)
            except F.FrameError as e:
                doc = {"error": "BAD_RESPONSE", "message": str(e), "status": 502}
                kind = F.ERROR
            if not isinstance(doc, dict):
                doc = {"error": "BAD_RESPONSE", "message": f"an answer that is not a map: {doc!r:.100}", "status": 502}
                kind = F.ERROR
            if rid == F.CONNECTION and kind == F.ERROR:     # about the connection: the node is closing it
                status = _error_status(doc)
                self._lost = StreamRefused(status, doc)
                for fut in self.pending.values():
                    if not fut.done():
                        fut.set_result((status, doc))
                self.pending = pending = {}
                continue
            fut = pending.pop(rid, None)
            if fut is None or fut.done():
                continue
            if kind == F.ERROR:
                fut.set_result((_error_status(doc), doc))
            else:
                fut.set_result((200, doc))
        if len(pending) < self.max_inflight:
            self._room.set()

    # --- requests ----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.transport is None or self._lost is not None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def send(self, topic: str, doc: dict[str, Any], timeout_s: float = DEFAULT_TIMEOUT_S) -> Awaitable[Any]:
        """`doc` is the HTTP send body (`{"messages": [...]}`); awaits (status, answer), or
        asyncio.TimeoutError after `timeout_s`. With room in the window and the socket this is
        a bare future (no task, no timer of its own: one sweeper per connection keeps time)."""
        payload = {"topic": topic, "messages": doc["messages"]}
        if len(self.pending) < self.max_inflight and self._can_write.is_set():
            return self._request(F.SEND, payload, timeout_s)
        return self._send_when_room(payload, timeout_s)

    async def _send_when_room(self, payload: dict[str, Any], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while len(self.pending) >= self.max_inflight and self._lost is None:
            self._room.clear()
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await self._room.wait()
        if not self._can_write.is_set():
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await self._can_write.wait()
        return await self._request(F.SEND, payload, max(0.0, deadline - time.monotonic()))

    @property
    def has_room(self) -> bool:
        """A send now would be within the window and the socket keeps up."""
        return len(self.pending) < self.max_inflight and self._can_write.is_set()

    def send_with_callback(self, topic: str, doc: dict[str, Any],
                           callback: Callable[[tuple[int, dict[str, Any]] | None, BaseException | None], None],
                           timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """`send` without a future: `callback((status, answer), None)` when the answer arrives,
        `callback(None, error)` on timeout or a lost connection (RocketMQ's SendCallback). It
        runs on the event loop, where the answer is read: keep it short. Call it only when
        `has_room`; ConnectionResetError if the connection is closed."""
        if not self.has_room:
            raise RuntimeError("the produce stream's window is full: wait until has_room")
        self._request(F.SEND, {"topic": topic, "messages": doc["messages"]}, timeout_s, _Callback(callback))

    def _request(self, kind: int, doc: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
                 waiter: "asyncio.Future | _Callback | None" = None) -> Any:
        if self._lost is not None or self.transport is None:
            raise ConnectionResetError(f"produce stream closed: {self._lost}")
        self._next_id = self._next_id % REQUEST_ID_MAX + 1     # 0 is the connection's own id
        rid = self._next_id
        loop = asyncio.get_running_loop()
        fut = waiter if waiter is not None else loop.create_future()
        self.pending[rid] = fut
        self._deadlines.append((time.monotonic() + timeout_s, rid))
        if self._sweeper is None:
            self._sweeper = loop.call_later(SWEEP_S, self._sweep)
        frame = self._encoder.frame(kind, rid, doc)
        if not self._out:
            if len(self.pending) == 1:      # the only request in flight: nothing to batch it with, write now
                self.transport.write(frame)
                return fut
            loop.call_soon(self._flush)
        self._out.append(frame)
        self._out_bytes += len(frame)
        if self._out_bytes >= FLUSH_BYTES:
            self._flush()
        return fut

    def _sweep(self) -> None:
        """Fail the requests whose deadline passed with asyncio.TimeoutError; drop the answered.
        Deadlines are checked in send order, so a request behind a longer-lived one is timed
        out once that one is answered or expires (callers use one timeout in practice)."""
        self._sweeper = None
        now = time.monotonic()
        dl, pending = self._deadlines, self.pending
        while dl:
            at, rid = dl[0]
            fut = pending.get(rid)
            if fut is not None and not fut.done():
                if at > now:
                    break
                del pending[rid]
                fut.set_exception(asyncio.TimeoutError(f"no answer on the produce stream in time (request {rid})"))
            elif fut is not None:
                del pending[rid]
            dl.popleft()
        if len(pending) < self.max_inflight:
            self._room.set()
        if dl and self.transport is not None:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)

    def _flush(self) -> None:
        """One socket write for the frames of one loop turn (many senders, one syscall)."""
        if self._out and self.transport is not None:
            self.transport.write(b"".join(self._out) if len(self._out) > 1 else self._out[0])
        self._out.clear()
        self._out_bytes = 0

    def _fail_all(self, exc: BaseException) -> None:
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ConnectionResetError(str(exc)))

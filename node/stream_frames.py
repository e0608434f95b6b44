"""Frames of the produce stream: the pipelined binary send channel (`streamListenPort`).

    frame = STREAM_FRAME_HEADER (length u32, kind u8, request_id u32) + msgpack payload

Both ends write frames back to back on one TCP (or TLS) connection; many requests may be in
flight, and each answer names the request it answers, in whatever order they commit.

| kind     | from   | payload                                                                   |
|----------|--------|---------------------------------------------------------------------------|
| HELLO    | client | `{}`, or the X-MQ-* signature headers of `STREAM STREAM_TARGET` (ACL on)   |
| HELLO_OK | node   | `{"node_id", "max_frame_bytes", "max_inflight"}`                           |
| SEND     | client | `{"topic", "messages": [...]}`: the body of `POST /topics/{topic}/messages` |
| RESULT   | node   | `{"results": [SendResult]}`: that route's answer                           |
| ERROR    | node   | `{"error", "message", "retriable", "leader", "status"}`: the HTTP error's shape and status |

A SEND is checked and appended exactly as that HTTP request would be. An ERROR with request
id 0 is about the connection (bad frame, no HELLO on an ACL node, too many connections) and
the node closes it after writing the frame. The length is checked against the cap before
the payload is read, and a frame of an unknown kind closes the connection.
"""

from __future__ import annotations

from typing import Any

import msgpack

from node.store import layout as L

HEADER = L.STREAM_FRAME_HEADER
HELLO, HELLO_OK, SEND, RESULT, ERROR = 1, 2, 3, 4, 5
KINDS = frozenset({HELLO, HELLO_OK, SEND, RESULT, ERROR})
STREAM_METHOD = "STREAM"       # what a HELLO's signature covers (node/acl.py signature())
STREAM_TARGET = "/stream"
CONNECTION = 0                 # request id of an ERROR about the whole connection


class FrameError(ValueError):
    """The byte stream is not frames of this protocol (or a frame is over the cap)."""

    def __init__(self, message: str, limit: str | None = None):
        super().__init__(message)
        self.limit = limit


def encode(kind: int, request_id: int, doc: Any) -> bytes:
    payload = msgpack.packb(doc, use_bin_type=True)
    return HEADER.pack(len(payload), kind, request_id) + payload


class Encoder:
    """`encode` with one reused msgpack Packer (cheaper per frame; one per connection, as a
    Packer is not safe to share between threads)."""

    __slots__ = ("_pack",)

    def __init__(self) -> None:
        self._pack = msgpack.Packer(use_bin_type=True).pack

    def frame(self, kind: int, request_id: int, doc: Any) -> bytes:
        payload = self._pack(doc)
        return HEADER.pack(len(payload), kind, request_id) + payload


def decode_payload(payload: bytes) -> Any:
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    # TypeError: a map key msgpack cannot hash (an array or a map).
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise FrameError(f"a frame's payload is not msgpack: {e}") from None


class FrameReader:
    """Splits received bytes into `(kind, request_id, payload)` frames. A frame still arriving
    is kept as its received pieces and joined once, when it is whole (a large frame read in
    many pieces is copied once, not once per piece); the cap bounds what is kept."""

    __slots__ = ("max_frame_bytes", "_parts", "_have", "_need")

    def __init__(self, max_frame_bytes: int):
        self.max_frame_bytes = max_frame_bytes
        self._parts: list[bytes] = []
        self._have = 0          # bytes in _parts
        self._need = 0          # bytes _parts must reach before a frame can be cut from them

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        if self._parts:
            self._parts.append(data)
            self._have += len(data)
            if self._have < self._need:
                return []
            buf = b"".join(self._parts)
            self._parts, self._have = [], 0
        else:
            buf = data
        frames: list[tuple[int, int, bytes]] = []
        pos, end, size = 0, len(buf), HEADER.size
        unpack = HEADER.unpack_from
        need = size
        while end - pos >= size:
            length, kind, rid = unpack(buf, pos)
            if length > self.max_frame_bytes:
                raise FrameError(f"frame of {length} bytes exceeds the cap of {self.max_frame_bytes} "
                                 "(maxRequestBytes)", limit="stream_frame_bytes")
            if kind not in KINDS:
                raise FrameError(f"unknown frame kind {kind}")
            stop = pos + size + length
            if stop > end:
                need = size + length
                break
            frames.append((kind, rid, buf[pos + size:stop]))
            pos = stop
        if pos < end:
            self._parts, self._have, self._need = [buf[pos:]], end - pos, need
        return frames

    @property
    def buffered(self) -> int:
        return self._have

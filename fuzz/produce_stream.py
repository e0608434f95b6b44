"""Fuzz the produce stream's decoders (node/stream_frames.py, node/produce_stream.py).

Input: byte 0 is the number of chunks the rest is fed in (1..16, equal cuts) to a
FrameReader (cap 4 KiB); every SEND frame's payload then goes through the node's request
check (`StreamProtocol._parse_send`: msgpack, topic name, batch and message limits).
Allowed errors: FrameError from the reader (the node closes the connection), StoreError
from a request (that request's ERROR frame). Checks: what the reader keeps stays within one
header + one capped payload + the last feed, and every frame it returns is within the cap.
"""

from __future__ import annotations

TARGET = "produce_stream"
MODULES = ("node.stream_frames", "node.produce_stream", "node.api")
CAP = 4096


def _chunks(buf: bytes, n: int) -> list[bytes]:
    step = max(1, -(-len(buf) // n))
    return [buf[i:i + step] for i in range(0, len(buf), step)] or [b""]


class _Server:
    """What StreamProtocol reads of its server for a request check (no ACL, default limits)."""

    def __init__(self) -> None:
        from node import limits
        self.limits = limits.Limits()
        self.max_frame_bytes = CAP
        self.max_inflight = 16
        self.gate = None


def test_one_input(data: bytes) -> None:
    from node import limits
    from node import stream_frames as F
    from node.produce_stream import StreamProtocol
    from node.store.errors import StoreError

    n, buf = ((data[0] % 16) + 1, data[1:]) if data else (1, b"")
    proto = StreamProtocol(_Server())
    reader = F.FrameReader(CAP)
    with limits.applied(proto.server.limits):
        for chunk in _chunks(buf, n):
            try:
                frames = reader.feed(chunk)
            except F.FrameError:
                return
            assert reader.buffered <= F.HEADER.size + CAP + len(chunk)
            for kind, _rid, payload in frames:
                assert len(payload) <= CAP and kind in F.KINDS
                if kind != F.SEND:
                    continue
                try:
                    topic, messages = proto._parse_send(payload)
                except StoreError:
                    continue
                assert isinstance(topic, str) and all(isinstance(m.body, bytes) for m in messages)


def main() -> None:
    from fuzz._common import run
    run(TARGET, test_one_input, MODULES)


if __name__ == "__main__":
    main()

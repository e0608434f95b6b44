"""Fuzz the Raft transport's inbound side (dledger/transport.py): framing, handshake, decode.

Input: the bytes a peer sends on a connection. They are fed to an asyncio
StreamReader and read exactly as `Transport._serve` does: the handshake frame, then
frames until the stream ends. The frame cap is 4 KiB. Allowed errors: FrameError,
CodecError, IncompleteReadError (the stream ended mid-frame). Nothing read may
exceed the cap.
"""

from __future__ import annotations

import asyncio

TARGET = "raft_transport"
MODULES = ("dledger.transport", "dledger.codec")
CAP = 4096

_state: dict = {}


def _setup():
    from dledger.transport import Transport, TransportConfig
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    got: list = []
    t = Transport("n0", "g", ("127.0.0.1", 0), {"n0": ("127.0.0.1", 1), "n1": ("127.0.0.1", 2)},
                  lambda sender, msg: got.append(msg), TransportConfig(max_frame_bytes=CAP))
    _state.update(loop=loop, transport=t, got=got)


async def _session(data: bytes) -> None:
    from dledger import codec
    from dledger.transport import FrameError
    t, got = _state["transport"], _state["got"]
    reader = asyncio.StreamReader(limit=1 << 16)
    reader.feed_data(data)
    reader.feed_eof()
    got.clear()
    try:
        sender = await t._handshake(reader)
        assert sender == "n1"
        await t._receive(sender, reader)
    except (FrameError, codec.CodecError, asyncio.IncompleteReadError):
        pass
    assert len(got) <= len(data) // 5 + 1


def test_one_input(data: bytes) -> None:
    if not _state:
        _setup()
    _state["loop"].run_until_complete(_session(data))


def main() -> None:
    from fuzz._common import run
    run(TARGET, test_one_input, MODULES)


if __name__ == "__main__":
    main()

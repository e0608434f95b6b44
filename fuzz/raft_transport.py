"""Fuzz the Raft transport's inbound side (dledger/transport.py): framing, handshake, decode.

Input: the bytes a peer sends on a connection. They are fed to an asyncio StreamReader and
the handshake frame is read as `Transport._serve` does. The rest goes to the connection's
protocol (`_Receiver`, as `_receive` hands it over) in two reads and then the end of the
stream, and, separately, through the StreamReader fallback (`_receive_stream`). The frame
cap is 4 KiB. Allowed errors: FrameError, CodecError, IncompleteReadError (the stream ended
mid-frame). Both ways hand over the same frames; nothing read may exceed the cap.
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


class _Closed:
    """The transport under a `_Receiver`: it only gets closed."""

    def close(self) -> None:
        pass


async def _session(data: bytes) -> None:
    from dledger import codec
    from dledger.transport import FrameError, _Receiver
    allowed = (FrameError, codec.CodecError, asyncio.IncompleteReadError)
    t, got = _state["transport"], _state["got"]
    reader = asyncio.StreamReader(limit=1 << 16)
    reader.feed_data(data)
    reader.feed_eof()
    got.clear()
    try:
        sender = await t._handshake(reader)
    except allowed:
        return
    assert sender == "n1"
    rest = bytes(reader._buffer)

    done = asyncio.get_running_loop().create_future()
    receiver = _Receiver(t, sender, done)
    receiver.connection_made(_Closed())
    half = len(rest) // 2
    receiver.data_received(rest[:half])
    receiver.data_received(rest[half:])
    receiver.connection_lost(None)
    assert isinstance(done.exception(), allowed), done.exception()
    by_protocol = list(got)

    got.clear()
    again = asyncio.StreamReader(limit=1 << 16)
    again.feed_data(rest)
    again.feed_eof()
    try:
        await t._receive_stream(sender, again)
    except allowed:
        pass
    assert got == by_protocol
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

"""Regression tests for the inputs the fuzz harnesses (fuzz/) found crashing a decoder.

Method: each test feeds the minimal crashing input to the real decoder and checks
that it now fails with the decoder's documented error, not a stray exception.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from dledger.transport import HANDSHAKE_MAGIC, PROTOCOL_VERSION, FrameError, Transport, frame
from node import api
from node.store.errors import BadRequest


def test_raft_handshake_with_an_array_sender_id_is_a_frame_error_not_a_type_error():
    # ["mqstore-raft", 2, "g", ["n1"]]: the sender id was looked up in a dict unhashed.
    async def go():
        t = Transport("n0", "g", ("127.0.0.1", 0), {"n1": ("127.0.0.1", 1)}, lambda s, m: None)
        reader = asyncio.StreamReader()
        reader.feed_data(frame(msgpack.packb([HANDSHAKE_MAGIC, PROTOCOL_VERSION, "g", ["n1"]])))
        reader.feed_eof()
        with pytest.raises(FrameError, match="unknown peer"):
            await t._handshake(reader)
    asyncio.run(go())


class _Req:
    content_type = api.MSGPACK

    def __init__(self, raw: bytes):
        self.raw = raw

    async def read(self) -> bytes:
        return self.raw


@pytest.mark.parametrize("raw", [b"\x81\x81\xa1a\x01\x01",    # {{"a": 1}: 1}
                                 b"\x81\x91\x01\x01"])        # {[1]: 1}
def test_msgpack_body_with_an_unhashable_map_key_is_a_400_not_a_500(raw):
    with pytest.raises(BadRequest, match="malformed msgpack"):
        asyncio.run(api.read_doc(_Req(raw)))


def test_produce_stream_send_with_an_unhashable_map_key_is_that_request_s_400():
    # SEND payload {{}: 0}: msgpack raised TypeError out of data_received, and asyncio closed
    # the connection with "Fatal error: protocol.data_received() call failed".
    from node.stream_frames import FrameError, decode_payload
    with pytest.raises(FrameError, match="not msgpack"):
        decode_payload(b"\x81\x80\x00")
    from fuzz.produce_stream import test_one_input
    from node import stream_frames as F
    test_one_input(b"\x00" + F.HEADER.pack(3, F.SEND, 1) + b"\x81\x80\x00")    # allowed error only

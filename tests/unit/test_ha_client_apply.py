"""Goal: the slave's HA client writes contiguous in-step pushes of one commitlog file with one
append, never across a file, checks every push in order, and on an out-of-step push keeps
the in-step bytes before it and drops the link. Method: a recording sink, pushes encoded
as the master sends them, `HAClient._apply` driven directly."""

from __future__ import annotations

import asyncio

import pytest

from ha.protocol import HAProtocolError, PushDecoder, encode_push
from ha.replication import HAClientCore, PushVerdict
from ha.shell import HAClient

SEG = 1000


class Sink:
    segment_size = SEG

    def __init__(self, start: int = 0):
        self.end = start
        self.appends: list[tuple[PushVerdict, int, int]] = []

    def ha_max_offset(self) -> int:
        return self.end

    async def ha_append(self, verdict, offset, data):
        assert verdict is PushVerdict.RESET_AND_APPEND or offset == self.end, (offset, self.end)
        self.appends.append((verdict, offset, len(data)))
        self.end = offset + len(data)


def apply(sink: Sink, pushes: list[tuple[int, int]]) -> None:
    client = HAClient("127.0.0.1:1", sink, broker_id=1)
    stream = b"".join(encode_push(o, bytes(n)) for o, n in pushes)
    asyncio.run(client._apply(HAClientCore(0), PushDecoder(), stream))


def test_contiguous_pushes_of_one_file_are_one_append():
    sink = Sink(100)
    apply(sink, [(100, 300), (400, 0), (700 - 300, 300), (700, 300), (1000, 200), (1200, 50)])
    assert sink.appends == [(PushVerdict.APPEND, 100, 900), (PushVerdict.APPEND, 1000, 250)]
    assert sink.end == 1250


def test_empty_slave_resets_then_appends_the_rest():
    sink = Sink(0)
    apply(sink, [(3000, 400), (3400, 100)])
    assert sink.appends == [(PushVerdict.RESET_AND_APPEND, 3000, 400), (PushVerdict.APPEND, 3400, 100)]


def test_out_of_step_push_keeps_the_bytes_before_it_and_drops_the_link():
    sink = Sink(0)
    with pytest.raises(HAProtocolError):
        apply(sink, [(0, 200), (200, 200), (900, 50)])
    assert sink.appends == [(PushVerdict.APPEND, 0, 400)] and sink.end == 400

"""Goal: the HA wire codec round-trips every frame, however the stream is split, and
rejects truncated, oversized and garbage frames. Method: Hypothesis over frame lists
and split points, plus hand-made bad headers."""

import struct

import pytest
from hypothesis import given, settings, strategies as st

from ha.protocol import (HAProtocolError, Push, PushDecoder, Report, ReportDecoder, encode_push,
                         encode_report)
from node.store import layout as L

offsets = st.integers(min_value=0, max_value=2**63 - 1)
bodies = st.binary(min_size=0, max_size=512)


def _split(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(stream) + 1) for c in cuts})
    out, prev = [], 0
    for p in points + [len(stream)]:
        out.append(stream[prev:p])
        prev = p
    return out


@given(st.lists(offsets, max_size=20), st.lists(st.integers(min_value=0), max_size=10))
def test_reports_round_trip_under_any_split(values, cuts):
    stream = b"".join(encode_report(v) for v in values)
    dec = ReportDecoder()
    got = [r for chunk in _split(stream, cuts) for r in dec.feed(chunk)]
    assert got == [Report(v) for v in values]
    assert dec.pending == 0


@given(st.lists(st.tuples(offsets, bodies), max_size=12), st.lists(st.integers(min_value=0), max_size=10))
@settings(max_examples=200)
def test_pushes_round_trip_under_any_split(frames, cuts):
    stream = b"".join(encode_push(o, b, max_body_bytes=512) for o, b in frames)
    dec = PushDecoder(max_body_bytes=512)
    got = [p for chunk in _split(stream, cuts) for p in dec.feed(chunk)]
    assert got == [Push(o, b) for o, b in frames]
    assert dec.pending == 0


@given(offsets, st.binary(min_size=1, max_size=64), st.integers(min_value=1, max_value=75))
def test_truncated_push_yields_nothing_and_reports_pending(offset, body, cut):
    frame = encode_push(offset, body)
    cut = min(cut, len(frame) - 1)
    dec = PushDecoder()
    assert dec.feed(frame[:cut]) == []
    assert dec.pending == cut
    assert dec.feed(frame[cut:]) == [Push(offset, body)]


def test_heartbeat_is_size_zero():
    (p,) = PushDecoder().feed(encode_push(4096, b""))
    assert p.is_heartbeat and p.offset == 4096 and p.end == 4096


def test_header_over_cap_is_rejected_before_body_arrives():
    dec = PushDecoder(max_body_bytes=L.HA_MAX_TRANSFER_BYTES)
    header = L.HA_PUSH_HEADER.pack(0, L.HA_MAX_TRANSFER_BYTES + 1)
    with pytest.raises(HAProtocolError):
        dec.feed(header)   # no body byte sent: the cap is checked on the header alone


def test_push_of_exactly_the_cap_is_accepted():
    body = bytes(L.HA_MAX_TRANSFER_BYTES)
    (p,) = PushDecoder().feed(encode_push(7, body))
    assert len(p.data) == L.HA_MAX_TRANSFER_BYTES


@pytest.mark.parametrize("offset,size", [(0, -1), (-5, 10), (0, 2**31 - 1)])
def test_garbage_headers_are_errors(offset, size):
    with pytest.raises(HAProtocolError):
        PushDecoder().feed(struct.pack(">qi", offset, size))


@given(st.binary(min_size=12, max_size=200))
def test_garbage_stream_never_over_buffers(garbage):
    dec = PushDecoder(max_body_bytes=64)
    try:
        pushes = dec.feed(garbage)
    except HAProtocolError:
        return
    assert all(len(p.data) <= 64 for p in pushes)
    assert dec.pending <= 12 + 64


def test_negative_report_is_error():
    with pytest.raises(HAProtocolError):
        ReportDecoder().feed(struct.pack(">q", -1))


def test_encode_push_refuses_oversized_body():
    with pytest.raises(AssertionError):
        encode_push(0, bytes(L.HA_MAX_TRANSFER_BYTES + 1))

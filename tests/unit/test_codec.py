"""Raft wire codec: every message round-trips, and a damaged Append never decodes.

Method: round-trip one of each message; for Append (its own binary entries layout),
flip single bits in the entries blob and check that decode raises CodecError, and
check each field the codec validates in place of Entry.__post_init__.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dledger import codec
from dledger import messages as M

E = M.EntryType


def entries(prev: int, terms: list[int], body: bytes = b"x" * 40) -> tuple[M.Entry, ...]:
    return tuple(M.Entry(prev + 1 + k, t, E.NORMAL if k else E.NOOP, body + bytes([k % 256]))
                 for k, t in enumerate(terms))


def test_every_message_round_trips():
    msgs = [
        M.RequestVote(3, "n1", 10, 2, True, False), M.VoteResponse(3, True, False), M.TimeoutNow(4, "n0"),
        M.Heartbeat(3, "n0", 7), M.Compare(3, "n0", 5, 2, 4), M.Truncate(3, "n0", 6, 9, 2, 4),
        M.Append(3, "n0", 5, 2, entries(5, [2, 3, 3]), 4), M.InstallBase(3, "n0", 5, 2, 9, 2, 5),
        M.HeartbeatResponse(3, 4), M.CompareResponse(3, 5, True, 9, 2, 8, 5, 2), M.TruncateResponse(3, 6, True, 5, 5),
        M.AppendResponse(3, True, 8, 8), M.InstallBaseResponse(3, 5, True, 5),
        M.FetchEntries(7, 12, 1), M.FetchEntriesResponse(7, 12, b"\x00raw entry\xff", ""),
        M.FetchEntriesResponse(8, 12, b"", "entry 12 is not a committed entry here"),
    ]
    for m in msgs:
        assert codec.decode(codec.encode(m)) == m


@pytest.mark.parametrize("wire, why", [
    (["FetchEntries", 0, 5, 1], "request_id"),
    (["FetchEntries", 1, 0, 1], "index"),
    (["FetchEntries", 1, 5, M.MAX_FETCH_ENTRIES + 1], "count"),
    (["FetchEntries", 1, 5, 0], "count"),
    (["FetchEntriesResponse", 1, 5, b"", ""], "exactly one"),
    (["FetchEntriesResponse", 1, 5, b"x", "and an error"], "exactly one"),
    (["FetchEntriesResponse", 1, 5, "not bytes", ""], "entries must be bytes"),
    (["FetchEntriesResponse", 1, 5, b"", "e" * (M.MAX_FETCH_ERROR_CHARS + 1)], "error must be"),
])
def test_repair_messages_are_bounded_and_validated(wire, why):
    with pytest.raises(codec.CodecError, match=why):
        codec.decode(msgpack.packb(wire, use_bin_type=True))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**40), st.lists(st.binary(max_size=200), min_size=1, max_size=20))
def test_append_round_trips_any_bodies(prev, bodies):
    es = tuple(M.Entry(prev + 1 + k, 7, E.NORMAL, b) for k, b in enumerate(bodies))
    m = M.Append(7, "n0", prev, 7 if prev else 0, es, prev)
    got = codec.decode(codec.encode(m))
    assert got == m
    assert all(type(e) is M.Entry and type(e.body) is bytes for e in got.entries)


def _append_fields(m: M.Append) -> list:
    return list(msgpack.unpackb(codec.encode(m), raw=False))


def test_every_bit_flip_in_the_entries_blob_is_rejected():
    m = M.Append(3, "n0", 5, 2, entries(5, [2, 3], b"body"), 4)
    fields = _append_fields(m)
    blob = fields[5]
    for bit in range(len(blob) * 8):
        bad = bytearray(blob)
        bad[bit // 8] ^= 1 << (bit % 8)
        fields[5] = bytes(bad)
        payload = msgpack.packb(fields, use_bin_type=True)
        try:
            got = codec.decode(payload)
        except codec.CodecError:
            continue
        # A flip in the term or type can still be a valid, CRC-clean Append; never a changed body.
        assert [e.body for e in got.entries] == [e.body for e in m.entries], bit


@pytest.mark.parametrize("mutate, why", [
    (lambda f: f.__setitem__(5, b""), "empty"),
    (lambda f: f.__setitem__(5, f[5][:-1]), "cut short"),
    (lambda f: f.__setitem__(5, f[5] + b"\x00"), "trailing byte"),
    (lambda f: f.__setitem__(5, [1, 2]), "not bin"),
    (lambda f: f.__setitem__(3, -1), "negative prev_index"),
    (lambda f: f.__setitem__(3, True), "bool prev_index"),
    (lambda f: f.pop(), "missing field"),
])
def test_malformed_append_is_a_codec_error(mutate, why):
    fields = _append_fields(M.Append(3, "n0", 5, 2, entries(5, [2, 3]), 4))
    mutate(fields)
    with pytest.raises(codec.CodecError):
        codec.decode(msgpack.packb(fields, use_bin_type=True))


def _raw_append(term: int, prev_term: int, wire_entries: list[tuple[int, int, bytes]]) -> bytes:
    import zlib
    blob = b"".join(codec.APPEND_ENTRY.pack(t, ty, len(b), zlib.crc32(b)) + b for t, ty, b in wire_entries)
    return msgpack.packb(["Append", term, "n0", 0, prev_term, blob, 0], use_bin_type=True)


@pytest.mark.parametrize("wire, why", [
    ([(0, 1, b"a")], "term 0 (Entry requires >= 1)"),
    ([(1, 9, b"a")], "unknown entry type"),
    ([(2, 1, b"a"), (1, 1, b"b")], "terms go backwards"),
    ([(5, 1, b"a")], "entry term above the message term"),
])
def test_append_fields_are_validated_like_entry(wire, why):
    with pytest.raises(codec.CodecError):
        codec.decode(_raw_append(3, 0, wire))


def test_blob_cache_never_confuses_different_ranges():
    a = entries(0, [1, 1, 1])
    b = entries(0, [1, 1, 2])
    assert codec.decode(codec.encode(M.Append(2, "n0", 0, 0, a, 0))).entries == a
    assert codec.decode(codec.encode(M.Append(2, "n0", 0, 0, b, 0))).entries == b
    assert codec.decode(codec.encode(M.Append(2, "n0", 0, 0, a[:2], 0))).entries == a[:2]


@pytest.mark.parametrize("n, body_size", [(1, 0), (1, 100), (3, 80), (40, 1000), (70, 1024)])
def test_append_frame_is_the_length_prefix_and_the_encoded_payload(n, body_size):
    """encode_frame builds an Append's frame around the cached blob in one join; its bytes are
    exactly FRAME_LEN + encode(m) for every bin header size (bin8, bin16, bin32)."""
    from node.store import layout as L
    for term, leader, prev, commit in ((3, "n0", 5, 4), (2**40, "é" * 40, 2**33, 2**62), (200, "n1", 127, 128)):
        es = tuple(M.Entry(prev + 1 + k, min(term, 2 + k), E.NORMAL, bytes([k % 256]) * body_size)
                   for k in range(n))
        m = M.Append(term, leader, prev, 2 if prev else 0, es, commit)
        payload = codec.encode(m)
        framed = codec.encode_frame(m)
        assert framed == L.FRAME_LEN.pack(len(payload)) + payload
        assert codec.decode(framed[L.FRAME_LEN.size:]) == m
    hb = M.Heartbeat(3, "n0", 7)
    assert codec.encode_frame(hb) == L.FRAME_LEN.pack(len(codec.encode(hb))) + codec.encode(hb)


def test_append_entry_term_below_prev_term_is_rejected():
    """The codec checks term order while it decodes (Append's per-entry loop is skipped)."""
    with pytest.raises(codec.CodecError, match="out of order"):
        codec.decode(_raw_append(3, 2, [(1, 1, b"a")]))
    assert codec.decode(_raw_append(3, 2, [(2, 1, b"a"), (3, 1, b"b")])).entries[1].term == 3


def test_append_of_checked_entries_equals_append_and_checks_its_scalars():
    es = entries(5, [2, 3, 3])
    assert M.append_of_checked_entries(3, "n0", 5, 2, es, 4) == M.Append(3, "n0", 5, 2, es, 4)
    for bad in ((0, "n0", 5, 2, es, 4), (3, "", 5, 2, es, 4), (3, "n0", -1, 2, es, 4), (3, "n0", 5, True, es, 4),
                (3, "n0", 5, 2, es, -1), (3, "n0", 5, 2, (), 4), (3, "n0", 5, 2, list(es), 4)):
        with pytest.raises(M.InvalidMessage):
            M.append_of_checked_entries(*bad)

"""DLedger entry codec: round trip, and every damaged field is detected.

Method: Hypothesis generates entries and chain seeds; single-bit flips anywhere in
the encoded entry must make decode_entry (with the chain seed) raise CorruptRecord.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dledger.entry import HEADER_SIZE, decode_entry, encode_blank, encode_entry, peek_magic_size
from node.store import layout as L
from node.store.errors import CorruptRecord

entries = st.tuples(
    st.integers(1, 2**62), st.integers(1, 2**62), st.integers(0, 2**62),
    st.sampled_from([L.ENTRY_MAGIC_NORMAL, L.ENTRY_MAGIC_NOOP, L.ENTRY_MAGIC_CONFIG]),
    st.binary(max_size=300), st.integers(0, 2**32 - 1))


@given(entries)
def test_round_trip(e):
    index, term, pos, magic, body, seed = e
    raw = encode_entry(index, term, pos, magic, body, seed)
    assert len(raw) == HEADER_SIZE + len(body)
    d = decode_entry(raw, pos, seed)
    assert (d.index, d.term, d.pos, d.magic, d.body, d.size) == (index, term, pos, magic, body, len(raw))
    # Embedded in a larger buffer at an offset.
    d2 = decode_entry(b"x" * 7 + raw + b"y", pos, seed, at=7)
    assert d2 == d


@settings(max_examples=300)
@given(entries, st.data())
def test_any_bit_flip_is_detected(e, data):
    index, term, pos, magic, body, seed = e
    raw = bytearray(encode_entry(index, term, pos, magic, body, seed))
    bit = data.draw(st.integers(0, len(raw) * 8 - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptRecord):
        decode_entry(bytes(raw), pos, seed)


def test_wrong_chain_seed_detected():
    raw = encode_entry(5, 2, 100, L.ENTRY_MAGIC_NORMAL, b"body", 1234)
    decode_entry(raw, 100, None)   # without a seed only the body CRC is checked
    with pytest.raises(CorruptRecord, match="chain"):
        decode_entry(raw, 100, 1235)


def test_wrong_position_detected():
    raw = encode_entry(5, 2, 100, L.ENTRY_MAGIC_NORMAL, b"body", 0)
    with pytest.raises(CorruptRecord, match="pos"):
        decode_entry(raw, 101, 0)


@pytest.mark.parametrize("cut", [0, 10, HEADER_SIZE, HEADER_SIZE + 3])
def test_truncated_entry_detected(cut):
    raw = encode_entry(5, 2, 100, L.ENTRY_MAGIC_NORMAL, b"body", 0)
    with pytest.raises(CorruptRecord):
        decode_entry(raw[:cut], 100, 0)


def test_blank_is_not_an_entry():
    blank = encode_blank(64)
    assert peek_magic_size(blank, 0) == (L.ENTRY_MAGIC_BLANK, 64)
    with pytest.raises(CorruptRecord, match="magic"):
        decode_entry(blank + bytes(56), 0, 0)


def test_chain_links_entries():
    a = encode_entry(1, 1, 0, L.ENTRY_MAGIC_NORMAL, b"a", 0)
    da = decode_entry(a, 0, 0)
    b = encode_entry(2, 1, len(a), L.ENTRY_MAGIC_NORMAL, b"b", da.chain_crc)
    assert decode_entry(b, len(a), da.chain_crc).index == 2
    with pytest.raises(CorruptRecord):
        decode_entry(b, len(a), 0)

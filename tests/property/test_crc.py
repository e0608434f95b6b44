"""Property tests for node.store.crc: the shared crc32 against zlib.crc32.

Goal: every record on disk and on the wire carries a CRC-32 from node.store.crc; the
implementation it picks (ISA-L via python-isal, or zlib) must give zlib's value for
any bytes and any seed, in the one-shot and the running (value, seed) form, for
every buffer type the callers pass (bytes, bytearray, memoryview slices).
Method: Hypothesis generates data, split points and seeds; zlib.crc32 is the oracle.
"""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.store import crc
from node.store.crc import crc32

seeds = st.integers(min_value=0, max_value=0xFFFFFFFF)
payloads = st.binary(max_size=4096)


def test_the_fast_implementation_is_in_use():
    # python-isal is a declared dependency: falling back to zlib silently would lose
    # the speed this module exists for.
    assert crc.IMPLEMENTATION == "isal"
    assert crc32 is not zlib.crc32


@given(payloads)
@settings(max_examples=300)
def test_one_shot_matches_zlib(data):
    assert crc32(data) == zlib.crc32(data)


@given(payloads, seeds)
@settings(max_examples=300)
def test_seeded_matches_zlib(data, seed):
    assert crc32(data, seed) == zlib.crc32(data, seed)


@given(payloads, st.data())
@settings(max_examples=300)
def test_running_crc_matches_one_pass(data, draw):
    # The chain CRC of dledger entries is fed in steps; any split gives the one-pass value.
    cut = draw.draw(st.integers(min_value=0, max_value=len(data)))
    seed = draw.draw(seeds)
    running = crc32(data[cut:], crc32(data[:cut], seed))
    assert running == zlib.crc32(data, seed)
    assert running == zlib.crc32(data[cut:], zlib.crc32(data[:cut], seed))


@given(payloads, st.data())
@settings(max_examples=200)
def test_buffer_types_match_zlib(data, draw):
    lo = draw.draw(st.integers(min_value=0, max_value=len(data)))
    hi = draw.draw(st.integers(min_value=lo, max_value=len(data)))
    expected = zlib.crc32(data[lo:hi])
    assert crc32(memoryview(data)[lo:hi]) == expected
    assert crc32(bytearray(data)[lo:hi]) == expected


def test_known_vectors():
    assert crc32(b"") == 0
    assert crc32(b"123456789") == 0xCBF43926          # the CRC-32/ISO-HDLC check value
    assert crc32(b"", 0xFFFFFFFF) == 0xFFFFFFFF


def test_rejects_text_like_zlib():
    with pytest.raises(TypeError):
        crc32("not bytes")  # type: ignore[arg-type]

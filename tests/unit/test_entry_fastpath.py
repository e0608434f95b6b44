"""The store's hot path: the header-only encoder, data-only fsync, the threaded flusher and
the entry's body CRC computed once.

Method: the fast header encoder must give exactly encode_entry's header for any entry;
a crash after `flush(index_file=False)` (index writes lost) must recover every flushed
entry and rebuild the index; a flush running on a thread while the loop truncates must
never report an index above what the log still holds.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dledger import codec
from dledger.codec import CodecError, decode_append_entries, encode_append_entries
from dledger.core import _new_entries
from dledger.entry import HEADER_SIZE, encode_entry, encode_header
from dledger.entry_store import EntryStore, INDEX_SIZE
from dledger.messages import Entry, EntryType
from node.store import layout as L
from node.store.fileio import FaultyFileSystem

SEG = 4096
IDX_SEG = INDEX_SIZE * 16


@given(st.integers(1, 2**62), st.integers(1, 2**62), st.integers(0, 2**62),
       st.sampled_from([L.ENTRY_MAGIC_NORMAL, L.ENTRY_MAGIC_NOOP, L.ENTRY_MAGIC_CONFIG]),
       st.binary(max_size=300), st.integers(0, 2**32 - 1))
def test_encode_header_equals_encode_entry(index, term, pos, magic, body, seed):
    full = encode_entry(index, term, pos, magic, body, seed)
    header, chain = encode_header(index, term, pos, magic, body, seed)
    assert header == full[:HEADER_SIZE]
    assert chain == int.from_bytes(full[36:40], "big")


def _store(fs, root) -> EntryStore:
    s = EntryStore(fs, str(root), "n0", data_segment_size=SEG, index_segment_size=IDX_SEG)
    s.recover()
    return s


def _mk(first: int, n: int, term: int = 1) -> list[Entry]:
    return [Entry(i, term, EntryType.NORMAL, bytes([i % 251]) * 200) for i in range(first, first + n)]


def test_data_only_flush_survives_a_crash_that_loses_the_index(tmp_path):
    fs = FaultyFileSystem(0)
    s = _store(fs, tmp_path)
    s.append(_mk(1, 30))
    assert s.flush(index_file=False) == 30
    fs.crash()  # the index file was never fsynced: its writes are gone
    s2 = _store(fs, tmp_path)
    assert s2.last_index() == 30
    assert s2.entry_at(30).index == 30
    assert [e.body for e in s2.entries(1, 31, 1 << 20)] == [e.body for e in _mk(1, 30)]


def test_threaded_flush_never_claims_truncated_entries(tmp_path):
    fs = FaultyFileSystem(0)
    s = _store(fs, tmp_path)
    s.append(_mk(1, 20))
    results: list[int] = []
    stop = threading.Event()

    def flusher():
        while not stop.is_set():
            results.append(s.flush())

    t = threading.Thread(target=flusher)
    t.start()
    try:
        for k in range(20):
            s.truncate_from(11)
            assert s.flushed_index <= 10
            s.append(_mk(11, 10, term=2 + k))
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()
    assert all(r <= 20 for r in results)
    assert s.flush() == 20
    assert s.term(20) == 21


@given(st.lists(st.binary(max_size=200), min_size=1, max_size=8), st.integers(1, 50))
def test_every_way_of_making_an_entry_gives_it_its_bodys_crc(tmp_path_factory, bodies, term):
    """Entry.crc is the store's bodyCrc and the wire's body CRC, computed once per entry: the
    constructor, dataclasses.replace, the core's column-wise new entries, the codec's received
    entries and the store's read-back must each hold crc32 of the entry's own body."""
    root = tmp_path_factory.mktemp("crc")
    made = _new_entries(1, term, EntryType.NORMAL, bodies)
    assert [e.crc for e in made] == [zlib.crc32(b) for b in bodies]
    assert replace(made[0], body=b"other").crc == zlib.crc32(b"other")
    assert Entry(1, term, EntryType.NOOP, b"").crc == 0
    got = decode_append_entries(encode_append_entries(tuple(made)), 0, 1)
    assert got == tuple(made) and [e.crc for e in got] == [e.crc for e in made]
    fs = FaultyFileSystem(0)
    store = _store(fs, root)
    store.append(got)
    store.flush()
    back = _store(fs, root).entries(1, len(bodies) + 1, 1 << 20)   # from disk, CRCs checked
    assert back == list(made) and [e.crc for e in back] == [zlib.crc32(b) for b in bodies]
    assert codec.decode(codec.encode(made[-1])) == made[-1]


def test_a_received_entry_whose_body_was_changed_is_refused():
    blob = bytearray(encode_append_entries((Entry(1, 1, EntryType.NORMAL, b"payload"),)))
    blob[-1] ^= 0x01
    with pytest.raises(CodecError, match="body crc mismatch"):
        decode_append_entries(bytes(blob), 0, 1)

"""DLedger entry codec: 48-byte header + body (pure, no IO).

Layout (node/store/layout.py ENTRY_HEADER): magic · size · index · term · pos ·
channel · chain_crc · body_crc · body_size · body.

(ours) Both CRCs are computed, where DLedger leaves them 0:
- body_crc  = crc32(body)
- chain_crc = crc32(header[0:36] + body_crc as 4 big-endian bytes), seeded with the
  previous entry's chain_crc. A flipped bit anywhere in the header or body, or an
  entry spliced in from another log, breaks the chain from that entry on.

The chain seed of the first entry of a log is 0 (or whatever the store recorded
when it dropped the entries before it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from node.store.crc import crc32 as _crc32
from node.store import layout as L
from node.store.errors import CorruptRecord

HEADER_SIZE = L.ENTRY_HEADER.size
BLANK_SIZE = L.ENTRY_BLANK.size
VALID_MAGICS = (L.ENTRY_MAGIC_NORMAL, L.ENTRY_MAGIC_NOOP, L.ENTRY_MAGIC_CONFIG)
_CHAIN_SPAN = L.ENTRY_CHAIN_CRC_SPAN
_BODY_CRC_AT = L.ENTRY_FIELD_OFFSET["body_crc"]
# The chain CRC covers header[0:36] then body_crc: the 4 bytes at [40:44]. We feed them
# as two crc32 steps (no concatenation copy); this is the same value as one pass.
assert _BODY_CRC_AT == _CHAIN_SPAN + 4
_U32 = struct.Struct(">I")
_PACK_HEADER = L.ENTRY_HEADER.pack
# header[0:36] (magic .. channel) followed by body_crc: exactly the bytes chain_crc covers.
_CHAIN_COVER = struct.Struct(L.ENTRY_HEADER.format[:7] + "I")
_PACK_CHAIN_COVER = _CHAIN_COVER.pack
assert _CHAIN_COVER.size == _CHAIN_SPAN + 4
PACK_HEADER, PACK_CHAIN_COVER = _PACK_HEADER, _PACK_CHAIN_COVER   # for EntryStore.append's inline encode
assert L.ENTRY_FIELD_OFFSET["chain_crc"] == _CHAIN_SPAN


@dataclass(frozen=True, slots=True)
class DecodedEntry:
    magic: int
    size: int          # header + body
    index: int
    term: int
    pos: int
    chain_crc: int
    body_crc: int
    body: bytes

    @property
    def end(self) -> int:
        return self.pos + self.size


def chain_crc_of(header_prefix: bytes | memoryview, body_crc: int, prev_chain_crc: int) -> int:
    """crc32(header[0:36] + body_crc BE) seeded with the previous entry's chain CRC."""
    crc = _crc32(header_prefix[:_CHAIN_SPAN], prev_chain_crc)
    return _crc32(_U32.pack(body_crc), crc)


def encode_entry(index: int, term: int, pos: int, magic: int, body: bytes,
                 prev_chain_crc: int) -> bytes:
    """The complete entry (header + body)."""
    assert magic in VALID_MAGICS, magic
    assert index >= 1
    assert term >= 1
    assert pos >= 0
    size = HEADER_SIZE + len(body)
    body_crc = _crc32(body)
    # Pack once with chain_crc 0 to get the covered prefix, then the real header.
    prefix = L.ENTRY_HEADER.pack(magic, size, index, term, pos, 0, 0, body_crc, len(body))
    chain = chain_crc_of(prefix, body_crc, prev_chain_crc)
    header = L.ENTRY_HEADER.pack(magic, size, index, term, pos, 0, chain, body_crc, len(body))
    return header + body


def encode_header(index: int, term: int, pos: int, magic: int, body: bytes,
                  prev_chain_crc: int) -> tuple[bytes, int]:
    """(48-byte header, its chain CRC) for `body`: the hot path of EntryStore.append.

    The same bytes as encode_entry's header, without copying the body: the store writes
    header and body side by side in one join."""
    body_crc = _crc32(body)
    n = len(body)
    size = HEADER_SIZE + n
    # The chain CRC's 40 covered bytes (header[0:36] + body_crc) packed in one go, then
    # the header itself: two packs and one CRC call, no slicing or concatenation.
    chain = _crc32(_PACK_CHAIN_COVER(magic, size, index, term, pos, 0, body_crc), prev_chain_crc)
    return _PACK_HEADER(magic, size, index, term, pos, 0, chain, body_crc, n), chain


def encode_blank(size: int) -> bytes:
    """End-of-file filler header: magic -1, size = the bytes left in the file."""
    assert size >= BLANK_SIZE
    return L.ENTRY_BLANK.pack(L.ENTRY_MAGIC_BLANK, size)


def peek_magic_size(buf: bytes | memoryview, at: int) -> tuple[int, int]:
    """(magic, size) of whatever starts at `at`; raises CorruptRecord if cut short."""
    if at + BLANK_SIZE > len(buf):
        raise CorruptRecord(at, "truncated entry prefix")
    return L.ENTRY_BLANK.unpack_from(buf, at)


def decode_entry(buf: bytes | memoryview, pos: int, prev_chain_crc: int | None = None,
                 at: int = 0) -> DecodedEntry:
    """Decode and check the entry that starts at buf[at:], expected at log position `pos`.

    Checks magic, sizes, the recorded pos, the body CRC and, when `prev_chain_crc`
    is given, the chain CRC. Raises CorruptRecord(pos, reason) on any failure.
    """
    if at + HEADER_SIZE > len(buf):
        raise CorruptRecord(pos, "truncated entry header")
    magic, size, index, term, rec_pos, _channel, chain, body_crc, body_size = \
        L.ENTRY_HEADER.unpack_from(buf, at)
    if magic not in VALID_MAGICS:
        raise CorruptRecord(pos, f"bad entry magic {magic}")
    if body_size < 0 or size != HEADER_SIZE + body_size:
        raise CorruptRecord(pos, f"entry size {size} does not match body size {body_size}")
    if at + size > len(buf):
        raise CorruptRecord(pos, "entry body cut short")
    if rec_pos != pos:
        raise CorruptRecord(pos, f"entry records pos {rec_pos}")
    if index < 1 or term < 1:
        raise CorruptRecord(pos, f"bad index/term {index}/{term}")
    body = bytes(buf[at + HEADER_SIZE:at + size])
    if _crc32(body) != body_crc:
        raise CorruptRecord(pos, "entry body crc mismatch")
    if prev_chain_crc is not None:
        prefix = buf[at:at + _CHAIN_SPAN]
        if chain_crc_of(prefix, body_crc, prev_chain_crc) != chain:
            raise CorruptRecord(pos, "entry chain crc mismatch")
    return DecodedEntry(magic, size, index, term, pos, chain, body_crc, body)

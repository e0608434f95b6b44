"""Wire codec for Raft messages: msgpack arrays driven by the dataclasses' type hints (pure).

A message is encoded as `[type name, field, field, ...]`. Field kinds come from the
type hints of the dataclasses in `dledger.messages`, so a new message type needs no
change here: an enum field travels as its value, a nested dataclass (Entry) as its
field array, and `tuple[Entry, ...]` as an array of those. Nested values are plain
arrays, not ext types, because the per-entry cost of Append decides throughput. A bytes
field (FetchEntriesResponse.entries, the raw entries a peer sends for repair) travels as
one msgpack bin.

Decoding rebuilds each dataclass through its own __post_init__ validation; anything
that does not decode to a registered message raises `CodecError`.

`Append` has its own layout, because its entries decide replication throughput:
`["Append", term, leader_id, prev_index, prev_term, entries_blob, commit_index]`, where
`entries_blob` is one msgpack bin holding, per entry, APPEND_ENTRY (term, type, body
size, CRC32 of the body) followed by the body. Indexes are implicit (prev_index + 1, + 2,
...). The receiver checks every body CRC before the entries reach the core (a flipped bit
on the wire is a CodecError, never a stored entry) and validates every field that
`Entry.__post_init__` would, in one pass, then builds the entries without that per-entry
call (~2 us each).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import struct
import typing
from itertools import repeat
from typing import Any, Callable

import msgpack

from dledger import messages as M
from node.store.crc import crc32 as _crc32


class CodecError(ValueError):
    """A frame payload is not a valid message. The fault is remote (the sender)."""

    retriable = False
    local = False


Encoder = Callable[[Any], Any]
Decoder = Callable[[Any], Any]


def _identity(v: Any) -> Any:
    return v


def _enum_codec(cls: type[enum.Enum]) -> tuple[Encoder, Decoder]:
    by_value = {m.value: m for m in cls}

    def dec(v: Any) -> Any:
        try:
            return by_value[v]
        except (KeyError, TypeError):
            raise CodecError(f"{v!r} is not a {cls.__name__}") from None
    return (lambda m: m.value), dec


def _field_codec(hint: Any) -> tuple[Encoder, Decoder] | None:
    """Codec for one field type; None when msgpack carries it as is."""
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_codec(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass_codec(hint)
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            inner = _field_codec(args[0])
            if inner is not None:
                enc, dec = inner
                return (lambda t: [enc(x) for x in t]), (lambda t: tuple(dec(x) for x in _seq(t)))
    return None


def _seq(v: Any) -> tuple:
    if not isinstance(v, tuple):
        raise CodecError(f"expected an array, got {type(v).__name__}")
    return v


_CACHE: dict[type, tuple[Encoder, Decoder]] = {}


def _dataclass_codec(cls: type) -> tuple[Encoder, Decoder]:
    """(obj -> field array, field array -> obj) for a dataclass: its constructor's fields (a
    derived one, such as Entry.crc, is derived again on decode)."""
    if cls in _CACHE:
        return _CACHE[cls]
    hints = typing.get_type_hints(cls, vars(M))
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    codecs = [_field_codec(hints[n]) for n in names]
    if all(c is None for c in codecs):
        def enc(obj: Any) -> list:
            return [getattr(obj, n) for n in names]

        def dec(arr: Any) -> Any:
            if len(_seq(arr)) != len(names):
                raise CodecError(f"{cls.__name__} needs {len(names)} fields, got {len(arr)}")
            return cls(*arr)
    else:
        encs = [c[0] if c else _identity for c in codecs]
        decs = [c[1] if c else _identity for c in codecs]
        pairs = tuple(zip(names, encs))

        def enc(obj: Any) -> list:
            return [e(getattr(obj, n)) for n, e in pairs]

        def dec(arr: Any) -> Any:
            if len(_seq(arr)) != len(decs):
                raise CodecError(f"{cls.__name__} needs {len(decs)} fields, got {len(arr)}")
            return cls(*[d(v) for d, v in zip(decs, arr)])
    _CACHE[cls] = (enc, dec)
    return enc, dec


def _build_registry() -> dict[str, tuple[type, Encoder, Decoder]]:
    registry: dict[str, tuple[type, Encoder, Decoder]] = {}
    for name, obj in vars(M).items():
        if isinstance(obj, type) and dataclasses.is_dataclass(obj):
            enc, dec = _dataclass_codec(obj)
            registry[name] = (obj, enc, dec)
    return registry


_BY_NAME = _build_registry()
_BY_TYPE = {cls: (name, enc) for name, (cls, enc, _dec) in _BY_NAME.items()}


# One entry of an Append on the wire, followed by `body_size` bytes of body.
APPEND_ENTRY = struct.Struct(
    ">Q"   # term: the entry's term (>= 1)
    "B"    # type: EntryType value (1 normal, 2 no-op, 3 config)
    "I"    # body_size: bytes of body that follow
    "I"    # body_crc: CRC32 of the body, checked on receive
)
assert APPEND_ENTRY.size == 17
_ENTRY_TYPES = {int(t): t for t in M.EntryType}
_new = object.__new__
_consume = collections.deque      # _consume(iterator, 0) runs it to the end, keeping nothing
_SET_INDEX, _SET_TERM, _SET_TYPE, _SET_BODY, _SET_CRC = M.ENTRY_SLOT_SETTERS
assert tuple(f.name for f in dataclasses.fields(M.Entry)) == ("index", "term", "type", "body", "crc")
assert tuple(f.name for f in dataclasses.fields(M.Append)) == (
    "term", "leader_id", "prev_index", "prev_term", "entries", "commit_index")


# The leader pushes the same entries to every follower: the last few blobs are kept,
# keyed by the identity of their first and last Entry objects and their count. Entries
# are immutable and a range of a log is only ever replaced from some index to its end,
# so the same first object, last object and count mean the same entries.
_BLOB_CACHE_MAX = 8
_blob_cache: list[tuple[M.Entry, M.Entry, int, bytes]] = []


def encode_append_entries(entries: tuple[M.Entry, ...]) -> bytes:
    """The entries blob of an Append (see the module docstring)."""
    first, last, count = entries[0], entries[-1], len(entries)
    for f, la, c, blob in _blob_cache:
        if f is first and la is last and c == count:
            return blob
    blob = _encode_entries(entries)
    _blob_cache.append((first, last, count, blob))
    if len(_blob_cache) > _BLOB_CACHE_MAX:
        del _blob_cache[0]
    return blob


def _encode_entries(entries: tuple[M.Entry, ...]) -> bytes:
    pack = APPEND_ENTRY.pack
    parts: list[bytes] = []
    for e in entries:
        body = e.body
        parts.append(pack(e.term, e.type, len(body), e.crc))
        parts.append(body)
    return b"".join(parts)


def decode_append_entries(blob: Any, prev_index: int, prev_term: int = 1,
                          max_term: int | None = None) -> tuple[M.Entry, ...]:
    """Entries prev_index+1.. from an Append's blob; CodecError on any bad field or CRC, or
    on a term below the one before it (from `prev_term`) or above `max_term` (the Append's)."""
    if not isinstance(blob, bytes):
        raise CodecError(f"Append entries must be bin, got {type(blob).__name__}")
    if type(prev_index) is not int or prev_index < 0:
        raise CodecError(f"Append prev_index must be an int >= 0, got {prev_index!r}")
    unpack, crc32, head, n = APPEND_ENTRY.unpack_from, _crc32, APPEND_ENTRY.size, len(blob)
    types = _ENTRY_TYPES
    bodies: list[bytes] = []
    terms: list[int] = []
    kinds: list[M.EntryType] = []
    crcs: list[int] = []
    add_body, add_term, add_kind, add_crc = bodies.append, terms.append, kinds.append, crcs.append
    index, at = prev_index, 0
    floor = prev_term if type(prev_term) is int else 1
    ceiling = max_term if type(max_term) is int else 1 << 64
    while at < n:
        if at + head > n:
            raise CodecError(f"Append entry {index + 1}: header cut short")
        term, type_value, size, crc = unpack(blob, at)
        at += head
        end = at + size
        if end > n:
            raise CodecError(f"Append entry {index + 1}: body cut short")
        body = blob[at:end]
        if crc32(body) != crc:
            raise CodecError(f"Append entry {index + 1}: body crc mismatch")
        entry_type = types.get(type_value)
        if entry_type is None or term < 1:
            raise CodecError(f"Append entry {index + 1}: bad type {type_value} or term {term}")
        if not floor <= term <= ceiling:
            raise CodecError(f"Append entry {index + 1}: term {term} out of order")
        floor = term
        index += 1
        add_body(body)
        add_term(term)
        add_kind(entry_type)
        add_crc(crc)
        at = end
    return tuple(_entries_of(prev_index + 1, terms, kinds, bodies, crcs))


def _entries_of(first: int, terms, kinds, bodies: list[bytes], crcs: list[int]) -> list[M.Entry]:
    """Entry(first + k, terms[k], kinds[k], bodies[k]) for every k, fields already checked
    (crcs[k] is bodies[k]'s CRC, checked): the objects made and their slots filled column by
    column at C speed (no per-entry __init__/__post_init__, no per-entry Python call)."""
    n = len(bodies)
    out = list(map(_new, repeat(M.Entry, n)))
    _consume(map(_SET_INDEX, out, range(first, first + n)), 0)
    _consume(map(_SET_TERM, out, terms), 0)
    _consume(map(_SET_TYPE, out, kinds), 0)
    _consume(map(_SET_BODY, out, bodies), 0)
    _consume(map(_SET_CRC, out, crcs), 0)
    return out


def _encode_append(m: M.Append) -> bytes:
    return msgpack.packb(["Append", m.term, m.leader_id, m.prev_index, m.prev_term,
                          encode_append_entries(m.entries), m.commit_index], use_bin_type=True)


_FRAME_LEN = struct.Struct(">I")     # node.store.layout.FRAME_LEN (checked at import below)
_APPEND_ARRAY = b"\x97" + msgpack.packb("Append")     # fixarray of 7, then the type name


def _bin_header(n: int) -> bytes:
    """msgpack's bin header for `n` bytes, the smallest form, as packb writes it."""
    if n < 0x100:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _append_frame(m: M.Append) -> bytes:
    """FRAME_LEN + `_encode_append(m)` in one join: the (shared, cached) entries blob is copied
    once, not through msgpack's buffer and again into the frame."""
    blob = encode_append_entries(m.entries)
    pack = msgpack.packb
    head = b"".join((_APPEND_ARRAY, pack(m.term), pack(m.leader_id, use_bin_type=True), pack(m.prev_index),
                     pack(m.prev_term), _bin_header(len(blob))))
    tail = pack(m.commit_index)
    return b"".join((_FRAME_LEN.pack(len(head) + len(blob) + len(tail)), head, blob, tail))


def encode_frame(msg: object) -> bytes:
    """A whole transport frame: FRAME_LEN (payload length) + `encode(msg)`."""
    if type(msg) is M.Append:
        return _append_frame(msg)
    payload = encode(msg)
    return _FRAME_LEN.pack(len(payload)) + payload


def _decode_append(fields: tuple) -> M.Append:
    if len(fields) != 6:
        raise CodecError(f"Append needs 6 fields, got {len(fields)}")
    term, leader_id, prev_index, prev_term, blob, commit_index = fields
    # decode_append_entries numbers the entries contiguously and checks their term order
    # (prev_term <= terms <= term); append_of_checked_entries checks the scalars as Append() does.
    if type(term) is not int or type(prev_term) is not int:
        return M.Append(term, leader_id, prev_index, prev_term, (), commit_index)   # raises, with the words
    return M.append_of_checked_entries(term, leader_id, prev_index, prev_term,
                                       decode_append_entries(blob, prev_index, prev_term, term), commit_index)


def encode(msg: object) -> bytes:
    """The payload of one frame."""
    if type(msg) is M.Append:
        return _encode_append(msg)
    try:
        name, enc = _BY_TYPE[type(msg)]
    except KeyError:
        raise TypeError(f"not a registered message: {type(msg).__name__}") from None
    arr = enc(msg)
    arr.insert(0, name)
    return msgpack.packb(arr, use_bin_type=True)


def decode(payload: bytes) -> object:
    """The message in a frame payload; raises CodecError if it is not one."""
    try:
        arr = msgpack.unpackb(payload, raw=False, use_list=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise CodecError(f"undecodable payload: {e}") from e
    if not isinstance(arr, tuple) or not arr or not isinstance(arr[0], str):
        raise CodecError("payload is not [type, fields...]")
    entry = _BY_NAME.get(arr[0])
    if entry is None:
        raise CodecError(f"unknown message type {arr[0]!r}")
    try:
        if arr[0] == "Append":
            return _decode_append(arr[1:])
        return entry[2](arr[1:])
    except CodecError:
        raise
    except (M.InvalidMessage, ValueError, TypeError) as e:
        raise CodecError(f"invalid {arr[0]}: {e}") from e

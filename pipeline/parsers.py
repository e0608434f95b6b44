"""Pure parsers for mqstore segment files (no Spark, no pyarrow).

A store directory holds either commitlog segments (`commitlog/`, standalone and
classic HA) or DLedger data segments (`dledger-<selfId>/data/`). Every segment
is a fixed-size, preallocated (sparse) file named by the 20-digit offset of its
first byte, so the data in a file ends at the first all-zero record prefix, at
an end-of-file blank, or at the file's end.

The parsers walk one segment with `struct.unpack_from` over a memoryview (an
mmap for files: no read copies, the kernel pages in big sequential chunks) and
yield plain tuples whose field order is declared once below. They never guess:
the first record that fails a check stops the scan and is described in the
`ParseReport` (absolute offset + reason), like leveldb's log reader Reporter.

Every binary layout comes from `node.store.layout`; this module holds no
format strings. `decode_record` in `node.store.message` is the reference
decoder; `_decode_message` below is a leaner equivalent (no StoredMessage
object, optional body copy, cached topic and host strings) because the
pipeline is bound by per-record Python work. The tests hold the two equal.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Iterator

from node.store.crc import crc32 as _crc32
from dledger.entry import chain_crc_of
from node.store import layout as L
from node.store.message import (KEY_SEPARATOR, PROPERTY_KEYS, PROPERTY_TAGS,
                                PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX)
from node.store.segment import NAME_DIGITS

# --- The row schema, declared once -------------------------------------------------------
# (name, Spark SQL type, nullable). Nullable where the REST mode may not carry the field.
# The data source builds its Spark and Arrow schemas
# from this; the tuples yielded by `parse_commitlog_segment` hold MESSAGE_COLUMNS in this
# order (timestamps as epoch milliseconds, properties as a dict).
MESSAGE_COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("topic", "string", False),
    ("queue_id", "int", False),
    ("queue_offset", "bigint", False),      # -1 for prepared / rolled-back transaction messages
    ("commitlog_offset", "bigint", False),  # physical (body) offset of the message record
    ("size", "int", True),                  # record size in bytes
    ("tags", "string", True),
    ("keys", "string", True),               # KEYS property, space-separated as RocketMQ stores it
    ("properties", "map<string,string>", True),
    ("born_timestamp", "timestamp", True),
    ("store_timestamp", "timestamp", True),
    ("born_host", "string", True),
    ("store_host", "string", True),
    ("reconsume_times", "int", True),
    ("sys_flag", "int", True),
    ("body", "binary", True),               # null when the reader was asked not to copy bodies
)
# DLedger facts about the entry holding the message; null (index, term) for commitlog stores,
# where every readable record counts as committed (standalone: committed = written).
ENTRY_COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("index", "bigint", True),
    ("term", "bigint", True),
    ("committed", "boolean", False),
)
COLUMNS = MESSAGE_COLUMNS + ENTRY_COLUMNS
COLUMN_NAMES = tuple(c[0] for c in COLUMNS)
MESSAGE_FIELD = {c[0]: i for i, c in enumerate(MESSAGE_COLUMNS)}
TIMESTAMP_COLUMNS = frozenset(c[0] for c in COLUMNS if c[1] == "timestamp")

# Fields of a DLedger entry tuple, before the message tuple (or None for no-op / config entries).
ENTRY_FIELDS = ("index", "term", "pos", "magic", "size", "chain_crc", "body_crc", "chain_ok")
ENTRY_FIELD = {n: i for i, n in enumerate(ENTRY_FIELDS)}


def ddl_schema() -> str:
    """The Spark DDL string of the data source schema."""
    return ", ".join(f"`{name}` {typ}" + ("" if nullable else " NOT NULL") for name, typ, nullable in COLUMNS)


def message_as_dict(row: tuple) -> dict:
    """A message tuple as {column: value} (tests, debugging; the hot paths keep tuples)."""
    return dict(zip((c[0] for c in MESSAGE_COLUMNS), row))


# --- Reports -------------------------------------------------------------------------------
END_EOF = "eof"            # the scan reached the end of the file (or the requested end)
END_ZERO = "zero"          # an all-zero prefix: the preallocated, never-written part
END_BLANK = "blank"        # an end-of-file blank record pads the rest
END_CORRUPT = "corrupt"    # a record failed a check; nothing after it was read
END_LIMIT = "limit"        # stopped at the caller's end offset / index


@dataclass
class ParseReport:
    """What one segment scan found. Filled in as the iterator advances."""

    path: str | None = None
    base_offset: int = 0
    records: int = 0                   # message records (commitlog) or entries (DLedger) read
    data_end: int = 0                  # absolute offset just past the last good record
    end_reason: str | None = None      # one of END_*; None while the scan is running
    corrupt_offset: int | None = None  # absolute offset of the first bad record
    corrupt_reason: str | None = None
    first_index: int | None = None     # DLedger: first and last entry index read
    last_index: int | None = None
    chain_failures: list[int] = field(default_factory=list)  # DLedger indexes whose chain CRC failed

    @property
    def ok(self) -> bool:
        return self.end_reason is not None and self.end_reason != END_CORRUPT and not self.chain_failures

    def as_dict(self) -> dict:
        return {"path": self.path, "base_offset": self.base_offset, "records": self.records,
                "data_end": self.data_end, "end_reason": self.end_reason,
                "corrupt_offset": self.corrupt_offset, "corrupt_reason": self.corrupt_reason,
                "first_index": self.first_index, "last_index": self.last_index,
                "chain_failures": list(self.chain_failures)}


class _Corrupt(Exception):
    """Internal: the record at `rel` (relative to the buffer) failed a check."""

    def __init__(self, rel: int, reason: str):
        super().__init__(reason)
        self.rel = rel
        self.reason = reason


# --- Buffers ------------------------------------------------------------------------------
class _Source:
    """A read-only memoryview over a file (mmap) or a bytes-like object; closes the mmap."""

    def __init__(self, path_or_bytes: str | os.PathLike | bytes | bytearray | memoryview):
        self.path: str | None = None
        self._mmap: mmap.mmap | None = None
        if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
            self.view = memoryview(path_or_bytes).cast("B")
            return
        self.path = os.fspath(path_or_bytes)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                self.view = memoryview(b"")
                return
            self._mmap = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        # Sequential scan: ask the kernel for aggressive read-ahead.
        if hasattr(self._mmap, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
            self._mmap.madvise(mmap.MADV_SEQUENTIAL)
        self.view = memoryview(self._mmap)

    def close(self) -> None:
        self.view.release()
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


# --- Message record decoding -------------------------------------------------------------
_HEADER = L.MESSAGE_HEADER
_HEADER_SIZE = _HEADER.size
_BLANK = L.BLANK
_PROPS_LEN = L.PROPERTIES_LEN
_OVERHEAD = L.MESSAGE_OVERHEAD
_MESSAGE_MAGIC = L.MESSAGE_MAGIC
_BLANK_MAGIC = L.BLANK_MAGIC
_NV = L.NAME_VALUE_SEPARATOR
_PS = L.PROPERTY_SEPARATOR


class _Caches:
    """Per-scan string caches: topics and hosts repeat on almost every record."""

    __slots__ = ("topics", "hosts")

    def __init__(self) -> None:
        self.topics: dict[bytes, str] = {}
        self.hosts: dict[tuple[bytes, int], str] = {}

    def host(self, ip: bytes, port: int) -> str:
        key = (ip, port)
        s = self.hosts.get(key)
        if s is None:
            s = self.hosts[key] = f"{socket.inet_ntoa(ip)}:{port}"
        return s

    def topic(self, raw: bytes) -> str:
        s = self.topics.get(raw)
        if s is None:
            s = self.topics[raw] = raw.decode("ascii", "replace")
        return s


def decode_properties_fast(raw: bytes) -> dict[str, str]:
    """`name\\x01value\\x02` pairs -> dict; same result as message.decode_properties."""
    if not raw:
        return {}
    out: dict[str, str] = {}
    for pair in raw.decode("utf-8", "replace").split(_PS):
        name, sep, value = pair.partition(_NV)
        if sep:
            out[name] = value
    return out


def _decode_message(mv: memoryview, p: int, limit: int, check_crc: bool, caches: _Caches):
    """Validate the record at `p` (which must end by `limit`); return (header, topic, props_raw).

    Raises _Corrupt(p, reason). The checks are those of message.decode_record.
    """
    if p + _HEADER_SIZE > limit:
        raise _Corrupt(p, "truncated header")
    h = _HEADER.unpack_from(mv, p)
    total = h[0]
    if h[1] != _MESSAGE_MAGIC:
        raise _Corrupt(p, f"bad magic {h[1]:#x}")
    if total < _OVERHEAD or p + total > limit:
        raise _Corrupt(p, f"bad total size {total}")
    body_len = h[16]
    if body_len < 0 or _OVERHEAD + body_len > total:
        raise _Corrupt(p, f"bad body length {body_len}")
    q = p + _HEADER_SIZE
    if check_crc and _crc32(mv[q:q + body_len]) != h[2]:
        raise _Corrupt(p, "body crc mismatch")
    q += body_len
    topic_len = mv[q]
    topic = caches.topic(mv[q + 1:q + 1 + topic_len].tobytes())
    q += 1 + topic_len
    end = p + total
    if q + 2 > end:
        raise _Corrupt(p, "properties length past record end")
    props_len = _PROPS_LEN.unpack_from(mv, q)[0]
    q += 2
    if q + props_len != end:
        raise _Corrupt(p, "record size does not match its fields")
    return h, topic, mv[q:end].tobytes()


def _message_row(mv: memoryview, p: int, h: tuple, topic: str, props_raw: bytes,
                 with_body: bool, caches: _Caches) -> tuple:
    """The MESSAGE_COLUMNS tuple of a validated record at `p`."""
    props = decode_properties_fast(props_raw)
    body = mv[p + _HEADER_SIZE:p + _HEADER_SIZE + h[16]].tobytes() if with_body else None
    return (topic, h[3], h[5], h[6], h[0], props.get(PROPERTY_TAGS), props.get(PROPERTY_KEYS), props,
            h[8], h[11], caches.host(h[9], h[10]), caches.host(h[12], h[13]), h[14], h[7], body)


# --- Commitlog segments ------------------------------------------------------------------
def _scan_commitlog(mv: memoryview, base_offset: int, check_crc: bool, end_offset: int | None,
                    report: ParseReport, caches: _Caches) -> Iterator[tuple[int, tuple, str, bytes]]:
    """Yield (relative pos, header, topic, props_raw) for each good record; fill `report`."""
    n = len(mv)
    stop = n if end_offset is None else max(0, min(n, end_offset - base_offset))
    p = 0
    report.data_end = base_offset
    # Each pass consumes at least MESSAGE_OVERHEAD bytes, so the loop is bounded by n / 91.
    while True:
        if p >= stop:
            report.end_reason = END_EOF if stop == n else END_LIMIT
            return
        if p + _BLANK.size > n:
            _stop_corrupt(report, base_offset + p, "fewer than 8 bytes left after a record")
            return
        total, magic = _BLANK.unpack_from(mv, p)
        if total == 0 and magic == 0:
            report.end_reason = END_ZERO
            return
        if magic == _BLANK_MAGIC:
            if total != n - p:
                _stop_corrupt(report, base_offset + p, f"blank size {total} != {n - p} bytes left")
            else:
                report.end_reason = END_BLANK
            return
        try:
            h, topic, props_raw = _decode_message(mv, p, n, check_crc, caches)
        except _Corrupt as e:
            _stop_corrupt(report, base_offset + e.rel, e.reason)
            return
        if h[6] != base_offset + p:
            _stop_corrupt(report, base_offset + p, f"PHYSICALOFFSET {h[6]} != record offset {base_offset + p}")
            return
        yield p, h, topic, props_raw
        p += total
        report.records += 1
        report.data_end = base_offset + p


def _stop_corrupt(report: ParseReport, offset: int, reason: str) -> None:
    report.end_reason = END_CORRUPT
    report.corrupt_offset = offset
    report.corrupt_reason = reason


def parse_commitlog_segment(path_or_bytes, base_offset: int, *, check_crc: bool = True,
                            with_body: bool = True, end_offset: int | None = None,
                            report: ParseReport | None = None) -> Iterator[tuple]:
    """Yield one MESSAGE_COLUMNS tuple per record of a commitlog segment, in offset order.

    `base_offset` is the segment's first byte (its file name). Scanning stops at the end
    of data; a bad record stops it too and lands in `report` (pass one in to read it).
    `end_offset` (absolute) stops before the first record at or past it.
    """
    report = report if report is not None else ParseReport()
    report.base_offset = base_offset
    src = _Source(path_or_bytes)
    report.path = src.path
    caches = _Caches()
    try:
        mv = src.view
        for p, h, topic, props_raw in _scan_commitlog(mv, base_offset, check_crc, end_offset, report, caches):
            yield _message_row(mv, p, h, topic, props_raw, with_body, caches)
    finally:
        src.close()


@dataclass(slots=True)
class Unit:
    """What a consume queue and an index file need of one message (no body, no dict)."""

    commitlog_offset: int
    size: int
    topic: str
    queue_id: int
    queue_offset: int
    sys_flag: int
    store_timestamp: int
    properties_raw: bytes


def parse_commitlog_units(path_or_bytes, base_offset: int, *, check_crc: bool = True,
                          end_offset: int | None = None,
                          report: ParseReport | None = None) -> Iterator[tuple]:
    """Lean scan for rebuild/stats: yield (commitlog_offset, size, topic, queue_id,
    queue_offset, sys_flag, store_timestamp, born_timestamp, properties_raw) per record."""
    report = report if report is not None else ParseReport()
    report.base_offset = base_offset
    src = _Source(path_or_bytes)
    report.path = src.path
    try:
        for _p, h, topic, props_raw in _scan_commitlog(src.view, base_offset, check_crc, end_offset,
                                                       report, _Caches()):
            yield (h[6], h[0], topic, h[3], h[5], h[7], h[11], h[8], props_raw)
    finally:
        src.close()


# --- DLedger data segments ---------------------------------------------------------------
_ENTRY = L.ENTRY_HEADER
_ENTRY_SIZE = _ENTRY.size


def _scan_dledger(mv: memoryview, base_offset: int, check_crc: bool, prev_chain_crc: int | None,
                  max_index: int | None, report: ParseReport) -> Iterator[tuple[int, tuple]]:
    """Yield (relative pos, entry header) for each good entry; fill `report`.

    The body CRC and the entry's own geometry are checked here; the chain CRC is checked
    when the previous entry's chain CRC is known (from this scan, or `prev_chain_crc`)
    and a failure is recorded (report.chain_failures), not fatal: the audit decides.
    """
    n = len(mv)
    p = 0
    prev = prev_chain_crc
    expect_index = None
    report.data_end = base_offset
    while True:  # each pass consumes >= 48 bytes: bounded by n / 48
        if p >= n:
            report.end_reason = END_EOF
            return
        if p + L.ENTRY_BLANK.size > n:
            _stop_corrupt(report, base_offset + p, "fewer than 8 bytes left after an entry")
            return
        magic, size = L.ENTRY_BLANK.unpack_from(mv, p)
        if magic == 0 and size == 0:
            report.end_reason = END_ZERO
            return
        if magic == L.ENTRY_MAGIC_BLANK:
            if size != n - p:
                _stop_corrupt(report, base_offset + p, f"blank size {size} != {n - p} bytes left")
            else:
                report.end_reason = END_BLANK
            return
        e = _check_entry(mv, p, n, base_offset, expect_index, check_crc)
        if isinstance(e, str):
            _stop_corrupt(report, base_offset + p, e)
            return
        if max_index is not None and e[2] > max_index:
            report.end_reason = END_LIMIT
            return
        chain_ok = None
        if prev is not None:
            chain_ok = chain_crc_of(mv[p:p + _ENTRY_SIZE], e[7], prev) == e[6]
            if not chain_ok:
                report.chain_failures.append(e[2])
        prev = e[6]
        expect_index = e[2] + 1
        yield p, e, chain_ok
        # Counted only once the consumer accepted the entry (it may find the body bad).
        if report.first_index is None:
            report.first_index = e[2]
        report.last_index = e[2]
        p += size
        report.records += 1
        report.data_end = base_offset + p


def _check_entry(mv: memoryview, p: int, n: int, base_offset: int, expect_index: int | None,
                 check_crc: bool) -> tuple | str:
    """The entry header at `p` if its geometry and body CRC hold, else the reason it fails."""
    if p + _ENTRY_SIZE > n:
        return "truncated entry header"
    e = _ENTRY.unpack_from(mv, p)
    magic, size, index, _term, pos, _ch, _chain, body_crc, body_size = e
    if magic not in (L.ENTRY_MAGIC_NORMAL, L.ENTRY_MAGIC_NOOP, L.ENTRY_MAGIC_CONFIG):
        return f"bad entry magic {magic}"
    if body_size < 0 or size != _ENTRY_SIZE + body_size or p + size > n:
        return f"bad entry size {size} (body {body_size})"
    if pos != base_offset + p:
        return f"entry pos {pos} != its offset {base_offset + p}"
    if index < 1 or _term < 1:
        return f"bad entry index/term {index}/{_term}"
    if expect_index is not None and index != expect_index:
        return f"entry index {index} after {expect_index - 1}"
    if check_crc and _crc32(mv[p + _ENTRY_SIZE:p + size]) != body_crc:
        return "entry body crc mismatch"
    return e


def parse_dledger_segment(path_or_bytes, base_offset: int, *, check_crc: bool = True,
                          with_body: bool = True, with_message: bool = True,
                          prev_chain_crc: int | None = None, max_index: int | None = None,
                          report: ParseReport | None = None) -> Iterator[tuple]:
    """Yield (index, term, pos, magic, size, chain_crc, body_crc, chain_ok, message) per entry.

    `message` is the MESSAGE_COLUMNS tuple of a normal entry's body (None for no-op and
    config entries, or when with_message=False). The body must be one commitlog record
    whose PHYSICALOFFSET is pos + 48; the body CRC of the message is not re-checked since
    the entry body CRC covers the same bytes. `chain_ok` is None when the seed is unknown.
    """
    report = report if report is not None else ParseReport()
    report.base_offset = base_offset
    src = _Source(path_or_bytes)
    report.path = src.path
    caches = _Caches()
    try:
        mv = src.view
        for p, e, chain_ok in _scan_dledger(mv, base_offset, check_crc, prev_chain_crc, max_index, report):
            msg = None
            if with_message and e[0] == L.ENTRY_MAGIC_NORMAL:
                msg = _entry_message(mv, p, e, with_body, caches, report, base_offset)
                if msg is None:
                    return
            yield (e[2], e[3], e[4], e[0], e[1], e[6], e[7], chain_ok, msg)
    finally:
        src.close()


def _entry_message(mv, p, e, with_body, caches, report, base_offset):
    """Decode a normal entry's body; on failure mark the report corrupt and return None."""
    q = p + _ENTRY_SIZE
    try:
        h, topic, props_raw = _decode_message(mv, q, p + e[1], False, caches)
    except _Corrupt as exc:
        _undo_last(report, base_offset + p, exc.reason)
        return None
    if h[0] != e[8]:
        _undo_last(report, base_offset + p, f"message size {h[0]} != entry body size {e[8]}")
        return None
    if h[6] != e[4] + _ENTRY_SIZE:
        _undo_last(report, base_offset + p, f"PHYSICALOFFSET {h[6]} != entry pos + 48 ({e[4] + _ENTRY_SIZE})")
        return None
    return _message_row(mv, q, h, topic, props_raw, with_body, caches)


def _undo_last(report: ParseReport, offset: int, reason: str) -> None:
    """The entry just yielded by the scanner is bad after all: the data ends before it
    (the scanner counts an entry only after its consumer returns, so nothing to undo)."""
    _stop_corrupt(report, offset, reason)


def parse_dledger_units(path_or_bytes, base_offset: int, *, check_crc: bool = True,
                        max_index: int | None = None, report: ParseReport | None = None) -> Iterator[tuple]:
    """Lean DLedger scan for rebuild/stats: the same tuples as parse_commitlog_units, for
    normal entries only (no-op and config entries carry no message)."""
    report = report if report is not None else ParseReport()
    report.base_offset = base_offset
    src = _Source(path_or_bytes)
    report.path = src.path
    caches = _Caches()
    try:
        mv = src.view
        for p, e, _ok in _scan_dledger(mv, base_offset, check_crc, None, max_index, report):
            if e[0] != L.ENTRY_MAGIC_NORMAL:
                continue
            q = p + _ENTRY_SIZE
            try:
                h, topic, props_raw = _decode_message(mv, q, p + e[1], False, caches)
            except _Corrupt as exc:
                _undo_last(report, base_offset + p, exc.reason)
                return
            if h[6] != e[4] + _ENTRY_SIZE:
                _undo_last(report, base_offset + p, "PHYSICALOFFSET != entry pos + 48")
                return
            yield (h[6], h[0], topic, h[3], h[5], h[7], h[11], h[8], props_raw)
    finally:
        src.close()


# --- Property helpers for the lean paths -----------------------------------------------------
def props_get(props_raw: bytes, name: str) -> str | None:
    """One property from the raw `name\\x01value\\x02` bytes without building a dict."""
    if not props_raw:
        return None
    key = (name + _NV).encode("utf-8")
    i = 0
    n = len(props_raw)
    while i < n:  # bounded: i strictly increases
        if props_raw.startswith(key, i):
            j = props_raw.find(b"\x02", i)
            return props_raw[i + len(key):(n if j < 0 else j)].decode("utf-8", "replace")
        j = props_raw.find(b"\x02", i)
        if j < 0:
            return None
        i = j + 1
    return None


def index_keys(props: dict[str, str]) -> list[str]:
    """Keys an index file records for a message: UNIQ_KEY, then each KEYS entry."""
    out = []
    uniq = props.get(PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX)
    if uniq:
        out.append(uniq)
    for k in props.get(PROPERTY_KEYS, "").split(KEY_SEPARATOR):
        if k:
            out.append(k)
    return out


# --- Store directories ---------------------------------------------------------------------
KIND_COMMITLOG = "commitlog"
KIND_DLEDGER = "dledger"
_DLEDGER_DIR = re.compile(r"^dledger-(.+)$")


@dataclass(frozen=True)
class SegmentInfo:
    path: str
    base_offset: int
    file_size: int
    kind: str


def dledger_dirs(store_dir: str) -> list[str]:
    """`dledger-<selfId>` directories of a store root that hold a data/ folder."""
    if not os.path.isdir(store_dir):
        return []
    return sorted(os.path.join(store_dir, d) for d in os.listdir(store_dir)
                  if _DLEDGER_DIR.match(d) and os.path.isdir(os.path.join(store_dir, d, "data")))


def detect_store_kind(store_dir: str) -> str:
    """'dledger' or 'commitlog'; raises ValueError for anything else (or both)."""
    has_cl = os.path.isdir(os.path.join(store_dir, "commitlog"))
    dl = dledger_dirs(store_dir)
    if len(dl) > 1:
        raise ValueError(f"{store_dir}: several DLedger stores ({', '.join(map(os.path.basename, dl))}); "
                         "point at one node's root")
    if dl and has_cl:
        raise ValueError(f"{store_dir}: holds both commitlog/ and {os.path.basename(dl[0])}/; which one?")
    if dl:
        return KIND_DLEDGER
    if has_cl:
        return KIND_COMMITLOG
    raise ValueError(f"{store_dir}: no commitlog/ or dledger-<id>/data/ directory; not an mqstore store root")


def segments_dir(store_dir: str, kind: str | None = None) -> str:
    kind = kind or detect_store_kind(store_dir)
    if kind == KIND_COMMITLOG:
        return os.path.join(store_dir, "commitlog")
    return os.path.join(dledger_dirs(store_dir)[0], "data")


def list_segments(store_dir: str) -> list[SegmentInfo]:
    """The segment files of a store root in offset order (foreign and temp files skipped)."""
    kind = detect_store_kind(store_dir)
    d = segments_dir(store_dir, kind)
    out = []
    for name in sorted(os.listdir(d)):
        if len(name) != NAME_DIGITS or not name.isdigit():
            continue
        path = os.path.join(d, name)
        out.append(SegmentInfo(path, int(name), os.path.getsize(path), kind))
    return out


# --- Side files: checkpoint, DLedger index ---------------------------------------------------
def read_checkpoint(store_dir: str) -> dict | None:
    """The store's checkpoint as a dict, or None if missing, short or failing its CRC."""
    path = os.path.join(store_dir, "checkpoint")
    try:
        with open(path, "rb") as f:
            raw = f.read(L.CHECKPOINT.size)
    except FileNotFoundError:
        return None
    if len(raw) < L.CHECKPOINT.size:
        return None
    phys, logics, index_ts, committed, crc = L.CHECKPOINT.unpack(raw)
    if _crc32(raw[:L.CHECKPOINT.size - 4]) != crc:
        return None
    return {"physic_msg_timestamp": phys, "logics_msg_timestamp": logics,
            "index_msg_timestamp": index_ts, "committed_offset": committed}


def read_dledger_meta(store_dir: str) -> dict | None:
    """The DLedger entry store's `meta` JSON (committed, base_index, base_chain, ...), or None."""
    dirs = dledger_dirs(store_dir)
    if not dirs:
        return None
    try:
        with open(os.path.join(dirs[0], "meta"), "rb") as f:
            meta = json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _segment_files(directory: str) -> list[tuple[int, str]]:
    if not os.path.isdir(directory):
        return []
    return [(int(n), os.path.join(directory, n)) for n in sorted(os.listdir(directory))
            if len(n) == NAME_DIGITS and n.isdigit()]


def dledger_index_entry(store_dir: str, index: int) -> tuple[int, int, int, int, int] | None:
    """(magic, pos, size, index, term) of entry `index` from the DLedger index file, or None."""
    at = index * L.ENTRY_INDEX.size
    for base, path in reversed(_segment_files(os.path.join(dledger_dirs(store_dir)[0], "index"))):
        if base > at:
            continue
        with open(path, "rb") as f:
            f.seek(at - base)
            raw = f.read(L.ENTRY_INDEX.size)
        if len(raw) < L.ENTRY_INDEX.size:
            return None
        e = L.ENTRY_INDEX.unpack(raw)
        return e if e[3] == index and e[2] > 0 else None
    return None


def dledger_entry_header(store_dir: str, pos: int) -> tuple | None:
    """The ENTRY_HEADER fields at data position `pos`, or None if no file holds it."""
    for base, path in reversed(_segment_files(segments_dir(store_dir, KIND_DLEDGER))):
        if base > pos:
            continue
        with open(path, "rb") as f:
            f.seek(pos - base)
            raw = f.read(L.ENTRY_HEADER.size)
        return L.ENTRY_HEADER.unpack(raw) if len(raw) == L.ENTRY_HEADER.size else None
    return None


def dledger_prev_chain_crc(store_dir: str, index: int) -> int | None:
    """Chain seed for entry `index`: 0 for the log's first entry (index 1), else the chain CRC
    of entry index-1 found through the index file; None when that entry is not retained."""
    if index <= 1:
        return 0
    meta = read_dledger_meta(store_dir) or {}
    if index == int(meta.get("base_index", 0)) + 1:
        return int(meta.get("base_chain", 0))    # the first entry after a compacted / installed base
    e = dledger_index_entry(store_dir, index - 1)
    if e is None:
        return None
    h = dledger_entry_header(store_dir, e[1])
    if h is None or h[2] != index - 1:
        return None
    return h[6]


def dledger_last_index_within(store_dir: str, end_pos: int, first: int, last: int) -> int | None:
    """The highest index in [first, last] whose entry ends at or before `end_pos` (index file)."""
    lo, hi, best = first, last, None
    while lo <= hi:  # binary search: bounded by log2(last - first + 1) + 1 passes
        mid = (lo + hi) // 2
        e = dledger_index_entry(store_dir, mid)
        if e is None:
            return best
        if e[1] + e[2] <= end_pos:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best

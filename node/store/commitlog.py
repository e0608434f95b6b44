"""RocketMQ's commitlog: message records appended to fixed-size segment files.

A record never spans two files: when `total_size + 8 > remaining` the rest of
the file gets an 8-byte BLANK (TOTALSIZE = remaining, BLANK_MAGIC) followed by
zeros, and the record goes to a new file (CommitLog.END_FILE_MIN_BLANK_LENGTH).
So every file ends either in a BLANK or with at least 8 bytes still free, and
a reader meeting a BLANK jumps to the next file's base.

`append_batch` is the hot path: per message it packs one 88-byte header and
appends two references (header, sealed tail) to a list; each segment touched
gets one `b"".join` and one pwrite. What is durable is decided by `flush`;
what is committed is decided by the ReplicatedLog built on top.
"""

from __future__ import annotations

import errno
import logging
import struct
from dataclasses import dataclass
from datetime import datetime
from typing import Sequence

from node.store.crc import crc32 as _crc32
from node.replicated_log import ScanBatch, ScannedRecord
from node.store import layout as L
from node.store import retention
from node.store.errors import CorruptRecord, DiskFull, InvalidMessage, StoreFatal
from node.store.fileio import FileSystem
from node.store.message import MessageDraft
from node.store.queue_offsets import QueueOffsetTable
from node.store.retention import RetentionDecision, RetentionPolicy
from node.store.segment import Segment, SegmentedFile, TailCut, TruncateReport

log = logging.getLogger(__name__)

_HEADER = L.MESSAGE_HEADER
_BLANK = L.BLANK
_MIN_BLANK = L.END_FILE_MIN_BLANK_LENGTH
_OFF_PHYS = L.MESSAGE_FIELD_OFFSET["physical_offset"]
_BODY_AT = _HEADER.size
_PROPERTY_END = ord(L.PROPERTY_SEPARATOR)
# A scan never asks the disk for less than this, so small max_bytes still reads efficiently.
_SCAN_MIN_READ_BYTES = 64 * 1024
# Upper bound on segments one scan call walks through (each BLANK is one hop).
_SCAN_MAX_HOPS = 64


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """What retention needs to know about one segment file."""

    base: int           # offset of the file's first byte
    end: int            # offset one past the file's last data byte
    path: str


def record_problem(buf: bytes | memoryview, i: int, abs_pos: int, seg_remaining: int,
                   check_crc: bool = True) -> str | None:
    """None if a whole, valid message record starts at buf[i]; else what is wrong with it.

    `abs_pos` is the record's commitlog offset (it must equal its PHYSICALOFFSET field: a
    record found where it was not written is stale) and `seg_remaining` the bytes from it
    to the end of its segment. The caller has checked the magic and that `total` bytes
    are in `buf`. Returns a reason instead of raising so recovery's loop stays cheap.
    """
    (total, _magic, body_crc, _qid, _flag, _qoff, phys, _sys, _bts, _bip, _bport, _sts, _sip, _sport,
     _recon, _prep, body_len) = _HEADER.unpack_from(buf, i)
    if total < L.MESSAGE_OVERHEAD or total + _MIN_BLANK > seg_remaining:
        return f"bad total size {total}"
    if phys != abs_pos:
        return f"physical offset field {phys} != position"
    if body_len < 0 or L.MESSAGE_OVERHEAD + body_len > total:
        return f"bad body length {body_len}"
    p = i + _BODY_AT + body_len
    q = p + 1 + buf[p]
    end = i + total
    if q + L.PROPERTIES_LEN.size > end:
        return "topic runs past the record end"
    props_len = L.PROPERTIES_LEN.unpack_from(buf, q)[0]
    if q + L.PROPERTIES_LEN.size + props_len != end:
        return "record size does not match its fields"
    # BODYCRC covers only the body. A write torn inside topic or properties leaves the old
    # bytes (zeros) at the record's end, so check the bytes that are never zero there.
    if q == p + 1 or buf[q - 1] == 0:
        return "topic is empty or ends in a zero byte (torn write?)"
    if props_len and buf[end - 1] != _PROPERTY_END:
        return "properties do not end with their separator (torn write?)"
    if check_crc and _crc32(buf[i + _BODY_AT:p]) != body_crc:
        return "body crc mismatch"
    return None


class CommitLog:
    """Message records in `directory`, one SegmentedFile of `segment_size`-byte files."""

    def __init__(self, fs: FileSystem, directory: str, segment_size: int, store_ip: bytes, store_port: int):
        assert len(store_ip) == 4, "store_ip is a packed IPv4 address"
        assert segment_size > L.MESSAGE_OVERHEAD + _MIN_BLANK, "a segment must hold at least one record"
        self.fs = fs
        self.directory = directory
        self.files = SegmentedFile(fs, directory, segment_size)
        self.store_ip = store_ip
        self.store_port = store_port

    # --- geometry -------------------------------------------------------------------------
    @property
    def segment_size(self) -> int:
        return self.files.segment_size

    @property
    def max_record_size(self) -> int:
        """The largest record a file can take: a record always leaves room for a BLANK."""
        return self.files.segment_size - _MIN_BLANK

    @property
    def max_offset(self) -> int:
        """Write end: the offset the next record would start at (before any roll)."""
        return self.files.end

    @property
    def min_offset(self) -> int:
        """First retained byte (the first segment's base)."""
        return self.files.start

    @property
    def flushed_offset(self) -> int:
        return self.files.flushed

    def segment_base(self, offset: int) -> int:
        return offset - offset % self.files.segment_size

    def segment_infos(self) -> list[SegmentInfo]:
        return [SegmentInfo(s.base, s.end, s.path) for s in self.files.segments]

    def load(self) -> None:
        """Open the files on disk; their data end is unknown until recovery sets it."""
        self.files.load()

    def close(self) -> None:
        self.files.close()

    # --- append ---------------------------------------------------------------------------
    def batch_may_roll(self, drafts: Sequence[MessageDraft]) -> bool:
        """True if appending `drafts` could start a new segment (the caller then serializes
        the append against a flush in progress, because a failed batch that rolled must
        delete the new file)."""
        seg = self.files.last()
        if seg is None or seg.remaining < _MIN_BLANK:
            return True
        need = _MIN_BLANK
        for d in drafts:
            need += d.total_size
        return need > seg.remaining

    def append_batch(self, drafts: Sequence[MessageDraft], queue_offsets: QueueOffsetTable,
                     store_timestamp_ms: int) -> list[tuple[int, int, int]]:
        """Append sealed drafts as one indivisible batch; return (physical_offset, size, queue_offset)
        per draft. All or nothing: on ENOSPC (DiskFull) or any other write error (StoreFatal)
        the bytes written so far are durably removed and the queue offsets rewound."""
        limit = self.max_record_size
        for d in drafts:
            assert d.total_size > 0, "draft not sealed"
            if d.total_size > limit:
                raise InvalidMessage(f"record of {d.total_size} bytes exceeds the segment limit {limit} "
                                     f"(mappedFileSizeCommitLog {self.files.segment_size} minus {_MIN_BLANK})")
        seg = self.files.ensure_writable(self.files.end)
        batch_start = seg.base + seg.write_pos
        qoffs = queue_offsets.assign_batch(drafts)
        pending: list[tuple[Segment, int, int]] = []   # [(segment, rel start, bytes)] of each write
        try:
            results = self._append_records(drafts, qoffs, store_timestamp_ms, seg, pending)
        except (OSError, struct.error) as e:
            queue_offsets.rewind(drafts, qoffs)
            self._roll_back(batch_start, pending)
            if isinstance(e, struct.error):
                raise InvalidMessage(f"a message field is out of range: {e}") from e
            if e.errno == errno.ENOSPC:
                raise DiskFull(f"disk full writing {self.directory} (ENOSPC); batch of {len(drafts)} "
                               f"messages not stored, log truncated back to {batch_start}") from e
            raise StoreFatal(f"write failed in {self.directory}: {e}") from e
        return results

    def _append_records(self, drafts: Sequence[MessageDraft], qoffs: list[int], ts: int, seg: Segment,
                        pending: list[tuple[Segment, int, int]]) -> list[tuple[int, int, int]]:
        # Locals for the loop: attribute lookups cost as much as the work here.
        pack = _HEADER.pack
        magic = L.MESSAGE_MAGIC
        ip = self.store_ip
        port = self.store_port
        results: list[tuple[int, int, int]] = []
        add_result = results.append
        parts: list[bytes] = []
        add = parts.append
        phys = seg.base + seg.write_pos
        seg_limit = seg.base + seg.capacity
        for d, qoff in zip(drafts, qoffs):
            size = d.total_size
            if phys + size + _MIN_BLANK > seg_limit:
                remaining = seg_limit - phys
                add(_BLANK.pack(remaining, L.BLANK_MAGIC))
                add(bytes(remaining - _MIN_BLANK))
                self._write(seg, parts, pending)
                seg = self.files.roll()
                parts = []
                add = parts.append
                phys = seg.base
                seg_limit = seg.base + seg.capacity
            add_result((phys, size, qoff))
            add(pack(size, magic, d.body_crc, d.queue_id, d.flag, qoff, phys, d.sys_flag, d.born_timestamp,
                     d.born_ip, d.born_port, ts, ip, port, d.reconsume_times, d.prepared_tx_offset,
                     len(d.body)))
            add(d.tail)
            phys += size
        if parts:
            self._write(seg, parts, pending)
        assert self.files.end == phys, "write end must follow the last record"
        return results

    @staticmethod
    def _write(seg: Segment, parts: list[bytes], pending: list[tuple[Segment, int, int]]) -> None:
        data = b"".join(parts)
        pending.append((seg, seg.write_pos, len(data)))  # so a torn write can be zeroed
        seg.append(data)

    def _roll_back(self, batch_start: int, pending: list[tuple[Segment, int, int]]) -> None:
        """Durably remove everything the failed batch wrote, including a partial pwrite.

        truncate() clears the file holding `batch_start` from there to its end (a short
        write's bytes included: Segment.append counts them) and deletes the files the batch
        rolled into, so no record of the batch can be read back by a later recovery."""
        try:
            report = self.files.truncate(batch_start)
        except OSError as e:
            raise StoreFatal(f"cannot roll back a failed batch in {self.directory}: {e}") from e
        assert all(seg not in self.files.segments or seg.write_pos <= rel for seg, rel, _ in pending), \
            "a failed batch left bytes past the end"
        log.warning("commitlog batch rolled back", extra={"batch_start": batch_start,
                                                          "zeroed_bytes": report.zeroed_bytes,
                                                          "removed_files": report.removed_files})

    # --- read -----------------------------------------------------------------------------
    def read(self, physical_offset: int, size: int) -> bytes:
        """The whole record at `physical_offset`; KeyError if no such record is retained."""
        if physical_offset < self.min_offset or physical_offset + size > self.max_offset or size <= 0:
            raise KeyError(f"no record at {physical_offset} (+{size}); log holds [{self.min_offset}, "
                           f"{self.max_offset})")
        data = self.files.read(physical_offset, size)
        if len(data) != size:
            raise KeyError(f"record at {physical_offset} (+{size}) crosses a segment end")
        total, magic = _BLANK.unpack_from(data, 0)
        if magic != L.MESSAGE_MAGIC or total != size:
            raise KeyError(f"no record of {size} bytes at {physical_offset}")
        seg_remaining = self.files.segment_size - physical_offset % self.files.segment_size
        problem = record_problem(data, 0, physical_offset, seg_remaining)
        if problem is not None:
            raise CorruptRecord(physical_offset, problem)
        return data

    def scan(self, position: int, max_bytes: int, limit: int | None = None, check_crc: bool = True,
             verify: bool = True) -> ScanBatch:
        """Message records from `position` up to `limit` (default: the write end), about
        `max_bytes` of them (always at least one whole record if one is there). BLANKs are
        skipped to the next file. Raises CorruptRecord on anything that is not a record.

        verify=False checks only the framing (magic, size within the file and the data):
        for bytes already verified by recovery or written by this process, read by a
        consumer that checks every field it uses (the dispatcher; RocketMQ's reput service
        does not re-check CRCs either)."""
        spans, position = self.scan_spans(position, max_bytes, limit, check_crc, verify)
        return ScanBatch(tuple([ScannedRecord(phys, buf[i:i + size]) for buf, i, phys, size in spans]), position)

    def scan_spans(self, position: int, max_bytes: int, limit: int | None = None, check_crc: bool = True,
                   verify: bool = True) -> tuple[list[tuple[bytes, int, int, int]], int]:
        """`scan` without a copy per record: `(chunk, start, physical_offset, size)` per record,
        the record being `chunk[start:start + size]` (records of one file share one chunk),
        and the position to continue from. Same checks as `scan`."""
        assert max_bytes > 0
        end = self.max_offset if limit is None else min(limit, self.max_offset)
        if position < self.min_offset:
            raise KeyError(f"position {position} is below the first retained offset {self.min_offset}")
        spans: list[tuple[bytes, int, int, int]] = []
        budget = max_bytes
        for _ in range(_SCAN_MAX_HOPS):
            if position >= end or budget <= 0:
                break
            position, used, at_blank = self._scan_segment(position, end, budget, check_crc, spans, verify)
            budget -= used
            if not at_blank:
                break
        return spans, position

    def _scan_segment(self, position: int, end: int, budget: int, check_crc: bool,
                      out: list[tuple[bytes, int, int, int]], verify: bool = True) -> tuple[int, int, bool]:
        """Records of one segment from `position`; returns (next position, bytes used, hit BLANK)."""
        seg_size = self.files.segment_size
        seg_end = self.segment_base(position) + seg_size
        stop = min(end, seg_end)
        chunk = self.files.read(position, min(stop - position, max(budget, _SCAN_MIN_READ_BYTES)))
        i = 0
        while i + _MIN_BLANK <= len(chunk) and i < budget:
            total, magic = _BLANK.unpack_from(chunk, i)
            at = position + i
            if magic == L.BLANK_MAGIC:
                if total != seg_end - at:
                    raise CorruptRecord(at, f"blank of {total} bytes does not reach the file end")
                return seg_end, i, True
            if magic != L.MESSAGE_MAGIC:
                raise CorruptRecord(at, f"bad magic {magic:#x} (size field {total})")
            if i + total > len(chunk):
                if total < L.MESSAGE_OVERHEAD or at + total > stop:
                    # Committed ends and file ends fall on record boundaries, so this is damage.
                    raise CorruptRecord(at, f"record of {total} bytes runs past {stop}")
                if out:
                    break  # the rest belongs to the next call
                chunk = chunk[:i] + self.files.read(at, total)  # one record larger than the budget
                if i + total > len(chunk):
                    raise CorruptRecord(at, f"record of {total} bytes runs past the data")
            if verify:
                problem = record_problem(chunk, i, at, seg_end - at, check_crc)
                if problem is not None:
                    raise CorruptRecord(at, problem)
            elif total < L.MESSAGE_OVERHEAD or total + _MIN_BLANK > seg_end - at:
                raise CorruptRecord(at, f"bad total size {total}")
            out.append((chunk, i, at, total))
            i += total
        return position + i, i, False

    # --- durability, truncation, retention ------------------------------------------------
    def flush(self) -> int:
        """fsync what is written; return the flushed offset. StoreFatal on error, never retried."""
        return self.files.flush()

    def truncate(self, offset: int) -> TruncateReport:
        """Durably drop every byte at or past `offset` (zeroed and fsynced; later files removed)."""
        return self.detach_tail(offset).make_durable()

    def detach_tail(self, offset: int) -> TailCut:
        """truncate in two steps: the cut in memory here, its file work by `make_durable`
        (on a worker thread); no append in between (SegmentedFile.detach_tail)."""
        assert self.min_offset <= offset, "cannot truncate below the first retained segment"
        return self.files.detach_tail(offset)

    def delete_head(self, upto_offset: int) -> list[str]:
        """Delete whole segments ending at or before `upto_offset`; never the one being written."""
        return self.files.delete_head(upto_offset)

    def delete_expired(self, policy: RetentionPolicy, now: datetime, disk_ratio: float,
                       safe_upto: int | None = None, manual: bool = False) -> RetentionDecision:
        """Apply the retention policy: delete expired head files (see node.store.retention)."""
        return retention.apply(self, policy, now, disk_ratio, safe_upto, manual=manual)

"""Corrupt data on disk: the registry of known-bad ranges, and the scrubber that finds them.

A bit flip in an old segment is found three ways: on read (every body served to a
consumer has its CRC checked before it leaves the node), by recovery (DLedger checks
every entry's body and chain CRC at start), and by the scrubber, a bounded background
walk over the committed log at `storeScrubRateMb` MB/s every `storeScrubIntervalMs`,
so a flip is found even if nobody reads it.

Whatever finds it reports a `CorruptRange` to the node's `CorruptionRegistry`, which
logs one ERROR line naming file, offset and expected/actual CRC, counts it
(`rocketmq_store_corrupt_records_total`) and keeps it (gauge
`rocketmq_store_corrupt_ranges`, `/health` "corrupt"). Reads that touch a known range
fail with `CorruptData` (retriable: in DLedger mode the range is repaired from a peer,
see dledger/repair.py); nothing in it is served and a pull never steps past it.
Standalone and classic nodes cannot repair: the range stays reported until an operator
restores the file.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol

from node.store.crc import crc32 as _crc32
from node.store import layout as L
from node.store.commitlog import record_problem
from node.store.errors import CorruptRecord

log = logging.getLogger(__name__)

_HEADER = L.MESSAGE_HEADER
_BLANK = L.BLANK
_MIN_BLANK = L.END_FILE_MIN_BLANK_LENGTH
_BODY_CRC_AT = L.MESSAGE_FIELD_OFFSET["body_crc"]
_BODY_LEN_AT = L.MESSAGE_FIELD_OFFSET["body_len"]

MAX_RANGES = 10_000                 # known corrupt ranges kept; beyond it the node stops itself
SCRUB_STEP_BYTES = 1 << 20          # bytes verified per scrubber step (one read, one crc32 pass)


class CorruptData(CorruptRecord):
    """A read touched a range whose CRC does not match: nothing of it is served.

    Retriable: in DLedger mode the range is repaired from a healthy replica (or another
    replica serves it); standalone and classic nodes report it until an operator acts."""

    code = "CORRUPT_RECORD"
    retriable = True
    http_status = 503


@dataclass(frozen=True, slots=True)
class CorruptRange:
    path: str                   # file holding the bad bytes
    start: int                  # log position of the bad record (entry pos in DLedger mode)
    end: int                    # one past its last byte
    expected_crc: int | None    # the CRC the record carries (None: framing damage, no CRC to compare)
    actual_crc: int | None      # CRC of the bytes now on disk
    found_by: str               # "read", "scrub" or "recovery"
    reason: str
    index: int | None = None    # DLedger entry index (repairable from a peer); None otherwise

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CorruptionRegistry:
    """Known corrupt ranges of one node's log, keyed by start position (bounded)."""

    def __init__(self, max_ranges: int = MAX_RANGES):
        self.max_ranges = max_ranges
        self._ranges: dict[int, CorruptRange] = {}
        self._starts: list[int] = []
        self.found_total = 0        # distinct corrupt records found since start (metric)
        self.repaired_total = 0     # ranges cleared after a verified repair (metric)
        self.listeners: list[Callable[[CorruptRange], None]] = []

    def __bool__(self) -> bool:
        return bool(self._ranges)

    def __len__(self) -> int:
        return len(self._ranges)

    def report(self, r: CorruptRange) -> bool:
        """Record a corrupt range; True if it was not known. Logs ERROR once per range."""
        if r.start in self._ranges:
            return False
        if len(self._ranges) >= self.max_ranges:
            raise CorruptData(r.start, f"more than {self.max_ranges} corrupt ranges; the store is not usable")
        self._ranges[r.start] = r
        bisect.insort(self._starts, r.start)
        self.found_total += 1
        log.error("corrupt record in %s at offset %d (+%d bytes, index %s): %s; expected crc %s, actual %s "
                  "(found by %s); not served until repaired", r.path, r.start, r.end - r.start, r.index,
                  r.reason, _hex(r.expected_crc), _hex(r.actual_crc), r.found_by,
                  extra={"corrupt_file": r.path, "corrupt_offset": r.start, "corrupt_end": r.end,
                         "expected_crc": r.expected_crc, "actual_crc": r.actual_crc, "found_by": r.found_by})
        for fn in self.listeners:
            fn(r)
        return True

    def _remove(self, start: int) -> CorruptRange | None:
        r = self._ranges.pop(start, None)
        if r is not None:
            del self._starts[bisect.bisect_left(self._starts, start)]
        return r

    def clear(self, start: int, how: str) -> None:
        r = self._remove(start)
        if r is None:
            return
        self.repaired_total += 1
        log.info("corrupt range in %s at offset %d (+%d bytes, index %s) repaired: %s", r.path, r.start,
                 r.end - r.start, r.index, how)

    def forget(self, start: int, why: str) -> None:
        """A range whose bytes are gone unrepaired (its file deleted): dropped, not counted as
        repaired; logged once."""
        r = self._remove(start)
        if r is None:
            return
        log.warning("corrupt range in %s at offset %d (+%d bytes, index %s) dropped unrepaired: %s", r.path,
                    r.start, r.end - r.start, r.index, why)

    def overlapping(self, lo: int, hi: int) -> CorruptRange | None:
        """The first known range that intersects [lo, hi), if any (O(log n); free when empty)."""
        if not self._starts:
            return None
        i = bisect.bisect_right(self._starts, lo) - 1
        if i >= 0 and self._ranges[self._starts[i]].end > lo:
            return self._ranges[self._starts[i]]
        if i + 1 < len(self._starts) and self._starts[i + 1] < hi:
            return self._ranges[self._starts[i + 1]]
        return None

    def first_at_or_after(self, pos: int) -> CorruptRange | None:
        i = bisect.bisect_left(self._starts, pos)
        return self._ranges[self._starts[i]] if i < len(self._starts) else None

    def ranges(self) -> list[CorruptRange]:
        return [self._ranges[s] for s in self._starts]

    def as_list(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.ranges()]

    def check(self, lo: int, hi: int) -> None:
        """Raise CorruptData if [lo, hi) touches a known corrupt range."""
        r = self.overlapping(lo, hi)
        if r is not None:
            raise CorruptData(lo, f"overlaps the corrupt range {r.start}..{r.end} in {r.path} "
                                  f"({r.reason}); not served until repaired")


def _hex(v: int | None) -> str:
    return "-" if v is None else f"{v:#010x}"


# --- commitlog records (standalone and classic) ------------------------------------------------
def commitlog_record_damage(commitlog: Any, phys: int, found_by: str) -> CorruptRange | None:
    """Describe what is wrong with the commitlog record at `phys` (None: it is intact).

    Reads the record's bytes once, checks framing and BODYCRC and names the file and CRCs."""
    seg_size = commitlog.segment_size
    seg = commitlog.files.segment_for(phys)
    path = seg.path if seg is not None else commitlog.directory
    seg_end = phys - phys % seg_size + seg_size
    head = commitlog.files.read(phys, _HEADER.size)
    if len(head) < _HEADER.size:
        return CorruptRange(path, phys, seg_end, None, None, found_by, "record header cut short")
    total = int.from_bytes(head[0:4], "big", signed=True)
    if total < L.MESSAGE_OVERHEAD or total + _MIN_BLANK > seg_end - phys:
        return CorruptRange(path, phys, seg_end, None, None, found_by, f"bad total size {total}")
    data = commitlog.files.read(phys, total)
    return _record_damage(data, 0, phys, seg_end, path, found_by)


def _record_damage(buf: bytes | memoryview, i: int, at: int, seg_end: int, path: str,
                   found_by: str) -> CorruptRange | None:
    total = int.from_bytes(buf[i:i + 4], "big", signed=True)
    if i + total > len(buf):
        return CorruptRange(path, at, seg_end, None, None, found_by, f"record of {total} bytes runs past the data")
    problem = record_problem(buf, i, at, seg_end - at, check_crc=False)
    if problem is not None:
        return CorruptRange(path, at, seg_end, None, None, found_by, problem)
    expected = int.from_bytes(buf[i + _BODY_CRC_AT:i + _BODY_CRC_AT + 4], "big")
    body_len = int.from_bytes(buf[i + _BODY_LEN_AT:i + _BODY_LEN_AT + 4], "big", signed=True)
    body_at = i + _HEADER.size
    actual = _crc32(buf[body_at:body_at + body_len])
    if actual != expected:
        return CorruptRange(path, at, at + total, expected, actual, found_by, "body crc mismatch")
    return None


class ScrubSource(Protocol):
    """What the scrubber walks: one log's committed bytes."""

    def bounds(self) -> tuple[int, int]:
        """[first retained position, committed position)."""

    def verify(self, position: int, max_bytes: int) -> tuple[int, list[CorruptRange]]:
        """Check whole records from `position` (about max_bytes); return (next position, damage)."""


class CommitLogSource:
    """Scrubs a CommitLog's committed records (standalone LocalLog and classic HALog)."""

    def __init__(self, rlog: Any):
        self.rlog = rlog
        self.commitlog = rlog.commitlog

    def bounds(self) -> tuple[int, int]:
        return self.commitlog.min_offset, self.rlog.committed_position

    def verify(self, position: int, max_bytes: int) -> tuple[int, list[CorruptRange]]:
        cl = self.commitlog
        seg_size = cl.segment_size
        seg_end = position - position % seg_size + seg_size
        stop = min(self.rlog.committed_position, seg_end)
        seg = cl.files.segment_for(position)
        if seg is None or position >= stop:   # file gone (retention) or the committed end moved back
            return (seg_end if seg is None else max(position + 1, stop)), []
        buf = cl.files.read(position, min(stop - position, max_bytes))
        out: list[CorruptRange] = []
        i = 0
        while i + _MIN_BLANK <= len(buf):
            total, magic = _BLANK.unpack_from(buf, i)
            at = position + i
            if magic == L.BLANK_MAGIC:
                return seg_end, out
            if magic != L.MESSAGE_MAGIC or total < L.MESSAGE_OVERHEAD or total + _MIN_BLANK > seg_end - at:
                # The framing is gone: nothing after this point in the file can be located.
                out.append(CorruptRange(seg.path, at, seg_end, None, None, "scrub",
                                        f"bad magic {magic:#x} or size {total}"))
                return seg_end, out
            if i + total > len(buf):
                if i == 0 and len(buf) < total:   # one record larger than the step: read it whole
                    buf = cl.files.read(at, total)
                    if len(buf) == total:
                        continue
                break
            damage = _record_damage(buf, i, at, seg_end, seg.path, "scrub")
            if damage is not None:
                out.append(damage)
                if damage.end == seg_end and damage.expected_crc is None:
                    return seg_end, out
            i += total
        if i == 0:   # nothing whole in what was read (cannot happen below the committed end)
            out.append(CorruptRange(seg.path, position, seg_end, None, None, "scrub", "no whole record here"))
            return seg_end, out
        return position + i, out


class Scrubber:
    """Walks a log's committed bytes at a bounded rate, every interval, reporting damage.

    One step reads at most SCRUB_STEP_BYTES and checks them on the event loop (about a
    millisecond), then sleeps so the average rate stays at `rate_mb_per_s`."""

    def __init__(self, source: ScrubSource, registry: CorruptionRegistry, interval_ms: int, rate_mb_per_s: float,
                 step_bytes: int = SCRUB_STEP_BYTES, clock: Callable[[], float] = time.monotonic):
        assert interval_ms >= 1 and rate_mb_per_s > 0 and step_bytes > 0
        self.source = source
        self.registry = registry
        self.interval_s = interval_ms / 1000.0
        self.rate_bytes_per_s = rate_mb_per_s * 1024 * 1024
        self.step_bytes = step_bytes
        self.clock = clock
        self.passes = 0             # completed passes (tests, status)
        self.bytes_checked = 0
        self.position: int | None = None

    def scrub_pass(self) -> list[CorruptRange]:
        """One whole pass without sleeping (tests and tools); returns the new damage found."""
        found: list[CorruptRange] = []
        lo, hi = self.source.bounds()
        pos = lo
        for _ in range(1 << 30):   # bounded by the log's size / step; the guard is for bugs
            if pos >= hi:
                break
            pos, new = self._step(pos)
            found.extend(new)
            hi = self.source.bounds()[1]
        self.passes += 1
        return found

    def _step(self, pos: int) -> tuple[int, list[CorruptRange]]:
        nxt, damage = self.source.verify(pos, self.step_bytes)
        assert nxt > pos, f"scrubber made no progress at {pos}"
        self.bytes_checked += nxt - pos
        return nxt, [d for d in damage if self.registry.report(d)]

    async def run(self) -> None:
        """Forever: wait an interval, walk the committed log at the rate limit."""
        while True:
            await asyncio.sleep(self.interval_s)
            lo, hi = self.source.bounds()
            pos = lo
            while pos < hi:
                t0, start = self.clock(), pos
                try:
                    nxt, _ = self._step(pos)
                except (KeyError, OSError, ValueError) as e:   # a file expired or was cut under us
                    log.warning("scrubber: pass stopped at %d (%s); next pass in %.0f s", pos, e, self.interval_s)
                    break
                self.position = pos = nxt
                spent = self.clock() - t0
                await asyncio.sleep(max(0.0, (nxt - start) / self.rate_bytes_per_s - spent))
                lo2, hi = self.source.bounds()
                pos = max(pos, lo2)
            else:
                self.passes += 1


def scrubber_for(rlog: Any, registry: CorruptionRegistry, interval_ms: int, rate_mb: float) -> Scrubber | None:
    """The scrubber for a node's log: the log's own source (DLedger) or its commitlog's."""
    make = getattr(rlog, "scrub_source", None)
    if make is not None:
        source = make()
    elif getattr(rlog, "commitlog", None) is not None:
        source = CommitLogSource(rlog)
    else:
        return None
    return Scrubber(source, registry, interval_ms, rate_mb)


def report_read_failure(rlog: Any, registry: CorruptionRegistry, phys: int, err: CorruptRecord) -> CorruptData:
    """A read of the record at `phys` failed its checks: register it, return the error to raise."""
    if isinstance(err, CorruptData):
        return err
    commitlog = getattr(rlog, "commitlog", None)
    damage = None
    if commitlog is not None:
        try:
            damage = commitlog_record_damage(commitlog, phys, "read")
        except (KeyError, OSError) as e:
            damage = CorruptRange(commitlog.directory, phys, phys + 1, None, None, "read", f"{err.reason} ({e})")
    if damage is not None:
        registry.report(damage)
    return CorruptData(phys, f"{err.reason}; the record is not served (see the node's log and /health)")


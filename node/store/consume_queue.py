"""Consume queues: per (topic, queue id), the 20-byte units that point into the commitlog.

A `ConsumeQueue` is a `SegmentedFile` under `consumequeue/<topic>/<queueId>/` whose
byte offset is `queue_offset * 20` (RocketMQ names its CQ files by that byte offset
too). Units are derived data: the dispatcher writes them from the committed log
and can always write them again, so

- `put_units` is idempotent: units already on disk are compared, not rewritten
  (a unit that differs was torn by a crash; the log wins and we repair it loudly);
- recovery only has to find where the valid units end (the first unit whose size
  is <= 0 or whose offset is negative; all-zero sparse space ends it too);
- a queue that starts at a non-zero offset (its head expired from the commitlog
  before we built it) has the head of its first file filled with blank units,
  like RocketMQ's fillPreBlank, so every file stays addressable by offset.

`ConsumeQueueStore` owns every queue of one store root.
"""

from __future__ import annotations

import logging
import os
import sys
from array import array
from typing import Callable, Iterator

from node.store import layout as L
from node.store.fileio import FileSystem, ShortWrite
from node.store.reaper import run_or_hand_over
from node.store.segment import SegmentedFile, TailCut

log = logging.getLogger(__name__)

UNIT = L.CQ_UNIT
UNIT_SIZE = L.CQ_UNIT.size
# RocketMQ's pre-blank unit: offset 0, size Integer.MAX_VALUE, tags 0. Valid to recovery
# (size > 0), never served (it lies below min_offset).
BLANK_SIZE = 0x7FFFFFFF
BLANK_UNIT = UNIT.pack(0, BLANK_SIZE, 0)
RECOVER_LAST_FILES = 3          # like RocketMQ: earlier files are full and trusted
DELETED_PREFIX = ".deleted-"    # a deleted topic's queue set aside until removed (no topic name has a dot)
_INTS_PER_UNIT = UNIT_SIZE // 4
assert UNIT_SIZE % 4 == 0
assert array("i").itemsize == 4

Unit = tuple[int, int, int]     # (commitlog_offset, size, tags_code)


def count_valid_units(data: bytes) -> int:
    """Number of leading valid units in `data` (offset >= 0 and size > 0).

    The common case, a full file of valid units, is decided by C-level min() over
    the size and offset-high columns; only a file with an end in it pays a Python loop.
    """
    n = len(data) // UNIT_SIZE
    if n == 0:
        return 0
    ints = array("i")
    ints.frombytes(data[:n * UNIT_SIZE])
    if sys.byteorder == "little":
        ints.byteswap()
    offset_hi = ints[0::_INTS_PER_UNIT]     # sign of the 8-byte commitlog offset
    sizes = ints[2::_INTS_PER_UNIT]
    if min(sizes) > 0 and min(offset_hi) >= 0:
        return n
    for i in range(n):
        if sizes[i] <= 0 or offset_hi[i] < 0:
            return i
    raise AssertionError("unreachable: min() found an invalid unit")


def _bsearch(lo: int, hi: int, pred: Callable[[int], bool]) -> int:
    """First i in [lo, hi) with pred(i) true (pred monotonic false..true); hi if none."""
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


class ConsumeQueue:
    """One topic/queue: units at `queue_offset * 20`."""

    def __init__(self, fs: FileSystem, store_root: str, topic: str, queue_id: int,
                 units_per_file: int = L.CQ_UNITS_PER_FILE):
        assert units_per_file > 0
        assert queue_id >= 0
        self.fs = fs
        self.topic = topic
        self.queue_id = queue_id
        self.units_per_file = units_per_file
        self.directory = os.path.join(store_root, "consumequeue", topic, str(queue_id))
        self.file = SegmentedFile(fs, self.directory, units_per_file * UNIT_SIZE)
        self._min = 0           # first servable queue offset; only rises (expiry, blanks)
        self.repaired_units = 0  # units a re-put found different on disk (torn by a crash)

    # --- geometry -----------------------------------------------------------------------
    @property
    def min_offset(self) -> int:
        return self._min

    @property
    def max_offset(self) -> int:
        """The next queue offset to write (RocketMQ's maxOffsetInQueue)."""
        if not self.file.segments:
            return self._min
        return max(self._min, self.file.end // UNIT_SIZE)

    @property
    def is_empty(self) -> bool:
        return self.max_offset <= self._min

    # --- reads --------------------------------------------------------------------------
    def _unit_at(self, queue_offset: int) -> Unit:
        raw = self.file.read(queue_offset * UNIT_SIZE, UNIT_SIZE)
        assert len(raw) == UNIT_SIZE, f"unit {queue_offset} of {self.directory} is outside the files"
        return UNIT.unpack(raw)

    def get(self, queue_offset: int) -> Unit | None:
        """(commitlog_offset, size, tags_code) at `queue_offset`; None outside [min, max)."""
        if not self._min <= queue_offset < self.max_offset:
            return None
        return self._unit_at(queue_offset)

    def get_range(self, start: int, max_units: int) -> list[Unit]:
        """Up to `max_units` units from `start`, stopping at the end of its file (one pread)."""
        assert max_units >= 0
        end = self.max_offset
        if not self._min <= start < end or max_units == 0:
            return []
        n = min(max_units, end - start)
        raw = self.file.read(start * UNIT_SIZE, n * UNIT_SIZE)   # never crosses a segment
        usable = len(raw) - len(raw) % UNIT_SIZE
        return list(UNIT.iter_unpack(raw[:usable]))

    # --- writes -------------------------------------------------------------------------
    def put(self, queue_offset: int, commitlog_offset: int, size: int, tags_code: int) -> None:
        assert commitlog_offset >= 0
        assert size > 0
        self.put_units(queue_offset, UNIT.pack(commitlog_offset, size, tags_code))

    def put_units(self, first_queue_offset: int, data: bytes | bytearray) -> None:
        """Write consecutive packed units starting at `first_queue_offset`.

        Units below min_offset are dropped (expired or blank head); units already
        on disk are compared (idempotent re-dispatch); the rest are appended with
        one pwrite per file touched.
        """
        assert len(data) % UNIT_SIZE == 0, "put_units takes whole units"
        assert first_queue_offset >= 0
        view = memoryview(data)
        first = first_queue_offset
        if first < self._min:
            skip = min(len(view) // UNIT_SIZE, self._min - first)
            view = view[skip * UNIT_SIZE:]
            first += skip
        if not view:
            return
        end = self.max_offset
        if first < end:
            overlap = min(len(view) // UNIT_SIZE, end - first)
            self._reconcile(first, view[:overlap * UNIT_SIZE])
            view = view[overlap * UNIT_SIZE:]
            first += overlap
            if not view:
                return
        if first > end:
            # A gap is our bug (the log hands out consecutive queue offsets), except
            # for an empty queue that starts where the commitlog's retained head starts.
            assert self.is_empty, (f"{self.directory}: gap in queue offsets: put at {first}, "
                                   f"next expected {end}")
            self._start_at(first)
        self._append(first, view)

    def _reconcile(self, first: int, view: memoryview) -> None:
        """Compare units already on disk with what the log says; repair a difference."""
        pos = first * UNIT_SIZE
        done = 0
        while done < len(view):
            seg = self.file.segment_for(pos + done)
            assert seg is not None
            rel = pos + done - seg.base
            n = min(len(view) - done, seg.capacity - rel)
            want = view[done:done + n]
            have = seg.handle.pread(n, rel)
            if have != want:
                bad = sum(1 for i in range(0, n, UNIT_SIZE) if have[i:i + UNIT_SIZE] != want[i:i + UNIT_SIZE])
                self.repaired_units += bad
                log.warning("%s: %d unit(s) at queue offset %d differ from the log; rewriting them "
                            "(a torn write from a crash)", self.directory, bad, (pos + done) // UNIT_SIZE)
                seg.handle.pwrite(want, rel)
                self.file.mark_unflushed(pos + done)
            done += n

    def _append(self, first: int, view: memoryview) -> None:
        pos = first * UNIT_SIZE
        while view:
            seg = self.file.ensure_writable(pos)
            assert seg.end == pos, f"{self.directory}: append at {pos}, file end {seg.end}"
            n = min(len(view), seg.remaining)
            try:
                seg.append(view[:n])
            except ShortWrite:
                # A full disk took part of the write: cut back to the last whole write so the
                # file never ends in a torn unit, and the retry (dispatch again) appends here.
                self.file.truncate(pos)
                raise
            view = view[n:]
            pos += n

    def _start_at(self, queue_offset: int) -> None:
        """Empty queue starting at a non-zero offset: fresh file, head filled with blanks."""
        base = self.file.first_file_start(queue_offset * UNIT_SIZE)
        self.fs.makedirs(self.directory)
        # Its names are made durable by the next flush (a directory fsync here stalled the
        # dispatch on the event loop for 1.5 s after a DLedger reset, on a slow disk).
        self.file.reset_to(base, names_now=False)
        blanks = queue_offset - base // UNIT_SIZE
        if blanks:
            self._append(base // UNIT_SIZE, memoryview(BLANK_UNIT * blanks))
        self._min = queue_offset
        log.info("%s: starts at queue offset %d (%d blank units before it)", self.directory,
                 queue_offset, blanks)

    # --- recovery, truncation, expiry ----------------------------------------------------
    def load(self) -> None:
        self.file.load()

    def recover(self) -> int:
        """Load, find the end of the valid units, cut any garbage past it; return max_offset."""
        if not self.file.segments:
            self.load()
        segs = self.file.segments
        if not segs:
            return self.max_offset
        end, dirty = segs[-1].base + segs[-1].capacity, False
        for seg in segs[max(0, len(segs) - RECOVER_LAST_FILES):]:
            # Only the part ever written: a file is created sparse at its full size (6 MB by
            # default), and reading all of it for each of a few thousand queues took 50 s.
            data = seg.handle.pread(seg.handle.data_end(seg.capacity), 0)
            valid = count_valid_units(data)
            if valid * UNIT_SIZE < seg.capacity:
                end = seg.base + valid * UNIT_SIZE
                dirty = bool(data[valid * UNIT_SIZE:].strip(b"\0")) or seg is not segs[-1]
                break
        if dirty:
            report = self.file.truncate(end)
            log.warning("%s: recovery cut garbage after queue offset %d (%d bytes zeroed, files removed: %s)",
                        self.directory, end // UNIT_SIZE, report.zeroed_bytes, report.removed_files)
        self.file.set_end(end)
        self._min = self._first_real_unit()
        return self.max_offset

    def _first_real_unit(self) -> int:
        """First non-blank unit of the first file (blanks are only ever a head prefix)."""
        lo = self.file.start // UNIT_SIZE
        hi = min(self.file.end // UNIT_SIZE, lo + self.units_per_file)
        return _bsearch(lo, hi, lambda i: self._unit_at(i)[1] != BLANK_SIZE)

    def truncate_past_physical(self, end_phys: int) -> int:
        """Durably drop units pointing at or past `end_phys` (the log's tail was cut)."""
        n, tail = self.detach_past_physical(end_phys)
        if tail is not None:
            tail.make_durable()
        return n

    def detach_past_physical(self, end_phys: int) -> tuple[int, TailCut | None]:
        """truncate_past_physical's cut, made in memory: no unit at or past `end_phys` is read
        from here on. The file work is the returned cut's `make_durable` (a worker thread may
        run it); no unit may be put before it ran. Returns the units dropped and the cut."""
        end = self.max_offset
        cut = _bsearch(self._min, end, lambda i: self._unit_at(i)[0] >= end_phys)
        if cut >= end:
            return 0, None
        tail = self.file.detach_tail(cut * UNIT_SIZE)
        log.warning("%s: dropped units [%d, %d) pointing at or past commitlog offset %d",
                    self.directory, cut, end, end_phys)
        return end - cut, tail

    def delete_expired(self, min_phys: int) -> int:
        """Delete whole files whose last unit is below `min_phys`; raise min_offset to match.
        Never waits for a flush of this queue in progress (it runs on the event loop): the
        files it holds go at the next pass, and min_offset is raised at once all the same."""
        upto = None
        for seg in self.file.segments[:-1]:   # never the last file (RocketMQ)
            last = seg.base // UNIT_SIZE + self.units_per_file - 1
            if self._unit_at(last)[0] >= min_phys:
                break
            upto = seg.base + seg.capacity
        removed = len(self.file.delete_head(upto, wait=False)) if upto is not None else 0
        self._correct_min_offset(min_phys)
        if removed:
            log.info("%s: deleted %d expired file(s); min offset now %d", self.directory, removed, self._min)
        return removed

    def _correct_min_offset(self, min_phys: int) -> None:
        """min_offset = first real unit at or past min_phys (never lowered). Blank units are
        only a restarted queue's head, so liveness is monotonic over the queue. Not only the
        first file: expired files a flush held are still there (delete_expired)."""
        if not self.file.segments:
            return
        lo = max(self._min, self.file.start // UNIT_SIZE)
        hi = self.max_offset
        first = _bsearch(lo, hi, lambda i: self._is_live(i, min_phys))
        self._min = max(self._min, first)

    def _is_live(self, queue_offset: int, min_phys: int) -> bool:
        off, size, _ = self._unit_at(queue_offset)
        return size != BLANK_SIZE and off >= min_phys

    def flush(self) -> int:
        """fsync unflushed units (StoreFatal on error); return the flushed byte offset."""
        return self.file.flush()

    def close(self) -> None:
        self.file.close()


class ConsumeQueueStore:
    """Every consume queue under `<store_root>/consumequeue/`."""

    def __init__(self, fs: FileSystem, store_root: str, units_per_file: int = L.CQ_UNITS_PER_FILE):
        self.fs = fs
        self.store_root = store_root
        self.units_per_file = units_per_file
        self.directory = os.path.join(store_root, "consumequeue")
        self._queues: dict[tuple[str, int], ConsumeQueue] = {}
        self._aside_count = 0       # deleted topics' queues set aside this run (remove_topic)

    def find_or_create(self, topic: str, queue_id: int) -> ConsumeQueue:
        key = (topic, queue_id)
        cq = self._queues.get(key)
        if cq is None:
            cq = ConsumeQueue(self.fs, self.store_root, topic, queue_id, self.units_per_file)
            self._queues[key] = cq
        return cq

    def get(self, topic: str, queue_id: int) -> ConsumeQueue | None:
        return self._queues.get((topic, queue_id))

    def queues(self) -> list[ConsumeQueue]:
        return list(self._queues.values())

    def __iter__(self) -> Iterator[ConsumeQueue]:
        return iter(list(self._queues.values()))

    def load_all(self) -> int:
        """Open every `consumequeue/<topic>/<queueId>/` on disk; return how many. A deleted
        topic's queue a crash left set aside (`.deleted-*`, remove_topic) is removed."""
        for topic in self.fs.listdir(self.directory):
            if topic.startswith(DELETED_PREFIX):
                log.warning("removing %s: a deleted topic's consume queue", os.path.join(self.directory, topic))
                self.fs.rmtree(os.path.join(self.directory, topic))
                continue
            for qdir in self.fs.listdir(os.path.join(self.directory, topic)):
                if not qdir.isdigit():
                    log.warning("ignoring %s: not a queue id", os.path.join(self.directory, topic, qdir))
                    continue
                cq = self.find_or_create(topic, int(qdir))
                if not cq.file.segments:
                    cq.load()
        return len(self._queues)

    def recover_all(self) -> dict[tuple[str, int], int]:
        self.load_all()
        return {key: cq.recover() for key, cq in self._queues.items()}

    def max_offsets(self) -> dict[tuple[str, int], int]:
        return {key: cq.max_offset for key, cq in self._queues.items()}

    def truncate_past_physical(self, end_phys: int) -> int:
        return sum(cq.truncate_past_physical(end_phys) for cq in self._queues.values())

    def detach_past_physical(self, end_phys: int) -> tuple[int, list[TailCut]]:
        """Every queue's `detach_past_physical`: the units dropped, and the cuts to make durable."""
        dropped, tails = 0, []
        for cq in self._queues.values():
            n, tail = cq.detach_past_physical(end_phys)
            dropped += n
            if tail is not None:
                tails.append(tail)
        return dropped, tails

    def delete_expired(self, min_phys: int) -> int:
        return sum(cq.delete_expired(min_phys) for cq in self._queues.values())

    def remove_topic(self, topic: str, below_phys: int) -> list[int]:
        """A deleted topic (RocketMQ destroyLogics): drop its units pointing below `below_phys`,
        the commitlog position of the deletion. A queue whose units all lie below it is closed
        and its directory removed; one that also holds later units (the topic was created again
        and written before this ran, e.g. in one re-dispatched batch) keeps those and has its
        head raised past the old ones. Returns the ids of the queues removed whole.

        On the loop a removed queue leaves the set and its directory is renamed aside (one
        rename, no fsync), so the name is free for the topic at once; the reaper's thread
        closes its files (after a flush in progress) and removes them, and the next start
        removes what a crash left aside (load_all)."""
        removed: list[int] = []
        aside: list[tuple[ConsumeQueue, str]] = []
        for (t, qid), cq in sorted(self._queues.items()):
            if t != topic:
                continue
            last = cq.get(cq.max_offset - 1) if not cq.is_empty else None
            if last is None or last[0] < below_phys:
                del self._queues[(t, qid)]
                cq.file.doom()
                if self.fs.exists(cq.directory):
                    self._aside_count += 1
                    dest = os.path.join(self.directory, f"{DELETED_PREFIX}{topic}-{qid}-{self._aside_count}")
                    self.fs.rename(cq.directory, dest)
                    aside.append((cq, dest))
                else:
                    aside.append((cq, ""))
                removed.append(qid)
            else:
                cq.delete_expired(below_phys)
        topic_dir = os.path.join(self.directory, topic)
        if self.fs.exists(topic_dir) and not self.fs.listdir(topic_dir):
            self.fs.rmtree(topic_dir)      # empty: one rmdir
        if aside:
            run_or_hand_over(self.fs.reaper, lambda: self._destroy(aside))
        if removed:
            log.info("consume queues of deleted topic %s removed: queues %s", topic, removed)
        return removed

    def _destroy(self, aside: list[tuple["ConsumeQueue", str]]) -> None:
        """remove_topic's file work, on the reaper's thread (or here without one)."""
        on_reaper = self.fs.reaper is not None
        for cq, path in aside:
            cq.file.close(drain=not on_reaper)
            if path:
                self.fs.rmtree(path)
        if self.fs.exists(self.directory):
            self.fs.fsync_dir(self.directory)

    def flush_all(self) -> None:
        """fsync every queue. May run on a worker thread while the loop adds queues, appends
        units and closes queues (each SegmentedFile locks its flush against closing)."""
        for cq in list(self._queues.values()):
            cq.flush()

    def close(self) -> None:
        for cq in self._queues.values():
            cq.close()

"""Fixed-size segment files named by the 20-digit offset of their first byte.

`Segment` is one file; `SegmentedFile` is the ordered list of them (RocketMQ's
MappedFileQueue): append at the end, roll when full, read anywhere, flush,
truncate (durably), delete from the head. What a record looks like, and how the
end of a file is padded, belongs to the log built on top (commitlog, DLedger
data, consume queue), not here.

Files are created at full size (sparse) like RocketMQ's mapped files, so the end
of the data in the last file is found by the owner's recovery scan, and a
truncation zeroes the bytes it removes before it returns (by cutting the file
down and growing it back, so the removed range becomes a hole: no writes, however
much of a 1 GiB file it covers).
"""

from __future__ import annotations

import bisect
import collections
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass

from node.store import cold_reads
from node.store.errors import StoreFatal
from node.store.fileio import DeferredDirSync, FileHandle, FileSystem, ShortWrite
from node.store.reaper import CLOSE_DRAIN_S, run_or_hand_over

NAME_DIGITS = 20
ORPHAN_SUFFIX = ".orphan"   # a file after a gap in the names, set aside at load

log = logging.getLogger(__name__)


def segment_name(base: int) -> str:
    return f"{base:0{NAME_DIGITS}d}"


class Segment:
    """One fixed-size file: [base, base + capacity)."""

    __slots__ = ("base", "capacity", "path", "handle", "write_pos")

    def __init__(self, base: int, capacity: int, path: str, handle: FileHandle):
        self.base = base
        self.capacity = capacity
        self.path = path
        self.handle = handle
        self.write_pos = 0      # bytes of data from the start of this file

    @property
    def end(self) -> int:
        return self.base + self.write_pos

    @property
    def remaining(self) -> int:
        return self.capacity - self.write_pos

    def append(self, data: bytes | memoryview) -> int:
        """Write at the end; return the absolute offset written at.

        On a short write the bytes that did land count as written (write_pos moves past
        them) before the error propagates, so the owner's truncate back to its batch start
        clears them; write_pos never lags behind what the file holds."""
        assert len(data) <= self.remaining, "caller must roll before a write that does not fit"
        at = self.base + self.write_pos
        try:
            self.handle.pwrite(data, self.write_pos)
        except ShortWrite as e:
            self.write_pos += max(0, min(e.written, len(data)))
            raise
        self.write_pos += len(data)
        return at

    def read(self, offset: int, size: int) -> bytes:
        """Up to `size` bytes at `offset` within the file (past the data end too: recovery
        scans there); b"" at or past the file end or for a size <= 0."""
        rel = offset - self.base
        assert 0 <= rel <= self.capacity
        n = min(size, self.capacity - rel)
        return self.handle.pread(n, rel) if n > 0 else b""


@dataclass
class TruncateReport:
    offset: int            # new end
    zeroed_bytes: int      # bytes cleared in the file that now holds the end
    removed_files: list[str]


@dataclass
class TailCut:
    """A cut `SegmentedFile.detach_tail` made in the set, its file work still to do."""
    file: SegmentedFile
    offset: int
    kept: Segment | None           # the segment now holding the end (its write_pos is the cut)
    detached: list[Segment]        # out of the set, their files still there and open
    zeroed_bytes: int

    def make_durable(self) -> TruncateReport:
        """Zero the kept segment past the cut, remove the detached files, each durable. May
        run on a worker thread; StoreFatal when a truncate or fsync fails."""
        return self.file._make_durable(self)


class SegmentedFile:
    """Ordered segments in one directory, each `segment_size` bytes."""

    def __init__(self, fs: FileSystem, directory: str, segment_size: int):
        assert segment_size > 0
        self.fs = fs
        self.directory = directory
        self.segment_size = segment_size
        self.segments: list[Segment] = []
        self._bases: list[int] = []
        self.flushed = 0       # everything below this offset is durable
        # flush() may run on a worker thread while the owner's loop appends (pwrite beside an
        # fsync is safe). It holds this lock, and whatever closes a segment (truncate,
        # delete_head, reset_to, close) takes it, so no fsync meets a closed descriptor.
        self._io = threading.Lock()
        self._closed = False
        self._doomed = False              # its directory is being removed (doom): a failed flush is no fault
        self._reaped = False              # delete_head gave files to the reaper (close waits for it)
        self._removal_error: OSError | None = None
        self._names = DeferredDirSync(fs, directory)    # an append's new segment: named durable by flush()
        # Old bytes read by cold-read workers for the loop's next try (node/store/cold_reads.py):
        # (generation, offset, bytes, bytes asked, when); a change of old bytes bumps the generation.
        self._fetched: collections.deque[tuple[int, int, bytes, int, float]] = collections.deque()
        self._fetch_lock = threading.Lock()
        self._gen = 0
        # Page-cache pages below this offset were dropped after a flush (cold_reads.RETAIN_BYTES).
        self._uncached = 0
        self._drop_failed = False

    # --- opening ------------------------------------------------------------------------
    def load(self) -> None:
        """Open the segments on disk. Every one is taken as full until the owner sets the end.

        A file longer than a segment, or named off a multiple of it, was written with another
        mappedFileSize: nothing is opened. (Files are created at full size, sparse; a shorter
        one, cut by a crash or by hand, reads as ending early.) Files after a gap in the
        names are a crash's orphans: the crash lost the name before them, which any flush of
        theirs would have made durable first, so none of them held a flushed byte
        (DeferredDirSync). They are renamed `<name>.orphan` (kept, for inspection) and the
        segments end at the gap."""
        self.fs.makedirs(self.directory)
        self._closed = False
        names = [n for n in self.fs.listdir(self.directory) if len(n) == NAME_DIGITS and n.isdigit()]
        off = [n for n in names if int(n) % self.segment_size]
        if off:
            raise StoreFatal(f"{self.directory}: {off[0]} is not a multiple of mappedFileSize ({self.segment_size}); "
                             f"is it the size the store was written with?")
        for i, name in enumerate(names):   # other names (temp files, orphans, foreign files) are not ours
            base = int(name)
            if self.segments and base != self.segments[-1].base + self.segment_size:
                self._set_aside(names[i:], f"segment {segment_name(self.segments[-1].base + self.segment_size)} "
                                           f"is missing")
                break
            path = os.path.join(self.directory, name)
            handle = self.fs.open(path)
            size = handle.size()
            if size > self.segment_size:
                handle.close()
                self.close()
                raise StoreFatal(f"{path}: {size} bytes, longer than mappedFileSize ({self.segment_size}); "
                                 f"is it the size the store was written with?")
            seg = Segment(base, self.segment_size, path, handle)
            seg.write_pos = self.segment_size
            self.segments.append(seg)
            self._bases.append(base)
        self._names = DeferredDirSync(self.fs, self.directory, existing=bool(self.segments))
        # The names found may not be durable yet (a crash just before this start): make them so
        # here, where a start loads its files off the event loop, not at the first new file
        # (DeferredDirSync fsyncs at once for a second new name in a directory with no durable
        # one: a restarted node's first roll before its first flush stalled the loop 805 ms on
        # a slow disk). About 60 us for a directory with nothing to write.
        self._names.sync()
        self.flushed = self.end

    def _set_aside(self, names: list[str], why: str) -> None:
        for name in names:
            path = os.path.join(self.directory, name)
            self.fs.rename(path, path + ORPHAN_SUFFIX)
        self.fs.fsync_dir(self.directory)
        log.warning("%s: %s; %d later file(s) left by a crash, never flushed, set aside as %s: %s",
                    self.directory, why, len(names), ORPHAN_SUFFIX, ", ".join(names))

    def set_end(self, offset: int) -> None:
        """After recovery: data ends at `offset`; later segments must not exist."""
        if not self.segments:
            return
        assert self.segments[0].base <= offset <= self.segments[-1].base + self.segment_size
        for seg in self.segments:
            seg.write_pos = min(self.segment_size, max(0, offset - seg.base))
        self.flushed = offset

    # --- geometry -----------------------------------------------------------------------
    @property
    def start(self) -> int:
        return self.segments[0].base if self.segments else 0

    @property
    def end(self) -> int:
        return self.segments[-1].end if self.segments else 0

    def first_file_start(self, offset: int) -> int:
        """Base of the segment that would hold `offset`."""
        return offset - offset % self.segment_size

    def segment_for(self, offset: int) -> Segment | None:
        i = bisect.bisect_right(self._bases, offset) - 1
        if i < 0:
            return None
        seg = self.segments[i]
        return seg if offset < seg.base + seg.capacity else None

    def last(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def ensure_writable(self, start_offset: int = 0) -> Segment:
        """The segment to append to, creating the first one at the file holding `start_offset`."""
        seg = self.last()
        if seg is None:
            return self._create(self.first_file_start(start_offset), dir_sync_deferred=True)
        if seg.remaining == 0:
            return self._create(seg.base + self.segment_size, dir_sync_deferred=True)
        return seg

    def roll(self) -> Segment:
        """Start the next segment (the owner has padded the current one)."""
        seg = self.last()
        assert seg is not None and seg.remaining == 0
        return self._create(seg.base + self.segment_size, dir_sync_deferred=True)

    def _create(self, base: int, dir_sync_deferred: bool = False) -> Segment:
        """A new last segment. Its directory entry is fsynced here, or, for an append
        (`dir_sync_deferred`), by the next flush() (DeferredDirSync). Where writes must not
        wait, an append whose new file would fsync the directory at once raises DiskWait
        first, before it creates anything (DeferredDirSync.off_loop_first)."""
        if dir_sync_deferred:
            self._names.off_loop_first()
        self.fs.makedirs(self.directory)
        path = os.path.join(self.directory, segment_name(base))
        handle = self.fs.open(path)
        handle.truncate(self.segment_size)  # sparse, full size
        seg = Segment(base, self.segment_size, path, handle)
        self._names.created(defer=dir_sync_deferred)    # before the segment counts toward `end`
        if not self.segments:
            self.flushed = base
        self.segments.append(seg)
        self._bases.append(base)
        return seg

    # --- IO -----------------------------------------------------------------------------
    def read(self, offset: int, size: int) -> bytes:
        """Up to `size` bytes of data at `offset`, never crossing a segment boundary nor the
        data end; b"" where there is no data (before the first file, past the end).

        Where reads must not wait (node/store/cold_reads.py), bytes more than HOT_BYTES behind
        the data end come from this file's fetched slots, or raise DiskWait whose `fetch`
        reads them there (on a worker)."""
        if not cold_reads.must_not_wait() or offset >= self.end - cold_reads.HOT_BYTES:
            return self._read(offset, size)
        got = self._from_fetched(offset, size)
        if got is not None:
            return got
        e = cold_reads.DiskWait(f"{size} bytes at {offset} in {self.directory} are old: read off the loop")
        e.fetch = functools.partial(self._fetch, offset, size)
        raise e

    def _from_fetched(self, offset: int, size: int) -> bytes | None:
        with self._fetch_lock:
            fetched, expired = self._fetched, time.monotonic() - cold_reads.FETCH_SLOT_TTL_S
            while fetched and fetched[0][4] < expired:
                fetched.popleft()
            for gen, start, data, asked, _at in fetched:
                # offset inside the slot: a read that starts where a cut slot ends starts in
                # the next file, or past the data end, which a plain read decides.
                if gen != self._gen or not start <= offset < start + len(data):
                    continue
                rel, stop = offset - start, start + len(data)
                if offset + size <= stop or (len(data) < asked and stop % self.segment_size == 0):
                    # Whole, or cut at a file's end, where _read cuts it too (not at the data end
                    # of then: appends may have moved it since).
                    return data[rel:rel + size]
        return None

    def _fetch(self, offset: int, size: int) -> None:
        """On a cold-read worker: read at least FETCH_BYTES from `offset`, and for a larger read
        as much again up to FETCH_AHEAD_MAX (a catch-up's next batch), within one segment's
        data, into a fetched slot. Under the lock that whatever closes a segment takes (the
        loop may expire or cut files meanwhile); a flush's fsync holds it too, so a fetch may
        wait for one, on the worker."""
        asked = max(min(2 * size, size + cold_reads.FETCH_AHEAD_MAX), cold_reads.FETCH_BYTES)
        with self._io:
            if self._closed:
                return
            gen, data = self._gen, self._read(offset, asked)
        with self._fetch_lock:
            if gen == self._gen:
                fetched = self._fetched
                fetched.append((gen, offset, data, asked, time.monotonic()))
                held = sum(len(f[2]) for f in fetched)
                while len(fetched) > cold_reads.FETCH_SLOTS or (len(fetched) > 1 and held > cold_reads.FETCH_SLOT_BYTES):
                    held -= len(fetched.popleft()[2])

    def forget_fetched(self) -> None:
        """Bytes a fetch may hold were cut, deleted or rewritten in place: drop every fetched
        slot (whoever writes over old bytes outside this class calls it too)."""
        with self._fetch_lock:
            self._gen += 1
            self._fetched.clear()

    def _read(self, offset: int, size: int) -> bytes:
        seg = self.segment_for(offset)
        if seg is None:
            return b""
        n = min(size, seg.end - offset)
        return seg.read(offset, n) if n > 0 else b""

    def flush(self) -> int:
        """fsync every segment holding unflushed data; return the new flushed offset.

        An fsync error is fatal: after a failed fsync the kernel may have dropped
        the dirty pages, so retrying could report durability that does not exist.
        """
        with self._io:
            end = self.end
            if self._closed or self.flushed >= end:
                return self.flushed
            i = max(0, bisect.bisect_right(self._bases, self.flushed) - 1)
            try:
                self._names.sync()
                for seg in self.segments[i:]:
                    seg.handle.fsync()
            except OSError as e:
                if self._doomed:
                    return self.flushed
                raise StoreFatal(f"fsync failed in {self.directory}: {e}; stopping (no retry after a failed fsync)") \
                    from e
            self.flushed = end
            self._drop_cached(end)
            return end

    def _drop_cached(self, flushed: int) -> None:
        """Under `_io`, after a flush: drop the page cache of the flushed bytes more than
        cold_reads.RETAIN_BYTES (never less than HOT_BYTES) behind `flushed`, once a step of
        them has gathered (a quarter of the tail, at most DROP_STEP_BYTES). A failure is
        logged once and never raised: the pages then stay, as the kernel decides."""
        keep = cold_reads.RETAIN_BYTES
        if keep <= 0 or self._drop_failed:
            return
        keep = max(keep, cold_reads.HOT_BYTES)
        upto = flushed - keep
        lo = max(self._uncached, self.start)
        if upto - lo < min(cold_reads.DROP_STEP_BYTES, max(1, keep // 4)):
            return
        for seg in self.segments[max(0, bisect.bisect_right(self._bases, lo) - 1):]:
            if seg.base >= upto:
                break
            a, b = max(lo, seg.base), min(upto, seg.base + seg.capacity)
            try:
                seg.handle.drop_cache(a - seg.base, b - a)
            except OSError as e:
                self._drop_failed = True
                log.warning("%s: cannot drop flushed pages from the page cache (%r); keeping them", self.directory, e)
                return
        self._uncached = upto

    def doom(self) -> None:
        """Its directory is about to be renamed aside and removed (a deleted topic's queue): a
        flush in progress or to come, which may find the directory gone, fails quietly."""
        self._doomed = True

    def mark_unflushed(self, offset: int) -> None:
        """Bytes at `offset` were rewritten in place: the next flush fsyncs from there (and
        drops their pages again if they are behind the retained tail)."""
        self.forget_fetched()
        with self._io:
            self.flushed = min(self.flushed, offset)
            self._uncached = min(self._uncached, offset)

    def rewrite(self, offset: int, data: bytes) -> bytes | None:
        """Overwrite bytes already written at `offset`, within one file (an in-place repair),
        fsync that file and return what reads back there; None when no open file holds the
        range any more (cut or reset meanwhile). Under the lock that closing a file takes, as
        a flush is, so it may run on a worker thread. OSError from the write or the fsync."""
        with self._io:
            seg = None if self._closed else self.segment_for(offset)
            if seg is None or offset + len(data) > seg.end:
                return None
            try:
                seg.handle.pwrite(data, offset - seg.base)
                seg.handle.fsync()
            finally:
                self.forget_fetched()      # a cold-read fetch may hold the old bytes
            return self._read(offset, len(data))

    def truncate(self, offset: int) -> TruncateReport:
        """Durably drop every byte at or past `offset` (zeroed, later files deleted)."""
        return self.detach_tail(offset).make_durable()

    def detach_tail(self, offset: int) -> TailCut:
        """truncate's change of the set, with no file work, where the set is read (the event
        loop): the segments past `offset` leave it (their descriptors stay open, for a flush
        or fetch holding them) and the one holding `offset` ends there, so no read goes past
        it from here on. `TailCut.make_durable` (a worker thread may run it) zeroes, fsyncs and
        removes. Nothing may be appended in between: that would write where the cut zeroes."""
        self.forget_fetched()
        detached: list[Segment] = []
        while self.segments and self.segments[-1].base > offset:
            self._bases.pop()           # first: a reader's bisect never indexes past `segments`
            detached.append(self.segments.pop())
        kept = self.last()
        zeroed = 0
        if kept is not None:
            rel = min(kept.capacity, max(0, offset - kept.base))
            # Everything past `rel` may hold data (up to write_pos; up to the whole file when
            # the end is not known yet, write_pos == capacity after load).
            zeroed = max(0, kept.write_pos - rel)
            kept.write_pos = rel
        self.flushed = min(self.flushed, self.end)
        self._uncached = min(self._uncached, self.end)
        return TailCut(self, offset, kept, detached, zeroed)

    def _make_durable(self, cut: TailCut) -> TruncateReport:
        with self._io:
            removed: list[str] = []
            for seg in cut.detached:
                seg.handle.close()
                self.fs.remove(seg.path)
                removed.append(seg.path)
            if cut.kept is not None:
                # Cut the file down to the end and grow it back: the kernel frees those blocks
                # and they read as zeros, at the cost of two metadata updates instead of
                # writing up to a segment of zeros.
                try:
                    cut.kept.handle.truncate(cut.kept.write_pos)
                    cut.kept.handle.truncate(cut.kept.capacity)
                    cut.kept.handle.fsync()
                except OSError as e:
                    raise StoreFatal(f"truncate to {cut.offset} failed in {self.directory}: {e}") from e
            if removed:
                self._names.sync_now(files_remain=bool(self.segments))
            # A flush that ran since the detach counted the old end.
            self.flushed = min(self.flushed, self.end)
            self._uncached = min(self._uncached, self.end)
        return TruncateReport(cut.offset, cut.zeroed_bytes, removed)

    def delete_head(self, upto_offset: int, wait: bool = True) -> list[str]:
        """Delete whole segments that end at or before `upto_offset` (never the last one);
        returns their paths. They leave the file set at once; with the file system's reaper
        (node/store/reaper.py) the files are removed by its thread, else here.

        `wait=False` (an event loop's call): when a flush holds the files (an fsync on a
        worker thread), delete nothing and return [] at once; the caller's next pass takes
        them. A flush holds them for as long as its fsync takes: seconds on a slow disk.

        One file at a time, each removal durable before the next: a crash then leaves the
        oldest files first, never a gap that would make load() take the live files for
        orphans. A removal that failed stops the ones after it (they stay, before the live
        files) and the next call raises StoreFatal, as a failed removal here does."""
        if self._removal_error is not None:
            raise StoreFatal(f"removing old files of {self.directory} failed: {self._removal_error}")
        if not self._io.acquire(blocking=wait):
            return []
        try:
            self.forget_fetched()
            paths: list[str] = []
            while len(self.segments) > 1 and self.segments[0].base + self.segment_size <= upto_offset:
                seg = self.segments.pop(0)
                self._bases.pop(0)
                seg.handle.close()
                paths.append(seg.path)
        finally:
            self._io.release()
        if paths and run_or_hand_over(self.fs.reaper, functools.partial(self._remove_detached, paths,
                                                                         raise_error=self.fs.reaper is None)):
            self._reaped = True
        return paths

    def _remove_detached(self, paths: list[str], raise_error: bool = False) -> None:
        """Remove files `delete_head` took out of the set, in order, each durable before the next.
        A name that is live again (a reset made a file of that name) is left alone."""
        try:
            for path in paths:
                if self._removal_error is not None:
                    return
                with self._io:
                    if not any(seg.path == path for seg in self.segments):
                        self.fs.remove(path)
                self._names.sync_now(files_remain=True)
        except OSError as e:
            self._removal_error = e
            log.error("removing old files of %s failed: %r; the rest stay until the next start", self.directory, e)
            if raise_error:
                raise StoreFatal(f"removing old files of {self.directory} failed: {e}") from e

    def reset_to(self, offset: int, names_now: bool = True) -> None:
        """Drop every segment and restart empty at `offset` (follower reset below leader's first).
        `names_now=False` (derived data: a consume queue): the directory is fsynced by the next
        flush, not here (DeferredDirSync.restarted)."""
        self.commit_reset(self.prepare_reset(offset, names_now), offset)

    def prepare_reset(self, offset: int, names_now: bool = True) -> Segment:
        """reset_to's file work, which may run on a worker thread while readers still use the
        segments: every file of the set removed (the open descriptors keep reading them), the new
        first file created (a fresh file, whatever its name), both durable in the directory
        (with `names_now`). Returns the new segment for `commit_reset`; the set is unchanged
        until then."""
        with self._io:
            paths = [seg.path for seg in self.segments]
        for path in paths:
            self.fs.remove(path)
        base = self.first_file_start(offset)
        self.fs.makedirs(self.directory)
        path = os.path.join(self.directory, segment_name(base))
        handle = self.fs.open(path)
        handle.truncate(self.segment_size)  # sparse, full size
        if names_now:
            self._names.created(defer=True)
            self._names.sync_now(files_remain=True)   # the removals and the new name
        else:
            self._names.restarted()
        seg = Segment(base, self.segment_size, path, handle)
        seg.write_pos = offset - base
        return seg

    def commit_reset(self, seg: Segment, offset: int) -> None:
        """After prepare_reset, where the set is read: the old segments closed, `seg` the set."""
        with self._io:
            self.forget_fetched()
            for old in self.segments:
                old.handle.close()
            self.segments[:] = [seg]
            self._bases[:] = [seg.base]
            self.flushed = self._uncached = offset

    def close(self, drain: bool = True) -> None:
        """Close every segment (after a flush in progress). `drain=False` on the reaper's own
        thread: the removals this file handed it ran before (it runs its jobs in order)."""
        self.forget_fetched()
        if drain and self._reaped and self.fs.reaper is not None and not self.fs.reaper.drain(CLOSE_DRAIN_S):
            log.warning("%s: old files still being removed at close; they stay until the next start",
                        self.directory)
        with self._io:
            self._closed = True
            for seg in self.segments:
                seg.handle.close()

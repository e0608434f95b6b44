"""Message index by key (RocketMQ's IndexFile and IndexService).

An index file is a fixed-size hash table on disk:

    header 40 bytes | hash_slots x 4-byte slot | max_entries x 20-byte entry

A slot holds the number of the newest entry whose key hash falls in it (0 = empty);
each entry holds (key_hash, phy_offset, time_diff seconds, prev_index), so a slot
heads a chain of entries, newest first. Entry numbers start at 1; the header's
index_count is "entries written + 1". Keys are `topic#key`; the hash is
abs(String.hashCode) (0 if abs overflows), like RocketMQ's indexKeyHashMethod.

Different keys can share a hash, so a query returns *candidate* offsets: the caller
reads each message and checks its topic, keys and exact store time. Times are kept
in whole seconds after the file's begin timestamp, so a query matches an entry whose
second overlaps [begin_ms, end_ms] **(ours: RocketMQ compares the floored time and can
miss a message stored in the first second of the range)**.

Performance: the writable file keeps its slot table in memory (RocketMQ mmaps it)
and buffers new entries; `write_pending()` writes the buffered entries with one
pwrite, `flush()` also writes the dirty slot pages and the header, then fsyncs.
Sealed files are read with pread.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import logging
import os
import sys
import threading
from array import array

from node.store import layout as L
from node.store.errors import StoreFatal, is_enospc
from node.store.fileio import DeferredDirSync, FileHandle, FileSystem
from node.store.message import KEY_SEPARATOR, java_string_hash
from node.store.reaper import CLOSE_DRAIN_S, run_or_hand_over

log = logging.getLogger(__name__)

HEADER = L.INDEX_HEADER
SLOT = L.INDEX_SLOT
ENTRY = L.INDEX_ENTRY
_ENTRY_PACK = ENTRY.pack
INT_MAX = 0x7FFFFFFF
_MASK32 = 0xFFFFFFFF
_PAGE_SHIFT = 10
_PAGE_SLOTS = 1 << _PAGE_SHIFT  # 4 KiB of slots: the unit in which dirty slots are written back
NAME_LEN = 17                   # yyyyMMddHHmmssSSS
assert array("i").itemsize == SLOT.size

__all__ = ["IndexFile", "IndexService", "index_key_hash", "file_name_for"]


# Java's hash of an ASCII string is sum(b_i * 31^(n-1-i)): its digits in base 31 would be
# the bytes themselves, but bytes exceed 30. Split each byte b = 31q + r: then
# hash = int(Q + "0", 31) + int(R, 31), where Q and R are the q and r digit strings;
# bytes.translate builds them and int() parses them, both in C (about 2x the byte loop).
_DIGITS = b"0123456789abcdefghijklmnopqrstu"
_Q_DIGITS = bytes(_DIGITS[b // 31] if b < 128 else 48 for b in range(256))
_R_DIGITS = bytes(_DIGITS[b % 31] for b in range(256))


def _hash32(s: str) -> int:
    """Java String.hashCode as an unsigned 32-bit value; fast path for ASCII."""
    if not s.isascii():
        return java_string_hash(s) & _MASK32
    if not s:
        return 0
    b = s.encode("ascii")
    return (int(b.translate(_Q_DIGITS) + b"0", 31) + int(b.translate(_R_DIGITS), 31)) & _MASK32


def _positive(h32: int) -> int:
    """RocketMQ indexKeyHashMethod: abs of the signed hash, 0 when abs overflows."""
    signed = h32 - (1 << 32) if h32 & 0x80000000 else h32
    return 0 if signed == -(1 << 31) else abs(signed)


class _KeyHasher:
    """abs(hashCode("topic#key")) without re-hashing the topic prefix for every key."""

    def __init__(self, max_topics: int = 10_000):
        self._prefix: dict[str, int] = {}
        self._max_topics = max_topics

    def __call__(self, topic: str, key: str) -> int:
        prefix = self._prefix.get(topic)
        if prefix is None:
            if len(self._prefix) >= self._max_topics:
                self._prefix.clear()
            prefix = self._prefix[topic] = _hash32(topic + "#")
        if key.isascii():
            # hash(a + b) = hash(a) * 31^len(b) + hash(b)  (mod 2^32; ASCII: 1 UTF-16 unit per char)
            n = len(key)
            mul = _POW31[n] if n < len(_POW31) else pow(31, n, 1 << 32)
            h32 = (prefix * mul + _hash32(key)) & _MASK32
        else:
            h32 = _hash32(f"{topic}#{key}")
        return _positive(h32)


_POW31 = [pow(31, n, 1 << 32) for n in range(512)]


def index_key_hash(topic: str, key: str) -> int:
    """The key hash stored in index entries for `topic#key`."""
    return _positive(java_string_hash(f"{topic}#{key}") & _MASK32)


def file_name_for(timestamp_ms: int) -> str:
    """yyyyMMddHHmmssSSS of a ms timestamp, in UTC (ours: RocketMQ uses local time)."""
    t = _dt.datetime.fromtimestamp(timestamp_ms / 1000, tz=_dt.timezone.utc)
    return t.strftime("%Y%m%d%H%M%S") + f"{timestamp_ms % 1000:03d}"


def _name_to_ms(name: str) -> int:
    t = _dt.datetime.strptime(name[:14], "%Y%m%d%H%M%S").replace(tzinfo=_dt.timezone.utc)
    return int(t.timestamp()) * 1000 + int(name[14:])


class IndexFile:
    """One index file. Writable until full, then sealed (read-only, slots on disk)."""

    def __init__(self, fs: FileSystem, path: str, hash_slots: int, max_entries: int, handle: FileHandle):
        assert hash_slots > 0
        assert max_entries > 1
        self.fs = fs
        self.path = path
        self.name = os.path.basename(path)
        self.hash_slots = hash_slots
        self.max_entries = max_entries
        self.handle = handle
        self.begin_timestamp = 0
        self.end_timestamp = 0
        self.begin_phy_offset = 0
        self.end_phy_offset = 0
        self.hash_slot_count = 0        # slots in use
        self.index_count = 1            # next entry number; entry 0 is never used
        self._slots: array | None = None   # in-memory slot table while writable
        self._dirty_pages: set[int] = set()
        self._pending = bytearray()     # entries [written_count, index_count) not yet written
        self._written_count = 1
        self._header_dirty = False
        self.closed = False
        self.readers = 0                # queries reading it on a worker thread (IndexService)
        self.doomed = False             # expired while read: deleted when the last reader ends

    # --- geometry -------------------------------------------------------------------------
    @staticmethod
    def file_size(hash_slots: int, max_entries: int) -> int:
        return HEADER.size + hash_slots * SLOT.size + max_entries * ENTRY.size

    @property
    def _entries_base(self) -> int:
        return HEADER.size + self.hash_slots * SLOT.size

    @property
    def entries(self) -> int:
        return self.index_count - 1

    @property
    def is_full(self) -> bool:
        return self.index_count >= self.max_entries

    @property
    def writable(self) -> bool:
        return self._slots is not None

    # --- open / create ----------------------------------------------------------------------
    @classmethod
    def create(cls, fs: FileSystem, path: str, hash_slots: int, max_entries: int) -> "IndexFile":
        handle = fs.open(path)
        handle.truncate(cls.file_size(hash_slots, max_entries))   # sparse, full size
        f = cls(fs, path, hash_slots, max_entries, handle)
        f._slots = array("i", [0]) * hash_slots
        f._header_dirty = True
        return f

    @classmethod
    def open(cls, fs: FileSystem, path: str, hash_slots: int, max_entries: int, writable: bool) -> "IndexFile":
        handle = fs.open(path)
        want = cls.file_size(hash_slots, max_entries)
        size = handle.size()
        if size != want:
            handle.close()
            raise StoreFatal(f"{path} is {size} bytes, expected {want} for {hash_slots} slots and "
                             f"{max_entries} entries: was the store written with another index geometry?")
        f = cls(fs, path, hash_slots, max_entries, handle)
        (f.begin_timestamp, f.end_timestamp, f.begin_phy_offset, f.end_phy_offset,
         f.hash_slot_count, count) = HEADER.unpack(handle.pread(HEADER.size, 0))
        # A header never flushed reads as zeros: that is an empty file.
        f.index_count = min(max(1, count), max_entries)
        f._written_count = f.index_count
        if writable:
            f._load_slots()
        return f

    def _load_slots(self) -> None:
        raw = self.handle.pread(self.hash_slots * SLOT.size, HEADER.size)
        slots = array("i")
        slots.frombytes(raw)
        if sys.byteorder == "little":
            slots.byteswap()
        self._slots = slots

    # --- writes -----------------------------------------------------------------------------
    def put_hash(self, key_hash: int, phy_offset: int, store_timestamp: int) -> bool:
        """Add one entry; False if the file is full (the caller rolls). Hot path: kept flat."""
        slots = self._slots
        assert slots is not None, f"{self.path} is sealed"
        count = self.index_count
        if count >= self.max_entries:
            return False
        slot = key_hash % self.hash_slots
        prev = slots[slot]
        if prev <= 0 or prev >= count:
            prev = 0            # empty, or garbage from a torn write: never followed
            self.hash_slot_count += 1
        begin = self.begin_timestamp
        diff = 0 if begin <= 0 else (store_timestamp - begin) // 1000
        if not 0 <= diff <= INT_MAX:
            diff = 0 if diff < 0 else INT_MAX
        self._pending += _ENTRY_PACK(key_hash, phy_offset, diff, prev)
        slots[slot] = count
        self._dirty_pages.add(slot >> _PAGE_SHIFT)
        if count <= 1:
            self.begin_phy_offset = phy_offset
            self.begin_timestamp = store_timestamp
        self.index_count = count + 1
        self.end_phy_offset = phy_offset
        self.end_timestamp = store_timestamp
        self._header_dirty = True
        return True

    def write_pending(self) -> None:
        """Write buffered entries with one pwrite (page cache; flush() makes them durable)."""
        if self._pending:
            self.handle.pwrite(bytes(self._pending), self._entries_base + self._written_count * ENTRY.size)
            self._written_count = self.index_count
            self._pending.clear()

    def flush(self) -> None:
        """Entries, dirty slot pages, header, then fsync. StoreFatal if the fsync fails."""
        if self.write_out():
            self.sync()

    def write_out(self) -> bool:
        """Entries, dirty slot pages and the header into the file (page cache, no fsync);
        True when that changed anything, so an fsync (sync()) is due."""
        self.write_pending()
        if self._slots is not None and self._dirty_pages:
            self._write_slot_pages()
        if not self._header_dirty:
            return False
        self.handle.pwrite(HEADER.pack(self.begin_timestamp, self.end_timestamp, self.begin_phy_offset,
                                       self.end_phy_offset, self.hash_slot_count, self.index_count), 0)
        self._header_dirty = False
        return True

    def sync(self) -> None:
        """fsync what write_out() wrote; StoreFatal if it fails (no retry after a failed fsync).
        Touches no in-memory state: it may run on a worker thread beside put_hash()."""
        try:
            self.handle.fsync()
        except OSError as e:
            raise StoreFatal(f"fsync of {self.path} failed: {e}; stopping (no retry after a failed fsync)") from e

    def _write_slot_pages(self) -> None:
        assert self._slots is not None
        pages = sorted(self._dirty_pages)
        total_pages = (self.hash_slots + _PAGE_SLOTS - 1) // _PAGE_SLOTS
        if len(pages) * 4 > total_pages:
            spans = [(0, self.hash_slots)]      # most of the table: one big write is cheaper
        else:
            spans = [(p * _PAGE_SLOTS, min(self.hash_slots, (p + 1) * _PAGE_SLOTS)) for p in pages]
        for lo, hi in spans:
            part = self._slots[lo:hi]
            if sys.byteorder == "little":
                part.byteswap()
            self.handle.pwrite(part.tobytes(), HEADER.size + lo * SLOT.size)
        self._dirty_pages.clear()

    def seal(self) -> bool:
        """Full: write everything out and drop the in-memory slot table. No fsync: True when
        one is due (sync()), which the owner makes off the event loop."""
        due = self.write_out()
        self._slots = None
        return due

    # --- reads ------------------------------------------------------------------------------
    def _slot(self, slot: int) -> int:
        if self._slots is not None:
            return self._slots[slot]
        return SLOT.unpack(self.handle.pread(SLOT.size, HEADER.size + slot * SLOT.size))[0]

    def entry(self, number: int) -> tuple[int, int, int, int]:
        """(key_hash, phy_offset, time_diff, prev_index) of entry `number` (1-based)."""
        assert 1 <= number < self.index_count
        if number >= self._written_count:
            return ENTRY.unpack_from(self._pending, (number - self._written_count) * ENTRY.size)
        return ENTRY.unpack(self.handle.pread(ENTRY.size, self._entries_base + number * ENTRY.size))

    def overlaps(self, begin_ms: int, end_ms: int) -> bool:
        return self.entries > 0 and self.begin_timestamp <= end_ms and self.end_timestamp >= begin_ms

    def query(self, key_hash: int, begin_ms: int, end_ms: int, max_num: int, out: list[int], seen: set[int]) -> None:
        """Append matching offsets to `out` (newest first, skipping `seen`) up to max_num total."""
        count = self.index_count
        number = self._slot(key_hash % self.hash_slots)
        if count <= 1 or not 0 < number < count:
            return
        while len(out) < max_num:       # bounded: entry numbers strictly decrease
            kh, phy, diff, prev = self.entry(number)
            if diff < 0:
                break
            t = self.begin_timestamp + diff * 1000      # the entry's second: [t, t + 999]
            if kh == key_hash and t <= end_ms and t + 999 >= begin_ms and phy not in seen:
                out.append(phy)
                seen.add(phy)
            if not 0 < prev < number or t + 999 < begin_ms:
                break
            number = prev

    def all_entries(self) -> list[tuple[int, int, int, int]]:
        """Every entry in insertion order (used to rebuild a file)."""
        self.write_pending()
        raw = self.handle.pread(self.entries * ENTRY.size, self._entries_base + ENTRY.size)
        return list(ENTRY.iter_unpack(raw[:len(raw) - len(raw) % ENTRY.size]))

    def close(self) -> None:
        self.closed = True
        self.handle.close()


def _query_files(files: list[IndexFile], key_hash: int, begin_ms: int, end_ms: int, max_num: int,
                 out: list[int], seen: set[int]) -> bool:
    """Query `files`, newest first, into `out`; False once no older file can add to it."""
    for f in files:
        if len(out) >= max_num:
            return False
        if f.overlaps(begin_ms, end_ms):
            f.query(key_hash, begin_ms, end_ms, max_num, out, seen)
        if f.entries > 0 and f.begin_timestamp < begin_ms:
            return False        # older files hold older messages only
    return len(out) < max_num


class IndexService:
    """Index files under `<store_root>/index/`, named by creation time, oldest first."""

    def __init__(self, fs: FileSystem, store_root: str, *, hash_slots: int = L.INDEX_SLOTS_DEFAULT,
                 max_entries: int = L.INDEX_ENTRIES_DEFAULT):
        assert hash_slots > 0
        assert max_entries > 1
        self.fs = fs
        self.directory = os.path.join(store_root, "index")
        self.hash_slots = hash_slots
        self.max_entries = max_entries
        self.files: list[IndexFile] = []
        self._hasher = _KeyHasher()
        # sync() may run on a worker thread (the dispatcher's flush): it holds this lock over
        # its fsyncs, and so does whatever closes a file, so no fsync meets a closed descriptor.
        self._io = threading.Lock()
        self._reaped = False        # expired files were given to the reaper (close waits for it)
        self._sync_due: list[IndexFile] = []        # written out, not yet fsynced (a few at most)
        self._due_lock = threading.Lock()           # only for _sync_due: never held over an fsync
        self._names = DeferredDirSync(fs, self.directory)     # a new file's name: made durable by sync()
        self.redispatch_from: int | None = None     # set at start: the checkpoint's position (build_index)
        self._built_below = 0       # messages below this offset were indexed whole by this process

    # --- startup ----------------------------------------------------------------------------
    def load(self, log_end_physical: int | None = None) -> list[str]:
        """Open the files; repair those that index past the recovered log end. Returns repaired names."""
        self.fs.makedirs(self.directory)
        names = [n for n in self.fs.listdir(self.directory) if len(n) == NAME_LEN and n.isdigit()]
        for i, name in enumerate(names):
            path = os.path.join(self.directory, name)
            self.files.append(IndexFile.open(self.fs, path, self.hash_slots, self.max_entries,
                                             writable=(i == len(names) - 1)))
        repaired: list[str] = []
        if log_end_physical is not None:
            for f in list(self.files):
                if f.entries > 0 and f.end_phy_offset >= log_end_physical:
                    repaired.append(f.name)
                    self._rebuild_below(f, log_end_physical)
        self._names = DeferredDirSync(self.fs, self.directory, existing=bool(self.files))
        self._names.sync()      # the names found, made durable at the start (as SegmentedFile.load)
        if self.files and self.files[-1].is_full and self.files[-1].seal():
            self.files[-1].sync()
        return repaired

    def _rebuild_below(self, f: IndexFile, end_phys: int) -> None:
        """The log was cut below this file's end: rewrite it with only the entries below the cut.

        RocketMQ drops such a file and rebuilds it from the commitlog; rebuilding it from
        its own entries gives the same result without re-reading the log. The new file is
        written under a temporary name, fsynced and renamed over the old one.
        """
        idx = self.files.index(f)
        keep = [e for e in f.all_entries() if e[1] < end_phys]
        base_ts = f.begin_timestamp
        tmp_path = f.path + ".rebuild"
        self.fs.remove(tmp_path)
        try:
            new = IndexFile.create(self.fs, tmp_path, self.hash_slots, self.max_entries)
            try:
                for key_hash, phy, diff, _prev in keep:
                    new.put_hash(key_hash, phy, base_ts + diff * 1000)
                new.flush()
            finally:
                new.close()
        except OSError as e:
            if not is_enospc(e):
                raise
            # No room for the repaired copy (a restart on a full disk): the file goes, which
            # frees its room. It is derived data; the node starts, and queries by key miss the
            # messages it indexed. Before, the start failed ("cannot start", exit 2).
            f.close()
            self.fs.remove(tmp_path)
            self.fs.remove(f.path)
            del self.files[idx]
            self.fs.fsync_dir(self.directory)
            log.warning("index file %s indexed past the log end %d and there is no room to repair it (%s): "
                        "removed; queries by key miss the %d messages it indexed below the cut",
                        f.name, end_phys, e, len(keep))
            return
        f.close()
        if keep:
            self.fs.rename(tmp_path, f.path)
            self.files[idx] = IndexFile.open(self.fs, f.path, self.hash_slots, self.max_entries,
                                             writable=(idx == len(self.files) - 1))
        else:
            self.fs.remove(tmp_path)
            self.fs.remove(f.path)
            del self.files[idx]
        self.fs.fsync_dir(self.directory)
        log.warning("index file %s indexed past the log end %d: kept %d of %d entries",
                    f.name, end_phys, len(keep), f.entries)

    # --- writes -----------------------------------------------------------------------------
    @property
    def end_phy_offset(self) -> int:
        return self.files[-1].end_phy_offset if self.files else 0

    @property
    def end_timestamp(self) -> int:
        return self.files[-1].end_timestamp if self.files else 0

    def _writable(self, store_timestamp: int) -> IndexFile:
        last = self.files[-1] if self.files else None
        if last is not None and last.writable and not last.is_full:
            return last
        self._names.off_loop_first()    # before anything changes
        if last is not None and last.writable and last.seal():
            # Its fsync goes with the next flush, on the flush thread, as RocketMQ's IndexService
            # flushes a full file on a thread of its own: made here, on the event loop, it
            # took up to 2 s behind other writers and silenced a leader's heartbeats (an election).
            self._due(last)
        # Named by the first message's store time, kept strictly increasing so names sort.
        ms = store_timestamp
        if last is not None:
            ms = max(ms, _name_to_ms(last.name) + 1)
        path = os.path.join(self.directory, file_name_for(ms))
        self.fs.makedirs(self.directory)
        f = IndexFile.create(self.fs, path, self.hash_slots, self.max_entries)
        self._names.created()
        self.files.append(f)
        log.info("index: new file %s", f.name)
        return f

    def put(self, topic: str, key: str, phy_offset: int, store_timestamp: int) -> None:
        self.put_hash(self._hasher(topic, key), phy_offset, store_timestamp)

    def put_hash(self, key_hash: int, phy_offset: int, store_timestamp: int) -> None:
        f = self._writable(store_timestamp)
        if not f.put_hash(key_hash, phy_offset, store_timestamp):
            f = self._writable(store_timestamp)     # it was full: roll once
            ok = f.put_hash(key_hash, phy_offset, store_timestamp)
            assert ok, "a fresh index file must accept an entry"

    def build_index(self, topic: str, keys: str | None, uniq_key: str | None, phy_offset: int,
                    store_timestamp: int) -> int:
        """Index one message under its UNIQ_KEY and each KEYS word (RocketMQ buildIndex).

        A message below the last file's end offset was indexed before (re-dispatch
        after a restart) and is skipped, unless it is at or past `redispatch_from`: the
        entries past the checkpoint were never fsynced, and a crash may have kept the
        header that counts them without them. Such a message is indexed again; a query
        returns each offset once. A message this process indexed whole is skipped too (a
        batch dispatched again after a full disk or a DiskWait). Returns the number of
        entries added.
        """
        if self.files:
            end = self.files[-1].end_phy_offset
            if (phy_offset <= end and phy_offset < self._built_below) or (phy_offset < end and (
                    self.redispatch_from is None or phy_offset < self.redispatch_from)):
                return 0
        words = [uniq_key] if uniq_key else []
        if keys:
            words += [k for k in keys.split(KEY_SEPARATOR) if k]
        f = self._writable(store_timestamp)
        hasher = self._hasher
        for key in words:
            key_hash = hasher(topic, key)
            if not f.put_hash(key_hash, phy_offset, store_timestamp):
                f = self._writable(store_timestamp)     # it was full: roll once
                ok = f.put_hash(key_hash, phy_offset, store_timestamp)
                assert ok, "a fresh index file must accept an entry"
        self._built_below = phy_offset + 1
        return len(words)

    def log_cut_at(self, phy_offset: int) -> None:
        """The log was cut at `phy_offset` (a slave's truncation, a reset): messages written
        there from now on are new ones, indexed whatever the entries of the old ones say."""
        self._built_below = min(self._built_below, phy_offset)
        if self.redispatch_from is not None:
            self.redispatch_from = min(self.redispatch_from, phy_offset)

    def write_pending(self) -> None:
        if self.files and self.files[-1].writable:
            self.files[-1].write_pending()

    def flush(self) -> None:
        self.write_out()
        self.sync()

    def write_out(self) -> None:
        """On the owner's loop: the writable file's buffered entries, slot pages and header
        into the file; sync() then makes them durable."""
        if self.files and self.files[-1].writable and self.files[-1].write_out():
            self._due(self.files[-1])

    def _due(self, f: IndexFile) -> None:
        with self._due_lock:
            if f not in self._sync_due:
                self._sync_due.append(f)

    def sync(self) -> None:
        """fsync what write_out() and a roll (a sealed file) wrote. Safe on a worker thread
        beside build_index()."""
        with self._due_lock:
            due, self._sync_due = self._sync_due, []
        with self._io:
            self._names.sync()
            for f in due:
                if not f.closed:
                    f.sync()

    # --- reads, expiry ------------------------------------------------------------------------
    def query(self, topic: str, key: str, begin_ms: int, end_ms: int, max_num: int) -> list[int]:
        """Candidate physical offsets for `topic#key` stored in [begin_ms, end_ms], newest first."""
        assert max_num >= 0
        out: list[int] = []
        _query_files(list(reversed(self.files)), self._hasher(topic, key), begin_ms, end_ms, max_num, out, set())
        return out

    async def query_off_loop(self, topic: str, key: str, begin_ms: int, end_ms: int, max_num: int) -> list[int]:
        """query(), the sealed files read by a worker thread. Their slots and entries are on
        disk and a chain walk reads pages at random: on old files each read may wait for the
        disk. The writable file (slots in memory, entries recent) is read here, on the loop.
        A sealed file being read is not deleted until the read ends (delete_expired)."""
        assert max_num >= 0
        key_hash = self._hasher(topic, key)
        out: list[int] = []
        seen: set[int] = set()
        files = list(reversed(self.files))
        if files and files[0].writable:
            if not _query_files(files[:1], key_hash, begin_ms, end_ms, max_num, out, seen):
                return out
            files = files[1:]
        if not files:
            return out
        for f in files:             # readers, doomed: only ever touched on the owner's loop
            f.readers += 1
        try:
            await asyncio.to_thread(_query_files, files, key_hash, begin_ms, end_ms, max_num, out, seen)
        finally:
            for f in files:
                f.readers -= 1
                if f.readers == 0 and f.doomed:
                    self._remove([f])
        return out

    def delete_expired(self, min_phys: int) -> list[str]:
        """Delete files (never the last) whose every entry is below the commitlog's min offset;
        one a query is reading goes when that query ends. They leave the set here; they are
        closed and removed by the reaper's thread, so the event loop never waits for a sync
        in progress (it holds the files across its fsyncs)."""
        removed: list[str] = []
        gone: list[IndexFile] = []
        while len(self.files) > 1 and self.files[0].end_phy_offset < min_phys:
            f = self.files.pop(0)
            if f.readers:
                f.doomed = True
            else:
                gone.append(f)
            removed.append(f.name)
        if gone:
            self._remove(gone)
        if removed:
            log.info("index: deleted expired files %s (commitlog min offset %d)", removed, min_phys)
        return removed

    def _remove(self, files: list[IndexFile]) -> None:
        """Close and remove files out of the set, then fsync the directory: on the file system's
        reaper thread if it has one (node/store/reaper.py), else here. The close waits for a
        sync in progress (`_io`): a file it fsyncs is not closed under it."""
        def remove() -> None:
            with self._io:
                for f in files:
                    f.close()
            for f in files:
                self.fs.remove(f.path)
            self.fs.fsync_dir(self.directory)
        if run_or_hand_over(self.fs.reaper, remove):
            self._reaped = True

    def close(self) -> None:
        if self._reaped and self.fs.reaper is not None and not self.fs.reaper.drain(CLOSE_DRAIN_S):
            log.warning("index: expired files still being removed at close; retention takes them again")
        with self._io:
            for f in self.files:
                f.close()

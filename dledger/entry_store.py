"""The DLedger entry store: data segments + index segments + an atomic meta file.

    <root>/dledger-<selfId>/data/<20-digit pos>     entries (header + body), blanks at file ends
    <root>/dledger-<selfId>/index/<20-digit byte>   32 bytes per entry at index * 32
    <root>/dledger-<selfId>/meta                    JSON, written atomically (temp, fsync, rename, fsync dir)
    <root>/dledger-<selfId>/base-<20-digit index>.state   the base's state (ENTRY_BASE_STATE + the
                                                    broker's bytes), written atomically before meta names it

Positions are identical on every replica: an entry goes at the end of the previous
one unless `size + 8` does not fit in the file, in which case a blank (magic -1,
size = bytes left) fills the file and the entry starts the next one. The leader
encodes each commitlog record with PHYSICALOFFSET = pos + 48 *before* proposing
(`place_entry`), and every replica checks that on append, so a replica opened with
another segment size fails loudly instead of serving wrong offsets.

Implements the core's `RaftStorage` (read side) plus the write side the shell uses:
`append`, `truncate_from` (durable before it returns: RocketMQ #10666), `reset_to` (or its
two steps: `prepare_reset` on a worker thread, then `commit_reset`),
`compact_to` (retention), `set_hard_state`, `flush`, `checkpoint`, and `recover`.

A log with a base (after retention or InstallBase) keeps the broker's state as of the
base beside it: the queue-offset table, without which queue offsets could not continue
once the entries that set them are gone. `base_state()` is that file's content, what
InstallBase carries; `base_app_state` is the broker's part.

Recovery walks every entry from the base checking magic, sizes, pos, consecutive
indexes, non-decreasing terms, body and chain CRCs, and makes the index file agree.
It cuts at the first bad entry, durably, and reports what it dropped. Corruption at
or below the *durable mark* (the last checkpoint: an index known fsynced) is not a
torn write but lost acknowledged data: `needs_catchup_to` is set in meta so the core
neither votes nor campaigns until the log is back there.
"""

from __future__ import annotations

import bisect
import json
import logging
import operator
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from dledger import entry as E
from dledger.messages import Entry, EntryType, HardState, entry_of_checked
from dledger.raft_storage import Compacted, NotCached
from dledger.repair import damaged_body
from node.store import cold_reads
from node.store import layout as L
from node.store.crc import crc32 as _crc32
from node.store.errors import CorruptRecord, DiskFull, StoreError, StoreFatal, is_enospc
from node.store.fileio import FileSystem
from node.store.reserve import DiskReserve
from node.store.segment import SegmentedFile

log = logging.getLogger(__name__)

INDEX_SIZE = L.ENTRY_INDEX.size
HEADER = E.HEADER_SIZE
_PHYS_AT = L.MESSAGE_FIELD_OFFSET["physical_offset"]
_MAGIC_AT = L.MESSAGE_FIELD_OFFSET["magic"]
_CHAIN_AT = L.ENTRY_FIELD_OFFSET["chain_crc"]
_SCAN_CHUNK = 8 << 20            # bytes read per recovery step
_CACHE_MAX_BYTES = 64 << 20      # recent entries kept in memory for the leader's pushes
_INDEX_VERIFY_BATCH = 8192       # entries compared against the index file at a time
_TYPES = {int(t): t for t in EntryType}
_BODY = operator.attrgetter("body")
# magic and PHYSICALOFFSET of a commitlog record body, in one unpack (the append-time check)
_RECORD_CHECK = L.view(L.MESSAGE_FIELD_OFFSET, {"magic": "I", "physical_offset": "q"}, ("magic", "physical_offset"))


class EntryTooLarge(StoreError):
    code = "MESSAGE_TOO_LARGE"
    http_status = 400


def place_entry(end: int, size: int, segment_size: int) -> int:
    """Where an entry of `size` bytes goes when the log ends at `end` (pure).

    DESIGN 3: when size + 8 > bytes left in the file, a blank fills the file and the
    entry starts the next one. `end` is never closer than 8 bytes to a file end.
    """
    if size + E.BLANK_SIZE > segment_size:
        raise EntryTooLarge(f"entry of {size} bytes cannot fit a {segment_size}-byte data file")
    remaining = segment_size - end % segment_size
    return end if size + E.BLANK_SIZE <= remaining else end + remaining


@dataclass(frozen=True, slots=True)
class IndexRecord:
    magic: int
    pos: int
    size: int
    index: int
    term: int

    @property
    def end(self) -> int:
        return self.pos + self.size


@dataclass(frozen=True, slots=True)
class NewBase:
    """A compaction's new base: entry `index` (of `term`, at `base_entry_pos`), after which
    the log starts at `pos`, with the broker's state as of it."""
    index: int
    term: int
    base_entry_pos: int
    pos: int
    app_state: bytes


@dataclass(frozen=True, slots=True)
class PreparedReset:
    """A reset whose files are written (`EntryStore.prepare_reset`), for `commit_reset`."""
    base_index: int
    base_term: int
    pos: int
    pos_unknown: bool           # no base pos given: learned from the first NORMAL entry appended
    chain: int
    app_state: bytes
    data: Any                   # the new first data and index segments (node.store.segment.Segment)
    index: Any


@dataclass(slots=True)
class Meta:
    term: int = 0
    voted_for: str | None = None
    needs_catchup_to: int | None = None
    # Highest index known durable and committed here when last checkpointed (the durable mark).
    committed: int = 0
    checkpoint_index: int = 0
    # The log restarts after (base_index, base_term); entry base_index+1 is at base_pos,
    # its chain CRC seeded with base_chain.
    base_index: int = 0
    base_term: int = 0
    base_pos: int = 0
    base_chain: int = 0

    @property
    def durable_mark(self) -> int:
        return max(self.committed, self.checkpoint_index)


@dataclass(slots=True)
class RecoveryReport:
    first_index: int
    last_index: int
    end_pos: int
    entries_scanned: int
    bytes_scanned: int
    seconds: float
    cut_at_index: int | None = None     # first index dropped (None: nothing dropped)
    cut_at_pos: int | None = None
    reason: str | None = None
    old_last_index: int | None = None   # best knowledge of how far the log went before
    lost_durable: bool = False          # True: a bit flip or lost file below the durable mark
    needs_catchup_to: int | None = None
    index_rebuilt_from: int | None = None


@dataclass(slots=True)
class _Scan:
    last_index: int
    last_term: int
    end_pos: int
    chain: int
    entries: int = 0
    bytes: int = 0
    bad: CorruptRecord | None = None
    bad_index: int | None = None
    run_starts: list[int] = field(default_factory=list)
    run_terms: list[int] = field(default_factory=list)
    damaged: list = field(default_factory=list)     # DamagedEntry: committed, body-only damage (kept, not cut)


class EntryStore:
    """One replica's Raft log on disk. The shell owns it: its event loop makes every call but
    flush() and checkpoint(), which may run on the shell's worker thread (see each)."""

    def __init__(self, fs: FileSystem, root: str, self_id: str,
                 data_segment_size: int = 1 << 30, index_segment_size: int = INDEX_SIZE * (1 << 22),
                 reserve: DiskReserve | None = None):
        assert index_segment_size % INDEX_SIZE == 0, "an index record must never span files"
        assert data_segment_size > 2 * HEADER
        self.fs = fs
        self.dir = os.path.join(root, f"dledger-{self_id}")
        # The node's reserve (node/store/reserve.py): given up for meta at recovery and for a
        # cut's base state on a disk full to the last block. None: no reserve.
        self.reserve = reserve
        self.data = SegmentedFile(fs, os.path.join(self.dir, "data"), data_segment_size)
        self.index = SegmentedFile(fs, os.path.join(self.dir, "index"), index_segment_size)
        # Set by the shell on its event loop: gets a DiskWait's `fetch` when a push's entries are
        # old (entries(..., may_defer=True)); None: such reads are made on the loop, as before.
        self.cold_reader: Callable[[Callable[[], None]], None] | None = None
        self.meta_path = os.path.join(self.dir, "meta")
        self.segment_size = data_segment_size
        self.meta = Meta()
        self._last_index = 0
        self._last_term = 0
        self._end_pos = 0           # end of the last entry (never a blank's end)
        self._last_chain = 0
        self._flushed_index = 0
        # Term runs: entries run_starts[i] .. run_starts[i+1]-1 have term run_terms[i].
        self._run_starts: list[int] = []
        self._run_terms: list[int] = []
        self._cache: list[Entry] = []
        self._cache_pos: list[int] = []
        self._cache_bytes = 0
        self._pos_unknown = False   # after reset_to without a base pos (see reset_to)
        self.base_app_state = b""   # the broker's state as of the base (b"": none)
        self.damaged: dict = {}     # index -> DamagedEntry found by recover() (dledger/repair.py)
        self._recovered = False
        # Held by flush() and checkpoint() (possibly on a flusher thread) and by everything that
        # cuts or closes files.
        self.flush_lock = threading.Lock()
        # Held across each meta write (a checkpoint may run on the flusher thread), and by
        # set_hard_state across its change, write and revert: no write interleaves with another,
        # and none encodes a term or vote that set_hard_state is about to take back.
        self._meta_lock = threading.RLock()
        # A compaction's base (meta's base_* fields) from its write_base on: every meta write
        # names it, also one on another thread before cut_below_base takes it in memory. A
        # reset clears it.
        self._pending_base: dict | None = None

    # --- RaftStorage ----------------------------------------------------------------
    def initial_state(self) -> HardState:
        m = self.meta
        return HardState(m.term, m.voted_for, m.needs_catchup_to)

    def first_index(self) -> int:
        return self.meta.base_index + 1

    def last_index(self) -> int:
        return self._last_index

    def term(self, index: int) -> int:
        base = self.meta.base_index
        if index < base:
            raise Compacted(index, base + 1)
        if index > self._last_index:
            raise IndexError(f"term({index}) beyond last index {self._last_index}")
        if index == base:
            return self.meta.base_term
        i = bisect.bisect_right(self._run_starts, index) - 1
        assert i >= 0
        return self._run_terms[i]

    def entries(self, lo: int, hi: int, max_bytes: int, may_defer: bool = False) -> list[Entry]:
        """With `may_defer` and a `cold_reader` (the shell's, on its event loop), entries whose
        bytes are old (node/store/cold_reads.py) and not fetched yet are not read on the loop:
        NotCached, and `cold_reader` gets the DiskWait's `fetch` to run off the loop."""
        if lo < self.first_index():
            raise Compacted(lo, self.first_index())
        if not lo < hi <= self._last_index + 1:
            raise IndexError(f"entries({lo}, {hi}) outside {self.first_index()}..{self._last_index}")
        cache_first = self._cache[0].index if self._cache else self._last_index + 1
        if lo >= cache_first:
            return _within_budget(self._cache[lo - cache_first:hi - cache_first], max_bytes)
        if may_defer and self.cold_reader is not None:
            fetch = None
            with cold_reads.no_disk_waits():
                try:
                    return self._read_entries(lo, hi, max_bytes)
                except cold_reads.DiskWait as e:
                    fetch = e.fetch
            if fetch is not None:
                self.cold_reader(fetch)
                raise NotCached(lo)
        return self._read_entries(lo, hi, max_bytes)

    def cached_entries(self, lo: int, hi: int) -> list[Entry]:
        """Entries lo..hi-1 if all of them are in the in-memory cache (no byte budget), else []."""
        cache = self._cache
        if not cache or hi > self._last_index + 1 or lo >= hi:
            return []
        first = cache[0].index
        return cache[lo - first:hi - first] if lo >= first else []

    def cached_spans(self, pos: int, limit: int, max_bytes: int) -> tuple[list[tuple[bytes, int, int, int]], int] | None:
        """DLedgerLog.scan_spans from the in-memory cache: `(body, 0, pos + 48, len(body))` per
        NORMAL entry from the one at `pos` (or, when `pos` is a file's blank tail, from the
        first entry of the next file) while entries end at or below `limit`, about
        `max_bytes` of them, and the position to continue from. None when `pos` is not in the
        cache (the caller reads the files)."""
        cpos = self._cache_pos
        if not cpos or pos < cpos[0]:
            return None
        i = bisect.bisect_left(cpos, pos)
        if i == len(cpos):
            return None
        if cpos[i] != pos:
            # Between two cached entries only a blank can lie: it fills `pos`'s file to its end.
            seg = self.segment_size
            prev = self._cache[i - 1]
            if cpos[i - 1] + HEADER + len(prev.body) != pos or cpos[i] != (pos // seg + 1) * seg:
                return None
        cache, normal = self._cache, EntryType.NORMAL
        # The entries that end at or below `limit` are i..j-1 (ends grow with starts: only the
        # last one starting at or below it may end past it). When the bytes before the last
        # of them are under the budget (the dispatcher following the commit), all are taken,
        # at C speed; else the walk below stops once the budget is used.
        j = bisect.bisect_right(cpos, limit - HEADER, i)
        if j > i and cpos[j - 1] + HEADER + len(cache[j - 1].body) > limit:
            j -= 1
        if j > i and cpos[j - 1] - pos < max_bytes:
            records = [(e.body, 0, at + HEADER, len(e.body))
                       for e, at in zip(cache[i:j], cpos[i:j]) if e.type is normal]
            return records, cpos[j - 1] + HEADER + len(cache[j - 1].body)
        records = []
        add = records.append
        used, end = 0, pos
        while i < j and used < max_bytes:
            e = cache[i]
            at = cpos[i]
            body = e.body
            size = HEADER + len(body)
            if e.type is normal:
                add((body, 0, at + HEADER, size - HEADER))
            used += size
            end = at + size
            i += 1
        return records, end

    def base_state(self) -> bytes:
        """The base's state as InstallBase carries it: ENTRY_BASE_STATE + the broker's bytes."""
        if self.meta.base_index == 0:
            return b""
        m = self.meta
        return L.ENTRY_BASE_STATE.pack(m.base_pos, m.base_chain, _crc32(self.base_app_state)) + self.base_app_state

    def bytes_from(self, index: int) -> int:
        """The log's bytes from entry `index` to its end, blanks at file ends included (how far
        behind a follower pushed from there is: DLedger's maxWrotePosition - entry pos)."""
        if index > self._last_index:
            return 0
        try:
            with cold_reads.no_disk_waits():     # called on the loop, for every push
                return self._end_pos - self.entry_at(index).pos
        except cold_reads.DiskWait:
            # Its index record is old (so the entry is far behind): the log's average entry
            # size says how far, without waiting for the disk.
            first = self.first_index()
            return (self._end_pos - self.start_pos) * (self._last_index - index + 1) // (self._last_index - first + 1)

    # --- geometry used by DLedgerLog -------------------------------------------------
    @property
    def end_pos(self) -> int:
        """Where the log's last entry ends (the next entry goes here or in the next file)."""
        return self._end_pos

    @property
    def start_pos(self) -> int:
        return self.meta.base_pos

    @property
    def last_term(self) -> int:
        return self._last_term

    @property
    def flushed_index(self) -> int:
        return self._flushed_index

    def next_pos_for(self, body_size: int, after: int | None = None) -> int:
        """Position an entry with `body_size` bytes of body would get after `after` (default: the end)."""
        return place_entry(self._end_pos if after is None else after, HEADER + body_size, self.segment_size)

    def entry_at(self, index: int) -> IndexRecord:
        """The index record of `index` (KeyError outside first..last)."""
        if not self.first_index() <= index <= self._last_index:
            raise KeyError(index)
        if self._cache and index >= self._cache[0].index:
            e = self._cache[index - self._cache[0].index]
            return IndexRecord(int(e.type), self._cache_pos[index - self._cache[0].index],
                               HEADER + len(e.body), e.index, e.term)
        raw = self.index.read(index * INDEX_SIZE, INDEX_SIZE)
        if len(raw) != INDEX_SIZE:
            raise StoreFatal(f"index record {index} missing")
        rec = IndexRecord(*L.ENTRY_INDEX.unpack(raw))
        if rec.index != index:
            raise StoreFatal(f"index file holds {rec.index} where {index} belongs")
        return rec

    def read_body(self, pos: int, size: int) -> bytes:
        """Raw bytes at `pos` (never across a file end)."""
        return self.data.read(pos, size)

    def read_entry(self, pos: int) -> E.DecodedEntry:
        """The entry at `pos`, CRC-checked (no chain check)."""
        head = self.data.read(pos, HEADER)
        magic, size = E.peek_magic_size(head, 0)
        if magic not in E.VALID_MAGICS or size < HEADER:
            raise CorruptRecord(pos, f"no entry at {pos} (magic {magic})")
        return E.decode_entry(self.data.read(pos, size), pos)

    # --- write side ---------------------------------------------------------------------
    def set_hard_state(self, hs: HardState) -> None:
        """Persist term, vote and the catch-up mark atomically, on the reserve if need be. A
        full disk past it raises DiskFull with the previous hard state kept."""
        m = self.meta
        with self._meta_lock:
            before = (m.term, m.voted_for, m.needs_catchup_to)
            m.term, m.voted_for, m.needs_catchup_to = hs.term, hs.voted_for, hs.needs_catchup_to
            try:
                # On a disk full to the last block the reserve is given up for it: a node must be
                # able to store a term and vote to be elected (and then cut its log).
                self._reserved(self._write_meta, f"{self.meta_path} (term {hs.term} and vote)")
            except StoreFatal as e:
                m.term, m.voted_for, m.needs_catchup_to = before
                if not is_enospc(e):
                    raise
                raise DiskFull(f"disk full writing {self.meta_path} (ENOSPC); term {hs.term} and vote "
                               f"{hs.voted_for} not stored") from e.__cause__

    def append(self, entries: Sequence[Entry]) -> list[int]:
        """Write entries after the last one (no fsync); return their positions.

        A full disk (ENOSPC) raises DiskFull with the store as it was before the call: the
        bytes that landed are cut away (durably), so the same entries can be appended again
        once there is space. Any other write error is StoreFatal."""
        try:
            return self._append(entries)
        except StoreFatal as e:
            if not is_enospc(e):
                raise
            self._undo_append()
            raise DiskFull(f"disk full writing {self.dir} (ENOSPC); entries {entries[0].index}.."
                           f"{entries[-1].index} not stored, the log cut back to {self._last_index}") from e.__cause__

    def _undo_append(self) -> None:
        """Cut whatever a failed append left past the log's end: data, index, term runs."""
        with self.flush_lock:
            self.data.truncate(self._end_pos)
            self.index.truncate((self._last_index + 1) * INDEX_SIZE)
            self._cut_runs(self._last_index + 1)

    def _append(self, entries: Sequence[Entry]) -> list[int]:
        """Hot path (every replicated entry passes here): one header pack and one small CRC
        step per entry (the chain's; the body's CRC is the entry's own, derived when it was
        made or checked when it was received), header and body joined once per file written."""
        assert self._recovered, "recover() first"
        assert entries
        assert entries[0].index == self._last_index + 1, (entries[0].index, self._last_index)
        if self._pos_unknown:
            self._derive_base_pos(entries)
        seg_start, chunks, idx_parts, positions = self._end_pos, [], [], []
        end, chain, last_term = self._end_pos, self._last_chain, self._last_term
        seg_size, normal, blank_size = self.segment_size, EntryType.NORMAL, E.BLANK_SIZE
        # encode_header inline (the same bytes): body CRC, chain CRC over header[0:36] + body_crc,
        # the header; then the index record.
        crc32, pack_cover, pack_header, pack_index = _crc32, E.PACK_CHAIN_COVER, E.PACK_HEADER, L.ENTRY_INDEX.pack
        add_chunk, add_idx, add_pos = chunks.append, idx_parts.append, positions.append
        record_fields, record_head, record_magic = _RECORD_CHECK.unpack_from, L.MESSAGE_HEADER.size, L.MESSAGE_MAGIC
        seg_left = seg_size - end % seg_size
        cache_bytes = 0
        for e in entries:
            term, body, etype, index = e.term, e.body, e.type, e.index
            assert term >= last_term, (index, term, last_term)
            n = len(body)
            size = HEADER + n
            if size + blank_size <= seg_left:
                pos = end
            else:  # roll: fill this file with a blank
                pos = place_entry(end, size, seg_size)
                chunks.append(E.encode_blank(pos - end) + bytes(pos - end - E.BLANK_SIZE))
                self._write_data(seg_start, chunks)
                seg_start, chunks, seg_left = pos, [], seg_size
                add_chunk = chunks.append
            if etype is normal and n >= record_head:   # _check_record_offset, inline
                magic, phys = record_fields(body, 0)
                if magic == record_magic and phys != pos + HEADER:
                    _check_record_offset(e, pos)   # raises, with the words
            body_crc = e.crc
            chain = crc32(pack_cover(etype, size, index, term, pos, 0, body_crc), chain)
            add_chunk(pack_header(etype, size, index, term, pos, 0, chain, body_crc, n))
            add_chunk(body)
            add_idx(pack_index(etype, pos, size, index, term))
            add_pos(pos)
            if term != last_term or not self._run_terms:
                self._note_term(index, term)
            end, last_term = pos + size, term
            seg_left -= size
            cache_bytes += size
        self._write_data(seg_start, chunks)
        self._write_index(entries[0].index, idx_parts)
        self._last_index, self._last_term = entries[-1].index, last_term
        self._end_pos, self._last_chain = end, chain
        self._cache_add(entries, positions, cache_bytes)
        return positions

    def flush(self, index_file: bool = True) -> int:
        """fsync data (and the index file unless `index_file` is False); return the last durable index.

        The index file is derived data: recovery checks it against the data and rebuilds
        what disagrees, so a SYNC_FLUSH round fsyncs the data alone (one fsync, not two)
        and the index file is fsynced with the periodic checkpoint.

        Safe to call from one flusher thread while the event loop appends: it holds
        `flush_lock`, which truncate_from, reset_to and close take too, so no file is cut
        or closed under a running fsync; appends need no lock (what they add after `last`
        was read is not claimed durable)."""
        with self.flush_lock:
            last = self._last_index
            self.data.flush()
            if index_file:
                self.index.flush()
            # A truncation waits for the lock, so `last` is still part of the log here.
            self._flushed_index = max(self._flushed_index, min(last, self._last_index))
            return self._flushed_index

    def checkpoint(self, committed: int) -> bool:
        """Record the durable mark in meta (after a flush); False if it had not moved. Two
        fsyncs (file and directory), once a second or so.

        Only what is both committed and fsynced here counts, so a power loss of the
        whole group can never leave every replica waiting to catch up.

        Safe to call from the flusher thread while the event loop appends: it holds
        `flush_lock`, so no truncation, reset or compaction moves the marks under it, and
        each meta write holds the meta lock (see set_hard_state)."""
        with self.flush_lock:
            return self._checkpoint(committed)

    def _checkpoint(self, committed: int) -> bool:
        mark = min(max(committed, self.meta.base_index), self._flushed_index)
        if mark <= self.meta.checkpoint_index and committed <= self.meta.committed:
            return False
        self.meta.checkpoint_index = max(self.meta.checkpoint_index, mark)
        self.meta.committed = max(self.meta.committed, min(committed, self._flushed_index))
        try:
            self._write_meta()
            return True
        except StoreFatal as e:
            if not is_enospc(e):
                raise
            # The durable mark on disk stays at its last value, which is still true (recovery
            # then checks less); the next meta write carries the new one. (A term or vote that
            # cannot be written raises DiskFull: the shell holds its Ready.)
            log.warning("%s: durable mark not checkpointed: disk full (%s); the next meta write carries it",
                        self.dir, e.__cause__)
            return False

    def truncate_from(self, index: int) -> None:
        """Durably drop every entry >= index (zeroed and fsynced before returning)."""
        with self.flush_lock:
            self._truncate_from(index)

    def _truncate_from(self, index: int) -> None:
        if index > self._last_index:
            return
        if index <= self.meta.base_index:
            raise Compacted(index, self.first_index())
        assert index > self.meta.committed, f"truncating committed entry {index} (committed {self.meta.committed})"
        if index - 1 == self.meta.base_index:
            prev_end, prev_chain = self.meta.base_pos, self.meta.base_chain
        else:
            prev = self.entry_at(index - 1)
            prev_end = prev.end
            prev_chain = int.from_bytes(self.data.read(prev.pos + _CHAIN_AT, 4), "big")
        self.data.truncate(prev_end)            # zeroes the tail (and any blank) + fsync
        self.index.truncate(index * INDEX_SIZE)
        self._cut_runs(index)
        self._cache_cut(index)
        self._last_index = index - 1
        self._last_term = self.term(index - 1)
        self._end_pos, self._last_chain = prev_end, prev_chain
        self._flushed_index = min(self._flushed_index, index - 1)
        if self.meta.checkpoint_index >= index:
            self.meta.checkpoint_index = index - 1
            self._write_meta()
        log.info("%s: truncated from index %d (pos %d)", self.dir, index, prev_end)

    def reset_to(self, base_index: int, base_term: int, state: bytes = b"", *, base_pos: int | None = None) -> None:
        """Drop everything; the log restarts after (base_index, base_term) with the leader's
        base `state` (`base_state()` of the leader: its base pos, its base entry's chain CRC,
        from which the next entry's chains, as the leader's do, and the broker's state).

        The follower must put entry base_index+1 where the leader has it: at the state's
        base pos, or `base_pos`; with neither it is derived from the first NORMAL entry
        appended next (its record carries PHYSICALOFFSET = pos + 48). The state file and
        then meta are written first, so a crash mid-reset recovers to the new base (old
        files below it are removed at recovery)."""
        self.commit_reset(self.prepare_reset(base_index, base_term, state, base_pos=base_pos))

    def prepare_reset(self, base_index: int, base_term: int, state: bytes = b"", *,
                      base_pos: int | None = None) -> PreparedReset:
        """reset_to's disk work, safe on a worker thread while the store serves its old log
        (nothing the store serves changes until `commit_reset`): the base's state file, meta
        naming the new base (every meta write from here on names it, `_pending_base`), then
        every data and index file replaced (the old ones removed, the open descriptors
        still reading them). A crash after meta recovers to the new base. The caller holds
        off appends, truncations and compactions until `commit_reset`."""
        app, chain = b"", 0
        if state:
            base_pos, got, app = _parse_base_state(state, f"InstallBase state for base {base_index}")
            chain = got or 0
        with self.flush_lock:
            m = self.meta
            pos = base_pos if base_pos is not None else self._end_pos
            fields = {"base_index": base_index, "base_term": base_term, "base_chain": chain, "base_pos": pos,
                      "checkpoint_index": max(m.checkpoint_index, base_index), "committed": max(m.committed, base_index)}
            # A compaction's pending base is replaced, in one meta write. On a full disk the
            # reserve is given up for it, as for a cut: the reset frees every old file once it
            # is switched in (DiskFull, meta unchanged, if even that is not room enough).
            self._reserved(lambda: self._write_base(fields, app), f"the reset to base {base_index} of {self.dir}")
            self._remove_stale_states(keep=base_index)
            data = self.data.prepare_reset(pos)
            index = self.index.prepare_reset((base_index + 1) * INDEX_SIZE)
        return PreparedReset(base_index, base_term, pos, base_pos is None, chain, app, data, index)

    def commit_reset(self, r: PreparedReset) -> None:
        """After prepare_reset, where the store is read (the loop): the store serves the new base."""
        m = self.meta
        with self._meta_lock:
            self._pending_base = None
            m.base_index, m.base_term, m.base_chain, m.base_pos = r.base_index, r.base_term, r.chain, r.pos
            m.checkpoint_index = max(m.checkpoint_index, r.base_index)
            m.committed = max(m.committed, r.base_index)
        self.base_app_state = r.app_state
        self.data.commit_reset(r.data, r.pos)
        self.index.commit_reset(r.index, (r.base_index + 1) * INDEX_SIZE)
        self._last_index, self._last_term = r.base_index, r.base_term
        self._end_pos, self._last_chain = r.pos, r.chain
        self._flushed_index = r.base_index
        self._run_starts, self._run_terms = [], []
        self._cache_cut(0)
        self._pos_unknown = r.pos_unknown
        log.warning("%s: log reset to base %d (term %d) at pos %d", self.dir, r.base_index, r.base_term, r.pos)

    def compact_to(self, base_index: int, app_state: bytes) -> list[str]:
        """Retention: forget entries <= base_index, which must be committed and fsynced, with
        at least one entry after them; `app_state` is the broker's state as of base_index.
        Whole data and index files below the new base go; returns their paths.

        In one call: `plan_base`, `write_base`, `cut_below_base`. A node on an event loop
        runs `write_base` (its fsyncs) on a worker thread between the other two."""
        new = self.plan_base(base_index, app_state)
        if new is None:
            return []
        self.write_base(new)
        removed = self.cut_below_base(new)
        if self.reserve is not None:
            self.reserve.ensure(freed=True)
        return removed

    def plan_base(self, base_index: int, app_state: bytes) -> NewBase | None:
        """The new base of a compaction to base_index (see compact_to), from what this store
        holds now; None when the base is there already. ValueError for an entry that may not
        be a base (uncommitted, unflushed, or the last one)."""
        m = self.meta
        if base_index <= m.base_index:
            return None
        if not (base_index < self._last_index and base_index <= self._flushed_index
                and base_index <= m.durable_mark):
            raise ValueError(f"compact_to({base_index}): only committed, fsynced entries with one after them "
                             f"(last {self._last_index}, fsynced {self._flushed_index}, durable {m.durable_mark})")
        base, nxt = self.entry_at(base_index), self.entry_at(base_index + 1)
        return NewBase(base_index, base.term, base.pos, nxt.pos, app_state)

    def write_base(self, new: NewBase) -> None:
        """The state file, then meta naming the new base, durably; then the older state files
        go. Safe on a worker thread while the loop appends and reads: nothing here changes
        what the store serves (the base in memory changes in `cut_below_base`), and every meta
        write from here on, by any thread, names the new base (`_pending_base`). A crash after
        it recovers to the new base and removes the files below. DiskFull on a full disk
        (after the reserve), with meta on disk and here naming the old base."""
        with self.flush_lock:    # no reset, truncation or other cut meanwhile
            if new.index <= self.meta.base_index:
                return
            chain = int.from_bytes(self.data.read(new.base_entry_pos + _CHAIN_AT, 4), "big")
            fields = {"base_index": new.index, "base_term": new.term, "base_pos": new.pos, "base_chain": chain}
            self._reserved(lambda: self._write_base(fields, new.app_state),
                           f"the new base {new.index} of {self.dir} (state of {len(new.app_state)} bytes)")
            self._remove_stale_states(keep=new.index)

    def cut_below_base(self, new: NewBase) -> list[str]:
        """After `write_base`, on the thread that serves the store (the loop): the new base in
        memory, and the whole files below it leave the file sets (the reaper removes them).
        Nothing when a reset replaced the base meanwhile. Returns the paths."""
        m, fields = self.meta, self._pending_base
        if fields is None or fields["base_index"] != new.index or m.base_index >= new.index:
            return []
        m.base_index, m.base_term, m.base_pos, m.base_chain = (fields["base_index"], fields["base_term"],
                                                               fields["base_pos"], fields["base_chain"])
        self.base_app_state = new.app_state
        removed = self.data.delete_head(new.pos) + self.index.delete_head((new.index + 1) * INDEX_SIZE)
        keep_run = max(0, bisect.bisect_right(self._run_starts, new.index + 1) - 1)   # the run of base+1 on
        del self._run_starts[:keep_run], self._run_terms[:keep_run]
        if self._cache and self._cache[0].index <= new.index:
            drop = min(len(self._cache), new.index + 1 - self._cache[0].index)
            self._cache_bytes -= sum(HEADER + len(e.body) for e in self._cache[:drop])
            del self._cache[:drop], self._cache_pos[:drop]
        log.info("%s: compacted to base %d (pos %d): %d file(s) deleted", self.dir, new.index, new.pos, len(removed))
        return removed

    def _reserved(self, write, what: str) -> None:
        """`write()`, with the node's reserve to give up if it meets a full disk."""
        if self.reserve is None:
            write()
        else:
            self.reserve.using(write, what)

    def _write_base(self, fields: dict, app_state: bytes) -> None:
        """The state file, then meta naming the new base (`fields`: meta's base_*, and what a
        reset raises with them). On failure meta on disk keeps the old base; DiskFull on ENOSPC."""
        try:
            self._write_base_state(fields["base_index"], fields["base_pos"], fields["base_chain"], app_state)
            with self._meta_lock:      # (not over the state file's fsyncs: a term and vote wait for it)
                before, self._pending_base = self._pending_base, fields
                try:
                    self._write_meta()
                except StoreFatal:
                    self._pending_base = before
                    raise
        except StoreFatal as e:
            if not is_enospc(e):
                raise
            raise DiskFull(f"disk full writing the new base {fields['base_index']} of {self.dir}; nothing "
                           f"deleted") from e.__cause__

    def _state_path(self, base_index: int) -> str:
        return os.path.join(self.dir, f"base-{base_index:020d}.state")

    def _write_base_state(self, base_index: int, base_pos: int, chain: int, app: bytes) -> None:
        try:
            self.fs.write_atomic(self._state_path(base_index),
                                 L.ENTRY_BASE_STATE.pack(base_pos, chain, _crc32(app)) + app)
        except OSError as e:
            raise StoreFatal(f"writing {self._state_path(base_index)} failed: {e}") from e

    def _read_base_state(self) -> bytes:
        m = self.meta
        path = self._state_path(m.base_index)
        if m.base_index == 0:
            return b""
        if not self.fs.exists(path):
            log.warning("%s: no state file for base %d; queue offsets continue from what the log holds",
                        self.dir, m.base_index)
            return b""
        pos, chain, app = _parse_base_state(self.fs.read_file(path), path)
        if pos != m.base_pos:   # a crash while a reset learned its pos (_rebase_empty): meta's is the newer
            log.warning("%s: state file puts base %d at %d, meta at %d; meta's kept", self.dir, m.base_index,
                        pos, m.base_pos)
        elif chain is not None and chain != m.base_chain:
            log.warning("%s: state file gives base %d the chain CRC %d, meta %d; meta's kept", self.dir,
                        m.base_index, chain, m.base_chain)
        return app

    def _remove_stale_states(self, keep: int | None = None) -> None:
        """Every base state file but base `keep`'s (default: meta's base)."""
        keep = os.path.basename(self._state_path(self.meta.base_index if keep is None else keep))
        for name in self.fs.listdir(self.dir):
            if name.startswith("base-") and name.endswith((".state", ".state.tmp")) and name != keep:
                self.fs.remove(os.path.join(self.dir, name))

    def close(self) -> None:
        with self.flush_lock:
            self.data.close()
            self.index.close()

    # --- recovery -----------------------------------------------------------------------
    def recover(self) -> RecoveryReport:
        """Open the store, verify every entry, cut a bad tail durably, fix the index."""
        t0 = time.monotonic()
        self.fs.makedirs(self.dir)
        self.meta = self._read_meta()
        m = self.meta
        meta_read = asdict(m) if self.fs.exists(self.meta_path) else None
        self.base_app_state = self._read_base_state()
        self._remove_stale_states()
        self._remove_below(self.data, m.base_pos)
        self._remove_below(self.index, (m.base_index + 1) * INDEX_SIZE)
        self.data.load()
        self._load_index()
        scan = self._scan(m)
        report = RecoveryReport(m.base_index + 1, scan.last_index, scan.end_pos, scan.entries, scan.bytes, 0.0)
        if scan.bad is not None:
            self._classify_loss(scan, report)
        elif scan.last_index < m.durable_mark:
            report.lost_durable, report.reason = True, f"log ends at {scan.last_index} below durable mark {m.durable_mark}"
            report.old_last_index = m.durable_mark
        if report.lost_durable:
            report.needs_catchup_to = max(report.old_last_index or 0, m.needs_catchup_to or 0, scan.last_index + 1)
            m.needs_catchup_to = report.needs_catchup_to
            m.checkpoint_index = min(m.checkpoint_index, scan.last_index)
            m.committed = min(m.committed, scan.last_index)
        self._cut_tail(self.data, scan.end_pos)
        report.index_rebuilt_from = self._fix_index(scan)
        self._install_scan(scan)
        # Written only when recovery changed it: a restart on a disk full to the last block,
        # its reserve already spent (a second crash before space returned), starts when the
        # log needed no repair (found by the random-fault runs: such a restart stopped on ENOSPC).
        if asdict(m) != meta_read:
            self._reserved(self._write_meta, f"{self.meta_path} at recovery")
        if self.reserve is not None:
            self.reserve.ensure()
        report.seconds = time.monotonic() - t0
        self._log_report(report)
        return report

    def _load_index(self) -> None:
        """The index is derived data: if its files are not contiguous, drop them all and rebuild."""
        try:
            self.index.load()
        except StoreFatal as e:
            log.warning("%s: index files unusable (%s); rebuilding the index from the data", self.dir, e)
            self.index.close()
            for name in self.fs.listdir(self.index.directory):
                self.fs.remove(os.path.join(self.index.directory, name))
            self.fs.fsync_dir(self.index.directory)
            self.index = SegmentedFile(self.fs, self.index.directory, self.index.segment_size)
            self.index.load()

    def _install_scan(self, scan: _Scan) -> None:
        self._last_index, self._last_term = scan.last_index, scan.last_term
        self._end_pos, self._last_chain = scan.end_pos, scan.chain
        self._run_starts, self._run_terms = scan.run_starts, scan.run_terms
        self._flushed_index = scan.last_index
        self.damaged = {d.index: d for d in scan.damaged}
        self._recovered = True

    def _scan(self, m: Meta) -> _Scan:
        """Walk every entry from the base; stop at a clean end or the first bad entry."""
        s = _Scan(m.base_index, m.base_term, m.base_pos, m.base_chain)
        pos = m.base_pos
        while True:
            seg = self.data.segment_for(pos)
            if seg is None:
                return s
            seg_end = seg.base + seg.capacity
            buf = seg.read(pos, min(_SCAN_CHUNK, seg_end - pos))
            at, stop = self._scan_chunk(s, buf, pos, seg_end)
            if stop:
                return s
            if at == 0 and pos + len(buf) < seg_end:
                # An entry larger than the chunk: read exactly it.
                _, size = E.peek_magic_size(buf, 0)
                buf = seg.read(pos, size)
                at, stop = self._scan_chunk(s, buf, pos, seg_end)
                if stop or at == 0:
                    return s
            pos += at

    def _scan_chunk(self, s: _Scan, buf: bytes, pos: int, seg_end: int) -> tuple[int, bool]:
        """Consume whole entries of `buf` (which starts at log position `pos`).

        Returns (bytes consumed, stopped). A blank consumes the rest of its file."""
        at, n = 0, len(buf)
        while at + E.BLANK_SIZE <= n:
            p = pos + at
            magic, size = L.ENTRY_BLANK.unpack_from(buf, at)
            if magic == 0 and size == 0:
                return at, True  # clean end: never-written bytes are zeros
            if magic == L.ENTRY_MAGIC_BLANK:
                if size != seg_end - p or s.last_index == s.run_starts[-1:] and False:
                    return self._bad(s, p, CorruptRecord(p, f"blank of {size} bytes, {seg_end - p} left")), True
                return n if p + size == pos + n else at + size, False
            if size < HEADER or size + E.BLANK_SIZE > seg_end - p:
                return self._bad(s, p, CorruptRecord(p, f"entry size {size} impossible here")), True
            if at + size > n:
                return at, False  # continue with a fresh read at this entry
            try:
                d = E.decode_entry(buf, p, s.chain, at)
            except CorruptRecord as err:
                # A committed entry whose body alone is damaged (header and chain intact) is kept
                # and repaired from a peer in place (dledger/repair.py): never cut committed data.
                d = damaged_body(buf, at, p, s.chain, s.last_index + 1, self.meta.durable_mark, err)
                if d is None:
                    return self._bad(s, p, err), True
                s.damaged.append(d)
            if d.index != s.last_index + 1 or d.term < s.last_term:
                return self._bad(s, p, CorruptRecord(p, f"entry {d.index}/term {d.term} after "
                                                        f"{s.last_index}/term {s.last_term}")), True
            if not s.run_terms or s.run_terms[-1] != d.term:
                s.run_starts.append(d.index)
                s.run_terms.append(d.term)
            s.last_index, s.last_term, s.end_pos, s.chain = d.index, d.term, d.end, d.chain_crc
            s.entries += 1
            s.bytes += size
            at += size
        return at, False

    def _bad(self, s: _Scan, pos: int, err: CorruptRecord) -> int:
        s.bad, s.bad_index = err, s.last_index + 1
        return 0

    def _classify_loss(self, scan: _Scan, report: RecoveryReport) -> None:
        """A bad entry: torn tail (above the durable mark) or lost durable data (below)."""
        assert scan.bad is not None and scan.bad_index is not None
        report.cut_at_index, report.cut_at_pos, report.reason = scan.bad_index, scan.bad.offset, scan.bad.reason
        old_last = self._index_file_last(scan.bad_index)
        report.old_last_index = max(old_last, self.meta.durable_mark, scan.last_index)
        report.lost_durable = scan.bad_index <= self.meta.durable_mark

    def _index_file_last(self, start: int) -> int:
        """Best effort: last index the index file still lists consecutively from `start`."""
        last, i = start - 1, start
        while True:
            raw = self.index.read(i * INDEX_SIZE, INDEX_SIZE * 4096)
            if len(raw) < INDEX_SIZE:
                return last
            for off in range(0, len(raw) - INDEX_SIZE + 1, INDEX_SIZE):
                magic, _pos, _size, idx, _term = L.ENTRY_INDEX.unpack_from(raw, off)
                if magic not in E.VALID_MAGICS or idx != i:
                    return last
                last, i = i, i + 1

    def _fix_index(self, scan: _Scan) -> int | None:
        """Make the index file list exactly entries first..last; return where it was rebuilt."""
        first = self.meta.base_index + 1
        mismatch = self._first_index_mismatch(first, scan.last_index)
        if mismatch is None:
            self._cut_tail(self.index, (scan.last_index + 1) * INDEX_SIZE)
            return None
        log.warning("%s: index file disagrees with data from index %d; rebuilding", self.dir, mismatch)
        self._cut_tail(self.index, mismatch * INDEX_SIZE)
        pos = self.entry_pos_by_walk(mismatch)
        parts: list[bytes] = []
        for rec in self._walk_records(pos, mismatch, scan.last_index):
            parts.append(L.ENTRY_INDEX.pack(rec.magic, rec.pos, rec.size, rec.index, rec.term))
            if len(parts) >= _INDEX_VERIFY_BATCH:
                self._write_index(rec.index - len(parts) + 1, parts)
                parts = []
        if parts:
            self._write_index(scan.last_index - len(parts) + 1, parts)
        self.index.flush()
        return mismatch

    def _first_index_mismatch(self, first: int, last: int) -> int | None:
        """First index whose index record disagrees with the data (None: all agree). The index
        file is read _INDEX_VERIFY_BATCH records at a time (a short read, at a file's end or
        the index's, is read on from the next record: an absent record is a mismatch)."""
        i, pos, pack = first, self.meta.base_pos, L.ENTRY_INDEX.pack
        raw, raw_first = b"", first            # index records raw_first.. as read
        for rec in self._walk_records(pos, first, last):
            at = (rec.index - raw_first) * INDEX_SIZE
            if at >= len(raw):
                raw_first, at = rec.index, 0
                raw = self.index.read(rec.index * INDEX_SIZE, min(_INDEX_VERIFY_BATCH, last + 1 - rec.index) * INDEX_SIZE)
            if raw[at:at + INDEX_SIZE] != pack(rec.magic, rec.pos, rec.size, rec.index, rec.term):
                return rec.index
            i = rec.index + 1
        assert i == last + 1
        return None

    def entry_pos_by_walk(self, index: int) -> int:
        """Position of `index` found by walking the data from the base (recovery only)."""
        for rec in self._walk_records(self.meta.base_pos, self.meta.base_index + 1, index):
            if rec.index == index:
                return rec.pos
        raise KeyError(index)

    def _walk_records(self, pos: int, first: int, last: int):
        """Yield IndexRecords of already-verified entries first..last starting at `pos`."""
        i = first
        while i <= last:
            seg = self.data.segment_for(pos)
            assert seg is not None, pos
            seg_end = seg.base + seg.capacity
            buf = seg.read(pos, min(_SCAN_CHUNK, seg_end - pos))
            at = 0
            while i <= last and at + E.BLANK_SIZE <= len(buf):
                magic, size = L.ENTRY_BLANK.unpack_from(buf, at)
                if magic == L.ENTRY_MAGIC_BLANK:
                    at = len(buf) if pos + at + size >= pos + len(buf) else at + size
                    break
                if at + size > len(buf):
                    break
                _m, _s, idx, term, rpos = L.ENTRY_HEADER.unpack_from(buf, at)[:5]
                assert idx == i, (idx, i)
                yield IndexRecord(magic, rpos, size, idx, term)
                i, at = i + 1, at + size
            if at == 0:
                _, size = E.peek_magic_size(buf, 0)
                buf = seg.read(pos, size)
                _m, _s, idx, term, rpos = L.ENTRY_HEADER.unpack_from(buf, 0)[:5]
                yield IndexRecord(_m, rpos, size, idx, term)
                i, at = i + 1, size
            pos += at

    def _cut_tail(self, sf: SegmentedFile, offset: int) -> None:
        """Durably make `offset` the end of `sf`: later files removed, the rest of its file zeroed.

        Zeroing is ftruncate down then back up (a hole), so a 1 GiB file costs no writes."""
        seg = sf.segment_for(offset)
        if seg is None and sf.segments and offset == sf.segments[-1].base + sf.segment_size:
            seg = None  # the end is exactly a file end: keep the files, create the next lazily
        if seg is None and not (sf.segments and offset == sf.segments[-1].base + sf.segment_size):
            sf.reset_to(offset)
            return
        sf.set_end(offset)
        sf.truncate(offset)  # removes later files; nothing left to zero in the holding file
        if seg is None:
            return
        rel = offset - seg.base
        try:
            seg.handle.truncate(rel)
            seg.handle.truncate(seg.capacity)
            seg.handle.fsync()
        except OSError as e:
            raise StoreFatal(f"cutting {seg.path} at {rel}: {e}") from e

    def _remove_below(self, sf: SegmentedFile, offset: int) -> None:
        """Delete files that end at or below `offset` (left by a crash during reset_to)."""
        removed = False
        for name in self.fs.listdir(sf.directory):
            if len(name) == 20 and name.isdigit() and int(name) + sf.segment_size <= offset:
                self.fs.remove(os.path.join(sf.directory, name))
                removed = True
        if removed:
            self.fs.fsync_dir(sf.directory)

    def _log_report(self, r: RecoveryReport) -> None:
        if r.cut_at_index is None and not r.lost_durable:
            log.info("%s: recovered entries %d..%d (%d bytes) in %.3fs", self.dir, r.first_index,
                     r.last_index, r.bytes_scanned, r.seconds)
            return
        level = logging.ERROR if r.lost_durable else logging.WARNING
        log.log(level, "%s: recovery cut the log at index %s (pos %s): %s; kept %d..%d, old last %s, "
                "needs_catchup_to=%s", self.dir, r.cut_at_index, r.cut_at_pos, r.reason, r.first_index,
                r.last_index, r.old_last_index, r.needs_catchup_to)

    # --- internals -------------------------------------------------------------------------
    def _write_data(self, start: int, chunks: list[bytes]) -> None:
        if not chunks:
            return
        seg = self.data.ensure_writable(start)
        assert seg.end == start, (seg.end, start)
        try:
            seg.append(b"".join(chunks) if len(chunks) > 1 else chunks[0])
        except OSError as e:
            raise StoreFatal(f"write to {seg.path} failed: {e}") from e

    def _write_index(self, first: int, parts: list[bytes]) -> None:
        offset, i = first * INDEX_SIZE, 0
        while i < len(parts):
            seg = self.index.ensure_writable(offset)
            assert seg.end == offset, (seg.end, offset)
            n = min(len(parts) - i, seg.remaining // INDEX_SIZE)
            try:
                seg.append(b"".join(parts[i:i + n]))
            except OSError as e:
                raise StoreFatal(f"write to {seg.path} failed: {e}") from e
            i, offset = i + n, offset + n * INDEX_SIZE

    def _read_entries(self, lo: int, hi: int, max_bytes: int) -> list[Entry]:
        """Entries lo..hi-1 from disk, CRC-checked, at least one, within max_bytes."""
        out: list[Entry] = []
        used, i = 0, lo
        pos = self.entry_at(lo).pos
        last = self.entry_at(hi - 1)
        end = last.pos + last.size          # read no further than the batch's last entry
        while i < hi:
            rec = self.entry_at(i) if not out else None
            if rec is not None:
                pos = rec.pos
            want = max(HEADER, min(max_bytes - used, self.data.segment_size, end - pos))
            buf = self.data.read(pos, want)
            at = 0
            while i < hi and at + E.BLANK_SIZE <= len(buf):
                magic, size = L.ENTRY_BLANK.unpack_from(buf, at)
                if magic == L.ENTRY_MAGIC_BLANK:
                    pos = pos + at + size
                    at = -1
                    break
                if (out and used + size > max_bytes) or at + size > len(buf):
                    break
                d = E.decode_entry(buf, pos + at, None, at)
                assert d.index == i, (d.index, i)
                out.append(entry_of_checked(d.index, d.term, _TYPES[d.magic], d.body, d.body_crc))
                used, i, at = used + size, i + 1, at + size
            if at == -1:
                continue
            if at == 0 and not out:  # first entry larger than the read: read it whole
                _, size = E.peek_magic_size(buf, 0)
                d = E.decode_entry(self.data.read(pos, size), pos)
                out.append(entry_of_checked(d.index, d.term, _TYPES[d.magic], d.body, d.body_crc))
                used, i, at = size, i + 1, size
            if at == 0 or used >= max_bytes:
                break
            pos += at
        return out

    def _derive_base_pos(self, entries: Sequence[Entry]) -> None:
        """After reset_to without a pos: learn it from the first NORMAL record in the batch."""
        sizes = 0
        for e in entries:
            if e.type is EntryType.NORMAL and _looks_like_record(e.body):
                phys = int.from_bytes(e.body[_PHYS_AT:_PHYS_AT + 8], "big", signed=True)
                start = phys - HEADER - sizes
                if start >= 0 and start // self.segment_size == (phys - HEADER) // self.segment_size:
                    self._rebase_empty(start)
                    return
                break
            sizes += HEADER + len(e.body)
        log.warning("%s: cannot learn the base position after a reset; keeping %d", self.dir, self._end_pos)
        self._pos_unknown = False

    def _rebase_empty(self, pos: int) -> None:
        assert self._last_index == self.meta.base_index
        with self._meta_lock:
            self._pending_base = None
            self.meta.base_pos = pos
            self._write_meta()
        self._write_base_state(self.meta.base_index, pos, self.meta.base_chain, self.base_app_state)
        self.data.reset_to(pos)
        self._end_pos = pos
        self._pos_unknown = False

    def _note_term(self, index: int, term: int) -> None:
        if not self._run_terms or self._run_terms[-1] != term:
            self._run_starts.append(index)
            self._run_terms.append(term)

    def _cut_runs(self, index: int) -> None:
        i = bisect.bisect_left(self._run_starts, index)
        del self._run_starts[i:]
        del self._run_terms[i:]

    def _cache_add(self, entries: Sequence[Entry], positions: list[int], nbytes: int) -> None:
        self._cache.extend(entries)
        self._cache_pos.extend(positions)
        self._cache_bytes += nbytes
        if self._cache_bytes > _CACHE_MAX_BYTES:
            # The oldest entries go until about half is kept: found by position (a blank at
            # a file's end counts as freed, so a little over half may stay), summed in C.
            cpos = self._cache_pos
            drop = bisect.bisect_left(cpos, cpos[0] + self._cache_bytes - _CACHE_MAX_BYTES // 2)
            self._cache_bytes -= HEADER * drop + sum(map(len, map(_BODY, self._cache[:drop])))
            del self._cache[:drop]
            del self._cache_pos[:drop]

    def _cache_cut(self, index: int) -> None:
        if not self._cache or index > self._cache[-1].index:
            return
        keep = max(0, index - self._cache[0].index)
        self._cache_bytes -= sum(HEADER + len(e.body) for e in self._cache[keep:])
        del self._cache[keep:]
        del self._cache_pos[keep:]

    def _read_meta(self) -> Meta:
        if not self.fs.exists(self.meta_path):
            return Meta()
        try:
            raw = json.loads(self.fs.read_file(self.meta_path))
            return Meta(**raw)
        except (ValueError, TypeError) as e:
            # write_atomic makes a torn meta impossible; a bad one is someone else's damage.
            raise StoreFatal(f"{self.meta_path} is unreadable ({e}); refusing to guess term and vote") from e

    def _write_meta(self) -> None:
        try:
            with self._meta_lock:
                doc = asdict(self.meta)
                if self._pending_base is not None:   # written, maybe not yet taken in memory
                    doc.update(self._pending_base)
                self.fs.write_atomic(self.meta_path, json.dumps(doc, sort_keys=True).encode())
        except OSError as e:
            raise StoreFatal(f"writing {self.meta_path} failed: {e}") from e


def _parse_base_state(raw: bytes, what: str) -> tuple[int, int | None, bytes]:
    """(base pos, base chain CRC, the broker's state) from ENTRY_BASE_STATE + state; StoreFatal
    if damaged. A header written before base_chain existed (ENTRY_BASE_STATE_V1, told apart by
    its state CRC) gives None for the chain."""
    for layout in (L.ENTRY_BASE_STATE, L.ENTRY_BASE_STATE_V1):
        if len(raw) >= layout.size:
            *head, crc = layout.unpack_from(raw)
            app = raw[layout.size:]
            if head[0] >= 0 and _crc32(app) == crc:
                return head[0], (head[1] if len(head) == 2 else None), app
    raise StoreFatal(f"{what} is damaged ({len(raw)} bytes; no header whose state CRC matches)")


def _within_budget(entries: list[Entry], max_bytes: int) -> list[Entry]:
    # The common case, all of them fit: summed at C speed, no per-entry Python step.
    if HEADER * len(entries) + sum(map(len, map(_BODY, entries))) <= max_bytes:
        return entries
    used = 0
    for n, e in enumerate(entries):
        used += HEADER + len(e.body)
        if n and used > max_bytes:
            return entries[:n]
    return entries


def _looks_like_record(body: bytes) -> bool:
    return len(body) >= L.MESSAGE_HEADER.size and \
        int.from_bytes(body[_MAGIC_AT:_MAGIC_AT + 4], "big") == L.MESSAGE_MAGIC


def _check_record_offset(e: Entry, pos: int) -> None:
    """A NORMAL body is a commitlog record whose PHYSICALOFFSET must be pos + 48."""
    if not _looks_like_record(e.body):
        return  # not a commitlog record (tests, or a future body kind): nothing to check
    phys = int.from_bytes(e.body[_PHYS_AT:_PHYS_AT + 8], "big", signed=True)
    if phys != pos + HEADER:
        raise StoreFatal(f"entry {e.index}: record says physical offset {phys} but lands at {pos + HEADER}; "
                         "do all replicas use the same data segment size?")

"""A simulated disk for one node: durability, crashes, torn writes, bit flips.

The disk implements the RaftStorage protocol (what the core reads) and the
write side the shell uses. Its model of durability:
- appended entries are *written* but not durable until `sync()`;
- truncation, reset and the hard state are durable at once (the shell fsyncs
  them before acknowledging, as the real store must);
- `crash()` loses a random part of the unsynced tail and may tear the last
  surviving record;
- `flip_bit()` corrupts one old, synced record (one that has a synced record
  after it, so recovery can tell corruption from a torn tail);
- `recover()` scans CRCs like the real recovery: a bad last record is a torn
  write and is dropped; a bad record followed by good ones is corruption, the
  log is cut before it and `needs_catchup_to` is raised to the old last index.
"""

from __future__ import annotations

import random
import struct
import zlib
from dataclasses import dataclass, replace

from dledger.messages import Entry, HardState
from dledger.raft_storage import Compacted, NotCached, entry_size_bytes

_CRC_HEADER = struct.Struct(">QQI")  # index, term, type: what the CRC covers besides the body


def entry_crc(entry: Entry) -> int:
    header = _CRC_HEADER.pack(entry.index, entry.term, int(entry.type))
    return zlib.crc32(entry.body, zlib.crc32(header))


@dataclass(slots=True)
class _Record:
    entry: Entry
    crc: int


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    dropped_from: int | None  # first index dropped, None if nothing was
    corrupted: bool  # a bad record in the middle of the log (not a torn tail)
    old_last_index: int


class SimDisk:
    def __init__(self) -> None:
        self._hard_state = HardState(0, None)
        self._base_index = 0
        self._base_term = 0
        self._base_state = b""
        self._records: list[_Record] = []
        self._synced = 0  # number of leading records that are durable
        # Cold reads: a push's entries (entries(..., may_defer=True)) answer NotCached with this
        # probability, as if out of the page cache; `pending_fill` until the cluster, a tick
        # later, tells the core they are read in (RaftCore.entries_fetched).
        self.cold_rate = 0.0
        self.cold_rng = random.Random(0)
        self.pending_fill = False

    # --- RaftStorage ---------------------------------------------------------------

    def initial_state(self) -> HardState:
        return self._hard_state

    def first_index(self) -> int:
        return self._base_index + 1

    def last_index(self) -> int:
        return self._base_index + len(self._records)

    def term(self, index: int) -> int:
        if index < self._base_index:
            raise Compacted(index, self.first_index())
        assert index <= self.last_index(), (index, self.last_index())
        if index == self._base_index:
            return self._base_term
        return self._records[index - self._base_index - 1].entry.term

    def entries(self, lo: int, hi: int, max_bytes: int, may_defer: bool = False) -> list[Entry]:
        if lo < self.first_index():
            raise Compacted(lo, self.first_index())
        assert lo < hi <= self.last_index() + 1, (lo, hi, self.last_index())
        if may_defer and self.cold_rate and self.cold_rng.random() < self.cold_rate:
            self.pending_fill = True
            raise NotCached(lo)
        taken: list[Entry] = []
        used = 0
        for record in self._records[lo - self._base_index - 1 : hi - self._base_index - 1]:
            used += entry_size_bytes(record.entry)
            if taken and used > max_bytes:
                break
            taken.append(record.entry)
        return taken

    def bytes_from(self, index: int) -> int:
        return sum(entry_size_bytes(r.entry) for r in self._records[max(0, index - self._base_index - 1):])

    # --- write side ------------------------------------------------------------------

    def append(self, entries: tuple[Entry, ...]) -> None:
        for entry in entries:
            assert entry.index == self.last_index() + 1, (entry.index, self.last_index())
            self._records.append(_Record(entry, entry_crc(entry)))

    def truncate_from(self, index: int) -> None:
        assert index >= self.first_index(), (index, self.first_index())
        del self._records[index - self._base_index - 1 :]
        self._synced = min(self._synced, len(self._records))

    def reset_to(self, base_index: int, base_term: int, state: bytes) -> None:
        self._records = []
        self._synced = 0
        self._base_index, self._base_term, self._base_state = base_index, base_term, state

    def set_hard_state(self, hard_state: HardState) -> None:
        self._hard_state = hard_state

    def sync(self) -> None:
        self._synced = len(self._records)

    def synced_index(self) -> int:
        return self._base_index + self._synced

    def compact(self, upto: int, state: bytes) -> None:
        """Retention: forget synced entries <= upto; `state` is the state as of upto."""
        assert self._base_index < upto <= self.synced_index(), (upto, self._base_index, self.synced_index())
        term = self.term(upto)
        dropped = upto - self._base_index
        del self._records[:dropped]
        self._synced -= dropped
        self._base_index, self._base_term, self._base_state = upto, term, state

    def base_state(self) -> bytes:
        return self._base_state

    # --- what checkers may look at --------------------------------------------------

    def base(self) -> tuple[int, int]:
        return self._base_index, self._base_term

    def synced_entry(self, index: int) -> Entry | None:
        position = index - self._base_index - 1
        if 0 <= position < self._synced:
            return self._records[position].entry
        return None

    def synced_term(self, index: int) -> int | None:
        if index == self._base_index:
            return self._base_term
        entry = self.synced_entry(index)
        return entry.term if entry is not None else None

    # --- faults -------------------------------------------------------------------------

    def crash(self, rng: random.Random, torn: bool) -> None:
        """Power loss: keep the synced prefix and a random part of the rest."""
        unsynced = len(self._records) - self._synced
        keep = self._synced + rng.randint(0, unsynced)
        del self._records[keep:]
        if torn and keep > self._synced:
            last = self._records[-1]
            self._records[-1] = _Record(last.entry, last.crc ^ 0x1)  # half-written record
        # Whatever survived is what the disk holds now.
        self._synced = len(self._records)

    def flip_bit(self, rng: random.Random) -> int | None:
        """Corrupt one synced record that has a synced record after it."""
        if self._synced < 2:
            return None
        position = rng.randrange(0, self._synced - 1)
        record = self._records[position]
        body = bytearray(record.entry.body or b"\x00")
        bit = rng.randrange(len(body) * 8)
        body[bit // 8] ^= 1 << (bit % 8)
        self._records[position] = _Record(replace(record.entry, body=bytes(body)), record.crc)
        return record.entry.index

    def recover(self) -> RecoveryReport:
        """Scan every record's CRC; cut at the first bad one."""
        old_last = self.last_index()
        for position, record in enumerate(self._records):
            if entry_crc(record.entry) == record.crc:
                continue
            dropped_from = record.entry.index
            corrupted = position < len(self._records) - 1
            del self._records[position:]
            self._synced = len(self._records)
            if corrupted:
                previous = self._hard_state.needs_catchup_to or 0
                self._hard_state = replace(self._hard_state, needs_catchup_to=max(previous, old_last))
            return RecoveryReport(dropped_from, corrupted, old_last)
        return RecoveryReport(None, False, old_last)

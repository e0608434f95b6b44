"""The storage seam of the Raft core.

`RaftStorage` is everything the core reads from stable storage. The shell owns
writes: it applies each `Ready` (reset, truncate, append, hard state) and then
calls `RaftCore.advance`. `MemoryStorage` is the in-memory implementation for
tests and the simulator's model of a disk is built the same way.

`RaftLog` is the core's view of its log: stable storage plus the tail the core
has produced but the shell has not yet persisted (etcd's `unstable`). The core
never asks storage for an entry that storage does not have yet.

Index conventions: a log is a *base* (base_index, base_term) followed by
entries base_index+1 .. last_index. A fresh log has base (0, 0). The base is
always committed: it is either the empty prefix, what retention compacted, or
what a leader installed (InstallBase). A base carries a *base state*: bytes opaque
to the core (the application's state as of the base, b"" for none), which
InstallBase hands to a follower together with the base.
"""

from __future__ import annotations

import operator
from typing import Protocol, Sequence, runtime_checkable

from dledger.messages import Entry, HardState

__all__ = ["Compacted", "MemoryStorage", "RaftLog", "RaftStorage", "entry_size_bytes"]

# An entry's header in the DLedger format (DESIGN.md section 3); used only to
# size batches, so the estimate matches what the transport will frame.
_ENTRY_HEADER_BYTES = 48


def entry_size_bytes(entry: Entry) -> int:
    return _ENTRY_HEADER_BYTES + len(entry.body)


class Compacted(Exception):
    """The requested index lies below the log's base: it was compacted away.

    A local condition, not retriable by asking again; the leader answers it with
    InstallBase."""

    retriable = False
    local = True

    def __init__(self, index: int, first_index: int) -> None:
        super().__init__(f"index {index} is compacted (first retained index is {first_index})")
        self.index = index
        self.first_index = first_index


class NotCached(Exception):
    """The requested entries are stored but old: reading them now could wait for the disk (a
    storage asked with `may_defer`). The storage has started reading them off the event loop;
    the core pushes nothing to that follower until `RaftCore.entries_fetched()`."""

    def __init__(self, index: int) -> None:
        super().__init__(f"entry {index} is old and not in memory; it is being read")
        self.index = index


@runtime_checkable
class RaftStorage(Protocol):
    """Read side of stable storage, as the core sees it."""

    def initial_state(self) -> HardState:
        """The persisted term, vote and catch-up mark (HardState(0, None) if none)."""

    def first_index(self) -> int:
        """Index of the first retained entry (= base_index + 1)."""

    def last_index(self) -> int:
        """Index of the last stored entry (= base_index if there are none)."""

    def term(self, index: int) -> int:
        """Term of entry `index`; term(first_index() - 1) is the base term.

        Raises Compacted below the base. `index` <= last_index() always."""

    def entries(self, lo: int, hi: int, max_bytes: int, may_defer: bool = False) -> list[Entry]:
        """Entries lo .. hi-1 (first_index() <= lo < hi <= last_index()+1), stopping
        before max_bytes would be exceeded but always returning at least one. With
        `may_defer` (a push), it may raise NotCached instead of waiting for the disk."""

    def base_state(self) -> bytes:
        """The state stored with the base (what InstallBase sends); b"" for none."""

    def bytes_from(self, index: int) -> int:
        """Bytes of the log from entry `index` to its end: header and body of each entry (and
        whatever a file-based log pads file ends with); 0 past the last entry.
        first_index() <= index."""


_BODY = operator.attrgetter("body")


def _take_within_budget(entries: Sequence[Entry], max_bytes: int) -> list[Entry]:
    # The common case, all of them fit: summed at C speed, no per-entry Python call.
    if _ENTRY_HEADER_BYTES * len(entries) + sum(map(len, map(_BODY, entries))) <= max_bytes:
        return list(entries)
    taken: list[Entry] = []
    used = 0
    for entry in entries:
        used += entry_size_bytes(entry)
        if taken and used > max_bytes:
            break
        taken.append(entry)
    return taken


class MemoryStorage:
    """RaftStorage in memory, plus the write side a shell would have."""

    def __init__(
        self,
        hard_state: HardState | None = None,
        base_index: int = 0,
        base_term: int = 0,
        entries: Sequence[Entry] = (),
    ) -> None:
        self._hard_state = hard_state or HardState(0, None)
        self._base_index = base_index
        self._base_term = base_term
        self._base_state = b""
        self._entries: list[Entry] = []
        self.append(entries)

    # --- RaftStorage -------------------------------------------------------

    def initial_state(self) -> HardState:
        return self._hard_state

    def first_index(self) -> int:
        return self._base_index + 1

    def last_index(self) -> int:
        return self._base_index + len(self._entries)

    def term(self, index: int) -> int:
        if index < self._base_index:
            raise Compacted(index, self.first_index())
        if index > self.last_index():
            raise IndexError(f"term({index}) beyond last index {self.last_index()}")
        if index == self._base_index:
            return self._base_term
        return self._entries[index - self._base_index - 1].term

    def entries(self, lo: int, hi: int, max_bytes: int, may_defer: bool = False) -> list[Entry]:
        if lo < self.first_index():
            raise Compacted(lo, self.first_index())
        if not lo < hi <= self.last_index() + 1:
            raise IndexError(f"entries({lo}, {hi}) outside {self.first_index()}..{self.last_index()}")
        offset = self._base_index + 1
        return _take_within_budget(self._entries[lo - offset : hi - offset], max_bytes)

    def base_state(self) -> bytes:
        return self._base_state

    def bytes_from(self, index: int) -> int:
        return sum(map(entry_size_bytes, self._entries[max(0, index - self._base_index - 1):]))

    # --- write side ------------------------------------------------------------

    def append(self, entries: Sequence[Entry]) -> None:
        """Append entries that continue the log exactly (truncation is explicit)."""
        for entry in entries:
            if entry.index != self.last_index() + 1:
                raise ValueError(f"entry {entry.index} does not follow last index {self.last_index()}")
            self._entries.append(entry)

    def truncate_from(self, index: int) -> None:
        """Delete every entry with index >= `index`."""
        if index < self.first_index():
            raise Compacted(index, self.first_index())
        del self._entries[index - self._base_index - 1 :]

    def set_hard_state(self, hard_state: HardState) -> None:
        self._hard_state = hard_state

    def reset_to(self, base_index: int, base_term: int, state: bytes = b"") -> None:
        """Drop everything; the log restarts after (base_index, base_term)."""
        self._entries = []
        self._base_index = base_index
        self._base_term = base_term
        self._base_state = state

    def compact(self, upto: int, state: bytes = b"") -> None:
        """Retention: forget entries <= upto (which must be committed); `state` is the
        application's state as of upto."""
        if upto <= self._base_index:
            return
        term = self.term(upto)
        del self._entries[: upto - self._base_index]
        self._base_index, self._base_term, self._base_state = upto, term, state


class RaftLog:
    """Stable storage plus the not-yet-persisted tail, and the pending
    structural changes (a reset or a truncation) that must reach storage first.

    Invariants:
    - entries with index < `_offset` come from storage (or are the pending base),
      entries >= `_offset` are `_unstable`, contiguous;
    - if storage holds entries >= `_offset` that are no longer part of the log,
      `_truncate` is set (<= `_offset`) or a reset is pending.
    """

    def __init__(self, storage: RaftStorage) -> None:
        self._storage = storage
        self._reset: tuple[int, int, bytes] | None = None
        self._truncate: int | None = None
        self._offset = storage.last_index() + 1
        self._unstable: list[Entry] = []

    # --- reads --------------------------------------------------------------

    def first_index(self) -> int:
        if self._reset is not None:
            return self._reset[0] + 1
        return self._storage.first_index()

    def last_index(self) -> int:
        return self._offset - 1 + len(self._unstable)

    def stable_last_index(self) -> int:
        """Last index the shell has persisted (as of the last advance)."""
        return self._offset - 1

    def term(self, index: int) -> int | None:
        """Term at `index`; None beyond the last index; Compacted below the base."""
        if index >= self._offset:
            position = index - self._offset
            return self._unstable[position].term if position < len(self._unstable) else None
        if self._reset is not None:
            base_index, base_term, _state = self._reset
            if index < base_index:
                raise Compacted(index, base_index + 1)
            return base_term
        return self._storage.term(index)

    def last_term(self) -> int:
        term = self.term(self.last_index())
        assert term is not None
        return term

    def matches(self, index: int, term: int) -> bool:
        """True if the log holds (index, term); False if not or compacted."""
        try:
            return self.term(index) == term
        except Compacted:
            return False

    def entries(self, lo: int, hi: int, max_bytes: int, may_defer: bool = False) -> list[Entry]:
        """Entries lo .. hi-1 within max_bytes (at least one); with `may_defer`, NotCached
        where the stored ones would have to wait for the disk."""
        assert self.first_index() <= lo < hi <= self.last_index() + 1, (lo, hi)
        result: list[Entry] = []
        if lo < self._offset:
            stop = min(hi, self._offset)
            result = self._storage.entries(lo, stop, max_bytes, may_defer)
            if lo + len(result) < stop:
                return result  # the byte budget ran out inside storage
            lo = stop
        if lo < hi:
            tail = self._unstable[lo - self._offset : hi - self._offset]
            if result:
                budget = max_bytes - sum(entry_size_bytes(entry) for entry in result)
                result.extend(tail[: _fit_count(tail, budget)])
            else:
                result = _take_within_budget(tail, max_bytes)
        return result

    def bytes_from(self, index: int) -> int:
        """Bytes the entries index .. last take, stored and not yet (RaftStorage.bytes_from)."""
        stored = 0
        if index < self._offset and self._reset is None:
            stored = self._storage.bytes_from(index)
            if self._storage.last_index() >= self._offset:   # entries a pending truncation drops
                stored -= self._storage.bytes_from(self._offset)
        return stored + sum(map(entry_size_bytes, self._unstable[max(0, index - self._offset):]))

    def is_up_to_date(self, last_index: int, last_term: int) -> bool:
        """Raft 5.4.1: is a candidate's log at least as up to date as ours?"""
        our_term = self.last_term()
        return last_term > our_term or (last_term == our_term and last_index >= self.last_index())

    def find_conflict_by_term(self, index: int, term: int) -> int:
        """Largest k <= index (and >= the base) with term(k) <= term.

        Terms never decrease along a log, so binary search. If even the base's
        term is larger, returns the base index."""
        lo = self.first_index() - 1
        hi = min(index, self.last_index())
        if hi <= lo:
            return lo
        if self._term_known(hi) <= term:
            return hi
        if self._term_known(lo) > term:
            return lo
        # invariant: term(lo) <= term < term(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._term_known(mid) <= term:
                lo = mid
            else:
                hi = mid
        return lo

    def _term_known(self, index: int) -> int:
        term = self.term(index)
        assert term is not None, index
        return term

    # --- writes (staged until the shell persists them) ----------------------------

    def append(self, entries: Sequence[Entry]) -> None:
        assert entries
        assert entries[0].index == self.last_index() + 1, (entries[0].index, self.last_index())
        self._unstable.extend(entries)

    def truncate_from(self, index: int) -> None:
        """Drop entries >= index (index must be above the base)."""
        assert index >= self.first_index(), (index, self.first_index())
        if index > self.last_index():
            return
        if index >= self._offset:
            del self._unstable[index - self._offset :]
            return
        self._unstable.clear()
        self._offset = index
        if self._reset is None:
            self._truncate = index if self._truncate is None else min(self._truncate, index)

    def base_state(self) -> bytes:
        """The state of the base (a pending reset's, else storage's)."""
        return self._reset[2] if self._reset is not None else self._storage.base_state()

    def reset(self, base_index: int, base_term: int, state: bytes = b"") -> None:
        """Restart the log after (base_index, base_term), whose state is `state`."""
        self._reset = (base_index, base_term, state)
        self._truncate = None
        self._unstable.clear()
        self._offset = base_index + 1

    # --- Ready / advance ---------------------------------------------------------

    def has_pending(self) -> bool:
        return bool(self._unstable) or self._truncate is not None or self._reset is not None

    def pending(self) -> tuple[tuple[int, int, bytes] | None, int | None, tuple[Entry, ...]]:
        return self._reset, self._truncate, tuple(self._unstable)

    def persisted(self) -> None:
        """The shell has applied everything `pending()` returned."""
        self._reset = None
        self._truncate = None
        self._offset += len(self._unstable)
        self._unstable.clear()
        assert self._storage.last_index() == self.last_index(), (
            "storage and core disagree about the last index after advance",
            self._storage.last_index(),
            self.last_index(),
        )


def _fit_count(entries: Sequence[Entry], max_bytes: int) -> int:
    """How many leading entries fit in max_bytes (possibly zero)."""
    used = 0
    for count, entry in enumerate(entries):
        used += entry_size_bytes(entry)
        if used > max_bytes:
            return count
    return len(entries)

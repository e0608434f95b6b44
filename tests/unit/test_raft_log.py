"""Tests for the storage seam: MemoryStorage and the core's RaftLog view.

Goal: the core's reads (term, entries within a byte budget, the conflict
search the COMPARE phase relies on) are right across the stable/unstable
boundary and above a compacted base. Method: examples for the edges, and
Hypothesis against linear-scan oracles for the searches.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dledger.messages import Entry, EntryType, HardState
from dledger.raft_storage import Compacted, MemoryStorage, RaftLog, RaftStorage, entry_size_bytes


def make_entries(terms: list[int], start: int = 1, body_size: int = 4) -> list[Entry]:
    return [Entry(start + offset, term, EntryType.NORMAL, b"x" * body_size) for offset, term in enumerate(terms)]


def test_memory_storage_is_a_raft_storage_with_a_base():
    storage = MemoryStorage(hard_state=HardState(3, "a"), base_index=5, base_term=2, entries=make_entries([2, 3], 6))
    assert isinstance(storage, RaftStorage)
    assert storage.initial_state() == HardState(3, "a")
    assert (storage.first_index(), storage.last_index()) == (6, 7)
    assert storage.term(5) == 2  # the base term
    assert storage.term(7) == 3
    with pytest.raises(Compacted):
        storage.term(4)
    with pytest.raises(Compacted):
        storage.entries(5, 7, 1 << 20)


def test_memory_storage_entries_stop_at_the_byte_budget_but_return_at_least_one():
    storage = MemoryStorage(entries=make_entries([1, 1, 1], body_size=10))
    size = entry_size_bytes(storage.entries(1, 2, 1 << 20)[0])
    assert len(storage.entries(1, 4, 2 * size)) == 2
    assert len(storage.entries(1, 4, 1)) == 1


def test_memory_storage_truncate_reset_and_compact():
    storage = MemoryStorage(entries=make_entries([1, 1, 2, 2]))
    storage.truncate_from(3)
    assert storage.last_index() == 2
    storage.compact(1)
    assert (storage.first_index(), storage.term(1)) == (2, 1)
    storage.reset_to(10, 4)
    assert (storage.first_index(), storage.last_index(), storage.term(10)) == (11, 10, 4)
    with pytest.raises(ValueError):
        storage.append(make_entries([4], start=12))


def test_raft_log_reads_across_stable_and_unstable_entries():
    log = RaftLog(MemoryStorage(entries=make_entries([1, 1])))
    log.append(make_entries([2, 2], start=3))
    assert log.last_index() == 4
    assert [log.term(index) for index in range(0, 6)] == [0, 1, 1, 2, 2, None]
    assert [entry.index for entry in log.entries(2, 5, 1 << 20)] == [2, 3, 4]


def test_raft_log_truncation_below_the_stable_tail_is_handed_to_the_shell():
    storage = MemoryStorage(entries=make_entries([1, 1, 1]))
    log = RaftLog(storage)
    log.truncate_from(2)
    log.append(make_entries([2], start=2))
    reset, truncate, entries = log.pending()
    assert (reset, truncate, [entry.index for entry in entries]) == (None, 2, [2])
    assert log.term(2) == 2 and log.term(3) is None
    storage.truncate_from(truncate)
    storage.append(entries)
    log.persisted()
    assert not log.has_pending()
    assert log.stable_last_index() == 2


def test_raft_log_reset_hides_storage_until_persisted():
    log = RaftLog(MemoryStorage(entries=make_entries([1, 1, 1])))
    log.reset(10, 3, b"s")
    assert (log.first_index(), log.last_index(), log.term(10)) == (11, 10, 3)
    with pytest.raises(Compacted):
        log.term(9)
    assert log.pending()[0] == (10, 3, b"s")
    assert log.base_state() == b"s"     # the pending base's state, not storage's


terms_strategy = st.lists(st.integers(min_value=0, max_value=3), min_size=0, max_size=30).map(
    lambda steps: [1 + sum(steps[: i + 1]) for i in range(len(steps))]
)


@given(
    terms=terms_strategy,
    base=st.integers(min_value=0, max_value=5),
    split=st.integers(min_value=0, max_value=30),
    index=st.integers(min_value=0, max_value=40),
    term=st.integers(min_value=0, max_value=100),
)
@settings(max_examples=300)
def test_find_conflict_by_term_matches_a_linear_scan(terms, base, split, index, term):
    base_term = 1 if base else 0
    terms = [max(t, base_term) for t in terms]
    split = min(split, len(terms))
    entries = make_entries(terms, start=base + 1)
    log = RaftLog(MemoryStorage(base_index=base, base_term=base_term, entries=entries[:split]))
    if entries[split:]:
        log.append(entries[split:])
    last = base + len(terms)
    expected = base
    for k in range(base, min(index, last) + 1):
        if log.term(k) <= term:
            expected = k
    assert log.find_conflict_by_term(index, term) == expected


@given(
    sizes=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=20),
    split=st.integers(min_value=0, max_value=20),
    lo=st.integers(min_value=1, max_value=20),
    budget=st.integers(min_value=1, max_value=600),
)
def test_raft_log_entries_respect_the_budget_across_the_boundary(sizes, split, lo, budget):
    entries = [Entry(i + 1, 1, EntryType.NORMAL, b"y" * size) for i, size in enumerate(sizes)]
    split = min(split, len(entries))
    log = RaftLog(MemoryStorage(entries=entries[:split]))
    if entries[split:]:
        log.append(entries[split:])
    lo = min(lo, len(entries))
    got = log.entries(lo, len(entries) + 1, budget)
    expected: list[Entry] = []
    used = 0
    for entry in entries[lo - 1 :]:
        used += entry_size_bytes(entry)
        if expected and used > budget:
            break
        expected.append(entry)
    assert got == expected

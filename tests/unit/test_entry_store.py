"""EntryStore: placement with blanks, crash recovery, bit flips, durable truncation, reset.

Method: real files through FaultyFileSystem, whose crash() loses every write not
followed by an fsync (torn=True keeps a random prefix of the newest one). Small
segment sizes so a few entries cross file ends.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from dledger.entry_store import EntryStore, INDEX_SIZE, place_entry
from dledger.messages import Entry, EntryType, HardState
from dledger.raft_storage import Compacted
from node.store import cold_reads
from node.store import layout as L
from node.store.crc import crc32
from node.store.errors import StoreFatal
from node.store.fileio import FaultyFileSystem
from node.store.reserve import DiskReserve
from node.store.message import MessageDraft, encode_record

SEG = 4096
IDX_SEG = INDEX_SIZE * 16


def open_store(fs, root, seg=SEG) -> EntryStore:
    s = EntryStore(fs, str(root), "n0", data_segment_size=seg, index_segment_size=IDX_SEG)
    s.recover()
    return s


def reopen(s: EntryStore, fs, root):
    s.close()
    s2 = EntryStore(fs, str(root), "n0", data_segment_size=s.segment_size, index_segment_size=IDX_SEG)
    return s2, s2.recover()


def mk(first: int, n: int, term: int = 1, size: int = 300, rng=None) -> list[Entry]:
    out = []
    for i in range(first, first + n):
        body_size = rng.randrange(0, size) if rng else size
        out.append(Entry(i, term, EntryType.NORMAL, bytes([i % 251]) * body_size))
    return out


def test_place_entry_rule():
    assert place_entry(0, 100, 1000) == 0
    assert place_entry(892, 100, 1000) == 892      # 100 + 8 == 108 left: fits
    assert place_entry(893, 100, 1000) == 1000     # 107 left: blank + roll
    assert place_entry(1000, 100, 1000) == 1000


def test_roll_writes_blank_and_reads_back(tmp_path):
    fs = FaultyFileSystem(0)
    s = open_store(fs, tmp_path)
    ents = mk(1, 40)
    pos = s.append(ents)
    end = 0
    for e, p in zip(ents, pos):
        assert p == place_entry(end, 48 + len(e.body), SEG)
        end = p + 48 + len(e.body)
    rolled = [p for p in pos if p % SEG == 0 and p > 0]
    assert rolled, "expected at least one roll"
    before = s.read_body(rolled[0] - 1, 1)
    blank_at = max(q + 48 + 300 for q in pos if q < rolled[0])
    assert L.ENTRY_BLANK.unpack(s.read_body(blank_at, 8)) == (L.ENTRY_MAGIC_BLANK, rolled[0] - blank_at)
    assert before == b"\x00"
    s.flush()
    s, rep = reopen(s, fs, tmp_path)
    assert rep.last_index == 40 and rep.cut_at_index is None
    assert s.entries(1, 41, 1 << 30) == ents
    assert s.entries(5, 41, 700) == ents[4:6]        # byte budget, at least one entry
    assert s.entry_at(17).pos == pos[16]
    assert s.term(0) == 0 and s.term(40) == 1
    assert s.read_entry(pos[3]).body == ents[3].body


@pytest.mark.parametrize("new_names", ["lost", "random"])
@pytest.mark.parametrize("seed", range(25))
def test_recovery_after_torn_crash(tmp_path, seed, new_names):
    """With new_names="random" a crash keeps any of the files created since the last flush,
    a later one without the one before it too (several new names wait for a flush)."""
    rng = random.Random(seed)
    fs = FaultyFileSystem(seed)
    s = open_store(fs, tmp_path)
    written, flushed, idx, term = [], 0, 1, 1
    for _ in range(rng.randrange(1, 12)):
        if rng.random() < 0.2:
            term += 1
        batch = mk(idx, rng.randrange(1, 15), term, size=900, rng=rng)
        s.append(batch)
        written.extend(batch)
        idx += len(batch)
        if rng.random() < 0.4:
            flushed = s.flush()
            s.checkpoint(flushed)
    fs.crash(torn=True, new_names=new_names)
    s, rep = reopen(s, fs, tmp_path)
    assert flushed <= rep.last_index <= len(written)
    assert not rep.lost_durable and s.meta.needs_catchup_to is None
    assert s.entries(1, rep.last_index + 1, 1 << 30) == written[:rep.last_index] if rep.last_index else True
    # The store keeps working: append after the cut, crash again, recover.
    more = mk(rep.last_index + 1, 5, term + 1)
    s.append(more)
    s.flush()
    fs.crash(torn=True)
    s, rep2 = reopen(s, fs, tmp_path)
    assert rep2.last_index == rep.last_index + 5 and rep2.cut_at_index is None
    assert s.entries(rep.last_index + 1, rep2.last_index + 1, 1 << 30) == more
    s.close()


def test_bit_flip_in_old_entry_cuts_and_needs_catchup(tmp_path, caplog):
    # A flip in the header (here the term) breaks the chain: the entry cannot be located with
    # certainty, so recovery cuts. A flip in a committed body alone is kept and repaired in
    # place instead (tests/unit/test_corruption.py).
    fs = FaultyFileSystem(1)
    s = open_store(fs, tmp_path)
    pos = s.append(mk(1, 30))
    s.flush()
    s.checkpoint(30)
    s.close()
    path = os.path.join(s.data.directory, f"{0:020d}")
    with open(path, "r+b") as f:
        f.seek(pos[9] + 20)
        b = f.read(1)
        f.seek(pos[9] + 20)
        f.write(bytes([b[0] ^ 0x10]))
    s2 = EntryStore(fs, str(tmp_path), "n0", data_segment_size=SEG, index_segment_size=IDX_SEG)
    rep = s2.recover()
    assert rep.cut_at_index == 10 and rep.last_index == 9 and rep.lost_durable
    assert rep.needs_catchup_to == 30
    assert s2.initial_state() == HardState(0, None, 30)
    assert "needs_catchup_to=30" in caplog.text
    # The cut is durable and the mark persists across another reopen.
    s3, rep3 = reopen(s2, fs, tmp_path)
    assert rep3.last_index == 9 and rep3.cut_at_index is None
    assert s3.initial_state().needs_catchup_to == 30
    s3.close()


def test_truncation_is_durable_across_crash(tmp_path):
    fs = FaultyFileSystem(2)
    s = open_store(fs, tmp_path)
    s.append(mk(1, 30, term=1))
    s.flush()
    s.truncate_from(12)                  # durable before it returns
    assert s.last_index() == 11
    s.append(mk(12, 3, term=2))          # not flushed
    fs.crash(torn=False)
    s, rep = reopen(s, fs, tmp_path)
    assert rep.last_index == 11, "the truncated tail must not come back (RocketMQ #10666)"
    assert s.term(11) == 1
    # index file agrees
    assert s.entry_at(11).index == 11
    with pytest.raises(KeyError):
        s.entry_at(12)
    s.close()


def test_truncate_removes_blank_and_later_files(tmp_path):
    fs = FaultyFileSystem(3)
    s = open_store(fs, tmp_path)
    pos = s.append(mk(1, 30))
    first_in_2nd = next(i for i, p in enumerate(pos) if p >= SEG) + 1
    s.truncate_from(first_in_2nd)
    assert s.end_pos == pos[first_in_2nd - 2] + 348
    small = [Entry(first_in_2nd, 2, EntryType.NOOP, b"")]
    assert s.append(small) == [s.end_pos - 48]          # fits where the blank was
    s.flush()
    s, rep = reopen(s, fs, tmp_path)
    assert rep.last_index == first_in_2nd and rep.cut_at_index is None
    s.close()


def test_reset_to(tmp_path):
    fs = FaultyFileSystem(4)
    s = open_store(fs, tmp_path)
    s.append(mk(1, 10))
    s.flush()
    s.reset_to(100, 7, base_pos=5 * SEG)
    assert (s.first_index(), s.last_index(), s.term(100)) == (101, 100, 7)
    s.append(mk(101, 3, term=7))
    s.flush()
    s, rep = reopen(s, fs, tmp_path)
    assert (rep.first_index, rep.last_index) == (101, 103)
    assert s.entry_at(101).pos == 5 * SEG
    assert sorted(os.listdir(s.data.directory)) == [f"{5 * SEG:020d}"]
    s.close()


def test_reset_without_pos_learns_it_from_the_record(tmp_path):
    fs = FaultyFileSystem(5)
    s = open_store(fs, tmp_path)
    s.reset_to(50, 3)
    d = MessageDraft("T", 0, b"hello", {}).seal()
    body = encode_record(d, 0, 7 * SEG + 48, 1, b"\x7f\x00\x00\x01", 1)
    assert s.append([Entry(51, 3, EntryType.NORMAL, body)]) == [7 * SEG]


def test_record_offset_mismatch_is_fatal(tmp_path):
    s = open_store(FaultyFileSystem(6), tmp_path)
    d = MessageDraft("T", 0, b"hello", {}).seal()
    body = encode_record(d, 0, 999, 1, b"\x7f\x00\x00\x01", 1)
    with pytest.raises(StoreFatal, match="segment size"):
        s.append([Entry(1, 1, EntryType.NORMAL, body)])


def test_index_file_damage_is_rebuilt(tmp_path):
    fs = FaultyFileSystem(7)
    s = open_store(fs, tmp_path)
    ents = mk(1, 40)
    s.append(ents)
    s.flush()
    s.close()
    idx_dir = s.index.directory
    with open(os.path.join(idx_dir, f"{0:020d}"), "r+b") as f:
        f.seek(5 * INDEX_SIZE + 3)
        f.write(b"\xff")
    s2 = EntryStore(fs, str(tmp_path), "n0", data_segment_size=SEG, index_segment_size=IDX_SEG)
    rep = s2.recover()
    assert rep.index_rebuilt_from == 5 and rep.last_index == 40
    for i in range(1, 41):
        assert s2.entry_at(i).index == i
    s2._cache.clear()
    s2._cache_pos.clear()
    assert s2.entries(1, 41, 1 << 30) == ents
    s2.close()


def test_hard_state_persists(tmp_path):
    fs = FaultyFileSystem(8)
    s = open_store(fs, tmp_path)
    s.set_hard_state(HardState(4, "n2", None))
    fs.crash()
    s, _ = reopen(s, fs, tmp_path)
    assert s.initial_state() == HardState(4, "n2", None)


def test_missing_index_file_in_the_middle_rebuilds_from_there(tmp_path):
    """The index files after the gap are set aside (SegmentedFile.load) and the index is
    rebuilt from the data, from the first entry the missing file held."""
    fs = FaultyFileSystem(9)
    s = open_store(fs, tmp_path)
    ents = mk(1, 40)
    s.append(ents)
    s.flush()
    s.close()
    os.remove(os.path.join(s.index.directory, f"{IDX_SEG:020d}"))
    s2 = EntryStore(fs, str(tmp_path), "n0", data_segment_size=SEG, index_segment_size=IDX_SEG)
    rep = s2.recover()
    assert rep.index_rebuilt_from == IDX_SEG // 32 and rep.last_index == 40
    assert os.path.exists(os.path.join(s.index.directory, f"{2 * IDX_SEG:020d}.orphan"))
    assert [s2.entry_at(i).index for i in range(1, 41)] == list(range(1, 41))
    s2.close()


def test_cached_entries_are_the_stored_ones_or_nothing(tmp_path):
    """The replay of committed entries reads the in-memory cache directly: the same entries as
    `entries()`, and [] (the caller reads the disk) for any range not wholly cached."""
    fs = FaultyFileSystem()
    s = open_store(fs, str(tmp_path))
    s.append(mk(1, 30))
    assert s.cached_entries(3, 31) == s.entries(3, 31, 1 << 30)
    assert s.cached_entries(5, 6) == s.entries(5, 6, 1 << 30)
    assert s.cached_entries(3, 32) == [] and s.cached_entries(7, 7) == []
    s.truncate_from(20)
    assert s.cached_entries(10, 21) == [] and s.cached_entries(10, 20) == s.entries(10, 20, 1 << 30)
    s2, _ = reopen(s, fs, str(tmp_path))   # a reopened store has nothing cached
    assert s2.cached_entries(1, 20) == [] and len(s2.entries(1, 20, 1 << 30)) == 19


def test_scan_spans_from_the_cache_equal_the_spans_read_from_the_files(tmp_path):
    """DLedgerLog.scan_spans serves recent entries from the store's cache: the same records, the
    same physical offsets and the same next positions as walking the files, across blanks
    (small files), no-ops, a committed limit inside the log and small byte budgets."""
    from dledger.dledger_log import DLedgerLog
    from node.store.scrub import CorruptionRegistry
    fs = FaultyFileSystem()
    s = open_store(fs, str(tmp_path))
    rng = random.Random(9)
    index = 0
    for _ in range(60):
        index += 1
        if index % 11 == 0:
            s.append([Entry(index, 1, EntryType.NOOP, b"")])
            continue
        d = MessageDraft("T", index % 3, bytes([index % 251]) * rng.randrange(1, 700), {}).seal()
        pos = place_entry(s.end_pos, L.ENTRY_HEADER.size + d.total_size, SEG)
        s.append([Entry(index, 1, EntryType.NORMAL, encode_record(d, index, pos + L.ENTRY_HEADER.size, 1,
                                                                   b"\x7f\x00\x00\x01", 1))])

    def view(store, limit):
        lg = object.__new__(DLedgerLog)
        lg.store, lg.corruption, lg._scan_floor, lg._committed_pos = store, CorruptionRegistry(), 0, limit
        return lg

    def walk(lg, budget):
        out, pos = [], lg.min_position
        while pos < lg.committed_position:
            spans, nxt = lg.scan_spans(pos, budget)
            assert nxt > pos
            out.append(([(bytes(b[at:at + n]), phys) for b, at, phys, n in spans], nxt))
            pos = nxt
        return out

    s.close()
    cold = open_store(fs, str(tmp_path))        # nothing cached: every span is read from the files
    s2 = open_store(fs, str(tmp_path))
    s2._cache, s2._cache_pos = list(s._cache), list(s._cache_pos)   # the written entries, cached
    assert s2.cached_spans(s2.start_pos, s2.end_pos, 1 << 20) is not None
    served, blanks, real = [], [], s2.cached_spans

    def counted(pos, limit, max_bytes):
        got = real(pos, limit, max_bytes)
        served.append(got is not None)
        blanks.append(got is not None and pos not in s2._cache_pos)
        return got
    s2.cached_spans = counted
    for limit in (s2.end_pos, s2.entry_at(37).end):
        for budget in (1, 900, 3000, 1 << 20):
            assert walk(view(s2, limit), budget) == walk(view(cold, limit), budget), (limit, budget)
    assert all(served) and any(blanks)     # the cache served every call, blank tails included


def test_a_full_disk_skips_the_checkpoint_and_refuses_a_term_or_vote_keeping_the_old_one(tmp_path, caplog):
    """Regression: the periodic durable-mark checkpoint failed with ENOSPC as StoreFatal, which
    stopped a DLedger leader whose disk had filled although it was refusing sends already."""
    from node.store.errors import DiskFull
    fs = FaultyFileSystem(8)
    s = open_store(fs, tmp_path)
    s.append(mk(1, 3))
    s.flush()
    fs.write_budget_bytes = 0                  # the disk is full from here on
    s.checkpoint(3)                            # no exception: the mark on disk stays as it was
    assert "durable mark not checkpointed: disk full" in caplog.text
    assert s.meta.checkpoint_index == 3
    with pytest.raises(DiskFull, match="term 2 and vote n1 not stored"):
        s.set_hard_state(HardState(2, "n1", None))
    assert s.initial_state().term == 0         # the shell holds the Ready and retries it
    fs.write_budget_bytes = None
    s.set_hard_state(HardState(2, "n1", None))  # space is back: the next meta write carries the mark
    s2, _ = reopen(s, fs, tmp_path)
    assert s2.meta.checkpoint_index == 3 and s2.meta.term == 2


@pytest.mark.parametrize("budget", [0, 100, 3000, 5000])
def test_an_append_that_meets_a_full_disk_leaves_the_store_as_it_was(tmp_path, budget):
    """ENOSPC part-way through an append (also after it rolled to a new file): DiskFull, the
    bytes that landed cut away, and the same entries append cleanly once there is space."""
    from node.store.errors import DiskFull
    fs = FaultyFileSystem(9)
    s = open_store(fs, tmp_path)
    s.append(mk(1, 5))
    s.flush()
    last, end, term = s.last_index(), s.end_pos, s.last_term
    fs.write_budget_bytes = budget
    batch = mk(6, 20, term=2)                  # ~7 KB: crosses into the next 4 KiB file
    with pytest.raises(DiskFull, match="ENOSPC"):
        s.append(batch)
    assert (s.last_index(), s.end_pos, s.last_term) == (last, end, term)
    with pytest.raises(Exception):
        s.entry_at(6)
    fs.write_budget_bytes = None
    assert s.append(batch)[0] == end
    s.flush()
    s2, report = reopen(s, fs, tmp_path)
    assert report.cut_at_index is None and s2.last_index() == 25
    assert [e.body for e in s2.entries(1, 26, 1 << 20)] == [e.body for e in mk(1, 5) + batch]


# --- retention: compact_to and the base state ------------------------------------------------


def _first_of_file(pos: list[int], file_no: int) -> int:
    """The index of the first entry at or past the start of data file `file_no` (0-based)."""
    return next(i for i, p in enumerate(pos, 1) if p >= file_no * SEG)


def _filled(fs, root, n=60):
    s = open_store(fs, root)
    pos = s.append(mk(1, n))
    s.flush()
    s.checkpoint(n)
    return s, pos


def test_compact_to_deletes_whole_files_below_the_new_base_and_survives_a_restart(tmp_path):
    fs = FaultyFileSystem(20)
    s, pos = _filled(fs, tmp_path)
    k = _first_of_file(pos, 3)     # first entry of the 4th file
    removed = s.compact_to(k - 1, b"queues as of k-1")
    assert sorted(os.path.basename(p) for p in removed if "/data/" in p) == [f"{i * SEG:020d}" for i in range(3)]
    assert (s.first_index(), s.start_pos, s.term(k - 1)) == (k, 3 * SEG, 1)
    assert s.entries(k, 61, 1 << 30) == mk(1, 60)[k - 1:]
    with pytest.raises(Compacted):
        s.entries(k - 1, k, 1 << 30)
    s, rep = reopen(s, fs, tmp_path)
    assert (rep.first_index, rep.last_index, rep.cut_at_index) == (k, 60, None)   # chain seeded from the base
    assert s.base_app_state == b"queues as of k-1"
    assert s.entry_at(k).pos == pos[k - 1] == 3 * SEG
    assert sorted(n for n in os.listdir(s.dir) if n.startswith("base-")) == [f"base-{k - 1:020d}.state"]
    s.close()


def test_compact_to_refuses_what_is_not_committed_fsynced_and_followed(tmp_path):
    fs = FaultyFileSystem(21)
    s = open_store(fs, tmp_path)
    s.append(mk(1, 10))
    s.flush()
    s.checkpoint(5)
    with pytest.raises(ValueError):
        s.compact_to(6, b"")           # above the durable mark
    with pytest.raises(ValueError):
        s.compact_to(10, b"")          # nothing after it
    s.append(mk(11, 2))                # not fsynced
    s.checkpoint(12)
    assert s.compact_to(5, b"x") == [] and s.first_index() == 6
    s.close()


def _leader_cut_before_file_2(fs, root):
    """A filled store cut below its third data file; (store, entry positions, its first index)."""
    leader, pos = _filled(fs, root)
    k = _first_of_file(pos, 2)
    leader.compact_to(k - 1, b"table")
    return leader, pos, k


def test_a_follower_reset_with_the_leaders_base_state_continues_at_the_leaders_positions(tmp_path):
    fs = FaultyFileSystem(22)
    leader, pos, k = _leader_cut_before_file_2(fs, tmp_path / "a")
    follower = open_store(fs, tmp_path / "b")
    follower.append(mk(1, 3))
    follower.flush()
    follower.reset_to(k - 1, 1, leader.base_state())
    assert (follower.start_pos, follower.base_app_state, follower.first_index()) == (2 * SEG, b"table", k)
    assert follower.append(leader.entries(k, 61, 1 << 30)) == pos[k - 1:]
    follower.flush()
    follower, rep = reopen(follower, fs, tmp_path / "b")
    assert (rep.first_index, rep.last_index, follower.base_app_state) == (k, 60, b"table")
    assert follower.base_state() == leader.base_state()
    follower.close()
    leader.close()


def _raw_entries(store: EntryStore, first: int, last: int) -> list[bytes]:
    return [store.data.read(e.pos, e.end - e.pos) for e in map(store.entry_at, range(first, last + 1))]


def test_regression_a_follower_reset_to_the_leaders_base_chains_its_entries_as_the_leader_does(tmp_path):
    """The reset seeded the follower's chain CRC with 0 where the leader's entry after the base
    chains from the base entry's: the two replicas' committed entries differed in chain_crc (the
    audit's committed divergence, found by the random-fault runs' retention fault)."""
    fs = FaultyFileSystem(23)
    leader, _, k = _leader_cut_before_file_2(fs, tmp_path / "a")
    assert leader.meta.base_chain != 0
    follower = open_store(fs, tmp_path / "b")
    follower.reset_to(k - 1, 1, leader.base_state())
    follower.append(leader.entries(k, 61, 1 << 30))
    follower.flush()
    assert _raw_entries(follower, k, 60) == _raw_entries(leader, k, 60)
    follower, rep = reopen(follower, fs, tmp_path / "b")      # recovery checks the chain from the base
    assert (rep.first_index, rep.last_index, follower.meta.base_chain) == (k, 60, leader.meta.base_chain)
    follower.close()
    leader.close()


def test_a_base_state_file_written_before_the_chain_was_kept_is_still_read(tmp_path):
    fs = FaultyFileSystem(24)
    s, _, k = _leader_cut_before_file_2(fs, tmp_path / "a")
    path = s._state_path(k - 1)
    s.close()
    with open(path, "wb") as f:     # the 12-byte header of before: base_pos, state_crc
        f.write(L.ENTRY_BASE_STATE_V1.pack(2 * SEG, __import__("zlib").crc32(b"table")) + b"table")
    s, rep = reopen(s, fs, tmp_path / "a")
    assert (rep.first_index, s.base_app_state, s.start_pos) == (k, b"table", 2 * SEG)
    with open(path, "r+b") as f:    # neither header's CRC matches: damaged
        f.seek(20)
        f.write(b"X")
    s.close()
    with pytest.raises(StoreFatal, match="damaged"):
        reopen(s, fs, tmp_path / "a")


def test_a_crash_between_the_state_file_and_meta_keeps_the_old_base(tmp_path):
    fs = FaultyFileSystem(23)
    s, pos = _filled(fs, tmp_path)
    s.compact_to(5, b"old")
    s._write_base_state(20, pos[20], 0, b"new")     # compact_to's first step, then the crash
    s, rep = reopen(s, fs, tmp_path)
    assert (rep.first_index, s.base_app_state) == (6, b"old")
    assert [n for n in os.listdir(s.dir) if n.startswith("base-")] == [f"base-{5:020d}.state"]
    s.close()


def test_between_write_base_and_cut_the_store_serves_the_old_base_and_every_meta_write_names_the_new(tmp_path):
    """A node writes a compaction's base on a worker thread (write_base) and takes it in memory
    on its loop (cut_below_base). Between the two, reads see the old base, and a checkpoint
    or term write (another thread) must not put the old base back on disk: the files below
    the new one may be gone by the next crash."""
    fs = FaultyFileSystem(27)
    s, pos = _filled(fs, tmp_path)
    k = _first_of_file(pos, 2)
    new = s.plan_base(k - 1, b"as of k-1")
    s.write_base(new)
    assert (s.first_index(), s.start_pos, s.entries(1, 2, 1 << 30)) == (1, 0, mk(1, 1))
    s.set_hard_state(HardState(term=3, voted_for="n1"))      # a meta write before the cut
    on_disk = json.loads(fs.read_file(s.meta_path))
    assert (on_disk["base_index"], on_disk["base_pos"], on_disk["term"]) == (k - 1, 2 * SEG, 3)
    removed = s.cut_below_base(new)
    assert sorted(os.path.basename(p) for p in removed if "/data/" in p) == [f"{i * SEG:020d}" for i in range(2)]
    assert (s.first_index(), s.start_pos, s.base_app_state) == (k, 2 * SEG, b"as of k-1")
    s, rep = reopen(s, fs, tmp_path)
    assert (rep.first_index, rep.last_index, s.base_app_state, s.initial_state().term) == (k, 60, b"as of k-1", 3)
    s.close()


def test_a_crash_after_write_base_recovers_to_the_new_base(tmp_path):
    fs = FaultyFileSystem(28)
    s, pos = _filled(fs, tmp_path)
    k = _first_of_file(pos, 2)
    s.write_base(s.plan_base(k - 1, b"new"))      # the worker's part; the loop's never ran
    s, rep = reopen(s, fs, tmp_path)
    assert (rep.first_index, s.start_pos, s.base_app_state) == (k, 2 * SEG, b"new")
    assert s.entries(k, 61, 1 << 30) == mk(1, 60)[k - 1:]
    s.close()


def test_a_reset_between_write_base_and_cut_wins_and_the_cut_does_nothing(tmp_path):
    fs = FaultyFileSystem(29)
    leader, lpos = _filled(fs, tmp_path / "a")
    k = _first_of_file(lpos, 3)
    leader.compact_to(k - 1, b"leader's table")
    s, _ = _filled(fs, tmp_path / "b", n=20)
    new = s.plan_base(10, b"mine")
    s.write_base(new)
    s.reset_to(k - 1, 1, leader.base_state())         # InstallBase lands before the loop's cut
    assert s.cut_below_base(new) == []
    assert (s.first_index(), s.start_pos, s.base_app_state) == (k, 3 * SEG, b"leader's table")
    s.set_hard_state(HardState(term=2, voted_for=None))
    assert json.loads(fs.read_file(s.meta_path))["base_index"] == k - 1
    s, rep = reopen(s, fs, tmp_path / "b")
    assert (rep.first_index, s.base_app_state) == (k, b"leader's table")
    s.close()
    leader.close()


def test_a_damaged_base_state_stops_recovery_with_a_clear_error(tmp_path):
    fs = FaultyFileSystem(24)
    s, _ = _filled(fs, tmp_path)
    s.compact_to(5, b"queue table")
    path = s._state_path(5)
    s.close()
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 1
    open(path, "wb").write(bytes(raw))
    with pytest.raises(StoreFatal, match="damaged"):
        EntryStore(fs, str(tmp_path), "n0", data_segment_size=SEG, index_segment_size=IDX_SEG).recover()


RESERVE = 8192


def _with_reserve(fs, root, reserve=RESERVE) -> EntryStore:
    s = EntryStore(fs, str(root), "n0", data_segment_size=SEG, index_segment_size=IDX_SEG,
                   reserve=DiskReserve(fs, str(root), reserve))
    s.recover()
    return s


def test_a_disk_full_to_the_last_block_gives_up_the_reserve_for_a_cut_which_then_puts_it_back(tmp_path, caplog):
    """Regression: with the disk full (not just past the guard's ratio) a cut could not write its
    base state, so nothing was ever deleted and the disk stayed full."""
    from node.store.errors import DiskFull
    fs = FaultyFileSystem(26)
    s = _with_reserve(fs, tmp_path)
    assert os.path.getsize(s.reserve.path) == RESERVE
    s.append(mk(1, 60))
    s.flush()
    s.checkpoint(60)
    fs.write_budget_bytes = 0                      # not one block left
    with pytest.raises(DiskFull):
        s.append(mk(61, 1))
    removed = s.compact_to(30, b"state")
    assert removed and "the 8192-byte reserve" in caplog.text and s.reserve.given_up == 1
    assert (s.first_index(), s.base_app_state) == (31, b"state")
    assert os.path.getsize(s.reserve.path) == RESERVE, "put back from the room the cut made"
    s, rep = reopen(s, fs, tmp_path)
    assert (rep.first_index, rep.last_index, s.base_app_state) == (31, 60, b"state")
    s.close()


def test_a_reset_on_a_disk_full_to_the_last_block_gives_up_the_reserve_and_a_state_larger_than_it_changes_nothing(
        tmp_path, caplog):
    """Regression: a follower's reset to the leader's base (InstallBase) on a full disk stopped
    the node (StoreFatal) though the reset frees every old file. Its base state file and meta
    now take the reserve, as a cut's do; a state larger than the reserve raises DiskFull (the
    node holds the reset and tries again) and leaves meta and the log as they were."""
    from node.store.errors import DiskFull
    fs = FaultyFileSystem(27)
    s = _with_reserve(fs, tmp_path / "a")
    s.append(mk(1, 60))
    s.flush()
    s.checkpoint(60)
    fs.write_budget_bytes = 0                      # not one block left
    s.commit_reset(s.prepare_reset(200, 3, b""))
    assert "the 8192-byte reserve" in caplog.text and s.reserve.given_up == 1
    assert (s.first_index(), s.last_index()) == (201, 200)
    s, rep = reopen(s, fs, tmp_path / "a")
    assert (rep.first_index, rep.last_index) == (201, 200)
    s.close()

    fs = FaultyFileSystem(28)
    s = _with_reserve(fs, tmp_path / "b")
    s.append(mk(1, 60))
    s.flush()
    s.checkpoint(60)
    fs.write_budget_bytes = 0
    big = L.ENTRY_BASE_STATE.pack(0, 0, crc32(b"x" * 3 * RESERVE)) + b"x" * 3 * RESERVE
    with pytest.raises(DiskFull, match="base 200"):
        s.prepare_reset(200, 3, big)
    assert (s.first_index(), s.last_index()) == (1, 60)
    fs.write_budget_bytes = None
    s, rep = reopen(s, fs, tmp_path / "b")
    assert (rep.first_index, rep.last_index) == (1, 60), "meta names the old base still"
    s.close()


def test_a_restart_on_a_full_disk_writes_nothing_when_recovery_changed_nothing(tmp_path, caplog):
    """Regression (random-fault runs): recovery rewrote meta at every start, so a node restarted
    on a disk full to the last block whose reserve an earlier start had already spent stopped
    with ENOSPC. Meta is written only when recovery changed it."""
    fs = FaultyFileSystem(29)
    s = _with_reserve(fs, tmp_path)
    s.append(mk(1, 60))
    s.flush()
    s.checkpoint(60)
    s.close()
    os.remove(s.reserve.path)                      # spent by an earlier start on this full disk
    fs.write_budget_bytes = 0
    meta = open(s.meta_path, "rb").read()
    s = EntryStore(fs, str(tmp_path), "n0", data_segment_size=SEG, index_segment_size=IDX_SEG,
                   reserve=DiskReserve(fs, str(tmp_path), RESERVE))
    rep = s.recover()
    assert (rep.first_index, rep.last_index) == (1, 60) and open(s.meta_path, "rb").read() == meta
    assert "is given up" not in caplog.text
    s.close()


def test_a_restart_on_a_full_disk_writes_meta_into_the_reserve_and_a_state_larger_than_it_deletes_nothing(tmp_path, caplog):
    from node.store.errors import DiskFull
    fs = FaultyFileSystem(27)
    s = _with_reserve(fs, tmp_path)
    s.append(mk(1, 60))
    s.flush()
    s.checkpoint(60)
    torn_at = s.entry_at(60).pos                   # the last, durable entry's header
    seg = s.data.segment_for(torn_at)
    s.close()
    with open(seg.path, "r+b") as f:               # lost below the durable mark: recovery must
        f.seek(torn_at - seg.base)                 # record that in meta
        f.write(bytes(64))
    fs.write_budget_bytes = 0
    s = EntryStore(fs, str(tmp_path), "n0", data_segment_size=SEG, index_segment_size=IDX_SEG,
                   reserve=DiskReserve(fs, str(tmp_path), RESERVE))
    rep = s.recover()                              # meta is rewritten at recovery: it needed the reserve
    assert (rep.first_index, rep.last_index) == (1, 59)
    assert "meta at recovery" in caplog.text and s.reserve.given_up == 1 and not os.path.exists(s.reserve.path)
    files = sorted(os.listdir(s.data.directory))
    with pytest.raises(DiskFull, match="nothing deleted"):
        s.compact_to(30, b"q" * (2 * RESERVE))     # the reserve is spent and too small for this anyway
    assert (s.first_index(), sorted(os.listdir(s.data.directory))) == (1, files)
    assert s.compact_to(30, b"small")              # what the reserve left fits a small state
    assert os.path.getsize(s.reserve.path) == RESERVE
    s.close()


def test_no_reserve_by_default_and_a_reserve_of_the_right_size_is_left_alone(tmp_path):
    fs = FaultyFileSystem(28)
    s = open_store(fs, tmp_path)                   # no reserve given: none made
    assert s.reserve is None and not os.path.exists(os.path.join(str(tmp_path), "reserve"))
    s.close()
    s = _with_reserve(fs, tmp_path)
    mtime = os.stat(s.reserve.path).st_mtime_ns
    s.close()
    s = _with_reserve(fs, tmp_path)
    assert os.stat(s.reserve.path).st_mtime_ns == mtime
    s.close()
    s = EntryStore(fs, str(tmp_path), "n0", data_segment_size=SEG, index_segment_size=IDX_SEG,
                   reserve=DiskReserve(fs, str(tmp_path), 0))
    s.recover()                                    # diskReserveBytes=0 now: the old one goes
    assert not os.path.exists(os.path.join(str(tmp_path), "reserve"))
    s.close()


def test_compact_to_on_a_full_disk_deletes_nothing_and_keeps_the_base(tmp_path):
    from node.store.errors import DiskFull
    fs = FaultyFileSystem(25)
    s, _ = _filled(fs, tmp_path)
    files = sorted(os.listdir(s.data.directory))
    fs.write_budget_bytes = 0
    with pytest.raises(DiskFull, match="nothing deleted"):
        s.compact_to(30, b"state")
    fs.write_budget_bytes = None
    assert (s.first_index(), s.base_app_state, sorted(os.listdir(s.data.directory))) == (1, b"", files)
    s, rep = reopen(s, fs, tmp_path)
    assert (rep.first_index, rep.last_index) == (1, 60)
    s.close()


@pytest.mark.parametrize("damaged", [None, 2, 8192, 8193, 9000, 10_000])
def test_recovery_compares_the_index_file_in_batches(tmp_path, damaged):
    """Regression: recovery read the index file one 32-byte record per pread (a 260 ms event
    loop stall on a node restarting with ~30,000 entries in a random-fault run). It reads
    _INDEX_VERIFY_BATCH records at a time, and still finds a damaged record at or across a
    batch's edge, and an index cut short."""
    from dledger import entry_store as ES
    fs = FaultyFileSystem(11)
    root = tmp_path / "s"
    s = EntryStore(fs, str(root), "n0", data_segment_size=1 << 20, index_segment_size=INDEX_SIZE * 4096)
    s.recover()
    n = 10_000
    for first in range(1, n + 1, 1000):
        s.append(mk(first, 1000, size=10))
    s.flush()
    s.close()
    if damaged == 10_000:        # the index's last file cut short: its last record is gone
        last_file = sorted(os.listdir(s.index.directory))[-1]
        with open(os.path.join(s.index.directory, last_file), "r+b") as f:
            f.truncate((n % 4096) * INDEX_SIZE)
    elif damaged is not None:
        seg, at = divmod(damaged * INDEX_SIZE, INDEX_SIZE * 4096)
        with open(os.path.join(s.index.directory, f"{seg * INDEX_SIZE * 4096:020d}"), "r+b") as f:
            f.seek(at + 3)
            f.write(b"\xff")
    s2 = EntryStore(fs, str(root), "n0", data_segment_size=1 << 20, index_segment_size=INDEX_SIZE * 4096)
    reads = []
    real = s2.index.read
    s2.index.read = lambda offset, size: reads.append(size) or real(offset, size)
    rep = s2.recover()
    assert rep.index_rebuilt_from == damaged and rep.last_index == n
    assert [s2.entry_at(i).index for i in (1, 8192, 8193, n)] == [1, 8192, 8193, n]
    assert len(reads) <= 2 * (n // ES._INDEX_VERIFY_BATCH + 2) + 6, len(reads)
    s2.close()


def test_bytes_from_is_how_far_behind_a_follower_pushed_from_there_is(tmp_path, monkeypatch):
    """The push quota's measure (DLedger's maxWrotePosition - entry pos): exact from the
    index; for an entry whose index record would be an old read on the loop, estimated from
    the log's average entry size instead of waiting for the disk."""
    fs = FaultyFileSystem(30)
    s, pos = _filled(fs, tmp_path)
    end = s.end_pos
    assert [s.bytes_from(i) for i in (1, 30, 60, 61)] == [end - pos[0], end - pos[29], end - pos[59], 0]
    s, _ = reopen(s, fs, tmp_path)                 # nothing cached: entry_at reads the index file
    monkeypatch.setattr(cold_reads, "HOT_BYTES", 0)
    estimate = s.bytes_from(10)
    assert abs(estimate - (end - pos[9])) <= 0.1 * (end - pos[9]), (estimate, end - pos[9])
    s.close()

"""ConsumeQueue and ConsumeQueueStore behaviour.

Goal: units land at queue_offset * 20 across files, re-puts are idempotent, recovery
finds the end after a crash (lost unsynced units come back by re-putting them), the
tail can be cut by commitlog offset and the head expires file by file.
Method: tiny files (4 units each) on real files through FaultyFileSystem, compared
with a plain list model; a Hypothesis state sweep mixes puts, flushes and crashes.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.store import layout as L
from node.store.consume_queue import BLANK_SIZE, ConsumeQueue, ConsumeQueueStore, count_valid_units
from node.store.fileio import FaultyFileSystem, FileSystem

UPF = 4     # units per file


def unit(i: int) -> tuple[int, int, int]:
    """The i-th message of a queue: commitlog offset, size, tags code."""
    return (1000 + i * 100, 100, i * 7 - 3)


def packed(first: int, n: int) -> bytes:
    return b"".join(L.CQ_UNIT.pack(*unit(i)) for i in range(first, first + n))


def open_cq(fs, root, topic="T", qid=0) -> ConsumeQueue:
    cq = ConsumeQueue(fs, str(root), topic, qid, units_per_file=UPF)
    cq.recover()
    return cq


def files_of(cq: ConsumeQueue) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(cq.directory)):
        data = open(os.path.join(cq.directory, name), "rb").read()
        if data.strip(b"\0"):           # an empty trailing file is not content
            out[name] = data
    return out


def test_put_get_and_range_across_files(tmp_path):
    cq = open_cq(FileSystem(), tmp_path)
    for i in range(10):
        cq.put(i, *unit(i))
    assert (cq.min_offset, cq.max_offset) == (0, 10)
    assert [cq.get(i) for i in range(10)] == [unit(i) for i in range(10)]
    assert cq.get(10) is None
    assert cq.get(-1) is None
    assert sorted(os.listdir(cq.directory)) == ["%020d" % (n * UPF * 20) for n in range(3)]
    # A range stops at the end of its file (one pread), and at max_offset.
    assert cq.get_range(2, 10) == [unit(2), unit(3)]
    assert cq.get_range(4, 10) == [unit(i) for i in range(4, 8)]
    assert cq.get_range(8, 10) == [unit(8), unit(9)]
    assert cq.get_range(10, 5) == []


def test_put_units_batch_spanning_files_equals_single_puts(tmp_path):
    fs = FileSystem()
    a = ConsumeQueue(fs, str(tmp_path / "a"), "T", 0, UPF)
    b = ConsumeQueue(fs, str(tmp_path / "b"), "T", 0, UPF)
    a.put_units(0, packed(0, 11))
    for i in range(11):
        b.put(i, *unit(i))
    assert files_of(a) == files_of(b)


def test_reput_identical_is_noop_and_different_is_repaired(tmp_path):
    cq = open_cq(FileSystem(), tmp_path)
    cq.put_units(0, packed(0, 6))
    before = files_of(cq)
    cq.put_units(0, packed(0, 6))
    cq.put_units(2, packed(2, 3))
    assert files_of(cq) == before
    assert cq.max_offset == 6
    assert cq.repaired_units == 0
    # The log is the truth: a unit that differs (torn by a crash) is rewritten from it.
    cq.put(3, 1300, 100, 999)
    assert cq.get(3) == (1300, 100, 999)
    assert cq.repaired_units == 1
    # Overlapping batch that extends past the end: the overlap is compared, the rest appended.
    cq.put_units(4, packed(4, 5))
    assert cq.max_offset == 9
    assert cq.get(8) == unit(8)


def test_gap_in_a_non_empty_queue_is_a_bug(tmp_path):
    cq = open_cq(FileSystem(), tmp_path)
    cq.put(0, *unit(0))
    with pytest.raises(AssertionError, match="gap"):
        cq.put(2, *unit(2))


def test_empty_queue_starting_at_non_zero_offset_fills_head_with_blanks(tmp_path):
    fs = FileSystem()
    cq = open_cq(fs, tmp_path)
    cq.put(6, *unit(6))
    cq.put(7, *unit(7))
    assert (cq.min_offset, cq.max_offset) == (6, 8)
    assert cq.get(5) is None
    assert cq.get_range(6, 5) == [unit(6), unit(7)]
    # Units below min are dropped silently (expired head).
    cq.put(5, *unit(5))
    assert cq.get(5) is None
    assert sorted(os.listdir(cq.directory)) == ["%020d" % (UPF * 20)]
    raw = open(os.path.join(cq.directory, "%020d" % (UPF * 20)), "rb").read()
    assert L.CQ_UNIT.unpack_from(raw, 0) == (0, BLANK_SIZE, 0)
    cq.flush()
    cq.close()
    again = open_cq(fs, tmp_path)
    assert (again.min_offset, again.max_offset) == (6, 8)
    assert again.get(6) == unit(6)


class _CountedDirSyncs(FileSystem):
    def __init__(self):
        self.dir_syncs = 0

    def fsync_dir(self, path):
        self.dir_syncs += 1
        super().fsync_dir(path)


def test_regression_a_queue_started_at_a_non_zero_offset_leaves_its_directory_fsync_to_the_flush(tmp_path):
    """An empty queue started at a non-zero offset (after a DLedger reset: every queue of the
    old log dropped and started again at the base) fsynced its directory at once, in the
    dispatch on the event loop: 1.5 s under a slow-fsync fault in the random-fault runs. Its
    names are derived data, made durable by the queue's next flush (off the loop) instead; a
    crash before it loses units the dispatcher re-puts, as for any unflushed unit."""
    fs = _CountedDirSyncs()
    cq = open_cq(fs, tmp_path)
    before = fs.dir_syncs
    cq.put_units(6, packed(6, 2))
    assert fs.dir_syncs == before, "the start fsynced the directory"
    assert cq.get_range(6, 5) == [unit(6), unit(7)]
    cq.flush()
    assert fs.dir_syncs == before + 1, "the flush makes the new name durable"
    cq.close()
    again = open_cq(FaultyFileSystem(seed=3), tmp_path)
    assert (again.min_offset, again.max_offset) == (6, 8)


def test_recover_after_crash_loses_unsynced_units_and_reput_restores_them(tmp_path):
    fs = FaultyFileSystem(seed=1)
    cq = open_cq(fs, tmp_path)
    cq.put_units(0, packed(0, 6))
    cq.flush()
    cq.put_units(6, packed(6, 5))           # never flushed
    fs.crash()
    cq.close()
    cq = open_cq(fs, tmp_path)
    assert cq.max_offset == 6
    assert cq.get_range(4, 10) == [unit(4), unit(5)]
    cq.put_units(0, packed(0, 11))          # re-dispatch from the checkpoint
    clean = open_cq(FileSystem(), tmp_path / "clean")
    clean.put_units(0, packed(0, 11))
    assert files_of(cq) == files_of(clean)


@pytest.mark.parametrize("seed", range(12))
def test_torn_crash_then_redispatch_gives_identical_files(tmp_path, seed):
    fs = FaultyFileSystem(seed=seed)
    cq = open_cq(fs, tmp_path)
    cq.put_units(0, packed(0, 5))
    cq.flush()
    cq.put_units(5, packed(5, 2))
    cq.put_units(7, packed(7, 3))
    fs.crash(torn=True)
    cq.close()
    cq = open_cq(fs, tmp_path)
    assert 5 <= cq.max_offset <= 10
    cq.put_units(0, packed(0, 12))
    clean = open_cq(FileSystem(), tmp_path / "clean")
    clean.put_units(0, packed(0, 12))
    assert files_of(cq) == files_of(clean)


def test_recover_cuts_garbage_after_an_invalid_unit(tmp_path):
    fs = FileSystem()
    cq = open_cq(fs, tmp_path)
    cq.put_units(0, packed(0, 2))
    # A torn unit: offset written, size still zero; then stray bytes after it (same file).
    seg = cq.file.last()
    seg.handle.pwrite(L.CQ_UNIT.pack(5000, 0, 0) + b"\x01" * 20, 2 * 20)
    cq.close()
    cq = open_cq(fs, tmp_path)
    assert cq.max_offset == 2
    raw = open(os.path.join(cq.directory, "%020d" % 0), "rb").read()
    assert len(raw) == UPF * 20
    assert not raw[40:].strip(b"\0")
    cq.put(2, *unit(2))
    assert cq.get(2) == unit(2)


def test_truncate_past_physical_is_durable(tmp_path):
    fs = FaultyFileSystem()
    cq = open_cq(fs, tmp_path)
    cq.put_units(0, packed(0, 10))
    cq.flush()
    dropped = cq.truncate_past_physical(unit(5)[0])      # units 5.. point at or past the cut
    assert dropped == 5
    assert cq.max_offset == 5
    fs.crash()
    cq.close()
    cq = open_cq(fs, tmp_path)
    assert cq.max_offset == 5
    assert cq.get_range(4, 10) == [unit(4)]
    assert cq.truncate_past_physical(10**12) == 0
    cq.put_units(5, packed(5, 1))
    assert cq.max_offset == 6


def test_truncate_everything(tmp_path):
    cq = open_cq(FileSystem(), tmp_path)
    cq.put_units(0, packed(0, 6))
    assert cq.truncate_past_physical(0) == 6
    assert (cq.min_offset, cq.max_offset) == (0, 0)
    cq.put_units(0, packed(0, 2))
    assert cq.get_range(0, 9) == [unit(0), unit(1)]


def test_delete_expired_raises_min_offset_and_keeps_last_file(tmp_path):
    fs = FileSystem()
    cq = open_cq(fs, tmp_path)
    cq.put_units(0, packed(0, 10))          # files hold units 0-3, 4-7, 8-9
    assert cq.delete_expired(unit(2)[0]) == 0       # file 0's last unit (3) is still live
    assert cq.min_offset == 2                        # ... but the units below min_phys are not
    assert cq.get(1) is None
    assert cq.delete_expired(unit(6)[0]) == 1
    assert cq.min_offset == 6
    assert cq.get_range(6, 10) == [unit(6), unit(7)]
    assert cq.delete_expired(10**12) == 1            # never the last file
    assert (cq.min_offset, cq.max_offset) == (10, 10)
    cq.close()
    again = open_cq(fs, tmp_path)
    assert again.max_offset == 10
    assert again.min_offset == 8                     # recovery knows files, not the log's min
    again.delete_expired(10**12)
    assert again.min_offset == 10


def test_store_loads_and_recovers_every_queue(tmp_path):
    fs = FileSystem()
    store = ConsumeQueueStore(fs, str(tmp_path), units_per_file=UPF)
    store.find_or_create("A", 0).put_units(0, packed(0, 5))
    store.find_or_create("A", 3).put_units(0, packed(0, 2))
    store.find_or_create("%RETRY%g", 1).put_units(0, packed(0, 9))
    store.flush_all()
    store.close()
    again = ConsumeQueueStore(fs, str(tmp_path), units_per_file=UPF)
    assert again.recover_all() == {("A", 0): 5, ("A", 3): 2, ("%RETRY%g", 1): 9}
    assert again.max_offsets() == {("A", 0): 5, ("A", 3): 2, ("%RETRY%g", 1): 9}
    assert again.truncate_past_physical(unit(3)[0]) == 2 + 6
    assert again.max_offsets() == {("A", 0): 3, ("A", 3): 2, ("%RETRY%g", 1): 3}
    assert len(again.queues()) == 3


def test_count_valid_units():
    assert count_valid_units(b"") == 0
    assert count_valid_units(packed(0, 5)) == 5
    assert count_valid_units(packed(0, 3) + bytes(40)) == 3
    assert count_valid_units(L.CQ_UNIT.pack(-1, 5, 0) + packed(0, 2)) == 0


# --- property: any interleaving of batches, flushes and crashes, then re-dispatch -----------
ops = st.lists(st.one_of(st.tuples(st.just("put"), st.integers(1, 7)),
                         st.tuples(st.just("flush"), st.just(0)),
                         st.tuples(st.just("crash"), st.booleans())), max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, seed=st.integers(0, 1000))
def test_property_redispatch_after_any_crash_matches_model(tmp_path_factory, ops, seed):
    root = tmp_path_factory.mktemp("cq")
    fs = FaultyFileSystem(seed=seed)
    cq = open_cq(fs, root)
    produced = 0                        # units the "log" holds
    flushed = 0                         # units known durable
    for op, arg in ops:
        if op == "put":
            # the dispatcher re-puts from its checkpoint, which is <= the CQ end
            cq.put_units(flushed, packed(flushed, produced - flushed + arg))
            produced += arg
        elif op == "flush":
            cq.flush()
            flushed = produced
        else:
            fs.crash(torn=arg, new_names="random" if seed % 2 else "lost")
            cq.close()
            cq = open_cq(fs, root)
            assert flushed <= cq.max_offset <= produced
            assert cq.get_range(0, flushed) == [unit(i) for i in range(min(flushed, UPF))]
            # like the dispatcher's catch_up: re-put what the checkpoint does not cover
            cq.put_units(flushed, packed(flushed, produced - flushed))
    cq.put_units(flushed, packed(flushed, produced - flushed))
    assert cq.max_offset == produced
    got = []
    while len(got) < produced:
        got += cq.get_range(len(got), 100)
    assert got == [unit(i) for i in range(produced)]
    cq.close()


class _ReadSizes(FileSystem):
    """Records the size of every read through its handles."""

    def __init__(self):
        self.reads: list[int] = []

    def open(self, path):
        handle = super().open(path)
        fs = self

        class Recording:
            def __getattr__(self, name):
                return getattr(handle, name)

            def pread(self, size, offset):
                fs.reads.append(size)
                return handle.pread(size, offset)
        r = Recording()
        r.path = handle.path
        return r


def test_regression_recovery_reads_only_the_written_part_of_a_queue_file(tmp_path):
    """Recovery read each queue's last file whole: 6 MB at the default 300,000 units a file,
    created sparse at full size. A node with 2,000 queues took 50 s to start (0.6 s now)."""
    big = 300_000
    cq = ConsumeQueue(FileSystem(), str(tmp_path), "T", 0, units_per_file=big)
    cq.recover()
    cq.put_units(0, packed(0, 3))
    cq.flush()
    cq.close()
    fs = _ReadSizes()
    again = ConsumeQueue(fs, str(tmp_path), "T", 0, units_per_file=big)
    assert again.recover() == 3
    assert [again.get(i) for i in range(3)] == [unit(i) for i in range(3)]
    assert max(fs.reads) <= 1 << 16, fs.reads
    again.close()


def test_recovery_still_cuts_garbage_written_past_a_hole(tmp_path):
    """Bytes past the end of the units, beyond a stretch never written (a torn write far on):
    the file is read whole and the garbage is cut, as before."""
    big = 300_000
    cq = ConsumeQueue(FileSystem(), str(tmp_path), "T", 0, units_per_file=big)
    cq.recover()
    cq.put_units(0, packed(0, 3))
    cq.flush()
    path = cq.file.segments[0].path
    cq.close()
    with open(path, "r+b") as f:
        f.seek(100_000 * 20)
        f.write(packed(100_000, 2))
    again = open_cq_sized(tmp_path, big)
    assert again.max_offset == 3
    with open(path, "rb") as f:
        f.seek(100_000 * 20)
        assert f.read(40) == bytes(40), "the garbage past the end must be zeroed"
    again.close()


def open_cq_sized(root, units_per_file: int) -> ConsumeQueue:
    cq = ConsumeQueue(FileSystem(), str(root), "T", 0, units_per_file=units_per_file)
    cq.recover()
    return cq


def test_data_end_is_where_the_written_bytes_end(tmp_path):
    path = str(tmp_path / "f")
    h = FileSystem().open(path)
    h.truncate(1 << 20)                                   # sparse, nothing written
    assert h.data_end(1 << 20) == 0
    h.pwrite(b"x" * 10, 0)
    assert 10 <= h.data_end(1 << 20) < 1 << 20            # the written block(s), no more
    assert h.data_end(5) == 5                             # never past the limit
    h.pwrite(b"y", 600_000)                               # data after a hole: the whole limit
    assert h.data_end(1 << 20) == 1 << 20
    h.close()

"""IndexFile / IndexService behaviour (RocketMQ IndexService semantics).

Goal: every indexed key is found (also when keys share a slot), newest first and
de-duplicated; time ranges filter whole seconds; a full file rolls and queries span
files; restart, expiry and the repair of files that index past a cut log work.
Method: tiny geometries (a few slots, a few entries) so collisions and rolls are
certain; a Hypothesis sweep compares queries with a dumb dictionary model.
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.store.errors import StoreFatal
from node.store.fileio import FaultyFileSystem, FileSystem
from node.store.index_file import IndexFile, IndexService, _KeyHasher, file_name_for, index_key_hash

T0 = 1_700_000_000_000      # ms
ALL = (0, 2**62)


def service(root, slots=3, entries=50, fs=None) -> IndexService:
    s = IndexService(fs or FileSystem(), str(root), hash_slots=slots, max_entries=entries)
    s.load()
    return s


def test_key_hash_matches_rocketmq_method():
    assert index_key_hash("T", "k") == abs(sum(ord(c) * 31 ** i for i, c in enumerate(reversed("T#k"))) % 2**32)
    # abs(Integer.MIN_VALUE) overflows in Java: RocketMQ maps it to 0.
    hasher = _KeyHasher()
    for topic, key in [("T", "k"), ("TopicTest", "ключ-1"), ("%RETRY%g", "x" * 300), ("T", "")]:
        assert hasher(topic, key) == index_key_hash(topic, key)


@given(topic=st.from_regex(r"[a-zA-Z0-9_%|-]{1,20}", fullmatch=True), key=st.text(max_size=40))
def test_property_fast_hasher_equals_java_hash(topic, key):
    assert _KeyHasher()(topic, key) == index_key_hash(topic, key)


def test_keys_sharing_a_slot_are_all_found(tmp_path):
    idx = service(tmp_path, slots=1)            # one slot: every key collides
    for i in range(10):
        idx.put("T", f"k{i % 3}", 100 * i, T0 + i)
    assert idx.query("T", "k0", *ALL, 32) == [900, 600, 300, 0]
    assert idx.query("T", "k1", *ALL, 32) == [700, 400, 100]
    assert idx.query("T", "k1", *ALL, 2) == [700, 400]
    assert idx.query("T", "nope", *ALL, 32) == []
    assert idx.query("U", "k0", *ALL, 32) == []     # the topic is part of the key
    f = idx.files[0]
    assert (f.index_count, f.hash_slot_count) == (11, 1)
    assert (f.begin_phy_offset, f.end_phy_offset) == (0, 900)


def test_time_range_filters_by_second(tmp_path):
    idx = service(tmp_path, slots=7)
    for s in range(10):
        idx.put("T", "k", 1000 + s, T0 + s * 1000 + 250)
    # Seconds count from the file's first message (T0 + 250): entry 2's second is
    # [T0 + 2250, T0 + 3249], so a range from T0 + 3000 includes it (never a miss).
    assert idx.query("T", "k", T0 + 3250, T0 + 6249, 32) == [1005, 1004, 1003]
    assert idx.query("T", "k", T0 + 3000, T0 + 5999, 32) == [1005, 1004, 1003, 1002]
    # A message stored at +3.25 s is found from a range starting at its exact time.
    assert idx.query("T", "k", T0 + 3250, T0 + 3250, 32) == [1003]
    assert idx.query("T", "k", T0 + 20_000, T0 + 30_000, 32) == []
    assert idx.query("T", "k", 0, T0 - 1, 32) == []


def test_duplicates_are_removed_and_redispatch_is_skipped(tmp_path):
    idx = service(tmp_path)
    assert idx.build_index("T", "a b", "UNIQ1", 500, T0) == 3
    assert idx.build_index("T", "a b", "UNIQ1", 400, T0) == 0     # below the file's end: done before
    idx.put("T", "a", 500, T0)                                       # a raw duplicate entry
    assert idx.query("T", "a", *ALL, 10) == [500]
    assert idx.query("T", "UNIQ1", *ALL, 10) == [500]
    assert idx.query("T", "b", *ALL, 10) == [500]


def test_full_file_rolls_and_queries_span_files(tmp_path):
    idx = service(tmp_path, slots=3, entries=5)         # 4 entries per file
    for i in range(10):
        idx.put("T", "k" if i % 2 == 0 else f"other{i}", i, T0 + i * 1000)
    assert len(idx.files) == 3
    assert [f.entries for f in idx.files] == [4, 4, 2]
    names = [f.name for f in idx.files]
    assert names == sorted(names)
    assert names[0] == file_name_for(T0)
    assert idx.query("T", "k", *ALL, 32) == [8, 6, 4, 2, 0]
    assert idx.query("T", "k", T0 + 2000, T0 + 6000, 32) == [6, 4, 2]
    assert idx.query("T", "k", *ALL, 2) == [8, 6]


def test_rolled_files_named_in_the_same_millisecond_still_sort(tmp_path):
    idx = service(tmp_path, slots=3, entries=2)          # one entry per file
    for i in range(4):
        idx.put("T", "k", i, T0)
    names = [f.name for f in idx.files]
    assert len(set(names)) == 4
    assert names == sorted(names)
    assert idx.query("T", "k", T0, T0, 32) == [3, 2, 1, 0]


def test_restart_keeps_flushed_entries_and_crash_loses_unflushed(tmp_path):
    fs = FaultyFileSystem()
    idx = service(tmp_path, slots=5, entries=8, fs=fs)
    for i in range(10):
        idx.put("T", f"k{i}", i * 10, T0 + i)
    idx.flush()
    idx.put("T", "late", 999, T0 + 50)
    idx.write_pending()
    fs.crash()
    idx.close()
    again = service(tmp_path, slots=5, entries=8, fs=fs)
    assert [again.query("T", f"k{i}", *ALL, 4) for i in range(10)] == [[i * 10] for i in range(10)]
    assert again.query("T", "late", *ALL, 4) == []
    assert again.end_phy_offset == 90
    again.put("T", "late", 999, T0 + 50)             # re-dispatched
    assert again.query("T", "late", *ALL, 4) == [999]


def test_regression_a_roll_makes_no_fsync_and_the_next_flush_makes_the_sealed_file_durable(tmp_path):
    """A full file was sealed with an fsync on the dispatcher's (event loop's) path: under
    other writers it took 2 s and a DLedger leader's followers called an election. The
    fsync now goes with the next flush (the dispatcher makes it on a worker thread)."""
    fs = FaultyFileSystem()
    idx = service(tmp_path, slots=3, entries=5, fs=fs)      # 4 entries per file
    idx.put("T", "k0", 0, T0)
    idx.flush()                                             # the first file and its name are durable
    fs.fail_fsync = True                                    # any fsync now raises
    for i in range(1, 6):
        idx.put("T", f"k{i}", i * 10, T0 + i)               # rolls once: no fsync on this path
    assert len(idx.files) == 2 and not idx.files[0].writable
    fs.fail_fsync = False
    idx.flush()                                             # the sealed file and the new one
    fs.crash()
    idx.close()
    again = service(tmp_path, slots=3, entries=5, fs=fs)
    assert [again.query("T", f"k{i}", *ALL, 4) for i in range(6)] == [[i * 10] for i in range(6)]


def test_a_sealed_file_not_yet_flushed_is_lost_by_a_crash_and_re_dispatched(tmp_path):
    """The other side: before the flush nothing claims the sealed file durable (the
    checkpoint follows flushes), so a crash may lose its tail and the dispatcher, starting
    from the checkpoint, indexes those messages again."""
    fs = FaultyFileSystem()
    idx = service(tmp_path, slots=3, entries=5, fs=fs)
    idx.put("T", "k0", 0, T0)
    idx.flush()
    for i in range(1, 6):
        idx.put("T", f"k{i}", i * 10, T0 + i)
    fs.crash()
    idx.close()
    again = service(tmp_path, slots=3, entries=5, fs=fs)
    assert again.query("T", "k0", *ALL, 4) == [0]
    assert again.end_phy_offset == 0
    for i in range(1, 6):
        again.put("T", f"k{i}", i * 10, T0 + i)             # re-dispatched from the checkpoint
    assert [again.query("T", f"k{i}", *ALL, 4) for i in range(6)] == [[i * 10] for i in range(6)]


def test_files_past_the_log_end_are_rebuilt_without_those_entries(tmp_path):
    fs = FileSystem()
    idx = service(tmp_path, slots=3, entries=5, fs=fs)
    for i in range(10):
        idx.put("T", "k", i * 10, T0 + i * 1000)       # files: [0..30] [40..70] [80, 90]
    idx.flush()
    idx.close()
    again = IndexService(fs, str(tmp_path), hash_slots=3, max_entries=5)
    repaired = again.load(log_end_physical=55)
    assert len(repaired) == 2
    assert len(again.files) == 2
    assert again.query("T", "k", *ALL, 32) == [50, 40, 30, 20, 10, 0]
    assert again.end_phy_offset == 50
    again.put("T", "k", 55, T0 + 20_000)               # the new log tail indexes normally
    assert again.query("T", "k", *ALL, 2) == [55, 50]
    assert sorted(os.listdir(os.path.join(str(tmp_path), "index"))) == [f.name for f in again.files]


def test_a_file_past_the_log_end_with_no_room_to_repair_it_is_removed_and_the_start_goes_on(tmp_path, caplog):
    """Regression (random-fault runs): a node restarted on a full disk whose log had been cut
    below an index file's end could not write the repaired copy and did not start (exit 2)."""
    fs = FaultyFileSystem(7)
    idx = service(tmp_path, slots=3, entries=5, fs=fs)
    for i in range(10):
        idx.put("T", "k", i * 10, T0 + i * 1000)       # files: [0..30] [40..70] [80, 90]
    idx.flush()
    idx.close()
    fs.write_budget_bytes = 0                          # not one block left
    again = IndexService(fs, str(tmp_path), hash_slots=3, max_entries=5)
    repaired = again.load(log_end_physical=55)
    assert len(repaired) == 2 and len(again.files) == 1
    assert "no room to repair it" in caplog.text
    assert again.query("T", "k", *ALL, 32) == [30, 20, 10, 0], "what the removed file indexed is missed, nothing past the cut"
    assert sorted(os.listdir(os.path.join(str(tmp_path), "index"))) == [f.name for f in again.files]
    fs.write_budget_bytes = None
    again.put("T", "k", 55, T0 + 20_000)               # room again: the new tail indexes normally
    assert again.query("T", "k", *ALL, 2) == [55, 30]


def test_delete_expired_keeps_the_last_file(tmp_path):
    idx = service(tmp_path, slots=3, entries=3)        # 2 entries per file
    for i in range(6):
        idx.put("T", "k", i * 10, T0 + i)
    first = idx.files[0].name
    assert idx.delete_expired(25) == [first]            # its entries (0, 10) are below 25
    assert idx.query("T", "k", *ALL, 32) == [50, 40, 30, 20]
    assert len(idx.delete_expired(10**9)) == 1
    assert len(idx.files) == 1
    assert idx.query("T", "k", *ALL, 32) == [50, 40]


def test_wrong_geometry_is_refused(tmp_path):
    idx = service(tmp_path, slots=3, entries=5)
    idx.put("T", "k", 1, T0)
    idx.flush()
    idx.close()
    path = idx.files[0].path
    with pytest.raises(StoreFatal, match="geometry"):
        IndexFile.open(FileSystem(), path, 4, 5, writable=False)


ops = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 20)), min_size=1, max_size=60)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, slots=st.integers(1, 5), entries=st.integers(2, 9))
def test_property_query_equals_model(tmp_path_factory, ops, slots, entries):
    idx = service(tmp_path_factory.mktemp("idx"), slots=slots, entries=entries)
    model: dict[str, list[tuple[int, int]]] = {}
    for phy, (key_no, secs) in enumerate(ops):
        ts = T0 + sum(s for _, s in ops[:phy + 1]) * 1000     # non-decreasing store times
        idx.put("T", f"key{key_no}", phy, ts)
        model.setdefault(f"key{key_no}", []).append((phy, ts))
    lo = T0 + ops[0][1] * 1000 + 1500
    for key, rows in model.items():
        assert idx.query("T", key, *ALL, 1000) == [p for p, _ in reversed(rows)]
        got = idx.query("T", key, lo, 2**62, 1000)
        assert got == sorted(got, reverse=True)
        # never a miss; extra hits only within the second before `lo`
        assert set(got) >= {p for p, ts in rows if ts >= lo}
        assert set(got) <= {p for p, ts in rows if ts + 999 >= lo}
    idx.close()


class _ReadsByThread(FileSystem):
    """Records the thread of every pread; `gate`, once set up, holds the reads of sealed files."""

    def __init__(self):
        self.reads: list[tuple[str, int]] = []
        self.gate: threading.Event | None = None

    def open(self, path):
        handle = super().open(path)
        fs = self

        class Recording:
            def pread(self, size, offset):
                fs.reads.append((os.path.basename(path), threading.get_ident()))
                if fs.gate is not None and threading.get_ident() != threading.main_thread().ident:
                    fs.gate.wait(5)
                return handle.pread(size, offset)

            def __getattr__(self, name):
                return getattr(handle, name)

        return Recording()


def test_a_query_off_the_loop_reads_sealed_files_on_a_worker_and_answers_as_query(tmp_path):
    """A lookup by key walked sealed files' chains on the event loop (random pages of files
    up to 420 MB at the default geometry). query_off_loop reads them on a worker thread and
    the writable file on the loop, and answers exactly what query answers."""
    fs = _ReadsByThread()
    idx = service(tmp_path, slots=3, entries=5, fs=fs)
    for i in range(17):
        idx.put("T", "k" if i % 3 == 0 else f"o{i}", i * 10, T0 + i * 1000)
    idx.write_pending()
    assert len(idx.files) == 5 and sum(f.writable for f in idx.files) == 1
    sealed = {f.name for f in idx.files if not f.writable}
    for args in [("k", *ALL, 32), ("k", *ALL, 2), ("k", T0 + 3000, T0 + 9000, 32), ("o4", *ALL, 32), ("zz", *ALL, 5)]:
        fs.reads.clear()
        assert asyncio.run(idx.query_off_loop("T", *args)) == idx.query("T", *args), args
    fs.reads.clear()
    asyncio.run(idx.query_off_loop("T", "k", *ALL, 32))
    loop_thread = threading.get_ident()
    assert {name for name, _t in fs.reads} & sealed, "sealed files were read"
    assert all(t != loop_thread for name, t in fs.reads if name in sealed)


def test_an_index_file_expired_while_a_query_reads_it_goes_when_the_query_ends(tmp_path):
    fs = _ReadsByThread()
    idx = service(tmp_path, slots=3, entries=5, fs=fs)
    for i in range(9):
        idx.put("T", "k", i * 10, T0 + i * 1000)
    idx.flush()
    oldest = idx.files[0]

    async def scenario():
        fs.gate = threading.Event()
        query = asyncio.create_task(idx.query_off_loop("T", "k", *ALL, 32))
        for _ in range(200):                     # until the worker is held in a sealed file's read
            if any(t != threading.get_ident() for _n, t in fs.reads):
                break
            await asyncio.sleep(0.005)
        removed = idx.delete_expired(min_phys=35)
        during = os.path.exists(oldest.path)
        fs.gate.set()
        return removed, during, await query

    removed, during, found = asyncio.run(scenario())
    assert removed == [oldest.name] and oldest not in idx.files
    assert during, "the file a query was reading stayed until the query ended"
    assert not os.path.exists(oldest.path)
    assert found == [80, 70, 60, 50, 40, 30, 20, 10, 0]

"""Pipeline jobs: rebuild, audit, export, stats, and the CLI.

Goal: a rebuilt consumequeue/ and index/ tree is byte-identical to what the node's
single-process Dispatcher writes for the same committed log; audit finds injected
divergence and CRC damage and says whether it lies in the committed prefix.
Method: stores are written by the node (LocalLog) or by the DLedger generator, the
node's Dispatcher writes the reference tree into the store root, the rebuild writes into
a fresh target, and the two trees are compared file by file. Pure tests run the jobs
without Spark (same task functions, in-process); `spark`-marked ones go through Spark.
"""

from __future__ import annotations

import filecmp
import json
import os
import random
import tempfile
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.store import layout as L
from pipeline import cli, index_build, jobs
from pipeline import parsers as P
from pipeline.source import committed_bound
from tests.pipeline.storegen import (NodeGeometry, Spec, dispatch_dledger, write_dledger_store,
                                     write_node_store)

GEO = NodeGeometry(units_per_file=500, index_hash_slots=1009, index_max_entries=1500)
SPEC = Spec(tx_every=11, delay_every=17, keys_per_msg=2, body_max=200)


def _tree(root: str) -> dict[str, bytes]:
    out = {}
    for sub in ("consumequeue", "index"):
        base = os.path.join(root, sub)
        for dirpath, _dirs, files in os.walk(base):
            for f in files:
                path = os.path.join(dirpath, f)
                with open(path, "rb") as fh:
                    out[os.path.relpath(path, root)] = fh.read()
    return out


def assert_same_tree(reference_root: str, rebuilt_root: str) -> None:
    ref, got = _tree(reference_root), _tree(rebuilt_root)
    assert sorted(ref) == sorted(got), "different file sets"
    assert ref, "nothing to compare"
    for name in ref:
        assert ref[name] == got[name], f"{name} differs"


def _rebuild(store, target, spark=None, **kw):
    return jobs.rebuild(store, target, spark=spark, units_per_file=GEO.units_per_file,
                        index_hash_slots=GEO.index_hash_slots, index_max_entries=GEO.index_max_entries, **kw)


@pytest.fixture(scope="module")
def node_store():
    """A standalone store written by LocalLog and dispatched by the node (several segments)."""
    with tempfile.TemporaryDirectory() as root:
        write_node_store(root, 4000, 64 * 1024, spec=SPEC, geometry=GEO)
        yield root


@pytest.fixture(scope="module")
def dledger_store():
    """A DLedger store, committed up to 2/3 of its entries, dispatched by the node."""
    with tempfile.TemporaryDirectory() as root:
        w = write_dledger_store(root, "n0", 3000, 64 * 1024, spec=SPEC, term_every=400)
        ci = w.entries[len(w.entries) * 2 // 3].index
        dispatch_dledger(root, w, ci, GEO)
        yield root, w, ci


# --- rebuild, in-process ------------------------------------------------------------------------
@pytest.mark.parametrize("index_writer", ["bulk", "node"])
def test_rebuild_is_byte_identical_to_the_node_dispatcher(node_store, tmp_path, index_writer):
    r = _rebuild(node_store, str(tmp_path), index_writer=index_writer)
    assert r.records == 4000 and not r.problems
    assert_same_tree(node_store, str(tmp_path))


def test_dledger_rebuild_uses_committed_entries_only(dledger_store, tmp_path):
    root, w, ci = dledger_store
    r = _rebuild(root, str(tmp_path), committed_index=ci)
    assert r.committed_index == ci
    assert r.records == sum(1 for e in w.entries if e.index <= ci and e.magic == L.ENTRY_MAGIC_NORMAL)
    assert_same_tree(root, str(tmp_path))


def test_committed_index_comes_from_the_checkpoint(dledger_store):
    root, _w, ci = dledger_store
    assert committed_bound(root, P.KIND_DLEDGER, None) == ci     # the dispatcher's checkpoint proves it
    assert committed_bound(root, P.KIND_DLEDGER, 7) == 7          # an explicit index wins


def test_rebuild_refuses_a_damaged_log_and_can_stop_at_the_damage(tmp_path):
    store = str(tmp_path / "s")
    write_node_store(store, 1500, 64 * 1024, spec=SPEC, dispatch=False)
    segs = P.list_segments(store)
    victim_seg = segs[1]
    rows = list(P.parse_commitlog_units(victim_seg.path, victim_seg.base_offset))
    bad = rows[10][0]
    with open(victim_seg.path, "r+b") as f:
        f.seek(bad - victim_seg.base_offset + L.MESSAGE_HEADER.size)
        f.write(b"\x00\x01\x02")
    with pytest.raises(jobs.JobError, match=f"corrupt record at offset {bad}"):
        _rebuild(store, str(tmp_path / "t1"))
    assert not os.path.exists(tmp_path / "t1" / "consumequeue")
    r = _rebuild(store, str(tmp_path / "t2"), stop_at_corruption=True)
    assert r.valid_end == bad
    units = 0
    for name, data in _tree(str(tmp_path / "t2")).items():
        if name.startswith("consumequeue"):
            for off, size, _tags in L.CQ_UNIT.iter_unpack(data):
                if size:
                    assert off < bad
                    units += 1
    assert units == r.units


def test_rebuild_wants_an_empty_target(node_store, tmp_path):
    os.makedirs(tmp_path / "index")
    with pytest.raises(jobs.JobError, match="empty target"):
        _rebuild(node_store, str(tmp_path))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 700), slots=st.integers(1, 60), max_entries=st.integers(2, 300),
       seed=st.integers(0, 10 ** 6))
def test_bulk_index_writer_matches_the_node_index_service(n, slots, max_entries, seed):
    rng = random.Random(seed)
    flat = array("q")
    ts = 1_700_000_000_000 + rng.randrange(10 ** 6)
    for i in range(n):
        ts += rng.choice((0, 1, 999, 1000, 4321, -5))      # store times may repeat or step back
        flat.extend((rng.randrange(0x7FFFFFFF), 1000 + i * 77, ts))
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b, \
            tempfile.TemporaryDirectory() as c:
        jobs.build_index(a, [flat.tobytes()], slots, max_entries, None, writer="node")
        index_build.write_index(b, flat, slots, max_entries, use_numpy=False)
        index_build.write_index(c, flat, slots, max_entries, use_numpy=True)
        names = sorted(os.listdir(os.path.join(a, "index")))
        assert names == sorted(os.listdir(os.path.join(b, "index"))) == sorted(os.listdir(os.path.join(c, "index")))
        for name in names:
            for other in (b, c):
                assert filecmp.cmp(os.path.join(a, "index", name), os.path.join(other, "index", name),
                                   shallow=False), (other, name)


def test_check_reports_finds_data_after_a_hole():
    def rep(path, records, end, data_end=0):
        return {"path": path, "records": records, "end_reason": end, "data_end": data_end,
                "corrupt_offset": None, "corrupt_reason": None}
    ok = jobs.check_reports([rep("a", 5, P.END_BLANK), rep("b", 3, P.END_ZERO), rep("c", 0, P.END_ZERO)])
    assert ok.valid_end is None and not ok.problems
    hole = jobs.check_reports([rep("a", 5, P.END_ZERO, 700), rep("b", 3, P.END_ZERO)])
    assert hole.valid_end == 700 and "after the data ended" in hole.problems[0]


# --- audit, in-process ----------------------------------------------------------------------------
@pytest.fixture()
def replicas(tmp_path):
    """Three replicas: a and b identical; c took another term at index 52 (see term_every)."""
    roots = [str(tmp_path / n) for n in ("a", "b", "c")]
    for root, term_every in zip(roots, (50, 50, 0)):
        write_dledger_store(root, "n0", 150, 16 * 1024, seed=5, term_every=term_every)
    return roots


def test_audit_of_identical_replicas_is_clean(replicas):
    a = jobs.audit(replicas[:2], committed_index=100)
    assert a.ok and a.first_divergence is None and a.exit_code == 0
    assert a.uncommitted_tails == {r: [101, a.last_index[r]] for r in replicas[:2]}


def test_audit_reports_divergence_in_the_uncommitted_tail_without_failing(replicas):
    a = jobs.audit(replicas, committed_index=40)
    assert a.first_divergence["index"] == 52 and not a.first_divergence["committed"]
    assert a.exit_code == 0


def test_audit_fails_on_divergence_in_the_committed_prefix(replicas):
    a = jobs.audit(replicas, committed_index=60)
    assert a.first_divergence["index"] == 52 and a.committed_divergence and a.exit_code == 2
    assert a.first_divergence["replicas"][replicas[0]]["term"] == 2
    assert a.first_divergence["replicas"][replicas[2]]["term"] == 1


def test_audit_finds_a_crc_failure(replicas):
    seg = P.list_segments(replicas[1])[0]
    entries = list(P.parse_dledger_segment(seg.path, 0, with_message=False))
    victim = entries[20]
    with open(seg.path, "r+b") as f:
        f.seek(victim[2] + L.ENTRY_HEADER.size + 5)
        f.write(b"\xee\xee")
    a = jobs.audit(replicas[:2], committed_index=100)
    assert a.exit_code == 3 and a.first_divergence is None
    [failure] = a.crc_failures
    assert failure["replica"] == replicas[1] and failure["offset"] == victim[2]
    assert "crc" in failure["reason"] and failure["after_index"] == victim[0] - 1


def test_audit_checks_the_chain_across_files(replicas):
    segs = P.list_segments(replicas[0])
    assert len(segs) > 2
    first = next(iter(P.parse_dledger_segment(segs[2].path, segs[2].base_offset, with_message=False)))
    with open(segs[2].path, "r+b") as f:     # change the first entry's channel (covered by chain crc only)
        f.seek(first[2] - segs[2].base_offset + L.ENTRY_FIELD_OFFSET["channel"])
        f.write(b"\x00\x00\x00\x07")
    a = jobs.audit(replicas[:1], committed_index=200)
    assert [f["index"] for f in a.crc_failures] == [first[0]] and a.exit_code == 3


# --- CLI ------------------------------------------------------------------------------------------
def test_cli_rebuild_and_audit_exit_codes(node_store, replicas, tmp_path, capsys):
    code = cli.main(["--no-spark", "rebuild", node_store, str(tmp_path / "t"), "--cq-units-per-file",
                     str(GEO.units_per_file), "--index-hash-slots", str(GEO.index_hash_slots),
                     "--index-max-entries", str(GEO.index_max_entries)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["records"] == 4000
    assert_same_tree(node_store, str(tmp_path / "t"))
    assert cli.main(["--no-spark", "rebuild", node_store, str(tmp_path / "t")]) == 1     # target not empty
    conf = tmp_path / "broker.conf"        # the same geometry, read from the node's own config
    conf.write_text(f"mapedFileSizeConsumeQueue={GEO.units_per_file * L.CQ_UNIT.size}\n"
                    f"maxHashSlotNum={GEO.index_hash_slots}\nmaxIndexNum={GEO.index_max_entries}\n")
    assert cli.main(["--no-spark", "rebuild", node_store, str(tmp_path / "t2"), "--config", str(conf)]) == 0
    assert_same_tree(node_store, str(tmp_path / "t2"))
    assert cli.main(["--no-spark", "audit", *replicas, "--committed-index", "60"]) == 2
    assert cli.main(["--no-spark", "audit", *replicas, "--committed-index", "40"]) == 0
    assert cli.main(["--no-spark", "audit", str(tmp_path / "nope")]) == 1


# --- Spark ----------------------------------------------------------------------------------------
@pytest.mark.spark
@pytest.mark.parametrize("cq_writer", ["driver", "tasks"])
def test_spark_rebuild_is_byte_identical(spark, node_store, tmp_path, cq_writer):
    r = _rebuild(node_store, str(tmp_path), spark=spark, cq_writer=cq_writer)
    assert r.records == 4000 and r.segments == len(P.list_segments(node_store))
    assert_same_tree(node_store, str(tmp_path))


@pytest.mark.spark
def test_spark_dledger_rebuild_and_audit(spark, dledger_store, replicas, tmp_path):
    root, _w, ci = dledger_store
    _rebuild(root, str(tmp_path), spark=spark, cq_writer="tasks")
    assert_same_tree(root, str(tmp_path))
    a = jobs.audit(replicas, spark=spark, committed_index=60)
    assert a.exit_code == 2 and a.first_divergence["index"] == 52


@pytest.mark.spark
def test_export_writes_parquet_by_topic_and_date(spark, node_store, tmp_path):
    out = str(tmp_path / "pq")
    res = jobs.export(spark, node_store, out)
    assert res["rows"] == 4000
    topics = sorted(d for d in os.listdir(out) if d.startswith("topic="))
    assert "topic=orders" in topics and "topic=SCHEDULE_TOPIC_XXXX" in topics
    dates = os.listdir(os.path.join(out, "topic=orders"))
    assert dates and all(d.startswith("store_date=") for d in dates)
    df = spark.read.parquet(out)
    assert df.filter("topic = 'orders'").count() == sum(
        1 for s in P.list_segments(node_store) for u in P.parse_commitlog_units(s.path, s.base_offset)
        if u[2] == "orders")


@pytest.mark.spark
def test_stats_per_queue(spark, node_store):
    rows = jobs.stats(spark, node_store)
    want: dict = {}
    keys: dict = {}
    for s in P.list_segments(node_store):
        for m in P.parse_commitlog_segment(s.path, s.base_offset, with_body=False):
            k = (m[0], m[1])
            c = want.setdefault(k, [0, 0])
            c[0] += 1
            c[1] += m[4]
            keys.setdefault(k, set()).update(w for w in (m[6] or "").split(" ") if w)
    got = {(r["topic"], r["queue_id"]): r for r in rows}
    assert set(got) == set(want)
    for k, (n, size) in want.items():
        assert (got[k]["messages"], got[k]["bytes"]) == (n, size)
        assert got[k]["distinct_keys"] == len(keys[k])


@pytest.mark.spark
def test_cli_spark_jobs_report_json_and_clean_errors(spark, node_store, tmp_path, capsys):
    assert cli.main(["--no-progress", "stats", node_store]) == cli.EXIT_OK
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert sum(r["messages"] for r in rows) == 4000
    out = str(tmp_path / "pq")
    assert cli.main(["--no-progress", "export", node_store, out, "--topics", "orders"]) == cli.EXIT_OK
    assert json.loads(capsys.readouterr().out)["rows"] > 0
    # Exporting again into the same directory, and reading a directory that is no store,
    # are errors with one line on stderr, not tracebacks.
    assert cli.main(["--no-progress", "export", node_store, out]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "already exists" in err and "Traceback" not in err
    assert cli.main(["--no-progress", "stats", str(tmp_path / "nothing-here")]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not an mqstore store root" in err and "Traceback" not in err
    # A task that fails on a damaged segment: the task's own error, one line.
    bad = str(tmp_path / "bad")
    import shutil
    shutil.copytree(node_store, bad)
    seg = P.list_segments(bad)[1]
    victim = list(P.parse_commitlog_units(seg.path, seg.base_offset))[3]
    with open(seg.path, "r+b") as f:
        f.seek(victim[0] - seg.base_offset + L.MESSAGE_HEADER.size)    # first body byte
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    assert cli.main(["--no-progress", "stats", bad]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"corrupt record at offset {victim[0]}" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1

"""The pipeline over stores written by REAL node processes.

Goal: `rebuild` writes consumequeue/ and index/ byte-identical to what the node's own
dispatcher wrote; `audit` is clean on a real DLedger group's replicas and catches a
deliberately damaged copy (CRC failure -> exit 3) and a diverged copy (exit 2); the data
source reads exactly what was acknowledged.
Method: `python -m node --config broker.conf` on free loopback ports (tests/pipeline/nodes.py),
small segment / consume-queue / index geometry so files roll; messages go in over HTTP; the
nodes are stopped with SIGTERM (flush, dispatch, checkpoint); then the CLI and the jobs run
on the stopped stores. The DLedger group changes leader half way: the first leader is
stopped, a new one is elected (term >= 2), and the old leader restarts and catches up.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import pytest

from dledger.entry import encode_entry
from node.store import layout as L
from pipeline import cli, jobs
from pipeline import parsers as P
from tests.pipeline import nodes as N

TOPICS = {"orders": 4, "audit": 2}
CATCH_UP_TIMEOUT_S = 20.0


def _tree(root: str) -> dict[str, bytes]:
    out = {}
    for sub in ("consumequeue", "index"):
        for dirpath, _dirs, files in os.walk(os.path.join(root, sub)):
            for f in files:
                path = os.path.join(dirpath, f)
                with open(path, "rb") as fh:
                    out[os.path.relpath(path, root)] = fh.read()
    return out


def assert_same_tree(reference_root: str, rebuilt_root: str) -> None:
    ref, got = _tree(reference_root), _tree(rebuilt_root)
    assert sorted(ref) == sorted(got), "different file sets"
    assert any(k.startswith("index") for k in ref) and any(k.startswith("consumequeue") for k in ref)
    for name in ref:
        assert ref[name] == got[name], f"{name} differs"


def _send_everything(nodes: list[N.Node], messages: dict[str, list[dict]]) -> dict[str, list[dict]]:
    sent = {}
    for topic, msgs in messages.items():
        sent[topic] = [dict(m, **r) for m, r in zip(msgs, N.send_all(nodes, topic, msgs))]
    return sent


def _messages(seed: int, n: int) -> dict[str, list[dict]]:
    return {t: N.make_messages(n if t == "orders" else n // 5, q, seed + i) for i, (t, q) in enumerate(TOPICS.items())}


DELAY_LEVELS = "1s 2s 3s"      # not the default table: rebuild must take it from broker.conf
N_DELAYED = 60
N_HALF = 20


@pytest.fixture(scope="module")
def standalone_store():
    """A standalone node; besides plain messages, delayed ones (stored on SCHEDULE_TOPIC_XXXX,
    whose CQ tag code is the delivery time, then delivered) and transaction half messages."""
    with tempfile.TemporaryDirectory(prefix="pl-sa-") as d:
        nodes = N.standalone(d, f"messageDelayLevel={DELAY_LEVELS}\n")
        try:
            for t, q in TOPICS.items():
                N.create_topic(nodes, t, q)
            N.create_topic(nodes, "delayed", 2)
            sent = _send_everything(nodes, _messages(1, 2500))
            N.send_all(nodes, "delayed", [{"body": f"d{i}", "queue_id": i % 2, "keys": f"d{i}",
                                           "properties": {"DELAY": str(1 + i % 4)}} for i in range(N_DELAYED)])
            N.send_all(nodes, "orders", [{"body": f"h{i}", "queue_id": 0,
                                          "properties": {"TRAN_MSG": "true", "PGROUP": "pg"}} for i in range(N_HALF)])
            N.wait_messages(nodes[0], "delayed", N_DELAYED, timeout_s=15.0)
        finally:
            codes = [n.stop() for n in nodes]
        assert codes == [0], nodes[0].tail()
        yield nodes[0], sent


@pytest.fixture(scope="module")
def dledger_stores():
    """A 3-node group that changed leader once; every node stopped cleanly and complete."""
    with tempfile.TemporaryDirectory(prefix="pl-dl-") as d:
        nodes = N.dledger_group(d)
        try:
            for t, q in TOPICS.items():
                N.create_topic(nodes, t, q)
            first = _send_everything(nodes, _messages(1, 1200))
            old = N.leader(nodes)
            assert old.stop() == 0
            rest = [n for n in nodes if n is not old]
            second = _send_everything(rest, _messages(7, 1200))
            old.launch()
            old.wait_healthy(time.monotonic() + N.START_TIMEOUT_S)
            _wait_same_committed(nodes)
        finally:
            codes = [n.stop() for n in nodes]
        assert codes == [0, 0, 0], [n.tail() for n in nodes]
        sent = {t: first[t] + second[t] for t in TOPICS}
        yield nodes, sent


def _wait_same_committed(nodes: list[N.Node]) -> None:
    deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
    seen = None
    while time.monotonic() < deadline:
        seen = [(n.health() or {}).get("committed_offset") for n in nodes]
        if None not in seen and len(set(seen)) == 1:
            return
        time.sleep(0.1)
    raise AssertionError(f"replicas never agreed on the committed offset: {seen}")


def _cli_json(capsys, argv: list[str]) -> tuple[int, dict]:
    code = cli.main(argv)
    out = capsys.readouterr().out
    return code, (json.loads(out) if out.strip() else {})


# --- rebuild ------------------------------------------------------------------------------------
def test_rebuild_of_a_real_standalone_node_is_byte_identical(standalone_store, tmp_path, capsys):
    node, sent = standalone_store
    assert len(P.list_segments(node.store)) >= 3
    code, out = _cli_json(capsys, ["--no-spark", "rebuild", "--config", node.conf, node.store, str(tmp_path / "t")])
    assert code == 0, out
    n_sent = sum(len(v) for v in sent.values())
    # Topic creation itself is logged as messages on the system config topic.
    assert out["records"] >= n_sent and out["problems"] == []
    for t, q in TOPICS.items():
        for qid in range(q):
            assert out["queues"][f"{t}/{qid}"] == sum(1 for m in sent[t] if m["queue_id"] == qid)
    assert out["queues"]["delayed/0"] + out["queues"]["delayed/1"] == N_DELAYED
    assert sum(v for k, v in out["queues"].items() if k.startswith("SCHEDULE_TOPIC_XXXX/")) == N_DELAYED
    assert any(k.startswith("RMQ_SYS_TRANS_HALF_TOPIC/") for k in out["queues"]), out["queues"]
    assert_same_tree(node.store, str(tmp_path / "t"))
    # Without the node's delay table the SCHEDULE_TOPIC_XXXX units differ: the check has teeth.
    code, _out = _cli_json(capsys, ["--no-spark", "rebuild", node.store, str(tmp_path / "t2"),
                                    "--cq-units-per-file", "300", "--index-hash-slots", "1000",
                                    "--index-max-entries", "4000"])
    assert code == 0
    with pytest.raises(AssertionError, match="SCHEDULE_TOPIC_XXXX"):
        assert_same_tree(node.store, str(tmp_path / "t2"))


def test_rebuild_of_every_real_dledger_replica_is_byte_identical(dledger_stores, tmp_path, capsys):
    nodes, _sent = dledger_stores
    terms = set()
    for n in nodes:
        target = str(tmp_path / os.path.basename(n.dir))
        code, out = _cli_json(capsys, ["--no-spark", "rebuild", "--config", n.conf, n.store, target])
        assert code == 0, out
        meta = P.read_dledger_meta(n.store)
        assert out["committed_index"] == meta["committed"]
        assert_same_tree(n.store, target)
        seg = P.list_segments(n.store)
        assert len(seg) >= 3
        terms |= {e[1] for s in seg for e in P.parse_dledger_segment(s.path, s.base_offset, with_message=False)}
    assert max(terms) >= 2, "the group was meant to change leader"


@pytest.mark.spark
def test_spark_rebuild_of_a_real_dledger_replica(spark, dledger_stores, tmp_path):
    nodes, _sent = dledger_stores
    n = nodes[1]
    r = jobs.rebuild(n.store, str(tmp_path), spark=spark, units_per_file=6000 // L.CQ_UNIT.size,
                     index_hash_slots=1000, index_max_entries=4000, cq_writer="tasks")
    assert r.segments == len(P.list_segments(n.store))
    assert_same_tree(n.store, str(tmp_path))


# --- audit --------------------------------------------------------------------------------------
def _copy_store(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _entries(store: str) -> list[tuple]:
    return [e for s in P.list_segments(store)
            for e in P.parse_dledger_segment(s.path, s.base_offset, with_message=False)]


def test_audit_of_a_real_group_is_clean(dledger_stores, capsys):
    nodes, _sent = dledger_stores
    code, out = _cli_json(capsys, ["--no-spark", "audit", *[n.store for n in nodes]])
    assert code == 0, out
    assert out["ok"] and out["first_divergence"] is None and out["crc_failures"] == []
    assert out["uncommitted_tails"] == {}
    assert len(set(out["last_index"].values())) == 1 and out["committed_index"] == max(out["last_index"].values())


def test_audit_catches_a_corrupted_copy_of_a_real_replica(dledger_stores, tmp_path, capsys):
    nodes, _sent = dledger_stores
    bad = _copy_store(nodes[2].store, str(tmp_path / "bad"))
    entries = _entries(bad)
    victim = entries[len(entries) // 2]                     # well inside the committed prefix
    seg = [s for s in P.list_segments(bad) if s.base_offset <= victim[2]][-1]
    with open(seg.path, "r+b") as f:                        # one byte of the message body
        f.seek(victim[2] - seg.base_offset + victim[4] - 20)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x5A]))
    code, out = _cli_json(capsys, ["--no-spark", "audit", nodes[0].store, nodes[1].store, bad])
    assert code == cli.EXIT_CORRUPT, out
    [failure] = out["crc_failures"]
    assert failure["replica"] == bad and failure["offset"] == victim[2] and "crc" in failure["reason"]
    # The rebuild refuses the damaged log, naming where it is.
    code = cli.main(["--no-spark", "rebuild", "--config", nodes[2].conf, bad, str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert code == cli.EXIT_ERROR and f"offset {victim[2]}" in err


def _rewrite_terms_from(store: str, first_index: int, new_term: int) -> None:
    """Give entries >= first_index another term, re-chaining every CRC after them: a replica
    that holds a different (validly chained) history from first_index on."""
    prev_chain = None
    for s in P.list_segments(store):
        with open(s.path, "r+b") as f:
            for e in list(P.parse_dledger_segment(s.path, s.base_offset, with_message=False)):
                index, term, pos, magic, size, chain = e[:6]
                if index < first_index:
                    prev_chain = chain
                    continue
                f.seek(pos - s.base_offset + L.ENTRY_HEADER.size)
                body = f.read(size - L.ENTRY_HEADER.size)
                raw = encode_entry(index, max(term, new_term), pos, magic, body, prev_chain)
                f.seek(pos - s.base_offset)
                f.write(raw)
                prev_chain = L.ENTRY_HEADER.unpack_from(raw)[6]


def test_audit_fails_on_a_diverged_copy_in_the_committed_prefix(dledger_stores, tmp_path, capsys):
    nodes, _sent = dledger_stores
    forked = _copy_store(nodes[1].store, str(tmp_path / "forked"))
    entries = _entries(forked)
    at = entries[len(entries) // 3][0]
    _rewrite_terms_from(forked, at, max(e[1] for e in entries) + 1)
    for s in P.list_segments(forked):                       # the copy still parses cleanly
        rep = P.ParseReport()
        for _ in P.parse_dledger_segment(s.path, s.base_offset, with_message=False, report=rep):
            pass
        assert rep.end_reason != P.END_CORRUPT, rep.as_dict()
    code, out = _cli_json(capsys, ["--no-spark", "audit", nodes[0].store, forked])
    assert code == cli.EXIT_DIVERGED, out
    assert out["first_divergence"]["index"] == at and out["first_divergence"]["committed"]
    assert out["crc_failures"] == []                        # a valid chain, just another history
    # Above the committed index the same fork is only an uncommitted difference.
    code, out = _cli_json(capsys, ["--no-spark", "audit", nodes[0].store, forked, "--committed-index", str(at - 1)])
    assert code == cli.EXIT_OK and out["first_divergence"]["index"] == at


# --- the data source on real stores -------------------------------------------------------------
@pytest.mark.spark
def test_data_source_reads_what_a_real_group_acknowledged(spark, dledger_stores):
    nodes, sent = dledger_stores
    df = spark.read.format("mqstore").option("path", nodes[0].store).option("topics", ",".join(TOPICS)).load()
    assert df.rdd.getNumPartitions() == len(P.list_segments(nodes[0].store))
    rows = df.select("topic", "queue_id", "queue_offset", "body", "tags", "keys", "index", "term",
                     "committed").collect()
    got = {(r.topic, r.queue_id, r.queue_offset): r for r in rows}
    want = {(t, m["queue_id"], m["queue_offset"]): m for t in TOPICS for m in sent[t]}
    assert set(got) == set(want)
    for k, m in want.items():
        r = got[k]
        assert bytes(r.body) == m["body"].encode() and r.tags == m.get("tags") and r.keys == m.get("keys")
        assert r.committed and r["index"] >= 1 and r.term >= 1
    assert max(r.term for r in rows) >= 2


@pytest.mark.spark
def test_data_source_reads_a_real_standalone_store(spark, standalone_store):
    node, sent = standalone_store
    df = spark.read.format("mqstore").option("path", node.store).option("topics", "audit") \
        .option("startingOffsets", json.dumps({"audit": {"1": 10}})).load()
    want = [m for m in sent["audit"] if m["queue_id"] == 0 or m["queue_offset"] >= 10]
    assert df.count() == len(want)
    assert df.filter("index IS NOT NULL OR NOT committed").count() == 0

"""The `mqstore` Spark data source.

Goal: `spark.read.format("mqstore")` returns exactly the committed messages of a store
(path mode) or of a running node (endpoint mode), honours the Kafka-style options, and
fails loudly on a damaged segment unless asked to stop there.
Method: stores written by the node's CommitLog / the DLedger generator are read through
Spark and compared with the pure parser; a real node process (python -m node on free
loopback ports) serves the REST mode. Option parsing is tested without Spark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from mqstore.localcluster import free_ports
from node.store import layout as L
from pipeline import parsers as P
from pipeline.source import EARLIEST, LATEST, OptionError, parse_offsets, read_options
from tests.pipeline.storegen import Spec, write_commitlog_store, write_dledger_store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- options (pure) ---------------------------------------------------------------------------
def test_offsets_option_forms():
    assert parse_offsets(None, EARLIEST, "x") == (EARLIEST, {})
    assert parse_offsets("latest", EARLIEST, "x") == (LATEST, {})
    d, per = parse_offsets('{"orders": {"0": 23, "1": -2}}', EARLIEST, "x")
    assert per == {("orders", 0): 23, ("orders", 1): -2}
    for bad in ('{"orders": 3}', '[1]', "soon", '{"t": {"0": -3}}', '{"t": {"zero": 1}}'):
        with pytest.raises(OptionError):
            parse_offsets(bad, EARLIEST, "startingOffsets")


def test_read_options_validation_and_bounds():
    o = read_options({"path": "/s", "startingOffsets": '{"t": {"0": 5}}', "endingOffsets": '{"t": {"1": -2}}'})
    assert o.ranges.bounds("t", 0) == (5, 1 << 62)
    assert o.ranges.bounds("t", 1) == (0, 0)
    assert o.ranges.bounds("u", 0) == (0, 1 << 62) and o.ranges.explicit
    assert not read_options({"path": "/s"}).ranges.explicit
    with pytest.raises(OptionError, match="exactly one"):
        read_options({"path": "/s", "endpoint": "h:1"})
    with pytest.raises(OptionError, match="includeBody"):
        read_options({"path": "/s", "includeBody": "nope"})
    with pytest.raises(OptionError, match="onCorruption"):
        read_options({"path": "/s", "onCorruption": "ignore"})


# --- path mode ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cl_store():
    with tempfile.TemporaryDirectory() as root:
        write_commitlog_store(root, 1200, 64 * 1024, spec=Spec(tx_every=9, body_max=150))
        yield root


def _parsed(root):
    out = []
    for s in P.list_segments(root):
        out += list(P.parse_commitlog_segment(s.path, s.base_offset))
    return out


def _load(spark, root, **opts):
    r = spark.read.format("mqstore").option("path", root)
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


@pytest.mark.spark
def test_reads_every_record_as_the_parser_does(spark, cl_store):
    df = _load(spark, cl_store)
    assert df.rdd.getNumPartitions() == len(P.list_segments(cl_store))
    rows = df.select("topic", "queue_id", "queue_offset", "commitlog_offset", "size", "tags", "keys",
                     "properties", "body", "sys_flag", "index", "committed", "store_timestamp").collect()
    want = _parsed(cl_store)
    assert len(rows) == len(want)
    for r, m in zip(sorted(rows, key=lambda r: r.commitlog_offset), want):
        assert (r.topic, r.queue_id, r.queue_offset, r.commitlog_offset, r.size) == m[:5]
        assert (r.tags, r.keys, dict(r.properties), bytes(r.body), r.sys_flag) == (m[5], m[6], m[7], m[14], m[13])
        assert r["index"] is None and r.committed is True   # r.index is tuple.index: use r["index"]
        assert int(r.store_timestamp.timestamp() * 1000) == m[9]


@pytest.mark.spark
def test_topics_and_per_queue_offsets(spark, cl_store):
    opts = {"topics": "orders", "startingOffsets": json.dumps({"orders": {"0": 10, "1": -1}}),
            "endingOffsets": json.dumps({"orders": {"0": 20}})}
    got = {(r.queue_id, r.queue_offset) for r in _load(spark, cl_store, **opts).select("queue_id", "queue_offset")
           .collect()}
    want = set()
    for m in _parsed(cl_store):
        if m[0] != "orders" or m[2] < 0:
            continue
        lo, hi = {0: (10, 20), 1: (1 << 62, 1 << 62)}.get(m[1], (0, 1 << 62))
        if lo <= m[2] < hi:
            want.add((m[1], m[2]))
    assert got == want and (0, 10) in got and (0, 20) not in got


@pytest.mark.spark
def test_include_body_false_skips_bodies(spark, cl_store):
    df = _load(spark, cl_store, includeBody="false")
    assert df.filter("body is not null").count() == 0
    assert df.count() == len(_parsed(cl_store))


@pytest.mark.spark
def test_dledger_committed_entries_only_by_default(spark, tmp_path):
    w = write_dledger_store(str(tmp_path), "n2", 500, 32 * 1024, term_every=100)
    ci = 300
    normal = [e for e in w.entries if e.magic == L.ENTRY_MAGIC_NORMAL]
    df = _load(spark, str(tmp_path), committedIndex=str(ci))
    got = sorted((r["index"], r.term, r.commitlog_offset) for r in df.select("index", "term", "commitlog_offset").collect())
    assert got == [(e.index, e.term, e.pos + L.ENTRY_HEADER.size) for e in normal if e.index <= ci]
    everything = _load(spark, str(tmp_path), committedIndex=str(ci), includeUncommitted="true")
    flags = {r.committed: r["count"] for r in everything.groupBy("committed").count().collect()}
    assert flags == {True: len(got), False: len(normal) - len(got)}
    with pytest.raises(Exception, match="committedIndex"):
        _load(spark, str(tmp_path)).count()


@pytest.mark.spark
def test_a_corrupt_segment_fails_the_read_or_stops_there(spark, tmp_path):
    written = write_commitlog_store(str(tmp_path), 300, 64 * 1024)
    phys = written[100][0]
    seg = [s for s in P.list_segments(str(tmp_path)) if s.base_offset <= phys][-1]
    with open(seg.path, "r+b") as f:
        f.seek(phys - seg.base_offset + L.MESSAGE_HEADER.size)
        f.write(b"\xba\xad")
    with pytest.raises(Exception, match=f"corrupt record at offset {phys}"):
        _load(spark, str(tmp_path)).count()
    rows = _load(spark, str(tmp_path), onCorruption="stop").select("commitlog_offset").collect()
    offsets = {r.commitlog_offset for r in rows}
    assert phys not in offsets and written[99][0] in offsets


# --- endpoint mode against a real node ------------------------------------------------------------


def _http(method: str, url: str, doc: dict | None = None) -> dict:
    data = json.dumps(doc).encode() if doc is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json",
                                                                           "Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def node_endpoint():
    """A standalone node (python -m node) with topic `orders` (3 queues) and 90 messages."""
    with tempfile.TemporaryDirectory() as d:
        port, ha_port = free_ports(2)
        conf = os.path.join(d, "broker.conf")
        with open(conf, "w") as f:
            f.write(f"storePathRootDir={d}/store\nlistenPort={port}\nhaListenPort={ha_port}\n"
                    "bindAddress=127.0.0.1\nmappedFileSizeCommitLog=1048576\nmaxMessageSize=65536\n"
                    "logLevel=WARNING\n")
        proc = subprocess.Popen([sys.executable, "-m", "node", "-c", conf], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=open(os.path.join(d, "node.log"), "wb"))
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(100):       # up to ~10 s for the node to listen
                try:
                    _http("GET", base + "/health")
                    break
                except OSError:
                    time.sleep(0.1)
            _http("POST", base + "/topics", {"topic": "orders", "queues": 3})
            sent = []
            for i in range(90):
                msg = {"body": f"m{i}", "tags": "A" if i % 2 else "B", "keys": f"k{i} x{i % 5}", "queue_id": i % 3}
                if i % 10 == 0:
                    msg = {"body_b64": "AP8=", "queue_id": i % 3}
                sent.append(msg)
            for i in range(0, 90, 30):
                _http("POST", base + "/topics/orders/messages", {"messages": sent[i:i + 30]})
            yield f"127.0.0.1:{port}", sent
        finally:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.mark.spark
def test_endpoint_mode_reads_committed_messages_per_queue(spark, node_endpoint):
    endpoint, sent = node_endpoint
    df = spark.read.format("mqstore").option("endpoint", endpoint).option("topics", "orders") \
        .option("maxRecordsPerPull", "7").load()
    assert df.rdd.getNumPartitions() == 3
    rows = df.select("queue_id", "queue_offset", "body", "keys", "tags", "committed").collect()
    assert len(rows) == 90 and all(r.committed for r in rows)
    bodies = sorted(bytes(r.body) for r in rows)
    want = sorted(b"\x00\xff" if "body_b64" in m else m["body"].encode() for m in sent)
    assert bodies == want
    r5 = next(r for r in rows if bytes(r.body) == b"m5")
    assert (r5.keys, r5.tags) == ("k5 x0", "A")
    part = spark.read.format("mqstore").option("endpoint", endpoint).option("topics", "orders") \
        .option("startingOffsets", json.dumps({"orders": {"0": 25}})).load()
    assert part.count() == 90 - 25


@pytest.mark.spark
def test_endpoint_stream_reads_what_is_there(spark, node_endpoint, tmp_path):
    endpoint, _sent = node_endpoint
    stream = spark.readStream.format("mqstore").option("endpoint", endpoint).option("topics", "orders").load()
    q = (stream.writeStream.format("memory").queryName("mq_stream")
         .option("checkpointLocation", str(tmp_path / "ckpt")).start())
    try:
        q.processAllAvailable()
        assert spark.table("mq_stream").count() == 90
    finally:
        q.stop()


def test_endpoint_requests_follow_a_not_leader_answer_to_the_node_it_names():
    """A follower or slave with slaveReadEnable=false answers pulls with 421 NOT_LEADER naming
    the leader: endpoint mode reads there instead of failing. Without a name it fails, saying why."""
    from pipeline.source import rest_get
    from tests.json_stub import json_server

    def server(answer):
        return json_server(answer)[0]

    leader = server(lambda path: (200, {"status": "FOUND", "path": path}))
    # the follower names the leader; a lost one names nobody
    follower = server(lambda path: (421, {"error": "NOT_LEADER", "message": "slaveReadEnable=false",
                                          "leader": f"127.0.0.1:{leader.server_address[1]}"}))
    lost = server(lambda path: (421, {"error": "NOT_LEADER", "message": "no leader", "leader": None}))
    try:
        got = rest_get(f"127.0.0.1:{follower.server_address[1]}", "/topics/T/queues/0/messages", {"offset": 3})
        assert got == {"status": "FOUND", "path": "/topics/T/queues/0/messages?offset=3"}
        with pytest.raises(RuntimeError, match="HTTP 421.*no leader"):
            rest_get(f"127.0.0.1:{lost.server_address[1]}", "/topics/T/queues/0/messages", {"offset": 3})
    finally:
        for s in (leader, follower, lost):
            s.shutdown()

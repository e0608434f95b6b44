"""bench/bench_store.py's load generators against a real node process.

Method: start `python -m node` through the benchmark's own NodeProcess (free ports, temp
store), produce for a fraction of a second over HTTP with both codecs and over the produce
stream (every result must be SEND_OK, or the generator raises), pull everything back with
both codecs and check the counts, then stop the node and check a clean exit. Also the
figure helpers.
"""

from __future__ import annotations

import asyncio

import msgpack

from bench import bench_store as B


def test_http_and_stream_produce_then_pull_against_a_real_node(tmp_path):
    node = B.NodeProcess(str(tmp_path), "node", B.ASYNC_FLUSH)
    try:
        node.start()
        status, doc = asyncio.run(B._one_request(node.port, "POST", "/topics", {"topic": "BenchTopic", "queues": 4}))
        assert status == 200, doc
        produced = 0
        for codec in ("msgpack", "json"):
            r = asyncio.run(B.http_produce(node.port, "BenchTopic", codec, 0.4, 2_000, connections=2, batch=50,
                                           pid=node.proc.pid))
            assert r["msgs"] > 0 and r["msgs"] % 50 == 0 and r["requests"] == r["msgs"] // 50
            assert r["node_cpu_us_per_msg"] > 0 and r["p50_ms"] is not None
            produced += r["msgs"]
        r = asyncio.run(B.stream_produce(node.stream_port, "BenchTopic", 0.4, 2_000, connections=2, batch=50,
                                         pid=node.proc.pid))
        assert r["msgs"] > 0 and r["msgs"] % 50 == 0 and r["requests"] == r["msgs"] // 50
        assert r["node_cpu_us_per_msg"] > 0 and r["p99_ms"] is not None
        produced += r["msgs"]
        for codec in ("msgpack", "json"):
            r = asyncio.run(B.http_pull(node.port, "BenchTopic", codec, 4, 20.0, 10 ** 6, connections=2))
            assert r["msgs"] == produced, (codec, r, produced)
    finally:
        code = node.stop()
    assert code == 0, node.tail()


def test_produce_request_is_one_well_formed_batch():
    raw = B.produce_request(1234, "T", 3, "msgpack", keys=True)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /topics/T/messages HTTP/1.1\r\n")
    assert f"Content-Length: {len(body)}".encode() in head
    msgs = msgpack.unpackb(body, raw=False)["messages"]
    assert len(msgs) == 3 and all(len(m["body"]) == B.BODY_BYTES and m["tags"] == "bench" for m in msgs)
    assert [m["keys"] for m in msgs] == [["k0"], ["k1"], ["k2"]]
    assert "keys" not in msgpack.unpackb(B.produce_request(1, "T", 1, "msgpack").partition(b"\r\n\r\n")[2])[
        "messages"][0]


def test_figure_and_cpu_facts():
    f = B.figure(50.0, "msg/s", 100, "a", 200.0)
    assert f["meets_target"] is False and f["ratio_to_anchor"] == 0.25 and "load1" in f
    assert B.figure(150.0, "msg/s", 100, None, None)["meets_target"] is True
    facts = B.cpu_facts(1000, 0.02, 0.001)
    assert facts == {"node_cpu_us_per_msg": 20.0, "client_cpu_us_per_msg": 1.0, "node_one_core_msgs_s": 50000}
    assert B.cpu_facts(0, 1.0, 1.0) == {}

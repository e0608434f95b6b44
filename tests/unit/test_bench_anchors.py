"""bench/anchors.py: the disk anchor on a tiny size, and the NATS cluster config (pure; no
nats-server is started here)."""

import re

from bench import anchors
from bench.__main__ import parse_json_output


def test_disk_anchors_tiny_returns_positive_numbers(tmp_path):
    result = anchors.disk_anchors(tmp_path, size_mib=2, fsync_seconds=0.05, max_fsyncs=20,
                                  write_seconds=0.05, page_idle_s=0.01)
    for key in ("seq_write_mb_s", "fdatasync_per_s", "raw_write_msgs_per_s", "raw_write_mb_s",
                "page_write_reused_mb_s", "page_write_after_idle_mb_s"):
        assert result[key] > 0, key
    assert result["raw_write_record_bytes"] == 1115
    assert result["raw_write_msgs"] <= 2 * 1024 * 1024 // 1115
    assert list(tmp_path.iterdir()) == []  # its temp dir is removed


def test_loopback_anchor_measures_round_trips_and_leaves_nothing_behind():
    result = anchors.loopback_anchor(seconds=0.3, max_round_trips=200)
    assert 0 < result["round_trips"] <= 200 and result["payload_bytes"] == 1024
    assert 0 < result["send_p50_us"] <= result["rtt_p50_us"] <= result["rtt_p99_us"]
    assert result["cpu_us_per_round_trip"] > 0


def test_nats_three_node_cluster_config():
    configs = anchors.nats_cluster_configs("/tmp/x", [4001, 4002, 4003], [6001, 6002, 6003],
                                           cluster_name="c1")
    assert [name for name, _ in configs] == ["n0", "n1", "n2"]
    for i, (name, text) in enumerate(configs):
        assert f'server_name: "{name}"' in text
        assert f'listen: "127.0.0.1:{4001 + i}"' in text
        assert f'store_dir: "/tmp/x/{name}/js"' in text
        assert 'name: "c1"' in text
        assert f'listen: "127.0.0.1:{6001 + i}"' in text
        routes = re.findall(r'"nats-route://127\.0\.0\.1:(\d+)"', text)
        assert sorted(int(p) for p in routes) == [p for p in (6001, 6002, 6003) if p != 6001 + i]
        assert text.count("{") == text.count("}")
        assert text.count("[") == text.count("]")


def test_nats_single_server_config_has_no_cluster_block():
    [(name, text)] = anchors.nats_cluster_configs("/tmp/x", [4001])
    assert name == "n0"
    assert "cluster" not in text
    assert "jetstream {" in text


def test_select_anchors():
    assert anchors.select_anchors(None) == list(anchors.ANCHOR_NAMES)
    assert anchors.select_anchors({"anchors"}) == list(anchors.ANCHOR_NAMES)
    assert anchors.select_anchors({"nats"}) == ["nats_r1_async", "nats_r1_sync",
                                                "nats_r3_async", "nats_r3_sync"]
    assert anchors.select_anchors({"store"}) == []


def test_percentile_nearest_rank():
    samples = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert anchors._percentile_ms(samples, 0.50) == 50.0
    assert anchors._percentile_ms(samples, 0.99) == 99.0
    assert anchors._percentile_ms([], 0.99) is None


def test_parse_json_output_takes_last_json_line():
    assert parse_json_output('{"a": 1}') == {"a": 1}
    assert parse_json_output('progress\n{"a": 1}\n{"b": 2}\n') == {"b": 2}
    assert parse_json_output("no json here") is None

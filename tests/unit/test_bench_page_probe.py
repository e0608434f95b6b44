"""bench_store.page_cache_probe and the per-round system CPU of bench_ha.

Method: the probe writes into a temp dir; a median round is built from scripted rounds.
"""

from __future__ import annotations

import os

from bench import bench_ha, bench_store


def test_the_page_cache_probe_reports_cost_per_gib_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_store, "PAGE_PROBE_BYTES", 4 * bench_store.MIB)
    out = bench_store.page_cache_probe(str(tmp_path))
    assert out["bytes"] == 4 * bench_store.MIB
    assert out["sys_s_per_gib"] >= 0.0 and out["wall_s_per_gib"] > 0.0
    assert os.listdir(tmp_path) == []


def test_the_median_round_keeps_each_round_s_system_cpu():
    rounds = [{"msgs_s": r, "p99_ms": 1.0, "load1": 0.5, "node_sys_us_per_msg": s, "slave_sys_us_per_msg": s / 2}
              for r, s in ((90.0, 4.0), (120.0, 1.0), (100.0, 2.0))]
    out = bench_ha._median_round(rounds)
    assert out["msgs_s"] == 100.0
    assert [r["node_sys_us_per_msg"] for r in out["rounds"]] == [4.0, 1.0, 2.0]
    assert [r["slave_sys_us_per_msg"] for r in out["rounds"]] == [2.0, 0.5, 1.0]

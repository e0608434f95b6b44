"""bench_dledger's CPU figures: per-message CPU per node, and the rates that CPU allows.

Method: a CpuMeter over stand-in process ids whose CPU seconds are scripted.
"""

from __future__ import annotations

from bench import bench_dledger as D


def test_cpu_meter_derives_one_core_and_group_rates(monkeypatch):
    cpu = {1: 10.0, 2: 20.0, 3: 30.0}
    monkeypatch.setattr(D, "cpu_seconds", lambda pid: cpu[pid])
    monkeypatch.setattr(D.os, "cpu_count", lambda: 2)
    meter = D.CpuMeter.__new__(D.CpuMeter)
    meter.procs = {"leader": 1, "follower_a": 2, "follower_b": 3}
    meter.start = {k: cpu[p] for k, p in meter.procs.items()}
    meter.client0 = D.time.process_time()
    cpu.update({1: 10.5, 2: 20.25, 3: 30.25})          # 0.5 s + 0.25 s + 0.25 s over 50,000 messages
    out = meter.per_msg_us(50_000)
    assert (out["leader"], out["follower_a"], out["follower_b"]) == (10.0, 5.0, 5.0)
    assert out["nodes_total"] == 20.0
    assert out["leader_one_core_msgs_s"] == 100_000
    assert out["group_all_cores_msgs_s"] == 100_000
    assert meter.per_msg_us(0) == {}

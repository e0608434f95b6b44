"""bench_dledger helpers: per-message CPU per node and the rates that CPU allows; the
catch-up case's page-cache drop.

Method: a CpuMeter over stand-in process ids whose CPU seconds are scripted; files in a temp dir.
"""

from __future__ import annotations

from bench import bench_dledger as D


def test_cpu_meter_derives_one_core_and_group_rates(monkeypatch):
    cpu = {1: 10.0, 2: 20.0, 3: 30.0}
    sys_cpu = {1: 1.0, 2: 2.0, 3: 3.0}
    monkeypatch.setattr(D, "cpu_seconds", lambda pid: cpu[pid])
    monkeypatch.setattr(D, "sys_seconds", lambda pid: sys_cpu[pid])
    monkeypatch.setattr(D.os, "cpu_count", lambda: 2)
    meter = D.CpuMeter.__new__(D.CpuMeter)
    meter.procs = {"leader": 1, "follower_a": 2, "follower_b": 3}
    meter.start = {k: cpu[p] for k, p in meter.procs.items()}
    meter.sys0 = {k: sys_cpu[p] for k, p in meter.procs.items()}
    meter.client0 = D.time.process_time()
    cpu.update({1: 10.5, 2: 20.25, 3: 30.25})          # 0.5 s + 0.25 s + 0.25 s over 50,000 messages
    sys_cpu.update({1: 1.1, 2: 2.05, 3: 3.05})          # of which 0.2 s in the kernel
    out = meter.per_msg_us(50_000)
    assert (out["leader"], out["follower_a"], out["follower_b"]) == (10.0, 5.0, 5.0)
    assert out["nodes_total"] == 20.0
    assert out["nodes_sys_total"] == 4.0
    assert out["leader_one_core_msgs_s"] == 100_000
    assert out["group_all_cores_msgs_s"] == 100_000
    assert meter.per_msg_us(0) == {}


def test_catch_up_drops_only_the_bytes_older_than_the_hot_span(tmp_path):
    """bench_dledger catch_up: the leader's segments lose their pages below `end - keep` (files
    named by base offset), the newest `keep` bytes stay cached; other files are not touched."""
    for name in ("00000000000000000000", "00000000000000001000", "00000000000000002000"):
        (tmp_path / name).write_bytes(b"x" * 1000)
    (tmp_path / "meta").write_bytes(b"m")
    assert D.drop_old_from_page_cache(tmp_path, end=2800, keep=1500) == 1300
    assert D.drop_old_from_page_cache(tmp_path, end=1000, keep=1500) == 0

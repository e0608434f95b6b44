"""bench/__main__.py progress: step estimates from earlier reports, the overall bar with an ETA
(fake clock, fake terminal), log lines off a terminal, and stdout staying one JSON object."""

from __future__ import annotations

import io
import json
import logging
import sys
import types

import bench.__main__ as bm
from tests.unit.test_progress import Clock, Tty


def write_report(path, quick, anchors=None, timings=None):
    path.write_text(json.dumps({"quick": quick, "anchors": anchors or {}, "timings_s": timings or {}}))


def test_estimates_take_the_newest_report_of_the_same_mode(tmp_path):
    write_report(tmp_path / "bench-20260101-000000.json", False, {"disk": {"elapsed_s": 9.0}}, {"store": 50.0})
    write_report(tmp_path / "bench-20260102-000000.json", False, {"disk": {"elapsed_s": 4.0}})
    write_report(tmp_path / "bench-20260103-000000.json", True, {"disk": {"elapsed_s": 1.0}}, {"ha": 7.0})
    (tmp_path / "bench-20260104-000000.json").write_text("{not json")
    est = bm.estimate_steps(["anchor:disk", "store", "ha"], False, tmp_path)
    assert est == {"anchor:disk": 4.0, "store": 50.0, "ha": bm.DEFAULT_STEP_S[False]}
    assert bm.estimate_steps(["ha"], True, tmp_path) == {"ha": 7.0}
    assert bm.estimate_steps(["ha"], True, tmp_path / "missing") == {"ha": bm.DEFAULT_STEP_S[True]}


def test_bar_moves_within_a_step_caps_at_its_estimate_and_names_the_step():
    clock, tty = Clock(), Tty()
    p = bm.BenchProgress({"anchor:disk": 10.0, "store": 10.0}, stream=tty, clock=clock, quiet_s=0.0)
    p.start_step("anchor:disk")
    clock.t += 5.0
    p.tick()
    assert "bench [1/2] anchor:disk:  25.0% elapsed 0:00:05 ETA 0:00:15" in tty.getvalue()
    clock.t += 20.0                       # the step overruns its 10 s estimate
    p.tick()
    assert p.done == 9500                 # held at STEP_CAP of the step, not counted as finished
    assert "47.5% elapsed 0:00:25 ETA 0:00:28 (step 15 s over its estimate)" in tty.getvalue()
    p.start_step("store")
    out = tty.getvalue()
    assert "\r\x1b[Kbench: [2/2] running store (about 10 s)\n" in out   # the bar is cleared first
    assert out.rstrip("\x1b[K").endswith("50.0% elapsed 0:00:25 ETA 0:00:25")  # and redrawn after
    clock.t += 1.0
    p.finish()
    assert tty.getvalue().endswith("100.0% elapsed 0:00:26 ETA 0:00:00\x1b[K\n")


def test_off_a_terminal_progress_is_log_lines_every_few_seconds():
    clock, stream = Clock(), io.StringIO()
    records: list[logging.LogRecord] = []
    logger = logging.getLogger("test.bench.progress")
    logger.setLevel(logging.INFO)
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        p = bm.BenchProgress({"a": 60.0}, stream=stream, logger=logger, clock=clock, quiet_s=1.0,
                             log_every_s=10.0)
        p.start_step("a")
        assert [r.getMessage() for r in records] == []          # within quiet_s: silent
        for _ in range(30):                                     # 30 s in 1 s ticks
            clock.t += 1.0
            p.tick()
        assert len(records) == 3                                # one line per 10 s
        assert records[-1].getMessage() == "bench [1/1] a:  50.0% elapsed 0:00:30 ETA 0:00:30"
        assert stream.getvalue() == "bench: [1/1] running a (about 60 s)\n"
    finally:
        logger.removeHandler(handler)


def test_main_keeps_stdout_one_json_object_and_names_each_benchmark(tmp_path, monkeypatch, capsys):
    fake = types.ModuleType("bench.bench_fake")

    def run(quick, anchors):
        print("noise from the benchmark")
        return {"ops_per_s": 1.0, "anchors_seen": sorted(anchors)}

    fake.run = run
    monkeypatch.setitem(sys.modules, "bench.bench_fake", fake)
    monkeypatch.setattr(bm, "discover", lambda: {"fake": "bench_fake"})
    monkeypatch.setattr(bm, "REPORTS_DIR", tmp_path)
    assert bm.main(["--quick", "--only", "fake", "--out", str(tmp_path / "r.json")]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["results"] == {"fake": {"ops_per_s": 1.0, "anchors_seen": []}}
    assert json.loads((tmp_path / "r.json").read_text()) == report
    assert f"bench: [1/1] running fake (about {bm.DEFAULT_STEP_S[True]:.0f} s)" in err
    assert "noise from the benchmark" in err

"""`python -m node` raises the cyclic GC's young-generation threshold before serving.

At CPython's default (700) the collector took about 10% of a DLedger leader's CPU per
message. Method: run `node.__main__.main` with the server replaced by a probe that
records the thresholds in force when serving starts; the real thresholds are restored.
"""

from __future__ import annotations

import gc

import node.server
from node import __main__ as node_main


def test_serving_starts_with_the_raised_gc_threshold(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(node.server, "main", lambda config: seen.append(gc.get_threshold()) or 0)
    monkeypatch.setattr("node.auth.preflight", lambda config: None)
    conf = tmp_path / "broker.conf"
    conf.write_text(f"storePathRootDir={tmp_path / 'store'}\n")
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        assert node_main.main(["--config", str(conf)]) == 0
    finally:
        gc.set_threshold(*saved)
    assert seen == [node_main.GC_THRESHOLDS]
    assert node_main.GC_THRESHOLDS[0] > 700


def test_a_bad_config_exits_2_without_touching_the_gc(monkeypatch, tmp_path, capsys):
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        assert node_main.main(["--config", str(tmp_path / "missing.conf")]) == 2
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*saved)
    assert "ConfigError" in capsys.readouterr().err

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


def _young_collections_while_the_cache_turns_over(tmp_path, thresholds) -> int:
    """Append 1 KiB entries as a follower does, 256 at a time, until the entry cache has
    dropped its older half three times; count the young-generation collections meanwhile."""
    from dledger import entry_store as ES
    from dledger.core import _new_entries
    from dledger.messages import EntryType
    from node.store.fileio import FaultyFileSystem
    store = ES.EntryStore(FaultyFileSystem(0), str(tmp_path), "n0")
    store.recover()
    body = bytes(1024)
    per_turn = ES._CACHE_MAX_BYTES // 2 // (ES.HEADER + len(body))
    collections = []

    def seen(phase, info):
        if phase == "start" and info["generation"] == 0:
            collections.append(store.last_index())
    saved = gc.get_threshold()
    gc.set_threshold(*thresholds)
    gc.collect()
    gc.callbacks.append(seen)
    try:
        index = 1
        while index < 5 * per_turn:      # the cache fills (2 halves), then turns over 3 times
            store.append(_new_entries(index, 1, EntryType.NORMAL, [body] * 256))
            index += 256
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*saved)
        store.close()
    return sum(1 for at in collections if at > 2 * per_turn)


def test_the_entry_cache_turning_over_triggers_no_young_collection(tmp_path):
    """Regression: at a young-generation threshold of 20,000, every refill of the entry cache's
    dropped half triggered a collection that walked ~20,000 live entries (~10 ms each, 2-6%
    of a node's CPU in bench.bench_dledger); the node's thresholds leave it alone."""
    assert _young_collections_while_the_cache_turns_over(tmp_path / "old", (20_000, 10, 10)) >= 3
    assert _young_collections_while_the_cache_turns_over(tmp_path / "node", node_main.GC_THRESHOLDS) == 0

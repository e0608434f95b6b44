"""Goal: the pure parts of the drill tooling behave without Docker: the matrix row and table,
the ACL and cluster-secret files the compose cluster is started with, the credentials the drills sign with, and
bad settings refused with a clear error. Method: plain inputs, tmp files, env patches."""

from __future__ import annotations

import json
import os
import stat

import pytest

from deploy.drills import cluster as cl
from deploy.drills.matrix import COLUMNS, markdown, row_of
from node.acl import parse_acl, sign_headers


def _result(failovers, recoveries, ok=True, lost=None):
    return {"scenario": "kill_leader", "ok": ok, "timeline": {"cycles": len(failovers)}, "load_avg": 3.5,
            "targets": {"failover_target_s": 2.0, "met": True}, "paths": {"html": "x.html"},
            "verdict": {"sent": 100, "acked": 97, "lost": lost or {}, "duplicates": {}, "phantoms": {},
                        "divergence": [], "failover_s": failovers[0], "recovery_s": recoveries[-1],
                        "unavailable_s": 1.5, "failovers_s": failovers, "recoveries_s": recoveries}}


def test_matrix_row_has_median_and_p99_over_cycles():
    r = row_of(_result([1.0, 2.0, 3.0, 10.0], [0.1, 0.2, 0.3, 0.4]))
    assert r["ok"] and r["cycles"] == 4
    assert r["failover_median_s"] == 2.5 and r["failover_p99_s"] == 10.0
    assert r["recovery_median_s"] == pytest.approx(0.25) and r["recovery_p99_s"] == 0.4
    assert (r["lost"], r["duplicates"], r["phantoms"], r["divergence"]) == (0, 0, 0, 0)


def test_matrix_row_fails_a_cycle_without_an_ack_and_counts_losses():
    r = row_of(_result([1.0, None], [0.1], lost={"a0": {"count": 3, "sample": []}}))
    assert r["ok"] is False and "without an ack" in r["note"]
    assert r["lost"] == 3 and r["failover_median_s"] == 1.0


def test_matrix_markdown_has_every_column_and_row():
    rows = [row_of(_result([1.0], [0.5])), {"scenario": "disk_full", "ok": False, "note": "error: x"}]
    md = markdown(rows, {"started": "now", "seconds": 30.0, "rate": 40.0, "project": "p"})
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| scenario"))
    assert header.count("|") == len(COLUMNS) + 1
    assert any(line.startswith("| kill_leader | PASS |") for line in lines)
    assert any(line.startswith("| disk_full | FAIL |") for line in lines)
    assert "- disk_full: error: x" in md


def test_acl_file_is_generated_private_parseable_and_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("MQSTORE_ACCESS_KEY", raising=False)
    monkeypatch.delenv("MQSTORE_SECRET_KEY", raising=False)
    path = str(tmp_path / "acl.json")
    cl.ensure_acl_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    accounts = parse_acl(open(path, "rb").read())
    assert accounts[cl.ADMIN_ACCESS_KEY].admin
    before = open(path).read()
    cl.ensure_acl_file(path)                      # an existing file is kept, not regenerated
    assert open(path).read() == before
    ak, sk = cl.load_credentials(path)
    assert ak == cl.ADMIN_ACCESS_KEY and len(sk) >= 32


def test_cluster_secret_file_is_generated_private_loadable_and_kept(tmp_path):
    from node.peer_auth import MIN_SECRET_BYTES, load_secret
    path = str(tmp_path / "cluster.secret")
    cl.ensure_secret_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    secret = load_secret(secret_file=path)
    assert secret is not None and len(secret) >= MIN_SECRET_BYTES
    cl.ensure_secret_file(path)                   # an existing file is kept, not regenerated
    assert load_secret(secret_file=path) == secret
    other = str(tmp_path / "other.secret")
    cl.ensure_secret_file(other)
    assert load_secret(secret_file=other) != secret


def test_bad_cluster_secret_file_is_refused(tmp_path):
    short = tmp_path / "short.secret"
    short.write_text("abc\n")
    with pytest.raises(cl.DrillError, match="not usable.*at least"):
        cl.ensure_secret_file(str(short))
    assert short.read_text() == "abc\n"         # reported, never silently replaced
    os.makedirs(tmp_path / "dir.secret")
    with pytest.raises(cl.DrillError, match="is a directory"):
        cl.ensure_secret_file(str(tmp_path / "dir.secret"))


def test_bad_acl_file_and_half_credentials_are_refused(tmp_path, monkeypatch):
    path = tmp_path / "acl.json"
    path.write_text(json.dumps({"accounts": [{"accessKey": "ab", "secretKey": "x" * 10}]}))
    with pytest.raises(cl.DrillError, match="not usable"):
        cl.ensure_acl_file(str(path))
    os.makedirs(tmp_path / "dir.json")
    with pytest.raises(cl.DrillError, match="is a directory"):
        cl.ensure_acl_file(str(tmp_path / "dir.json"))
    monkeypatch.setenv("MQSTORE_ACCESS_KEY", "someone")
    monkeypatch.delenv("MQSTORE_SECRET_KEY", raising=False)
    with pytest.raises(cl.DrillError, match="both"):
        cl.load_credentials(str(path))


def test_http_json_signs_path_and_query(monkeypatch):
    """The signature covers the path with its query, as node/acl.py verifies it."""
    seen = {}

    class Resp:
        status = 200

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def read(self):
            return b"{}"

    def fake_urlopen(req, timeout):
        seen.update(req.header_items())
        seen["url"] = req.full_url
        return Resp()

    monkeypatch.setattr(cl.urllib.request, "urlopen", fake_urlopen)
    monkeypatch.setattr(cl, "CREDENTIALS", ("drill-admin", "s" * 40))
    st, _ = cl.http_json("GET", "http://127.0.0.1:1/topics/t/queues/0/messages?offset=5&max=32")
    assert st == 200
    headers = {k.lower(): v for k, v in seen.items()}
    want = sign_headers("drill-admin", "s" * 40, "GET", "/topics/t/queues/0/messages?offset=5&max=32", None, b"",
                        int(headers["x-mq-timestamp"]), nonce=headers["x-mq-nonce"])
    assert headers["x-mq-signature"] == want["X-MQ-Signature"]


def test_small_disk_size_is_validated(monkeypatch):
    monkeypatch.setenv("MQSTORE_SMALLDISK_MB", "10")
    with pytest.raises(cl.DrillError, match="64..4096"):
        cl.smalldisk_mb()
    monkeypatch.setenv("MQSTORE_SMALLDISK_MB", "lots")
    with pytest.raises(cl.DrillError):
        cl.smalldisk_mb()
    monkeypatch.setenv("MQSTORE_SMALLDISK_MB", "128")
    assert cl.smalldisk_mb() == 128


def test_explicit_compose_binary_must_exist(monkeypatch):
    monkeypatch.setenv("MQSTORE_COMPOSE", "/nonexistent/compose")
    with pytest.raises(cl.DrillError, match="not an executable"):
        cl.compose_command()


def test_workload_follows_a_new_leader_while_the_old_one_stalls(tmp_path, monkeypatch):
    """The route refresher: sends started after a new leader claims a higher term go to it,
    although the old leader never answers (paused), instead of each waiting SEND_TIMEOUT_S."""
    import threading
    import time as _time
    from types import SimpleNamespace

    from deploy.drills import workload as wl

    stalled = threading.Event()
    state = {"a0": ("LEADER", 1), "a1": ("FOLLOWER", 1), "a2": ("FOLLOWER", 1)}

    class FakeCluster:
        nodes = {s: SimpleNamespace(api=s) for s in ("a0", "a1", "a2")}

        def refresh(self):
            pass

        def health(self, s, timeout=1.0):
            if s == "a0" and stalled.is_set():
                _time.sleep(timeout)              # a paused container answers nothing
                return None
            role, term = state[s]
            return {"role": role, "term": term}

    sent_to: list[tuple[float, str]] = []

    def fake_http_json(method, url, body=None, timeout=2.0):
        api = url.split("/")[2]
        sent_to.append((_time.monotonic(), api))
        if api == "a0" and stalled.is_set():
            _time.sleep(timeout)
            raise OSError("timed out")
        return 200, {"results": [{"status": "SEND_OK", "queue_id": body["messages"][0]["queue_id"],
                                  "queue_offset": len(sent_to), "msg_id": "m"}]}

    monkeypatch.setattr(wl, "http_json", fake_http_json)
    monkeypatch.setattr(wl, "GROUPS", {"broker-a": ("a0", "a1", "a2")})
    w = wl.Workload(FakeCluster(), "broker-a", "T", 4, wl.History(str(tmp_path / "h.jsonl")),
                    rate_per_s=40)
    w.start()
    try:
        _time.sleep(0.5)
        assert {api for _, api in sent_to} == {"a0"}
        stalled.set()
        t_fault = _time.monotonic()
        _time.sleep(0.4)                          # the election takes a moment
        state["a1"] = ("LEADER", 2)
        t_elected = _time.monotonic()
        deadline = t_elected + wl.SEND_TIMEOUT_S
        while _time.monotonic() < deadline and not any(api == "a1" for _, api in sent_to):
            _time.sleep(0.02)
        first_new = next(t for t, api in sent_to if api == "a1")
        assert first_new - t_elected < 1.0, "sends kept waiting on the stalled leader"
        assert first_new - t_fault < wl.SEND_TIMEOUT_S
    finally:
        w.stop()
        w.history.close()

"""Goal: the pure parts of the drill tooling behave without Docker: the matrix row and table,
the ACL file the compose cluster is started with, the credentials the drills sign with, and
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

"""The live node's API against its own OpenAPI document (schemathesis).

Method: one real standalone node (`python -m node`) on a free loopback port with one
topic holding a message; the schemathesis CLI loads `/openapi.json` from it and
generates requests for every operation (coverage, fuzzing and stateful phases; bounded
examples per operation, deterministic generation so a failure replays; well under
90 s). Checks: no response is a 5xx, every status code and content type is one the
document lists, every body is valid against its schema, and the node logged no
unhandled error. Long polls are capped at 100 ms by the node's config.
(schemathesis' pytest plugin does not run under pytest 9, hence the CLI.)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("schemathesis", reason="schemathesis is a dev extra: pip install -e '.[dev]'")

from mqstore.localcluster import NodeProc, free_port, http  # noqa: E402
from tests.integration.test_node_process import write_conf  # noqa: E402

MAX_EXAMPLES = 15
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


@pytest.fixture
def live_node(tmp_path):
    port = free_port()
    node = NodeProc(write_conf(tmp_path, port, "longPollingMaxWaitMs=100\n"), port, str(tmp_path / "node.log"))
    node.start()
    assert http(port, "POST", "/topics", {"topic": "T", "queues": 2})[0] == 200
    assert http(port, "POST", "/topics/T/messages", {"messages": [{"body": "hello", "keys": ["k"]}]})[0] == 200
    yield node
    node.kill9()


def _cli() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    return [exe] if os.path.exists(exe) else [shutil.which("schemathesis") or "schemathesis"]


@pytest.mark.timeout(150)
def test_api_conforms_to_its_openapi_document(live_node, tmp_path):
    url = f"http://127.0.0.1:{live_node.port}/openapi.json"
    cmd = [*_cli(), "run", url, "--checks", CHECKS, "--max-examples", str(MAX_EXAMPLES),
           "--generation-deterministic", "--request-timeout", "10", "--no-color",
           "--report", "junit", "--report-dir", str(tmp_path / "report")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    selected = re.search(r"Selected: (\d+)/(\d+)", out)
    assert selected and selected.group(1) == selected.group(2) and int(selected.group(2)) >= 20, out[-3000:]
    assert re.search(r"\d+ generated, \d+ passed", out), out[-3000:]
    with open(tmp_path / "node.log", encoding="utf-8", errors="replace") as f:
        log = f.read()
    assert "unhandled error" not in log, log[-4000:]

"""A brief run of every fuzz harness (fuzz/<target>.py), as CI does on every change.

Method: each harness runs in its own subprocess (`python -m fuzz.<target> -runs=N`)
for a bounded number of inputs and at most a few seconds, starting from the
committed seeds; any crash (an exception other than the decoder's documented errors,
a timeout, an allocation past the limits) makes libFuzzer exit non-zero and fails
the test with the input that did it. New inputs go to a temp dir, never to the
committed corpus. `make fuzz` runs the same harnesses for longer.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("atheris", reason="atheris is a dev extra: pip install -e '.[dev]'")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# target -> inputs for the brief run (file-backed targets are slower per input).
TARGETS = {
    "message": 20_000,
    "dledger_entry": 20_000,
    "ha_protocol": 20_000,
    "raft_codec": 20_000,
    "raft_transport": 5_000,
    "rest_api": 10_000,
    "produce_stream": 10_000,
    "rest_app": 1_500,
    "consume_queue": 1_500,
    "index_file": 1_500,
    "entry_store": 600,
}
SECONDS_PER_TARGET = 4


def test_every_harness_has_a_brief_run_and_seeds():
    harnesses = {n[:-3] for n in os.listdir(os.path.join(ROOT, "fuzz"))
                 if n.endswith(".py") and not n.startswith("_") and n != "make_corpus.py"}
    assert harnesses == set(TARGETS)
    for t in TARGETS:
        seeds = os.listdir(os.path.join(ROOT, "fuzz", "corpus", t))
        assert len(seeds) >= 3, t


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fuzz_brief(target, tmp_path):
    env = {**os.environ, "MQSTORE_FUZZ_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", f"fuzz.{target}", f"-runs={TARGETS[target]}",
           f"-max_total_time={SECONDS_PER_TARGET}", "-seed=1"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"fuzz.{target} crashed (exit {p.returncode}):\n{out[-4000:]}"
    assert "Done" in out, out[-2000:]
    assert not [n for n in os.listdir(tmp_path / target) if n.startswith(("crash-", "oom-", "timeout-"))]

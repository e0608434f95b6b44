"""A live 3-node DLedger group of real `python -m node` processes on free loopback ports.

Shared by the metrics and dashboard tests: each node gets its own store under the
test's tmp dir; `kill9(node_id)` ends one process abruptly; `close()` ends them all.
"""

from __future__ import annotations

import os
import time
import urllib.error

from tests.integration.test_node_process import NodeProcess, free_port, http, write_conf

NODE_IDS = ("n0", "n1", "n2")


class DLedgerGroup:
    def __init__(self, tmp_path, extra: str = ""):
        self.api = {n: free_port() for n in NODE_IDS}
        raft = {n: free_port() for n in NODE_IDS}
        peers = ";".join(f"{n}-127.0.0.1:{raft[n]}" for n in NODE_IDS)
        apis = ";".join(f"{n}-127.0.0.1:{self.api[n]}" for n in NODE_IDS)
        self.nodes: dict[str, NodeProcess] = {}
        for n in NODE_IDS:
            d = tmp_path / n
            d.mkdir()
            conf = write_conf(d, self.api[n], "enableDLegerCommitLog=true\ndLegerGroup=broker-a\n"
                                              f"dLegerPeers={peers}\ndLegerPeerApis={apis}\n"
                                              f"dLegerSelfId={n}\n" + extra)
            self.nodes[n] = NodeProcess(conf, self.api[n], str(d / "node.log"))

    def start(self) -> "DLedgerGroup":
        for p in self.nodes.values():   # start all before waiting: a lone node has no quorum
            _spawn(p)
        for p in self.nodes.values():
            _wait_up(p)
        return self

    def alive(self) -> list[str]:
        return [n for n, p in self.nodes.items() if p.proc is not None and p.proc.poll() is None]

    def leader(self, timeout_s: float = 20.0, among: list[str] | None = None) -> str:
        """The node id that reports itself LEADER and can take writes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for n in among or self.alive():
                try:
                    status, doc = http(self.api[n], "GET", "/health", timeout=1.0)
                except (urllib.error.URLError, ConnectionError, OSError):
                    continue
                if status == 200 and doc.get("role") == "LEADER":
                    return n
            time.sleep(0.1)
        raise AssertionError("no leader elected; logs:\n" + "\n".join(p.tail() for p in self.nodes.values()))

    def kill9(self, node_id: str) -> None:
        self.nodes[node_id].kill9()

    def close(self) -> None:
        for p in self.nodes.values():
            p.kill9()

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n{p.tail()}" for n, p in self.nodes.items())


def _spawn(p: NodeProcess) -> None:
    import subprocess
    import sys
    from tests.integration.test_node_process import ROOT
    log = open(p.log_path, "ab")
    p.proc = subprocess.Popen([sys.executable, "-m", "node", "--config", p.conf], cwd=ROOT, stdout=log, stderr=log,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()


def _wait_up(p: NodeProcess, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise AssertionError(f"node exited with {p.proc.returncode}: {p.tail()}")
        try:
            if http(p.port, "GET", "/health", timeout=1.0)[0] in (200, 503):
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"node did not answer /health: {p.tail()}")

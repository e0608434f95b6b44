"""Real `python -m node` processes for the client tests: one standalone node, or a DLedger trio.

Every node gets free loopback ports and a store under the test's tmp dir. Delay levels are
shortened (level 2 is 2 s, every other level 1 s) so retry and delay paths run in seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error

from tests.integration.test_node_process import ROOT, NodeProcess, free_port, http, write_conf

FAST_DELAY_LEVELS = "1s 2s " + " ".join(["1s"] * 16)       # 18 levels, like the default table
COMMON = (f"messageDelayLevel={FAST_DELAY_LEVELS}\nlongPollingMaxWaitMs=1000\n"
          "flushConsumerOffsetInterval=1000\nautoCreateTopicEnable=true\n")


def _spawn(p: NodeProcess) -> None:
    with open(p.log_path, "ab") as log:
        p.proc = subprocess.Popen([sys.executable, "-m", "node", "--config", p.conf], cwd=ROOT, stdout=log,
                                  stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _health(port: int) -> dict | None:
    try:
        status, doc = http(port, "GET", "/health", timeout=1.0)
    except (urllib.error.URLError, ConnectionError, OSError, ValueError):
        return None
    return doc if status == 200 else None


class Standalone:
    def __init__(self, tmp_path, extra: str = ""):
        self.port = free_port()
        d = tmp_path / "standalone"
        d.mkdir(exist_ok=True)
        self.node = NodeProcess(write_conf(d, self.port, COMMON + extra), self.port, str(d / "node.log"))

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Standalone":
        self.node.start()
        return self

    def restart(self) -> None:
        assert self.node.terminate() == 0, self.node.tail()
        self.node.start()

    def close(self) -> None:
        if self.node.proc is not None and self.node.proc.poll() is None:
            self.node.kill9()


class DLedgerTrio:
    IDS = ("n0", "n1", "n2")

    def __init__(self, tmp_path, extra: str = ""):
        self.api = {n: free_port() for n in self.IDS}
        raft = {n: free_port() for n in self.IDS}
        peers = ";".join(f"{n}-127.0.0.1:{raft[n]}" for n in self.IDS)
        apis = ";".join(f"{n}-127.0.0.1:{self.api[n]}" for n in self.IDS)
        self.nodes: dict[str, NodeProcess] = {}
        for n in self.IDS:
            d = tmp_path / n
            d.mkdir()
            conf = write_conf(d, self.api[n], COMMON + "enableDLegerCommitLog=true\ndLegerGroup=broker-a\n"
                                                       f"dLegerPeers={peers}\ndLegerPeerApis={apis}\n"
                                                       f"dLegerSelfId={n}\n" + extra)
            self.nodes[n] = NodeProcess(conf, self.api[n], str(d / "node.log"))

    @property
    def addrs(self) -> list[str]:
        return [f"127.0.0.1:{self.api[n]}" for n in self.IDS]

    def start(self) -> "DLedgerTrio":
        for p in self.nodes.values():      # all at once: a lone node has no quorum
            _spawn(p)
        self.leader()
        return self

    def leader(self, timeout_s: float = 20.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for n, p in self.nodes.items():
                if p.proc is None or p.proc.poll() is not None:
                    continue
                doc = _health(self.api[n])
                if doc is not None and doc.get("role") == "LEADER":
                    return n
            time.sleep(0.1)
        raise AssertionError("no leader elected:\n" + self.tails())

    def kill9(self, node_id: str) -> None:
        self.nodes[node_id].kill9()

    def close(self) -> None:
        for p in self.nodes.values():
            if p.proc is not None and p.proc.poll() is None:
                p.kill9()

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n{p.tail()}" for n, p in self.nodes.items())

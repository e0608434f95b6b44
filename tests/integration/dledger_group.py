"""A live 3-node DLedger group of real `python -m node` processes on free loopback ports.

Shared by the metrics, dashboard and client tests: each node gets its own store under the
test's tmp dir and a produce stream port; `kill9(node_id)` ends one process abruptly; `close()` ends them all.
"""

from __future__ import annotations

from mqstore import localcluster as lc
from tests.integration.test_node_process import NodeProcess, write_conf

NODE_IDS = ("n0", "n1", "n2")


class DLedgerGroup:
    def __init__(self, tmp_path, extra: str = ""):
        k = len(NODE_IDS)
        ports = lc.free_ports(3 * k)
        self.api = dict(zip(NODE_IDS, ports))
        raft = dict(zip(NODE_IDS, ports[k:2 * k]))
        self.stream = dict(zip(NODE_IDS, ports[2 * k:]))     # produce streams: the SDK sends on them
        self.nodes: dict[str, NodeProcess] = {}
        for n in NODE_IDS:
            d = tmp_path / n
            d.mkdir()
            # slaveReadEnable: the tests read every replica's queues, followers' included.
            conf = write_conf(d, self.api[n], "\n".join([*lc.dledger_lines(n, "broker-a", raft, self.api),
                                                         f"streamListenPort={self.stream[n]}",
                                                         "slaveReadEnable=true"]) + "\n" + extra)
            self.nodes[n] = NodeProcess(conf, self.api[n], str(d / "node.log"))

    def start(self) -> "DLedgerGroup":
        for p in self.nodes.values():   # start all before waiting: a lone node has no quorum
            p.launch()
        for p in self.nodes.values():
            p.wait_healthy(30.0, statuses=(200, 503))
        return self

    def alive(self) -> list[str]:
        return [n for n, p in self.nodes.items() if p.proc is not None and p.proc.poll() is None]

    def leader(self, timeout_s: float = 20.0, among: list[str] | None = None) -> str:
        """The node id that reports itself LEADER and can take writes."""
        ids = among or self.alive()
        found = lc.find_leader([self.api[n] for n in ids], timeout_s, roles=("LEADER",))
        if found is None:
            raise AssertionError("no leader elected; logs:\n" + "\n".join(p.tail() for p in self.nodes.values()))
        return ids[[self.api[n] for n in ids].index(found)]

    def kill9(self, node_id: str) -> None:
        self.nodes[node_id].kill9()

    def close(self) -> None:
        for p in self.nodes.values():
            p.kill9()

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n{p.tail()}" for n, p in self.nodes.items())


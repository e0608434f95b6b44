"""Real `python -m node` processes for the client tests: one standalone node, or a DLedger trio.

Every node has a produce stream, so the SDK's producers send on it (and over HTTP where a
test turns it off).

Every node gets free loopback ports and a store under the test's tmp dir. Delay levels are
shortened (level 2 is 2 s, every other level 1 s) so retry and delay paths run in seconds, and
queue locks of ordered consumers live 3 s.
"""

from __future__ import annotations

from mqstore import localcluster as lc
from tests.integration.dledger_group import NODE_IDS, DLedgerGroup
from tests.integration.test_node_process import NodeProcess, write_conf

FAST_DELAY_LEVELS = "1s 2s " + " ".join(["1s"] * 16)       # 18 levels, like the default table
COMMON = (f"messageDelayLevel={FAST_DELAY_LEVELS}\nlongPollingMaxWaitMs=1000\n"
          "flushConsumerOffsetInterval=1000\nautoCreateTopicEnable=true\n"
          "rebalanceLockMaxLiveTimeMs=3000\n")        # ordered consumers' queue locks: 3 s


class Standalone:
    def __init__(self, tmp_path, extra: str = ""):
        self.port, self.stream_port = lc.free_ports(2)
        d = tmp_path / "standalone"
        d.mkdir(exist_ok=True)
        self.node = NodeProcess(write_conf(d, self.port, COMMON + f"streamListenPort={self.stream_port}\n" + extra),
                                self.port, str(d / "node.log"))

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
        self.node.kill9()


class DLedgerTrio(DLedgerGroup):
    """tests.integration.dledger_group.DLedgerGroup with the client tests' COMMON settings;
    `start` returns once a leader is elected."""

    IDS = NODE_IDS

    def __init__(self, tmp_path, extra: str = ""):
        super().__init__(tmp_path, COMMON + extra)

    @property
    def addrs(self) -> list[str]:
        return [f"127.0.0.1:{self.api[n]}" for n in self.IDS]

    def start(self) -> "DLedgerTrio":
        for p in self.nodes.values():      # all at once: a lone node has no quorum
            p.launch()
        self.leader()
        return self

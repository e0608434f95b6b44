"""What a drill needs from a cluster: the one interface the scenarios, the workload and the
runner use, whichever tier runs the nodes.

Two tiers implement it: `deploy.drills.cluster.Cluster` (docker-compose containers) and
`deploy.netns.cluster.NetnsCluster` (node processes in network namespaces on one host).
Service names are the same in both: GROUPS and CONTROLLERS of deploy.drills.cluster.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ClusterControl(Protocol):
    # service -> deploy.drills.cluster.Node (service, kind, ip, api "host:port" or None)
    nodes: dict[str, Any]

    # --- discovery ---------------------------------------------------------------------------
    def refresh(self) -> None: ...
    def health(self, service: str, timeout: float = 1.0) -> dict | None: ...
    def leader(self, group: str, timeout_s: float = 20.0, exclude: tuple = ()) -> str: ...
    def service_of_addr(self, addr: str | None) -> str | None: ...
    def wait_healthy(self, services, timeout_s: float = 90.0) -> float: ...
    def wait_converged(self, group: str, timeout_s: float = 60.0) -> float | None: ...

    # --- faults ------------------------------------------------------------------------------
    def kill(self, service: str) -> None: ...                      # kill -9
    def start(self, service: str) -> None: ...                     # start a stopped/killed service
    def stop(self, service: str, timeout_s: int = 10) -> None: ...  # graceful stop
    def pause(self, service: str) -> None: ...                     # SIGSTOP-like freeze
    def unpause(self, service: str) -> None: ...
    def disconnect(self, service: str) -> Any: ...                 # isolate both ways; returns a token
    def reconnect(self, service: str, saved: Any) -> None: ...     # undo disconnect(token)
    def iptables_drop_from(self, service: str, peers: list[str]) -> None: ...   # one-way: service hears nothing from peers
    def iptables_flush(self, service: str) -> None: ...

    # --- store audit ---------------------------------------------------------------------------
    def volume_mountpoint(self, service: str) -> str | None: ...


PROTOCOL_MEMBERS = ("nodes", "refresh", "health", "leader", "service_of_addr", "wait_healthy", "wait_converged",
                    "kill", "start", "stop", "pause", "unpause", "disconnect", "reconnect", "iptables_drop_from",
                    "iptables_flush", "volume_mountpoint")

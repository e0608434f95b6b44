"""The running compose cluster, seen through the docker SDK and the nodes' HTTP APIs.

`Compose` wraps the compose command (v2 `docker compose` or v1 `docker-compose`, whichever
exists) for up/down/clean. `Cluster` finds the project's containers by their compose labels,
maps each service to its published 127.0.0.1 API port, reads `/health`, and injects faults:
kill -9, pause, network disconnect, iptables one-way drops, stop/start.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROJECT = os.environ.get("MQSTORE_PROJECT", "mqstore")
IMAGE = os.environ.get("MQSTORE_IMAGE", "mqstore:latest")
GROUPS = {"broker-a": ("a0", "a1", "a2"), "broker-b": ("b0", "b1")}
CONTROLLERS = ("c0", "c1", "c2")
API_PORT = {"controller": 9876, "node": 10911}
LEADER_ROLES = ("LEADER", "MASTER")


class DrillError(RuntimeError):
    """The cluster is not in a state a drill can run against; the message says what to do."""


def compose_command() -> list[str]:
    """`docker compose` (v2) when the plugin answers, else `docker-compose` (v1)."""
    if shutil.which("docker"):
        r = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if r.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise DrillError("neither `docker compose` nor `docker-compose` is installed "
                     "(apt-get install -y docker.io docker-compose)")


def docker_client():
    try:
        import docker
    except ImportError:
        raise DrillError("the docker SDK is missing: pip install -e '.[deploy]'") from None
    try:
        client = docker.from_env(version="auto", timeout=30)
        client.ping()
    except Exception as e:  # noqa: BLE001 - the SDK raises many kinds; all mean "no engine"
        raise DrillError(f"no Docker engine answers ({e}); start dockerd") from None
    return client


class Compose:
    def __init__(self, project: str = PROJECT, file: str | None = None):
        self.project = project
        self.file = file or os.path.join(ROOT, "docker-compose.yml")
        self.cmd = compose_command()

    def run(self, *args: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
        full = [*self.cmd, "-p", self.project, "-f", self.file, *args]
        out = subprocess.PIPE if quiet else None
        r = subprocess.run(full, cwd=ROOT, stdout=out, stderr=out, text=True)
        if check and r.returncode != 0:
            raise DrillError(f"`{' '.join(full)}` failed with exit code {r.returncode}"
                             + (f": {r.stderr.strip()[-800:]}" if quiet and r.stderr else ""))
        return r

    def up(self) -> None:
        self.run("up", "-d")

    def down(self, volumes: bool = False) -> None:
        self.run("down", *(["-v"] if volumes else []))


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 2.0) -> tuple[int, dict]:
    """(status, JSON body); raises OSError (URLError included) when the node does not answer."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw or b"{}")
        except ValueError:
            return e.code, {"error": "HTTP_%d" % e.code, "message": raw[:200].decode(errors="replace")}


@dataclass
class Node:
    service: str
    kind: str                   # "node" or "controller"
    ip: str                     # address on the compose network (brokerIP1)
    api: str | None             # 127.0.0.1:<published port>, None while stopped


def service_healthy(kind: str, health: dict | None) -> bool:
    """A /health answer counts as healthy: any 200 for a broker; for a controller also `ready`."""
    if health is None:
        return False
    return kind != "controller" or health.get("ready") is True


class Cluster:
    def __init__(self, project: str = PROJECT):
        self.project = project
        self.client = docker_client()
        self.nodes: dict[str, Node] = {}
        self._static_ip: dict[str, tuple[str, str]] = {}     # service -> (network, ip), for reconnect
        self.refresh()

    # --- discovery ---------------------------------------------------------------------------
    def container(self, service: str):
        found = self.client.containers.list(all=True, filters={"label": [
            f"com.docker.compose.project={self.project}", f"com.docker.compose.service={service}"]})
        if not found:
            raise DrillError(f"no container for service {service} in compose project {self.project}; run `make up`")
        return found[0]

    def refresh(self) -> None:
        for service in (*GROUPS["broker-a"], *GROUPS["broker-b"], *CONTROLLERS):
            kind = "controller" if service in CONTROLLERS else "node"
            c = self.container(service)
            c.reload()
            port = API_PORT[kind]
            bound = (c.attrs["NetworkSettings"].get("Ports") or {}).get(f"{port}/tcp") or []
            api = next((f"127.0.0.1:{b['HostPort']}" for b in bound if b.get("HostIp") in ("127.0.0.1", "")), None)
            ip = ""
            for name, net in (c.attrs["NetworkSettings"].get("Networks") or {}).items():
                ip = (net.get("IPAMConfig") or {}).get("IPv4Address") or net.get("IPAddress") or ip
                self._static_ip[service] = (name, ip)
            if not ip and service in self._static_ip:
                ip = self._static_ip[service][1]      # disconnected by a drill: keep its address
            self.nodes[service] = Node(service, kind, ip, api)

    def service_of_addr(self, addr: str | None) -> str | None:
        """'172.29.7.12:10911' (a leader hint) -> 'a1'."""
        if not addr:
            return None
        host = addr.rsplit(":", 1)[0]
        return next((s for s, n in self.nodes.items() if n.ip == host), None)

    def health(self, service: str, timeout: float = 1.0) -> dict | None:
        n = self.nodes[service]
        if n.api is None:
            return None
        try:
            st, doc = http_json("GET", f"http://{n.api}/health", timeout=timeout)
        except OSError:
            return None
        return doc if st == 200 else None

    def leader(self, group: str, timeout_s: float = 20.0, exclude: tuple = ()) -> str:
        """The service that leads `group` (claims LEADER/MASTER in the highest term), waiting up to timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            claims = []
            for s in GROUPS[group]:
                if s in exclude:
                    continue
                h = self.health(s)
                if h and h.get("role") in LEADER_ROLES:
                    claims.append((int(h.get("term") or 0), s))
            if claims:
                return max(claims)[1]
            if time.monotonic() > deadline:
                raise DrillError(f"no leader in {group} after {timeout_s:.0f} s")
            time.sleep(0.2)

    def wait_healthy(self, services, timeout_s: float = 90.0) -> float:
        """Seconds until every service answers /health with 200 (refreshing ports as they appear);
        a controller also has to report `ready` (its Raft state machine caught up), since one that
        is not ready never decides anything and a classic master would never be replaced."""
        t0 = time.monotonic()
        pending = list(services)
        while pending:
            self.refresh()
            pending = [s for s in pending if not service_healthy(self.nodes[s].kind, self.health(s))]
            if not pending:
                break
            if time.monotonic() - t0 > timeout_s:
                raise DrillError(f"not healthy after {timeout_s:.0f} s: {pending} (a controller must report "
                                 f"ready=true in /health); see `docker logs`")
            time.sleep(0.5)
        return time.monotonic() - t0

    def wait_converged(self, group: str, timeout_s: float = 60.0) -> float | None:
        """Seconds until every replica of `group` is healthy with one committed offset, else None."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            hs = [self.health(s) for s in GROUPS[group]]
            if all(hs) and len({h["committed_offset"] for h in hs}) == 1 and any(
                    h.get("role") in LEADER_ROLES for h in hs):
                return time.monotonic() - t0
            time.sleep(0.3)
        return None

    # --- faults ------------------------------------------------------------------------------
    def kill(self, service: str) -> None:
        self.container(service).kill(signal="SIGKILL")

    def start(self, service: str) -> None:
        self.container(service).start()

    def stop(self, service: str, timeout_s: int = 10) -> None:
        self.container(service).stop(timeout=timeout_s)

    def pause(self, service: str) -> None:
        self.container(service).pause()

    def unpause(self, service: str) -> None:
        self.container(service).unpause()

    def disconnect(self, service: str) -> tuple[str, str]:
        """Detach from the compose network; returns what reconnect needs (network, static ip)."""
        c = self.container(service)
        name, ip = self._static_ip[service]
        self.client.networks.get(name).disconnect(c, force=True)
        return name, ip

    def reconnect(self, service: str, saved: tuple[str, str]) -> None:
        name, ip = saved
        self.client.networks.get(name).connect(self.container(service), ipv4_address=ip, aliases=[service])

    def exec(self, service: str, cmd: list[str]) -> str:
        r = self.container(service).exec_run(cmd)
        if r.exit_code != 0:
            raise DrillError(f"{service}: `{' '.join(cmd)}` exited {r.exit_code}: {r.output.decode(errors='replace')[-400:]}")
        return r.output.decode(errors="replace")

    def iptables_drop_from(self, service: str, peers: list[str]) -> None:
        """One-way cut: `service` drops every packet arriving from the peers (it can still send)."""
        for p in peers:
            self.exec(service, ["iptables", "-I", "INPUT", "-s", self.nodes[p].ip, "-j", "DROP"])

    def iptables_flush(self, service: str) -> None:
        self.exec(service, ["iptables", "-F", "INPUT"])

    def volume_mountpoint(self, service: str) -> str | None:
        """Host path of the service's store volume when this process can read it (same host, root)."""
        for m in self.container(service).attrs.get("Mounts", []):
            if m.get("Type") == "volume" and m.get("Destination") in ("/store", "/data"):
                src = m.get("Source")
                return src if src and os.access(src, os.R_OK) else None
        return None

"""The drill cluster as node processes in network namespaces on one host (no Docker).

Same services, roles and addresses-per-role as docker-compose.yml: controllers c0 c1 c2,
DLedger group broker-a (a0 a1 a2), classic group broker-b (b0 master + b1 slave, roles from
the controllers). Each service runs in its own namespace `mqnd-<tag>-<svc>` with one veth
into a bridge in the root namespace, on 10.213.N.<host>; inside its namespace it uses the
same fixed ports as its container would (10911 API, 40911 Raft, 10912 HA, 9876/9878
controller), so ports never clash with anything else on the host.

`NetnsCluster` implements deploy.drills.control.ClusterControl, so the docker tier's
scenarios, workload, checker, store audit and reports run unchanged against it:

    with NetnsCluster() as c:          # builds namespaces, starts 8 processes, waits for health
        run(SCENARIOS["kill_leader"], reports_dir, cluster=c)
    # processes, namespaces, veths, bridge, iptables rule and the work dir are gone here,
    # also on an exception; an atexit hook covers an interpreter exit without __exit__.

Faults: kill -9, SIGTERM stop, SIGSTOP/SIGCONT, and iptables rules inside a namespace:
`disconnect` (both directions, everything on eth0), `iptables_drop_from` (one-way),
`partition` / `bridge` (sides that cannot hear each other; a bridge node hears both).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time

import json

from deploy.drills import cluster as dc
from deploy.drills.cluster import (CONTROLLERS, GROUPS, LEADER_ROLES, ROOT, DrillError, Node, http_json,
                                   service_healthy)
from deploy.netns import net
from mqstore import localcluster as lc

HOSTS = {"c0": 2, "c1": 3, "c2": 4, "a0": 11, "a1": 12, "a2": 13, "b0": 21, "b1": 22}
API_PORT, RAFT_PORT, HA_PORT = 10911, 40911, 10912
CTL_PORT, CTL_RAFT_PORT = 9876, 9878
CONF_DIR = os.path.join(ROOT, "deploy", "conf")
STOP_TIMEOUT_S = 10.0
# Smaller commitlog segments than the compose volumes: less preallocated disk in the work dir.
COMMITLOG_SEGMENT = 16 * 1024 * 1024
# The brokers' stores sit on small tmpfs mounts, as deploy/compose.smalldisk.yml gives the compose
# tier, so the disk_full drills can fill one; 0 turns that off.
SMALLDISK_MB = 256


class NetnsCluster:
    """The drill cluster on veth addresses; a context manager that always cleans up."""

    def __init__(self, workdir: str | None = None, heartbeat_timeout_ms: int = 3000, keep_workdir: bool = False,
                 smalldisk_mb: int = SMALLDISK_MB):
        if heartbeat_timeout_ms <= 0:
            raise ValueError("heartbeat_timeout_ms must be > 0")
        if smalldisk_mb != 0 and not 64 <= smalldisk_mb <= 4096:
            raise ValueError(f"smalldisk_mb must be 0 (off) or 64..4096, got {smalldisk_mb}")
        self.smalldisk_mb = smalldisk_mb
        self.mounts: list[str] = []
        self.tag = net.new_tag()
        self.project = f"netns-{self.tag}"
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self._own_workdir = workdir is None
        self.workdir = os.path.abspath(workdir or tempfile.mkdtemp(prefix=f"{net.WORKDIR_PREFIX}{self.tag}-"))
        self.keep_workdir = keep_workdir
        self.net: net.Net | None = None
        self.procs: dict[str, lc.Proc] = {}
        self.nodes: dict[str, Node] = {}
        self._started = False
        self._closed = False
        self.acl_file = os.path.join(self.workdir, "acl.json")
        self.secret_file = os.path.join(self.workdir, "cluster.secret")
        self._creds_before = None

    # --- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "NetnsCluster":
        try:
            self.up()
        except BaseException:
            self.down(keep_workdir=True)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # kept for its logs after a failure; not after Ctrl-C or SIGTERM (SystemExit)
        failed = exc_type is not None and not issubclass(exc_type, (KeyboardInterrupt, SystemExit))
        self.down(keep_workdir=self.keep_workdir or failed)

    def up(self, timeout_s: float = 120.0) -> float:
        """Build the network, start every service, wait until all are healthy and both groups lead.
        Returns the seconds it took."""
        if self._started:
            raise DrillError("this NetnsCluster is already up")
        net.preflight()
        t0 = time.monotonic()
        self._started = True
        atexit.register(self.down)
        self._use_own_acl()
        self.net = net.Net(self.tag, net.pick_subnet(self.tag), HOSTS)
        self.net.up()
        for s in HOSTS:
            kind = "controller" if s in CONTROLLERS else "node"
            port = CTL_PORT if kind == "controller" else API_PORT
            self.nodes[s] = Node(s, kind, self.net.ip(s), f"{self.net.ip(s)}:{port}")
        if self.smalldisk_mb:
            for s in GROUPS["broker-a"] + GROUPS["broker-b"]:
                self._mount_smalldisk(os.path.join(self.workdir, s, "store"))
        for s in CONTROLLERS:
            self.procs[s] = self._controller_proc(s)
        for s in GROUPS["broker-a"]:
            self.procs[s] = self._node_proc(s, self._dledger_lines(s))
        for s in GROUPS["broker-b"]:
            self.procs[s] = self._node_proc(s, self._classic_lines(s))
        for s in HOSTS:
            self.procs[s].start()
        self.wait_healthy(list(HOSTS), timeout_s=timeout_s)
        left = max(5.0, timeout_s - (time.monotonic() - t0))
        self.leader("broker-a", timeout_s=left)
        self.leader("broker-b", timeout_s=left)
        return time.monotonic() - t0

    def down(self, keep_workdir: bool | None = None) -> list[str]:
        """End our processes (kill -9), remove namespaces, veths, bridge and rule; idempotent.
        Returns what could not be removed (empty when all went)."""
        if self._closed:
            return []
        self._closed = True
        try:
            atexit.unregister(self.down)
        except Exception:  # noqa: BLE001 - interpreter shutting down
            pass
        for p in self.procs.values():
            try:
                p.kill9()
            except Exception:  # noqa: BLE001 - keep cleaning the rest
                pass
        errors = self.net.down() if self.net is not None else []
        if self._started:
            dc.use_credentials(self._creds_before)
        while self.mounts:
            path = self.mounts.pop()
            r = net.sh("umount", path, check=False)
            if r.returncode != 0 and net.sh("umount", "-l", path, check=False).returncode != 0:
                errors.append(f"tmpfs {path}: {r.stderr.strip()}")
        keep = self.keep_workdir if keep_workdir is None else keep_workdir
        if self._own_workdir and not keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
        elif self._started:
            print(f"netns cluster: logs and stores kept in {self.workdir}", file=sys.stderr)
        if errors:
            print("netns cluster: could not remove " + "; ".join(errors), file=sys.stderr)
        return errors

    # --- configs -----------------------------------------------------------------------------
    def _use_own_acl(self) -> None:
        """The templates turn ACL on (aclEnable=true): this cluster gets its own ACL file with fresh
        secrets in the work dir, and every drill request is signed with its admin account."""
        dc.ensure_acl_file(self.acl_file)
        dc.ensure_secret_file(self.secret_file)       # the templates read it (clusterSecretFile)
        with open(self.acl_file) as f:
            admin = next(a for a in json.load(f)["accounts"] if a.get("admin") is True)
        self._creds_before = dc.CREDENTIALS
        dc.use_credentials((admin["accessKey"], admin["secretKey"]))

    def _template(self, name: str) -> list[str]:
        with open(os.path.join(CONF_DIR, name)) as f:
            return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]

    def _common(self, s: str) -> list[str]:
        return [f"brokerIP1={self.nodes[s].ip}", f"storePathRootDir={os.path.join(self.workdir, s, 'store')}",
                f"mappedFileSizeCommitLog={COMMITLOG_SEGMENT}", f"aclFile={self.acl_file}",
                f"clusterSecretFile={self.secret_file}"]

    def _dledger_lines(self, s: str) -> list[str]:
        ids = {x: f"n{i}" for i, x in enumerate(GROUPS["broker-a"])}
        peers = ";".join(f"{ids[x]}-{self.nodes[x].ip}:{RAFT_PORT}" for x in GROUPS["broker-a"])
        apis = ";".join(f"{ids[x]}-{self.nodes[x].ip}:{API_PORT}" for x in GROUPS["broker-a"])
        return [*self._template("dledger.conf"), *self._common(s), f"dLegerSelfId={ids[s]}",
                f"dLegerPeers={peers}", f"dLegerPeerApis={apis}", "slaveReadEnable=true"]   # drills read every replica

    def _classic_lines(self, s: str) -> list[str]:
        ctl = ";".join(f"{self.nodes[c].ip}:{CTL_PORT}" for c in CONTROLLERS)
        return [*self._template("classic.conf"), *self._common(s), f"brokerId={GROUPS['broker-b'].index(s)}",
                f"controllerAddr={ctl}", "slaveReadEnable=true"]

    def _mount_smalldisk(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        net.sh("mount", "-t", "tmpfs", "-o", f"size={self.smalldisk_mb}m,mode=0755", "tmpfs", path)
        self.mounts.append(path)

    def _in_ns(self, s: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.net.ns(s), *argv]      # ip execs: the PID is the child's

    def _node_proc(self, s: str, lines: list[str]) -> lc.Proc:
        conf = lc.write_conf(os.path.join(self.workdir, s, "broker.conf"), lines)
        return lc.Proc(self._in_ns(s, lc.node_argv(conf)), os.path.join(self.workdir, s, "node.log"), s,
                       new_session=True)

    def _controller_proc(self, s: str) -> lc.Proc:
        others = [c for c in CONTROLLERS if c != s]
        argv = [sys.executable, "-m", "ha", "--host", self.nodes[s].ip, "--port", str(CTL_PORT),
                "--raft-port", str(CTL_RAFT_PORT), "--data-dir", os.path.join(self.workdir, s, "data"),
                "--peers", ",".join(f"{self.nodes[c].ip}:{CTL_RAFT_PORT}" for c in others),
                "--peer-apis", ",".join(f"{self.nodes[c].ip}:{CTL_PORT}" for c in others),
                "--heartbeat-timeout-ms", str(self.heartbeat_timeout_ms),
                "--cluster-secret-file", self.secret_file]
        os.makedirs(os.path.join(self.workdir, s, "data"), exist_ok=True)
        return lc.Proc(self._in_ns(s, argv), os.path.join(self.workdir, s, "node.log"), s, new_session=True)

    # --- discovery (ClusterControl) ----------------------------------------------------------
    def _check(self, service: str) -> None:
        if service not in self.nodes:
            raise DrillError(f"unknown service {service!r}; known: {', '.join(self.nodes) or 'none (not up)'}")

    def refresh(self) -> None:
        """Addresses never move in this tier; nothing to look up."""

    def service_of_addr(self, addr: str | None) -> str | None:
        if not addr:
            return None
        host = addr.rsplit(":", 1)[0]
        return next((s for s, n in self.nodes.items() if n.ip == host), None)

    def health(self, service: str, timeout: float = 1.0) -> dict | None:
        self._check(service)
        try:
            st, doc = http_json("GET", f"http://{self.nodes[service].api}/health", timeout=timeout)
        except (OSError, ValueError):
            return None
        return doc if st == 200 else None

    def leader(self, group: str, timeout_s: float = 20.0, exclude: tuple = ()) -> str:
        """The service claiming LEADER/MASTER in the highest term, waiting up to timeout_s."""
        if group not in GROUPS:
            raise DrillError(f"unknown group {group!r}; known: {', '.join(GROUPS)}")
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
                raise DrillError(f"no leader in {group} after {timeout_s:.0f} s; logs in {self.workdir}")
            time.sleep(0.2)

    def wait_healthy(self, services, timeout_s: float = 90.0) -> float:
        t0 = time.monotonic()
        pending = list(services)
        for s in pending:
            self._check(s)
        while pending:
            for s in pending:
                p = self.procs.get(s)
                if p is not None and p.proc is not None and not p.running and not p.stopped:
                    raise DrillError(f"{s} exited with {p.returncode}; log {p.log_path}:\n{p.tail(1500)}")
            pending = [s for s in pending if not service_healthy(self.nodes[s].kind, self.health(s))]
            if not pending:
                break
            if time.monotonic() - t0 > timeout_s:
                raise DrillError(f"not healthy after {timeout_s:.0f} s: {pending} (a controller must report "
                                 f"ready=true in /health); logs in {self.workdir}")
            time.sleep(0.3)
        return time.monotonic() - t0

    def wait_converged(self, group: str, timeout_s: float = 60.0) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            hs = [self.health(s) for s in GROUPS[group]]
            if all(hs) and len({h["committed_offset"] for h in hs}) == 1 and any(
                    h.get("role") in LEADER_ROLES for h in hs):
                return time.monotonic() - t0
            time.sleep(0.3)
        return None

    # --- process faults ----------------------------------------------------------------------
    def _proc(self, service: str) -> lc.Proc:
        self._check(service)
        return self.procs[service]

    def kill(self, service: str) -> None:
        """kill -9 (a frozen process is killed too)."""
        self._proc(service).kill9()

    def start(self, service: str) -> None:
        """Start the service again if it is not running (like `docker start`: a no-op when it is)."""
        p = self._proc(service)
        if not p.running:
            p.start()

    def stop(self, service: str, timeout_s: int = 10) -> None:
        """SIGTERM; SIGKILL if it has not exited after timeout_s."""
        self._proc(service).stop(timeout_s)

    def pause(self, service: str) -> None:
        self._proc(service).sigstop()

    def unpause(self, service: str) -> None:
        self._proc(service).cont()

    def pid(self, service: str) -> int | None:
        p = self._proc(service)
        return p.pid if p.running else None

    # --- network faults (iptables inside the service's namespace) ---------------------------
    def disconnect(self, service: str) -> tuple[str, ...]:
        """Isolate both ways: every packet in or out of eth0 is dropped (peers and the drill client
        alike, as a container taken off its network). Returns the token reconnect needs."""
        self._check(service)
        self.net.iptables(service, "-I", "INPUT", "-i", "eth0", "-j", "DROP")
        self.net.iptables(service, "-I", "OUTPUT", "-o", "eth0", "-j", "DROP")
        return ("eth0",)

    def reconnect(self, service: str, saved: tuple[str, ...]) -> None:
        (dev,) = saved
        self.net.iptables(service, "-D", "INPUT", "-i", dev, "-j", "DROP")
        self.net.iptables(service, "-D", "OUTPUT", "-o", dev, "-j", "DROP")

    def iptables_drop_from(self, service: str, peers: list[str]) -> None:
        """One-way cut: `service` drops every packet arriving from the peers (it can still send)."""
        self._check(service)
        for p in peers:
            self._check(p)
            self.net.iptables(service, "-I", "INPUT", "-s", self.nodes[p].ip, "-j", "DROP")

    def iptables_flush(self, service: str) -> None:
        self._check(service)
        self.net.iptables(service, "-F", "INPUT")
        self.net.iptables(service, "-F", "OUTPUT")

    def partition(self, sides: list[list[str]]) -> list[str]:
        """Services that share no side cannot hear each other (both directions); a service on two
        sides is a bridge. Only the listed services are touched. Returns them, for heal()."""
        members = sorted({s for side in sides for s in side})
        for s in members:
            self._check(s)
        if len(sides) < 2:
            raise DrillError("a partition needs at least two sides")
        for x in members:
            for y in members:
                if x != y and not any(x in side and y in side for side in sides):
                    self.net.iptables(x, "-I", "INPUT", "-s", self.nodes[y].ip, "-j", "DROP")
        return members

    def bridge(self, middle: str, left: list[str], right: list[str]) -> list[str]:
        """`left` and `right` cannot hear each other; `middle` hears both (the bridge shape)."""
        return self.partition([[*left, middle], [*right, middle]])

    def heal(self, services: list[str] | None = None) -> None:
        """Drop every iptables rule in the services' namespaces (all when None)."""
        for s in services if services is not None else list(self.nodes):
            self.iptables_flush(s)

    def exec(self, service: str, cmd: list[str]) -> str:
        self._check(service)
        r = net.sh(*self._in_ns(service, cmd), check=False)
        if r.returncode != 0:
            raise DrillError(f"{service}: `{' '.join(cmd)}` exited {r.returncode}: {(r.stderr or r.stdout)[-400:]}")
        return r.stdout

    # --- store audit -------------------------------------------------------------------------
    def volume_mountpoint(self, service: str) -> str | None:
        self._check(service)
        path = os.path.join(self.workdir, service, "store")
        return path if os.path.isdir(path) else None

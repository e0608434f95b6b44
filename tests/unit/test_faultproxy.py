"""deploy.faultproxy: per-direction pass / delay / blackhole / drop over real loopback sockets.

Method: an echo-free "sink" server records what reaches the target and can answer; the
test drives a client socket through a ProxyHub link and checks, per rule, what arrives
on each side, how the sender sees it (healthy, reset), and that lifting a blackhole cuts
the connection whose byte stream now has a hole. The CLI is run as a process and driven
through its control port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from deploy.faultproxy import FaultProxyError, ProxyHub, Rule, parse_address, parse_link_spec, run_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Sink:
    """A target server: keeps what each connection sent; can send to the latest connection."""

    def __init__(self):
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(16)
        self.port = self.server.getsockname()[1]
        self.received = bytearray()
        self.conns: list[socket.socket] = []
        self.accepted = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.server.accept()
            except OSError:
                return
            with self.lock:
                self.conns.append(c)
                self.accepted += 1
            threading.Thread(target=self._read, args=(c,), daemon=True).start()

    def _read(self, c):
        while True:
            try:
                data = c.recv(65536)
            except OSError:
                return
            if not data:
                return
            with self.lock:
                self.received += data

    def send_latest(self, data: bytes) -> None:
        with self.lock:
            c = self.conns[-1]
        c.sendall(data)

    def close(self):
        self.server.close()
        for c in self.conns:
            c.close()


def wait_until(pred, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


@pytest.fixture
def env():
    sink = Sink()
    hub = ProxyHub()
    port = hub.add("a-b", ("127.0.0.1", sink.port))
    yield hub, sink, port
    hub.close()
    sink.close()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=3)


def is_cut(c: socket.socket) -> bool:
    """True if the proxy closed or reset this connection (within the socket timeout)."""
    try:
        while c.recv(4096):
            pass            # bytes already in flight before the cut
        return True         # orderly close
    except (ConnectionError, OSError):
        return True
    except TimeoutError:
        return False


def test_pass_forwards_both_directions(env):
    hub, sink, port = env
    c = connect(port)
    c.sendall(b"hello")
    assert wait_until(lambda: bytes(sink.received) == b"hello")
    sink.send_latest(b"back")
    assert c.recv(10) == b"back"
    st = hub.status()["a-b"]
    assert st["counters"]["up_forwarded_bytes"] == 5 and st["counters"]["down_forwarded_bytes"] == 4


def test_delay_holds_bytes_in_order(env):
    hub, sink, port = env
    hub.set("a-b", "up", "delay", 300)
    c = connect(port)
    t0 = time.monotonic()
    for i in range(5):
        c.sendall(b"%d" % i)
    assert wait_until(lambda: len(sink.received) == 5, 3.0)
    assert time.monotonic() - t0 >= 0.25
    assert bytes(sink.received) == b"01234"
    sink.send_latest(b"x")            # the other direction is not delayed
    t1 = time.monotonic()
    assert c.recv(1) == b"x" and time.monotonic() - t1 < 0.2


def test_blackhole_one_way_discards_silently_then_heal_cuts_the_holed_connection(env):
    hub, sink, port = env
    c = connect(port)
    c.sendall(b"before")
    assert wait_until(lambda: bytes(sink.received) == b"before")
    hub.set("a-b", "up", "blackhole")
    c.sendall(b"lost")                # the sender sees no error
    time.sleep(0.2)
    assert bytes(sink.received) == b"before"
    sink.send_latest(b"still-open")   # one-way: the reverse direction still flows
    assert c.recv(20) == b"still-open"
    assert hub.status()["a-b"]["counters"]["up_discarded_bytes"] == 4
    hub.heal("a-b")
    assert is_cut(c)                  # the byte stream has a hole: cut
    c2 = connect(port)                # a new connection flows again
    c2.sendall(b"after")
    assert wait_until(lambda: bytes(sink.received).endswith(b"after"))
    assert b"lost" not in bytes(sink.received)


def test_drop_resets_open_connections_and_refuses_new_ones(env):
    hub, sink, port = env
    c = connect(port)
    c.sendall(b"a")
    assert wait_until(lambda: bytes(sink.received) == b"a")
    hub.set("a-b", "both", "drop")
    assert is_cut(c)
    accepted = sink.accepted
    c2 = connect(port)
    assert is_cut(c2)
    assert sink.accepted == accepted            # never reached the target
    assert bytes(sink.received) == b"a"
    hub.heal("*")
    c3 = connect(port)
    c3.sendall(b"c")
    assert wait_until(lambda: bytes(sink.received) == b"ac")


def test_drop_one_way_cuts_on_first_byte_that_way(env):
    hub, sink, port = env
    hub.set("a-b", "down", "drop")
    c = connect(port)
    c.sendall(b"up-ok")               # up still flows
    assert wait_until(lambda: bytes(sink.received) == b"up-ok")
    sink.send_latest(b"z")            # the first byte down cuts the connection
    assert is_cut(c)
    assert hub.status()["a-b"]["counters"]["down_dropped_connections"] == 1


def test_bad_rules_and_names_are_clear_errors(env):
    hub, _sink, _port = env
    with pytest.raises(FaultProxyError, match="unknown mode"):
        hub.set("a-b", "up", "teleport")
    with pytest.raises(FaultProxyError, match="delay_ms"):
        hub.set("a-b", "up", "delay", -5)
    with pytest.raises(FaultProxyError, match="delay_ms"):
        Rule.parse("delay", "soon")
    with pytest.raises(FaultProxyError, match="no link matches"):
        hub.set("zz", "up", "drop")
    with pytest.raises(FaultProxyError, match="direction"):
        hub.set("a-b", "sideways", "drop")
    with pytest.raises(FaultProxyError, match="exists"):
        hub.add("a-b", ("127.0.0.1", 1))
    with pytest.raises(FaultProxyError, match="host:port"):
        parse_address("nohost")
    with pytest.raises(FaultProxyError, match="NAME="):
        parse_link_spec("x=1:2:3")
    with pytest.raises(FaultProxyError, match="unknown command"):
        run_command({}, "explode now")


def test_cli_serves_links_and_takes_control_commands(tmp_path):
    sink = Sink()
    proc = subprocess.Popen([sys.executable, "-m", "deploy.faultproxy", "--link",
                             f"x=127.0.0.1:0:127.0.0.1:{sink.port}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ports = json.loads(proc.stdout.readline())
        ctl = socket.create_connection(("127.0.0.1", ports["control"]), timeout=3)
        f = ctl.makefile("rw")

        def cmd(line):
            f.write(line + "\n")
            f.flush()
            return json.loads(f.readline())
        assert cmd("set x up blackhole") == {"ok": True, "links": ["x"]}
        c = connect(ports["links"]["x"])
        c.sendall(b"gone")
        time.sleep(0.2)
        assert bytes(sink.received) == b""
        assert cmd("status")["links"]["x"]["up"] == "blackhole"
        bad = cmd("set x up warp")
        assert bad["ok"] is False and "unknown mode" in bad["error"]
        assert cmd("heal *")["ok"] is True
        c2 = connect(ports["links"]["x"])
        c2.sendall(b"here")
        assert wait_until(lambda: bytes(sink.received) == b"here")
        ctl.close()
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
        sink.close()
    bad = subprocess.run([sys.executable, "-m", "deploy.faultproxy", "--link", "broken"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "NAME=" in bad.stderr

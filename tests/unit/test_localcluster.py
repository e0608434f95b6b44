"""mqstore.localcluster: ports, config writing, process stop bounds and waits.

Method: small child processes (`python -c ...`) stand in for nodes where only process
handling is under test; one tiny HTTP server in a thread answers /health."""

from __future__ import annotations

import http.server
import sys
import threading
import time

import pytest

from mqstore import localcluster as lc


def test_free_ports_are_distinct_and_bounded():
    ports = lc.free_ports(8)
    assert len(set(ports)) == 8 and all(0 < p < 65536 for p in ports)
    with pytest.raises(ValueError):
        lc.free_ports(0)
    with pytest.raises(ValueError):
        lc.free_ports(lc.MAX_PORTS + 1)


def test_free_ports_lie_below_the_ephemeral_range():
    """Regression (CI: a node exited with EADDRINUSE on a port probed free a moment before):
    a port the kernel hands out for port 0 can be taken in between as the source port of some
    outgoing connection; ports below the ephemeral range cannot."""
    floor = lc._ephemeral_floor()
    assert floor > lc.PORT_FLOOR, "this test needs Linux's ip_local_port_range"
    ports = lc.free_ports(64)
    assert len(set(ports)) == 64 and all(lc.PORT_FLOOR <= p < floor for p in ports)


def test_regression_free_ports_never_returns_a_port_twice(monkeypatch):
    """Regression (CI: 63 distinct of 64): the probe binds with SO_REUSEADDR, as a node does,
    and Linux lets two sockets that do not listen share a port that way; a port drawn twice
    came back twice."""
    draws = iter([20001, 20001, 20002, 20001, 20003] + list(range(20004, 20400)))
    monkeypatch.setattr(lc._port_rng, "randrange", lambda lo, hi: next(draws))
    assert lc._ephemeral_floor() > 20400, "this test needs Linux's ip_local_port_range"
    ports = lc.free_ports(4)
    assert len(set(ports)) == 4, ports


def test_write_conf_later_key_wins_and_bad_line_is_refused(tmp_path):
    path = lc.write_conf(str(tmp_path / "a" / "broker.conf"),
                         lc.node_lines(1234, "/s", "listenPort=99\nfoo=bar\n"))
    text = open(path).read().splitlines()
    assert "listenPort=99" in text and "listenPort=1234" not in text and "foo=bar" in text
    with pytest.raises(ValueError, match="key=value"):
        lc.write_conf(str(tmp_path / "b.conf"), ["no equals sign"])


def test_dledger_lines_name_every_peer_and_refuse_unknown_self():
    lines = lc.dledger_lines("n1", "g", {"n0": 1, "n1": 2}, {"n0": 3, "n1": 4})
    assert "dLegerPeers=n0-127.0.0.1:1;n1-127.0.0.1:2" in lines
    assert "dLegerPeerApis=n0-127.0.0.1:3;n1-127.0.0.1:4" in lines and "dLegerSelfId=n1" in lines
    with pytest.raises(ValueError):
        lc.dledger_lines("n9", "g", {"n0": 1}, {"n0": 3})


def test_controller_argv_has_peers_only_when_given():
    solo = lc.controller_argv(1, 2, "/d")
    assert "--peers" not in solo and solo[-2:] == ["--data-dir", "/d"]
    trio = lc.controller_argv(1, 2, "/d", ["a:1", "b:2"], ["a:3", "b:4"], 1500)
    assert trio[trio.index("--peers") + 1] == "a:1,b:2" and trio[-1] == "1500"


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    p = lc.Proc([sys.executable, "-c", code], str(tmp_path / "p.log"), "stubborn").start()
    lc.wait_for(lambda: "up" in p.tail(), 10, "child printed")
    t0 = time.monotonic()
    rc = p.stop(timeout_s=0.5)
    assert rc == -9 and not p.running and time.monotonic() - t0 < 5


def test_sigstop_and_cont_and_kill9(tmp_path):
    p = lc.Proc([sys.executable, "-c", "import time; time.sleep(60)"], str(tmp_path / "p.log")).start()
    p.sigstop()
    assert p.stopped and p.running
    p.cont()
    assert not p.stopped
    p.kill9()
    assert not p.running and p.returncode == -9
    with pytest.raises(lc.ClusterError):
        p.sigstop()


def test_wait_healthy_fails_fast_when_the_process_exits(tmp_path):
    p = lc.Proc([sys.executable, "-c", "print('bad config'); raise SystemExit(2)"], str(tmp_path / "p.log")).start()
    t0 = time.monotonic()
    with pytest.raises(lc.ClusterError, match="exited with 2"):
        lc.wait_healthy(lc.free_port(), p, timeout_s=20)
    assert time.monotonic() - t0 < 10


def test_wait_for_times_out_with_the_reason():
    with pytest.raises(lc.ClusterError, match="never"):
        lc.wait_for(lambda: None, 0.2, "never", interval=0.05)


def test_health_and_leader_against_a_tiny_server():
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"role": "LEADER"}' if self.path == "/health" else b'{"error": "NOPE"}'
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        port = srv.server_address[1]
        assert lc.health(port) == {"role": "LEADER"}
        assert lc.http(port, "GET", "/x") == (404, {"error": "NOPE"})
        assert lc.get_ok(port, "/x") is None
        dead = lc.free_port()
        assert lc.find_leader([dead, f"127.0.0.1:{port}"], timeout_s=2) == f"127.0.0.1:{port}"
        assert lc.find_leader([dead], timeout_s=0.2) is None
    finally:
        srv.shutdown()
        srv.server_close()


def test_proc_start_keeps_no_log_file_descriptor_open(tmp_path):
    """The child holds its own copy of the log descriptor; the parent closes its one at once."""
    import os
    before = len(os.listdir("/proc/self/fd"))
    for i in range(5):
        p = lc.Proc([sys.executable, "-c", "pass"], str(tmp_path / f"p{i}.log")).start()
        p.stop(10)
    assert len(os.listdir("/proc/self/fd")) <= before


def test_stop_pids_ends_a_process_that_ignores_sigterm(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    p = lc.Proc([sys.executable, "-c", code], str(tmp_path / "p.log")).start()
    lc.wait_for(lambda: "up" in p.tail(), 10, "child printed")
    assert lc.stop_pids([p.pid], timeout_s=0.5) == [p.pid]
    assert p.proc.wait(5) == -9 and not lc.pid_alive(p.pid)

"""Classic master/slave HA with the controller, as real processes on loopback.

Figures (DESIGN section 7), each with its anchor measured in the same run:
- produce (1 KiB bodies, batches of HTTP_BATCH, HTTP_CONNECTIONS connections each with one
  batch in flight, the same load generator for all three) against a standalone node (the
  anchor), a SYNC_MASTER with one slave (target >= 80 % of standalone) and an ASYNC_MASTER
  with one slave (target >= 95 %); msg/s and request p99. Twice: over HTTP, and over the
  produce stream (the SDK's send channel). All three deployments run at once (idle but for
  their timers) and are measured in interleaved rounds, order rotated each round, so load
  from elsewhere on the machine falls on all three alike; each figure is the median round,
  and its ratio the median of the rounds' ratios to the standalone round next to them
  (`paired_ratios`).
  Each slave is its own process: on a 2-core machine it competes with its master and the
  load generator for CPU, so CPU per message of master, slave and standalone is reported
  too, with the rate the two cores allow at those costs (`two_core_bound_msgs_s`), and the
  node's event-loop thread: its CPU per message, the share of the round it ran
  (`node_loop_busy_pct`) and the share it waited for a core (`node_loop_waiting_for_cpu_pct`);
- slave catch-up: a fresh slave joins a master holding N MiB; MB/s until its committed offset
  equals the master's (anchor: the disk's sequential write rate, measured here);
- failover: kill -9 of the SYNC_MASTER -> first write the new master stores, with one
  controller process (heartbeat timeout 3 s, the default); several kills, the killed broker
  rejoining as a slave between kills. The first write on the new master answers
  SLAVE_NOT_AVAILABLE (its only slave is the one just killed): stored and answered; the
  status is reported with each sample.
Every node uses flushDiskType=ASYNC_FLUSH so the comparison isolates replication.
Bounded: quick about 1 min, full < 5 min (time and count limits on every loop).

    python -m bench.bench_ha [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench.bench_store import (HTTP_BATCH, HTTP_CONNECTIONS, MIB, _one_request, figure, free_port, http_produce,
                               load1, page_cache_probe, proc_user_sys_s, stream_produce)
from mqstore import localcluster as lc

TOPIC = "HaBench"
QUEUES = 8
READY_TIMEOUT_S = 30.0
CTL_HEARTBEAT_TIMEOUT_MS = 3000
SEGMENT_BYTES = 256 * MIB            # one segment: a fresh slave fetches from offset 0


def _req(port: int, method: str, path: str, doc: dict | None = None, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        return asyncio.run(asyncio.wait_for(_one_request(port, method, path, doc), timeout))
    except (OSError, asyncio.TimeoutError, RuntimeError, ValueError):
        return 0, {}


def _wait(pred, timeout: float, what: str):
    try:
        return lc.wait_for(pred, timeout, what, interval=0.05)
    except lc.ClusterError as e:
        raise RuntimeError(str(e)) from None


class Procs:
    """Processes of one case; all are stopped (SIGTERM, then SIGKILL) at the end."""

    def __init__(self, root: str):
        self.root = root
        self.procs: dict[str, lc.Proc] = {}

    def spawn(self, name: str, argv: list[str]) -> lc.Proc:
        p = lc.Proc(argv, os.path.join(self.root, f"{name}.log"), name, new_session=True).start()
        self.procs[name] = p
        return p

    def kill9(self, name: str) -> None:
        self.procs[name].kill9()

    def stop_all(self) -> None:
        for p in self.procs.values():
            p.stop(15)

    def tail(self, name: str, limit: int = 1200) -> str:
        return self.procs[name].tail(limit) if name in self.procs else ""


def _broker_conf(path: str, store: str, api: int, ha: int, stream: int, role: str, extra: list[str]) -> None:
    with open(path, "w") as f:
        f.write("\n".join(["brokerClusterName=bench", "brokerName=broker-b", f"brokerRole={role}",
                           "flushDiskType=ASYNC_FLUSH", f"storePathRootDir={store}",
                           f"mappedFileSizeCommitLog={SEGMENT_BYTES}", f"listenPort={api}", f"haListenPort={ha}",
                           f"streamListenPort={stream}",
                           "brokerIP1=127.0.0.1", "bindAddress=127.0.0.1", "autoCreateTopicEnable=false",
                           "logLevel=WARNING", *extra, ""]))


class Group:
    """One controller and classic brokers of group broker-b."""

    def __init__(self, root: str, role: str):
        self.root = root
        self.role = role
        self.p = Procs(root)
        self.ctl_api, self.ctl_raft = free_port(), free_port()
        self.api: dict[int, int] = {}
        self.ha: dict[int, int] = {}
        self.stream: dict[int, int] = {}

    def start_controller(self) -> None:
        self.p.spawn("ctl", lc.controller_argv(self.ctl_api, self.ctl_raft, os.path.join(self.root, "ctl"),
                                               heartbeat_timeout_ms=CTL_HEARTBEAT_TIMEOUT_MS) + ["--log-level", "WARNING"])
        _wait(lambda: _req(self.ctl_api, "GET", "/health")[1].get("role") == "LEADER", READY_TIMEOUT_S,
              "controller leader")

    def start_broker(self, b: int) -> None:
        if b not in self.api:
            self.api[b], self.ha[b], self.stream[b] = free_port(), free_port(), free_port()
        conf = os.path.join(self.root, f"broker{b}.conf")
        _broker_conf(conf, os.path.join(self.root, f"store{b}"), self.api[b], self.ha[b], self.stream[b], self.role,
                     [f"brokerId={b}", f"controllerAddr=127.0.0.1:{self.ctl_api}"])
        self.p.spawn(f"b{b}", lc.node_argv(conf))

    def health(self, b: int) -> dict:
        return _req(self.api[b], "GET", "/health", timeout=2.0)[1]

    def wait_role(self, b: int, role: str, timeout: float = READY_TIMEOUT_S) -> None:
        _wait(lambda: (lambda h: h.get("role") == role and h.get("status") == "UP")(self.health(b)), timeout,
              f"broker {b} {role}: {self.p.tail(f'b{b}')}")

    def sss(self) -> list[int]:
        return sorted(_req(self.ctl_api, "GET", "/groups/broker-b/sync-state-set")[1].get("sync_state_set", []))

    def send_one(self, b: int, i: int) -> str:
        st, r = _req(self.api[b], "POST", f"/topics/{TOPIC}/messages",
                     {"messages": [{"body": f"f{i}", "queue_id": 0}]}, timeout=6.0)
        return r["results"][0]["status"] if st == 200 else f"HTTP{st}"


def _create_topic(port: int) -> None:
    st, doc = _req(port, "POST", "/topics", {"topic": TOPIC, "queues": QUEUES})
    if st not in (200, 201):
        raise RuntimeError(f"create topic answered {st}: {doc}")


class Target:
    """One deployment under load: its master's HTTP and stream ports, its pid, its slave's pid."""

    def __init__(self, api: int, stream: int, pid: int, slave_pid: int | None = None):
        self.api, self.stream, self.pid, self.slave_pid = api, stream, pid, slave_pid

    def produce(self, transport: str, secs: float, max_msgs: int = 2_000_000, pid: int | None = None) -> dict:
        if transport == "stream":
            return asyncio.run(stream_produce(self.stream, TOPIC, secs, max_msgs, pid=pid))
        return asyncio.run(http_produce(self.api, TOPIC, "msgpack", secs, max_msgs, pid=pid))


def _produce(t: Target, transport: str, secs: float) -> dict:
    """One measured round; with a slave, the slave's CPU per message rides along, and the rate
    two cores allow at the round's CPU per message (node + slave + load generator)."""
    s0 = proc_user_sys_s(t.slave_pid) if t.slave_pid else (0.0, 0.0)
    r = t.produce(transport, secs, pid=t.pid)
    if t.slave_pid and r["msgs"]:
        s1 = proc_user_sys_s(t.slave_pid)
        r["slave_cpu_us_per_msg"] = round((sum(s1) - sum(s0)) / r["msgs"] * 1e6, 2)
        r["slave_sys_us_per_msg"] = round((s1[1] - s0[1]) / r["msgs"] * 1e6, 2)
    node, client = r.get("node_cpu_us_per_msg"), r.get("client_cpu_us_per_msg")
    if node and client is not None:
        r["two_core_bound_msgs_s"] = round(min(1e6 / node, 2e6 / (node + client + r.get("slave_cpu_us_per_msg", 0))))
    r["load1"] = load1()
    return r


def standalone_up(root: str, p: "Procs") -> Target:
    api, stream = free_port(), free_port()
    conf = os.path.join(root, "standalone.conf")
    _broker_conf(conf, os.path.join(root, "store-standalone"), api, free_port(), stream, "ASYNC_MASTER", [])
    p.spawn("standalone", lc.node_argv(conf))
    _wait(lambda: _req(api, "GET", "/health")[0] == 200, READY_TIMEOUT_S, "standalone node")
    _create_topic(api)
    return Target(api, stream, p.procs["standalone"].pid)


def _median_round(rounds: list[dict]) -> dict:
    """The round with the median rate, plus every round's rate, p99 and load."""
    best = sorted(rounds, key=lambda r: r["msgs_s"])[len(rounds) // 2]
    out = dict(best)
    out["rounds"] = [{"msgs_s": round(r["msgs_s"], 1), "p99_ms": r["p99_ms"], "load1": r["load1"],
                      **{k: r[k] for k in ("node_sys_us_per_msg", "slave_sys_us_per_msg") if k in r}} for r in rounds]
    return out


def produce_rounds(targets: dict[str, Target], transport: str, rounds: int, secs: float) -> dict[str, dict]:
    """Interleaved rounds over the deployments, order rotated each round."""
    names = list(targets)
    for name in names:                                                         # warm-up
        targets[name].produce(transport, 0.3, 5_000)
    got: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            got[name].append(_produce(targets[name], transport, secs))
    return {n: _median_round(r) for n, r in got.items()}


def _anchor_facts(transport: str, base: dict) -> dict:
    return {f"standalone_{transport}_msgs_s": round(base["msgs_s"], 1),
            f"standalone_{transport}_p99_ms": base["p99_ms"],
            f"standalone_{transport}_node_cpu_us_per_msg": base.get("node_cpu_us_per_msg"),
            **{f"standalone_{transport}_{k}": v for k, v in base.items() if k.startswith("node_loop_")},
            f"standalone_{transport}_rounds": base["rounds"]}


def paired_ratios(rounds: list[dict], base_rounds: list[dict]) -> tuple[list[float], list[float]]:
    """Round i against the standalone node's round i (run next to it in time): msgs/s ratios
    and standalone p99 / this p99, one per pair."""
    pairs = [(r, b) for r, b in zip(rounds, base_rounds) if b["msgs_s"] and r["p99_ms"]]
    return ([round(r["msgs_s"] / b["msgs_s"], 3) for r, b in pairs],
            [round(b["p99_ms"] / r["p99_ms"], 3) for r, b in pairs])


def _ratio_figures(name: str, anchor: str, r: dict, base: dict, target: float) -> dict:
    """`{name}_msgs_s` and `{name}_p99_ms`, each against the standalone node's (the anchor).

    The ratio is the median of the paired rounds' ratios, not the ratio of the two median
    rounds: rounds next to each other in time ran on the same machine, and the machine
    changes within a run (new page-cache pages can cost ten times more a minute later:
    page_cache_probe), so the two median rounds may come from different machines."""
    rates, p99s = paired_ratios(r["rounds"], base["rounds"])
    ratio = statistics.median(rates) if rates else None
    p99_ratio = statistics.median(p99s) if p99s else None
    msgs = figure(r["msgs_s"], "msg/s", None, f"{anchor}_msgs_s", base["msgs_s"],
                  meets=ratio is not None and ratio >= target, target_ratio=target, paired_ratios=rates,
                  **{k: v for k, v in r.items() if k not in ("msgs_s", "load1")})
    p99 = figure(r["p99_ms"], "ms", None, f"{anchor}_p99_ms", base["p99_ms"],
                 meets=p99_ratio is not None and p99_ratio >= target, paired_ratios=p99s,
                 target_note=f"standalone p99 / this p99 >= {target}, the median of the paired rounds'")
    msgs["ratio_to_anchor"], p99["ratio_to_anchor"] = ratio, p99_ratio
    return {f"{name}_msgs_s": msgs, f"{name}_p99_ms": p99}


def group_up(root: str, role: str) -> Group:
    g = Group(root, role)
    g.start_controller()
    g.start_broker(0)
    g.wait_role(0, "MASTER")
    g.start_broker(1)
    g.wait_role(1, "SLAVE")
    _wait(lambda: g.sss() == [0, 1], READY_TIMEOUT_S, "slave in the SyncStateSet")
    _create_topic(g.api[0])
    return g


def catch_up_case(g: Group, mib: int) -> dict:
    """Stop the slave (kill -9), write `mib` MiB to the master, restart the slave and time
    until it holds them. (A fresh slave would copy only from the master's last segment.)"""
    g.p.kill9("b1")
    start = g.health(0)["committed_offset"]
    secs_cap = 30.0
    t0 = time.monotonic()
    while time.monotonic() - t0 < secs_cap:
        if g.health(0).get("committed_offset", 0) - start >= mib * MIB:
            break
        asyncio.run(http_produce(g.api[0], TOPIC, "msgpack", 1.0, 200_000))
    target = g.health(0)["committed_offset"]
    t1 = time.monotonic()
    g.start_broker(1)
    seen: list[tuple[float, int]] = []      # (when, the slave's committed offset), polled

    def caught_up() -> bool:
        off = g.health(1).get("committed_offset", -1)
        seen.append((time.monotonic(), off))
        return off >= target
    _wait(caught_up, 120, "the slave caught up")
    elapsed = time.monotonic() - t1
    mb_s, moving = transfer_rate(seen, start, t1)
    return {"bytes": target - start, "mb_s": mb_s, "transfer_s": round(moving, 2),
            "restart_to_caught_up_s": round(elapsed, 2),
            "note": "a slave restarted after kill -9 this far behind; mb_s from its first transfer on"}


def transfer_rate(seen: list[tuple[float, int]], start: int, t_start: float) -> tuple[float, float]:
    """(MB/s, seconds) of a catch-up polled as (time, offset) pairs, the last one done: from
    the last poll still at or below `start` (a restart, recovery and registration come
    before it) to the last poll."""
    t_from = max((t for t, off in seen if off <= start), default=t_start)
    moving = max(1e-3, seen[-1][0] - t_from)
    return (seen[-1][1] - start) / MIB / moving, moving


def failover_case(g: Group, kills: int) -> list[dict]:
    """Kill -9 whoever is master; time until the other broker stores a write; rejoin; repeat."""
    samples = []
    master, other = 0, 1
    for k in range(kills):
        g.p.kill9(f"b{master}")
        t0 = time.monotonic()
        status = _wait(lambda: (lambda s: s if s in ("SEND_OK", "SLAVE_NOT_AVAILABLE") else None)(
            g.send_one(other, k)), 30, "first write on the new master")
        samples.append({"seconds": round(time.monotonic() - t0, 3), "status": status, "load1": load1()})
        g.start_broker(master)            # the old master rejoins as a slave (truncating if it must)
        g.wait_role(master, "SLAVE")
        _wait(lambda: g.sss() == [0, 1], READY_TIMEOUT_S, "rejoined slave back in the SyncStateSet")
        master, other = other, master
    return samples


def _clean(root: str, keep_logs: bool) -> None:
    """Remove the run's directory; after a failure keep the process logs (stores removed)."""
    if not keep_logs:
        shutil.rmtree(root, ignore_errors=True)
        return
    for dirpath, dirnames, _ in os.walk(root):
        for d in [d for d in dirnames if d.startswith("store") or d == "ctl"]:
            shutil.rmtree(os.path.join(dirpath, d), ignore_errors=True)
    sys.stderr.write(f"bench_ha: failed; process logs kept in {root}\n")


def run(quick: bool, anchors: dict | None = None) -> dict:
    t_start = time.monotonic()
    root = tempfile.mkdtemp(prefix="mqstore-bench-ha-", dir="/tmp")
    secs, rounds = (1.5, 3) if quick else (3.0, 5)
    out: dict = {"bench": "ha", "quick": quick, "load1_start": load1(), "batch_messages": HTTP_BATCH,
                 "connections": HTTP_CONNECTIONS, "message_body_bytes": 1024, "controllers": 1,
                 "rounds": rounds, "round_s": secs, "page_cache_probe_start": page_cache_probe(root)}
    figs: dict = {}
    sa = Procs(os.path.join(root, "sa"))
    groups: dict[str, Group] = {}
    ok = False
    try:
        os.makedirs(sa.root)
        targets = {"standalone": standalone_up(sa.root, sa)}
        for role in ("SYNC_MASTER", "ASYNC_MASTER"):
            d = os.path.join(root, role.lower())
            os.makedirs(d)
            g = groups[role] = group_up(d, role)
            targets[role] = Target(g.api[0], g.stream[0], g.p.procs["b0"].pid, g.p.procs["b1"].pid)
        out["anchors"] = {}
        for transport in ("http", "stream"):
            res = produce_rounds(targets, transport, rounds, secs)
            out["anchors"].update(_anchor_facts(transport, res["standalone"]))
            for role, target in (("SYNC_MASTER", 0.80), ("ASYNC_MASTER", 0.95)):
                figs.update(_ratio_figures(f"{role.lower()}_{transport}", f"standalone_{transport}", res[role],
                                           res["standalone"], target))
        out["page_cache_probe_after_produce"] = page_cache_probe(root)
        sa.stop_all()
        disk = (anchors or {}).get("disk") or {}
        if disk:
            out["anchors"]["shared_disk"] = disk
        g = groups["SYNC_MASTER"]
        kills = 2 if quick else 5
        samples = failover_case(g, kills)
        med = statistics.median(s["seconds"] for s in samples)
        figs["failover_master_kill_to_first_write_s"] = figure(
            med, "s (median)", None, None, None, meets=med <= 5.0, target_max=5.0,
            samples=samples, max_s=max(s["seconds"] for s in samples),
            controller_heartbeat_timeout_ms=CTL_HEARTBEAT_TIMEOUT_MS)
        g.p.stop_all()
        c = catch_up_case(groups["ASYNC_MASTER"], 48 if quick else 192)
        figs["slave_catch_up_mb_s"] = figure(c["mb_s"], "MB/s", None, None, None, meets=None,
                                             **{k: v for k, v in c.items() if k != "mb_s"})
        ok = True
    finally:
        sa.stop_all()
        for g in groups.values():
            g.p.stop_all()
        _clean(root, keep_logs=not ok)
    out["figures"] = figs
    out["elapsed_s"] = round(time.monotonic() - t_start, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, fewer kills (< 60 s)")
    args = ap.parse_args(argv)
    anchors = json.loads(os.environ.get("MQSTORE_BENCH_ANCHORS", "{}") or "{}")
    json.dump(run(args.quick, anchors), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One drill from start to verdict: the common frame every scenario runs in.

  warm-up (workload on)  ->  fault for fault_s  ->  heal  ->  recovery (workload on)
  ->  workload off, wait for the group to converge  ->  drain every queue from each replica
  ->  checker  ->  store audit (containers stopped, volumes read, containers started again)
  ->  report (verdict.json, plot.png, index.html, history.jsonl)

A one-line status with a progress bar runs on stderr meanwhile (tqdm).
"""

from __future__ import annotations

import os
import sys
import time
import uuid

from deploy.drills import checker, report, storeaudit
from deploy.drills.cluster import CONTROLLERS, GROUPS, Cluster, DrillError, http_json
from deploy.drills.scenarios import Scenario
from deploy.drills.workload import History, Workload, drain

QUEUES = 4


class _Bar:
    """tqdm over the drill's seconds, with acked/failed counts; a plain line when tqdm is missing."""

    def __init__(self, name: str, total_s: float):
        self.name = name
        self.bar = None
        self.phase = None
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None and sys.stderr.isatty():
            self.bar = tqdm(total=round(total_s), desc=f"drill {name}", unit="s", file=sys.stderr,
                            bar_format="{desc} {bar} {n:.0f}/{total:.0f}s {postfix}", leave=True)
        self.t0 = time.monotonic()
        self.done = 0

    def tick(self, phase: str, wl: Workload | None) -> None:
        now = min(round(time.monotonic() - self.t0), self.bar.total if self.bar else 10 ** 9)
        post = f"{phase} acked={wl.acked if wl else 0} failed={wl.failed if wl else 0}"
        if self.bar is not None:
            self.bar.update(max(0, now - self.done))
            self.bar.set_postfix_str(post)
        elif phase != self.phase:       # not a terminal: one line per phase
            print(f"drill {self.name} {now}s {post}", file=sys.stderr, flush=True)
        self.phase = phase
        self.done = max(self.done, now)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _wait(seconds: float, bar: _Bar, phase: str, wl: Workload) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(0.5, max(0.0, end - time.monotonic())))
        bar.tick(phase, wl)


def _load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


MAX_CYCLES = 50


def run(sc: Scenario, out_root: str, warmup_s: float = 5.0, recovery_s: float = 10.0, rate_per_s: float = 40.0,
        store_audit: bool = True, cluster: Cluster | None = None, duration_s: float | None = None) -> dict:
    """One drill. With `duration_s`, the fault cycle (inject, fault_s, heal, recovery_s) repeats
    until that many seconds of load have passed (at least once, at most MAX_CYCLES), so the
    verdict carries one failover and one recovery time per cycle."""
    c = cluster or Cluster()
    recovery_s = max(recovery_s, sc.recovery_min_s)
    # a classic group fails over through the controllers, so they must be ready too
    c.wait_healthy([*GROUPS[sc.group], *(CONTROLLERS if sc.group == "broker-b" else ())], timeout_s=90)
    leader = c.leader(sc.group)
    topic = f"drill_{sc.name}_{uuid.uuid4().hex[:6]}"
    st, doc = http_json("POST", f"http://{c.nodes[leader].api}/topics", {"topic": topic, "queues": QUEUES}, timeout=10)
    if st != 200:
        raise DrillError(f"cannot create topic {topic} on {leader}: {st} {doc}")
    out_dir = os.path.join(out_root, f"{time.strftime('%Y%m%d-%H%M%S')}-{sc.name}")
    os.makedirs(out_dir, exist_ok=True)
    hist = History(os.path.join(out_dir, "history.jsonl"))
    wl = Workload(c, sc.group, topic, QUEUES, hist, rate_per_s=rate_per_s)
    bar = _Bar(sc.name, (duration_s or warmup_s + sc.fault_s + recovery_s) + 30)
    timeline: dict = {"leader_before": leader, "load_avg_start": _load_avg()}
    state: dict = {}
    try:
        t_start = time.monotonic()
        wl.start()
        _wait(warmup_s, bar, "warm-up", wl)
        cycles = 0
        while True:
            t_fault = time.monotonic()
            if sc.window_includes_inject:
                hist.add(type="fault", name=sc.name, phase="start")
            heal = sc.inject(c, state)
            if not sc.window_includes_inject:
                # stamped once the fault is in place: an ack for a send started after this
                # instant cannot have come from the victim
                hist.add(type="fault", name=sc.name, phase="start")
            _wait(max(0.0, sc.fault_s - (time.monotonic() - t_fault)), bar, "fault", wl)
            heal()
            hist.add(type="fault", name=sc.name, phase="end")
            _wait(recovery_s, bar, "recovery", wl)
            cycles += 1
            left = (duration_s or 0) - (time.monotonic() - t_start)
            if duration_s is None or cycles >= MAX_CYCLES or left < sc.fault_s + recovery_s:
                break
            # the next cycle needs the group whole again (under load the committed offsets
            # move, so "converged" is checked once, after the load stops)
            c.wait_healthy([*GROUPS[sc.group]], timeout_s=90)
            c.leader(sc.group, timeout_s=30)
        timeline["cycles"] = cycles
    finally:
        wl.stop()
        bar.tick("converging", wl)
    c.wait_healthy([*GROUPS[sc.group]], timeout_s=90)
    converged = c.wait_converged(sc.group, timeout_s=60)
    timeline["leader_after"] = c.leader(sc.group)
    timeline["victim"] = state.get("victim")
    bar.tick("draining", wl)
    reads = {s: drain(c, s, topic, QUEUES) for s in GROUPS[sc.group]}
    hist.close()
    verdict = checker.check(hist.events, reads)
    audit = {"status": "skipped", "reason": "--no-store-audit"}
    if store_audit:
        bar.tick("store audit", wl)
        audit = _store_audit(c, sc.group)
    bar.close()
    extra = sc.extra_check(hist.events, state) if sc.extra_check is not None else []
    timeline.update({k: v for k, v in state.items() if k != "victim"})   # the check's counts too
    ok = verdict.ok and converged is not None and audit.get("status") != "failed" and not extra
    targets = None
    if sc.failover_target_s is not None and verdict.failover_s is not None:
        targets = {"failover_target_s": sc.failover_target_s, "met": verdict.failover_s <= sc.failover_target_s}
    result = {"scenario": sc.name, "group": sc.group, "topic": topic, "description": sc.description,
              "expected": sc.expected, "ok": ok, "verdict": verdict.as_dict(), "store_audit": audit,
              "converged_s": converged, "timeline": timeline, "load_avg": _load_avg(), "targets": targets,
              "scenario_problems": extra,
              "summary": verdict.summary() + (f" audit={audit['status']}" if audit else "")
              + "".join(f" PROBLEM({p})" for p in extra)
              + ("" if converged is not None else " NOT-CONVERGED")
              + ("" if targets is None else f" failover-target({sc.failover_target_s:g}s)="
                 + ("met" if targets["met"] else "MISSED"))}
    result["paths"] = report.write(out_dir, sc.name, result, hist.events)
    return result


def _store_audit(c: Cluster, group: str) -> dict:
    services = list(GROUPS[group])
    stores = {s: c.volume_mountpoint(s) for s in services}
    if any(p is None for p in stores.values()):
        return storeaudit.audit(stores, dledger=group == "broker-a")
    for s in services:
        c.stop(s)
    try:
        return storeaudit.audit(stores, dledger=group == "broker-a")
    finally:
        for s in services:
            c.start(s)
        c.wait_healthy(services, timeout_s=90)
        c.wait_converged(group, timeout_s=60)

"""The drill checker: a pure function from a recorded history and drained reads to a verdict.

No docker, no clock, no network: the drill runner feeds it

  history  - the JSONL events the workload wrote, in order:
             {"t", "type": "send", "id", "queue"}                      a send started
             {"t", "type": "ack", "id", "queue", "queue_offset", "msg_id"}   SEND_OK came back
             {"t", "type": "fail", "id", "error", "definite"}         the send failed; definite =
                                                                      the store surely did not write it
             {"t", "type": "fault", "name", "phase": "start"|"end"}   fault windows
  reads    - replica name -> list of messages drained from every queue of that replica:
             {"id", "queue", "queue_offset", "commitlog_offset", "body_ok"}

Every send uses a fresh id (a retry is a new send), so any id read twice is a duplicate
written by the store, not by the client. A send that failed indefinitely (timeout, reset)
may or may not be in the log; one that failed definitely (NOT_LEADER, refused) must not be.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

# Errors after which the store certainly did not append the message.
DEFINITE_ERRORS = ("NOT_LEADER", "CONNECTION_REFUSED", "TOPIC_NOT_EXIST", "DISK_FULL", "SERVICE_NOT_AVAILABLE")
# A NOT_LEADER may also answer a write that was proposed and then orphaned by a leadership
# change (dledger_log._fail_pending: "...; the outcome is unknown, retry"): the entry may still
# be committed by the next leader, so that answer is indefinite.
UNKNOWN_OUTCOME_MARK = "outcome is unknown"
SAMPLE_LIMIT = 20          # ids listed per finding in the verdict (counts are always complete)


def is_definite(error: str, message: str | None = None) -> bool:
    """True when a failed send certainly did not reach the log (see DEFINITE_ERRORS)."""
    return error in DEFINITE_ERRORS and UNKNOWN_OUTCOME_MARK not in (message or "")


@dataclass
class Verdict:
    ok: bool
    sent: int
    acked: int
    failed_definite: int
    failed_indefinite: int
    lost: dict                        # replica -> acked ids missing there
    duplicates: dict                  # replica -> ids read more than once
    phantoms: dict                    # replica -> ids read that were never sent, or failed definitely
    changed: dict                     # replica -> ids whose queue/offset differ from the ack, or bad body
    divergence: list                  # per queue, where replicas disagree
    gaps: dict                        # replica -> queues whose offsets are not contiguous
    failover_s: float | None          # first fault start -> first ack of a send started after it
    unavailable_s: float | None       # longest gap between acks that overlaps a fault window
    recovery_s: float | None          # last fault end -> first ack of a send started after it
    latency_ms: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    failovers_s: list = field(default_factory=list)    # one per fault window (None: no ack after it)
    recoveries_s: list = field(default_factory=list)   # one per healed fault window

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def summary(self) -> str:
        def n(d):
            return sum(len(v) for v in d.values()) if isinstance(d, dict) else len(d)
        fo = f"{self.failover_s:.2f}s" if self.failover_s is not None else "n/a"
        rc = f"{self.recovery_s:.2f}s" if self.recovery_s is not None else "n/a"
        return (f"{'PASS' if self.ok else 'FAIL'} sent={self.sent} acked={self.acked} lost={n(self.lost)} "
                f"dup={n(self.duplicates)} phantom={n(self.phantoms)} changed={n(self.changed)} "
                f"diverged={len(self.divergence)} gaps={n(self.gaps)} failover={fo} recovery={rc}")


def fault_windows(history: list[dict]) -> list[tuple[float, float | None, str]]:
    """(start, end or None, name) for every fault in the history, in order of start."""
    open_: dict[str, float] = {}
    out = []
    for ev in history:
        if ev.get("type") != "fault":
            continue
        if ev["phase"] == "start":
            open_[ev["name"]] = ev["t"]
        elif ev["phase"] == "end" and ev["name"] in open_:
            out.append((open_.pop(ev["name"]), ev["t"], ev["name"]))
    out += [(t, None, name) for name, t in open_.items()]
    return sorted(out, key=lambda w: w[0])


def _first_ack_after(sends: dict, acks: list[dict], t0: float) -> float | None:
    best = None
    for a in acks:
        st = sends.get(a["id"], {}).get("t")
        if st is not None and st >= t0 and (best is None or a["t"] < best):
            best = a["t"]
    return None if best is None else best - t0


def _longest_gap_in_faults(acks: list[dict], windows: list, t_end: float) -> float | None:
    if not windows:
        return None
    times = sorted(a["t"] for a in acks)
    worst = 0.0
    for start, end, _ in windows:
        end = t_end if end is None else end
        before = [t for t in times if t <= start]
        prev = before[-1] if before else start
        for t in times:
            if t <= start:
                continue
            worst = max(worst, t - prev)
            prev = t
            if t > end:
                break
        else:
            worst = max(worst, t_end - prev)
    return worst


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def check(history: list[dict], reads: dict[str, list[dict]]) -> Verdict:
    sends = {e["id"]: e for e in history if e.get("type") == "send"}
    acks = [e for e in history if e.get("type") == "ack"]
    ack_of = {a["id"]: a for a in acks}
    fails = [e for e in history if e.get("type") == "fail"]
    definite = {f["id"] for f in fails if f.get("definite")}
    indefinite = {f["id"] for f in fails if not f.get("definite")}
    notes = []
    bad_acks = [a["id"] for a in acks if a["id"] not in sends]
    if bad_acks:
        notes.append(f"{len(bad_acks)} acks without a send in the history: {bad_acks[:SAMPLE_LIMIT]}")

    lost, dups, phantoms, changed, gaps = {}, {}, {}, {}, {}
    for replica, msgs in sorted(reads.items()):
        seen: dict[str, int] = {}
        by_queue: dict[int, list[int]] = {}
        ph, ch = [], []
        for m in msgs:
            seen[m["id"]] = seen.get(m["id"], 0) + 1
            by_queue.setdefault(m["queue"], []).append(m["queue_offset"])
            if m["id"] not in sends or m["id"] in definite:
                ph.append(m["id"])
                continue
            a = ack_of.get(m["id"])
            if not m.get("body_ok", True) or (a is not None and (a["queue"], a["queue_offset"]) != (m["queue"], m["queue_offset"])):
                ch.append(m["id"])
        missing = sorted(set(ack_of) - set(seen))
        d = sorted(i for i, c in seen.items() if c > 1)
        g = sorted(q for q, offs in by_queue.items() if sorted(offs) != list(range(min(offs), min(offs) + len(offs))))
        for name, val, into in (("lost", missing, lost), ("dup", d, dups), ("phantom", ph, phantoms),
                                ("changed", ch, changed), ("gaps", g, gaps)):
            if val:
                into[replica] = {"count": len(val), "sample": val[:SAMPLE_LIMIT]}

    divergence = _divergence(reads)
    t_end = max((e["t"] for e in history), default=0.0)
    windows = fault_windows(history)
    failover = _first_ack_after(sends, acks, windows[0][0]) if windows else None
    ends = [w[1] for w in windows if w[1] is not None]
    recovery = _first_ack_after(sends, acks, max(ends)) if ends else None
    lat = [a["t"] - sends[a["id"]]["t"] for a in acks if a["id"] in sends]
    latency = {"p50_ms": _ms(_pct(lat, 0.5)), "p99_ms": _ms(_pct(lat, 0.99)), "max_ms": _ms(max(lat, default=None)),
               "mean_ms": _ms(sum(lat) / len(lat)) if lat else None, "median_ms": _ms(median(lat)) if lat else None}
    if windows and failover is None:
        notes.append("no acked write after the fault started")
    ok = not (lost or dups or phantoms or changed or divergence or gaps or bad_acks) and bool(acks)
    if not acks:
        notes.append("no write was acked at all")
    return Verdict(ok, len(sends), len(acks), len(definite), len(indefinite), lost, dups, phantoms, changed,
                   divergence, gaps, failover, _longest_gap_in_faults(acks, windows, t_end), recovery, latency, notes,
                   [_first_ack_after(sends, acks, w[0]) for w in windows],
                   [_first_ack_after(sends, acks, w[1]) for w in windows if w[1] is not None])


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


def _divergence(reads: dict[str, list[dict]]) -> list[dict]:
    """Per queue, the replicas must hold the same (queue_offset -> id, commitlog_offset) map and
    the same length: the drill drains only after the group has caught up."""
    if len(reads) < 2:
        return []
    tables: dict[str, dict[int, dict[int, tuple]]] = {}
    for replica, msgs in reads.items():
        t = tables.setdefault(replica, {})
        for m in msgs:
            t.setdefault(m["queue"], {})[m["queue_offset"]] = (m["id"], m.get("commitlog_offset"))
    out = []
    queues = sorted({q for t in tables.values() for q in t})
    names = sorted(tables)
    for q in queues:
        views = {r: tables[r].get(q, {}) for r in names}
        ref_name = names[0]
        ref = views[ref_name]
        for r in names[1:]:
            v = views[r]
            if v == ref:
                continue
            diff = sorted(o for o in set(v) | set(ref) if v.get(o) != ref.get(o))
            out.append({"queue": q, "replicas": [ref_name, r], "first_offset": diff[0], "differing": len(diff),
                        "sizes": [len(ref), len(v)]})
    return out

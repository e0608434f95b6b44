"""`make drill-matrix`: every scenario for DRILL_SECONDS of load each, then one table.

    python -m deploy.drills.matrix [--seconds 180] [--project mqstore] [--only a,b] [--out reports]

Each scenario repeats its fault cycle for `--seconds` (runner.run duration_s), so failover
and recovery have one sample per cycle: the table shows their median and p99. Writes
<out>/drill-matrix-<time>.{json,md} and copies them to drill-matrix.{json,md}; exit code 0
when every scenario passed, 1 when one failed, 2 when the cluster is not usable.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from statistics import median

from deploy.drills.cluster import ROOT, Cluster, DrillError

COLUMNS = ("scenario", "ok", "cycles", "sent", "acked", "lost", "duplicates", "phantoms", "divergence",
           "failover_median_s", "failover_p99_s", "recovery_median_s", "recovery_p99_s", "unavailable_max_s",
           "target_s", "load_avg")


def _count(d) -> int:
    return sum(v.get("count", 0) for v in d.values()) if isinstance(d, dict) else len(d or ())


def _p(values: list, q: float) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    return vals[min(len(vals) - 1, int(q * len(vals)))]


def row_of(result: dict) -> dict:
    """One table row from a runner result (pure; tested without docker)."""
    v = result["verdict"]
    fo = v.get("failovers_s") or ([v["failover_s"]] if v.get("failover_s") is not None else [])
    rc = v.get("recoveries_s") or ([v["recovery_s"]] if v.get("recovery_s") is not None else [])
    missing = sum(1 for x in fo if x is None)
    r = {"scenario": result["scenario"], "ok": bool(result["ok"]), "cycles": result["timeline"].get("cycles", 1),
         "sent": v["sent"], "acked": v["acked"], "lost": _count(v["lost"]), "duplicates": _count(v["duplicates"]),
         "phantoms": _count(v["phantoms"]), "divergence": len(v["divergence"]),
         "failover_median_s": median([x for x in fo if x is not None]) if len(fo) > missing else None,
         "failover_p99_s": _p(fo, 0.99), "recovery_median_s": median([x for x in rc if x is not None])
         if any(x is not None for x in rc) else None, "recovery_p99_s": _p(rc, 0.99),
         "unavailable_max_s": v.get("unavailable_s"),
         "target_s": (result.get("targets") or {}).get("failover_target_s"), "load_avg": result.get("load_avg"),
         "report": result.get("paths", {}).get("html")}
    if missing:
        r["ok"] = False
        r["note"] = f"{missing} fault cycle(s) without an ack afterwards"
    return r


def _fmt(x) -> str:
    if isinstance(x, bool):
        return "PASS" if x else "FAIL"
    if isinstance(x, float):
        return f"{x:.2f}"
    return "-" if x is None else str(x)


def markdown(rows: list[dict], meta: dict) -> str:
    head = [f"# Drill matrix ({meta['started']}, {meta['seconds']:g} s of load per scenario, "
            f"{meta['rate']:g} sends/s, compose project {meta['project']})", "",
            "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    body = ["| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    notes = [f"- {r['scenario']}: {r['note']}" for r in rows if r.get("note")]
    return "\n".join(head + body + ([""] + notes if notes else []) +
                     ["", "Times in seconds; load_avg is the 1-minute load average at the end of the scenario "
                      "(2-core machine shared with other work: figures are noisy)."]) + "\n"


def main(argv: list[str] | None = None) -> int:
    from deploy.drills.runner import run
    from deploy.drills.scenarios import SCENARIOS
    p = argparse.ArgumentParser(prog="python -m deploy.drills.matrix", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=float(os.environ.get("DRILL_SECONDS", 180)))
    p.add_argument("--project", default=os.environ.get("MQSTORE_PROJECT", "mqstore"))
    p.add_argument("--only", default="", help="comma-separated scenarios (default: all)")
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument("--out", default=os.path.join(ROOT, "reports"))
    p.add_argument("--drill-reports", default=os.path.join(ROOT, "deploy", "reports"))
    p.add_argument("--no-store-audit", action="store_true")
    args = p.parse_args(argv)
    if not 20 <= args.seconds <= 1800:
        p.error("--seconds must be within 20..1800")
    if not 0 < args.rate <= 2000:
        p.error("--rate must be in (0, 2000]")
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": args.seconds, "rate": args.rate,
            "project": args.project}
    rows = []
    try:
        c = Cluster(args.project)
        for n in names:
            sc = SCENARIOS[n]
            warmup = min(10.0, args.seconds * 0.1)
            recovery = max(10.0, sc.fault_s)
            try:
                res = run(sc, args.drill_reports, warmup_s=warmup, recovery_s=recovery, rate_per_s=args.rate,
                          store_audit=not args.no_store_audit, cluster=c, duration_s=args.seconds)
                rows.append(row_of(res))
            except DrillError as e:       # one broken scenario is a FAIL row, the matrix goes on
                rows.append({"scenario": n, "ok": False, "note": f"error: {e}"})
            print(f"{n}: " + " ".join(f"{k}={_fmt(rows[-1].get(k))}" for k in COLUMNS[1:]), flush=True)
    except DrillError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    doc = {"meta": meta, "rows": rows}
    jpath = os.path.join(args.out, f"drill-matrix-{stamp}.json")
    mpath = os.path.join(args.out, f"drill-matrix-{stamp}.md")
    with open(jpath, "w") as f:
        json.dump(doc, f, indent=2)
    md = markdown(rows, meta)
    with open(mpath, "w") as f:
        f.write(md)
    shutil.copyfile(jpath, os.path.join(args.out, "drill-matrix.json"))
    shutil.copyfile(mpath, os.path.join(args.out, "drill-matrix.md"))
    print("\n" + md + f"\nwritten: {jpath}, {mpath}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

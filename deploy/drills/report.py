"""Drill reports: verdict.json, a throughput/latency plot (PNG, fault windows shaded) and an
HTML page that shows both. Pure file output; the plot is drawn with matplotlib's Agg backend."""

from __future__ import annotations

import html
import json
import os

from deploy.drills.checker import fault_windows


def series(history: list[dict], bucket_s: float = 1.0) -> dict:
    """Per time bucket (seconds from the first event): acks, failures, p50 and max latency in ms."""
    if not history:
        return {"t": [], "acks": [], "fails": [], "p50_ms": [], "max_ms": []}
    t0 = min(e["t"] for e in history)
    t1 = max(e["t"] for e in history)
    n = int((t1 - t0) / bucket_s) + 1
    acks, fails = [0] * n, [0] * n
    lat: list[list[float]] = [[] for _ in range(n)]
    send_t = {e["id"]: e["t"] for e in history if e["type"] == "send"}
    for e in history:
        b = int((e["t"] - t0) / bucket_s)
        if e["type"] == "ack":
            acks[b] += 1
            if e["id"] in send_t:
                lat[b].append((e["t"] - send_t[e["id"]]) * 1000)
        elif e["type"] == "fail":
            fails[b] += 1
    p50 = [sorted(x)[len(x) // 2] if x else None for x in lat]
    mx = [max(x) if x else None for x in lat]
    return {"t0": t0, "t": [i * bucket_s for i in range(n)], "acks": [a / bucket_s for a in acks],
            "fails": [f / bucket_s for f in fails], "p50_ms": p50, "max_ms": mx}


def plot(history: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = series(history)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    ax1.plot(s["t"], s["acks"], label="acked msg/s", color="tab:blue")
    ax1.plot(s["t"], s["fails"], label="failed sends/s", color="tab:red", alpha=0.7)
    ax1.set_ylabel("msg/s")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title(title)
    pts = [(t, v) for t, v in zip(s["t"], s["p50_ms"]) if v is not None]
    mxs = [(t, v) for t, v in zip(s["t"], s["max_ms"]) if v is not None]
    if pts:
        ax2.plot(*zip(*pts), label="p50 latency", color="tab:green")
    if mxs:
        ax2.plot(*zip(*mxs), label="max latency", color="tab:orange", alpha=0.7)
    ax2.set_yscale("log")
    ax2.set_ylabel("ms")
    ax2.set_xlabel("seconds since start")
    ax2.legend(loc="upper right", fontsize=8)
    t_last = s["t"][-1] if s["t"] else 0
    for start, end, name in fault_windows(history):
        a = start - s.get("t0", start)
        b = (end - s["t0"]) if end is not None else t_last
        for ax in (ax1, ax2):
            ax.axvspan(a, b, color="tab:red", alpha=0.12)
        ax1.text(a, ax1.get_ylim()[1] * 0.92, f" {name}", fontsize=8, color="tab:red", va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(out_dir: str, scenario: str, result: dict, history: list[dict]) -> dict:
    """verdict.json, plot.png, index.html in out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "verdict.json"), "png": os.path.join(out_dir, "plot.png"),
             "html": os.path.join(out_dir, "index.html")}
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=2, sort_keys=True, default=str)
    v0 = result["verdict"]
    fo = f"{v0['failover_s']:.2f}s" if v0.get("failover_s") is not None else "n/a"
    plot(history, paths["png"], f"drill {scenario}: {'PASS' if result['ok'] else 'FAIL'}, "
                                f"acked {v0['acked']}/{v0['sent']}, failover {fo}")
    v = result["verdict"]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td><code>{html.escape(json.dumps(v[k], default=str))}</code></td></tr>"
                   for k in ("ok", "sent", "acked", "failed_definite", "failed_indefinite", "lost", "duplicates",
                             "phantoms", "changed", "divergence", "gaps", "failover_s", "unavailable_s",
                             "recovery_s", "latency_ms", "notes"))
    extra = "".join(f"<tr><th>{html.escape(k)}</th><td><code>{html.escape(json.dumps(result.get(k), default=str))}</code></td></tr>"
                    for k in ("store_audit", "converged_s", "timeline", "load_avg", "targets"))
    color = "#1a7f37" if result["ok"] else "#cf222e"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>mqstore drill {html.escape(scenario)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} th{{text-align:left;padding-right:1em;vertical-align:top}}
td code{{white-space:pre-wrap;word-break:break-all}} .v{{color:{color};font-size:1.4em;font-weight:bold}}</style></head><body>
<h1>drill: {html.escape(scenario)}</h1>
<p>{html.escape(result['description'])}</p>
<p class="v">{'PASS' if result['ok'] else 'FAIL'} &mdash; {html.escape(result['summary'])}</p>
<p>Expected: {html.escape(result['expected'])}</p>
<img src="plot.png" alt="throughput and latency over time; fault windows shaded red" style="max-width:100%">
<h2>Verdict</h2><table>{rows}</table>
<h2>Run</h2><table>{extra}</table>
<p>Raw: <a href="verdict.json">verdict.json</a>, <a href="history.jsonl">history.jsonl</a></p>
</body></html>"""
    with open(paths["html"], "w") as f:
        f.write(page)
    return paths

"""Store-level checks on the replicas' volumes, run while the group's containers are stopped:

- DLedger groups: `pipeline.jobs.audit` compares the replicas entry by entry (term, pos,
  chain CRC, body CRC) up to the committed index: committed bytes must be identical.
- classic groups: the commitlog bytes of master and slave are compared over the shorter one.
- every replica: `pipeline.jobs.rebuild` rebuilds the consume queues from the committed log
  and they must equal the node's own consumequeue/ files.

The volumes are read from the host (`docker volume inspect` mountpoints), so this runs only
where the drill runs beside the Docker engine as root; otherwise it says it was skipped.
"""

from __future__ import annotations

import os
import tempfile


def _tree(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read().rstrip(b"\0")   # files are preallocated
    return out


def _commitlog_bytes(store: str, limit: int = 1 << 30) -> bytes:
    d = os.path.join(store, "commitlog")
    data = b""
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        with open(os.path.join(d, name), "rb") as f:
            data += f.read(limit - len(data))
    return data.rstrip(b"\0")


def audit(stores: dict[str, str | None], dledger: bool, cq_units_per_file: int = 300_000) -> dict:
    """stores: service -> host path of its /store volume (None when unreadable)."""
    if any(p is None for p in stores.values()):
        return {"status": "skipped", "reason": "store volumes are not readable from this process "
                "(run the drill as root on the Docker host)"}
    try:
        from pipeline import jobs
    except ImportError as e:
        return {"status": "skipped", "reason": f"pipeline not importable: {e}"}
    out: dict = {"status": "ok", "replicas": sorted(stores)}
    problems = []
    if dledger:
        try:
            a = jobs.audit([p for _, p in sorted(stores.items())], spark=None)
        except Exception as e:  # noqa: BLE001 - JobError / ValueError on a damaged store: a finding
            return dict(out, status="failed", problems=[f"audit could not read the replicas: {e}"])
        out["raft_audit"] = {k: v for k, v in a.as_dict().items() if k != "replicas"}
        if not a.ok:
            problems.append("replica logs diverge or fail their CRCs (see raft_audit)")
    else:
        logs = {s: _commitlog_bytes(p) for s, p in stores.items()}
        n = min(len(v) for v in logs.values())
        same = len({v[:n] for v in logs.values()}) == 1
        out["commitlog_compare"] = {"common_bytes": n, "lengths": {s: len(v) for s, v in logs.items()},
                                    "identical_prefix": same}
        if not same:
            problems.append("commitlog bytes differ between master and slave")
    rebuilt = {}
    for s, p in sorted(stores.items()):
        with tempfile.TemporaryDirectory(prefix=f"mqstore-drill-{s}-") as tmp:
            target = os.path.join(tmp, "rebuilt")
            try:
                jobs.rebuild(p, target, spark=None, units_per_file=cq_units_per_file,
                             index_hash_slots=50_000, index_max_entries=200_000)
            except Exception as e:  # noqa: BLE001 - a JobError or a damaged log; reported, not raised
                problems.append(f"{s}: rebuild failed: {e}")
                continue
            mine = _tree(os.path.join(p, "consumequeue"))
            theirs = _tree(os.path.join(target, "consumequeue"))
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k, b"") != theirs.get(k, b""))
            rebuilt[s] = {"files": len(theirs), "differing": diff[:10]}
            if diff:
                problems.append(f"{s}: consume queues differ from a rebuild in {len(diff)} file(s)")
    out["cq_rebuild"] = rebuilt
    if problems:
        out["status"] = "failed"
        out["problems"] = problems
    return out

"""Goal: the drill checker finds every kind of anomaly in a recorded history, and only those.
Method: synthetic histories and replica reads (no docker): a clean run, then one seeded
fault per test — an acked message missing from one replica, a duplicate, a phantom, a
message at another offset than its ack said, diverging replicas, a hole in a queue — and
the failover time measured from the fault to the first ack of a send started after it.
Runs in `make test` (not marked docker)."""

from __future__ import annotations

import copy

from deploy.drills.checker import check, fault_windows


def _history():
    """20 sends over 10 s, one per 0.5 s, queue = i % 2; a fault from t=3.2 to t=6.0 during
    which sends fail (NOT_LEADER = definite, a timeout = indefinite); all others acked."""
    h, offs = [], {0: 0, 1: 0}
    for i in range(20):
        t = i * 0.5
        if i == 7:
            h.append({"t": 3.2, "type": "fault", "name": "kill", "phase": "start"})
        if i == 12:
            h.append({"t": 6.0, "type": "fault", "name": "kill", "phase": "end"})
        q = i % 2
        h.append({"t": t, "type": "send", "id": f"m{i}", "queue": q})
        if i in (7, 8):
            h.append({"t": t + 0.1, "type": "fail", "id": f"m{i}", "error": "NOT_LEADER", "definite": True})
        elif i == 9:
            h.append({"t": t + 2.0, "type": "fail", "id": f"m{i}", "error": "TIMEOUT", "definite": False})
        else:
            h.append({"t": t + 0.01, "type": "ack", "id": f"m{i}", "queue": q, "queue_offset": offs[q]})
            offs[q] += 1
    return h


def _reads(history, replicas=("a0", "a1", "a2")):
    msgs = [{"id": e["id"], "queue": e["queue"], "queue_offset": e["queue_offset"],
             "commitlog_offset": 1000 + 300 * n} for n, e in enumerate(e for e in history if e["type"] == "ack")]
    return {r: copy.deepcopy(msgs) for r in replicas}


def test_clean_history_passes_and_measures_failover():
    h = _history()
    v = check(h, _reads(h))
    assert v.ok, v.summary()
    assert (v.sent, v.acked, v.failed_definite, v.failed_indefinite) == (20, 17, 2, 1)
    # the fault starts at 3.2; the first send started after it that was acked is m10 (t=5.0)
    assert abs(v.failover_s - (5.01 - 3.2)) < 1e-9
    assert abs(v.recovery_s - (6.01 - 6.0)) < 1e-9
    assert v.unavailable_s > 1.9       # acks at 3.01 and 5.01 around the fault
    assert fault_windows(h) == [(3.2, 6.0, "kill")]


def test_indefinite_failure_may_be_present_without_complaint():
    h = _history()
    r = _reads(h)
    for msgs in r.values():
        msgs.append({"id": "m9", "queue": 1, "queue_offset": 8, "commitlog_offset": 99_000})
    assert check(h, r).ok


def test_acked_message_missing_on_one_replica_is_lost():
    h = _history()
    r = _reads(h)
    r["a2"] = [m for m in r["a2"] if m["id"] != "m19"]
    v = check(h, r)
    assert not v.ok
    assert v.lost == {"a2": {"count": 1, "sample": ["m19"]}}
    assert v.divergence and v.divergence[0]["queue"] == 1


def test_duplicate_read_is_reported():
    h = _history()
    r = _reads(h)
    for msgs in r.values():
        msgs.append({"id": "m0", "queue": 0, "queue_offset": 9, "commitlog_offset": 50_000})
    v = check(h, r)
    assert not v.ok
    assert set(v.duplicates) == {"a0", "a1", "a2"}


def test_definitely_failed_send_that_is_read_is_a_phantom():
    h = _history()
    r = _reads(h)
    r["a0"].append({"id": "m7", "queue": 1, "queue_offset": 8, "commitlog_offset": 50_000})
    r["a0"].append({"id": "never-sent", "queue": 0, "queue_offset": 9, "commitlog_offset": 50_300})
    v = check(h, r)
    assert not v.ok
    assert v.phantoms["a0"]["sample"] == ["m7", "never-sent"]


def test_message_at_another_offset_than_acked_is_changed():
    h = _history()
    r = _reads(h)
    a, b = r["a1"][0], r["a1"][2]           # both queue 0
    a["id"], b["id"] = b["id"], a["id"]
    v = check(h, r)
    assert not v.ok
    assert v.changed["a1"]["count"] == 2
    assert v.divergence


def test_bad_body_is_changed():
    h = _history()
    r = _reads(h)
    r["a0"][3]["body_ok"] = False
    assert check(h, r).changed["a0"]["count"] == 1


def test_hole_in_a_queue_is_a_gap():
    h = _history()
    r = _reads(h)
    for msgs in r.values():
        for m in msgs:
            if m["queue"] == 0 and m["queue_offset"] >= 3:
                m["queue_offset"] += 1
    v = check(h, r)
    assert not v.ok
    assert v.gaps["a0"] == {"count": 1, "sample": [0]}
    assert v.changed                          # the acks named the old offsets


def test_no_ack_at_all_fails():
    h = [{"t": 0.0, "type": "send", "id": "x", "queue": 0},
         {"t": 1.0, "type": "fail", "id": "x", "error": "TIMEOUT", "definite": False}]
    v = check(h, {"a0": []})
    assert not v.ok
    assert "no write was acked at all" in v.notes


def test_not_leader_with_unknown_outcome_is_indefinite():
    """Regression (oneway_leader drill): a deaf leader that steps down fails its pending writes
    with NOT_LEADER "...; the outcome is unknown, retry", yet the next leader commits them.
    Such a failure must not count as definite, or the committed entry reads as a phantom."""
    from deploy.drills.checker import is_definite
    assert is_definite("NOT_LEADER", "this node is not the leader")
    assert is_definite("NOT_LEADER")
    assert not is_definite("NOT_LEADER", "leadership lost; the outcome is unknown, retry")
    assert not is_definite("TIMEOUT")
    h = [{"t": 0.0, "type": "send", "id": "a", "queue": 0},
         {"t": 0.5, "type": "fail", "id": "a", "error": "NOT_LEADER",
          "definite": is_definite("NOT_LEADER", "x; the outcome is unknown, retry")}]
    reads = {r: [{"id": "a", "queue": 0, "queue_offset": 0, "commitlog_offset": 0, "body_ok": True}]
             for r in ("a0", "a1")}
    assert check(h, reads).phantoms == {}
    h[1]["definite"] = True                 # the same read after a definite failure is a phantom
    assert set(check(h, reads).phantoms) == {"a0", "a1"}

"""The disk-full drills' own checks, on recorded histories.

The guard refuses sends as soon as the disk passes its ratio, which can happen while the drill
is still writing the ballast, before the runner stamps the fault's start. A CI run's
disk_full_leader drill got its only 507 12 ms before that stamp and the next send, after it, a
NOT_LEADER (the full leader had handed over): the check said no send failed with a disk-full
message. Failures count from the start of the fill."""

from deploy.drills.scenarios import _disk_full_checks, _disk_full_leader_checks

DISK_FULL_MSG = ("disk 90.2% full at /store, at or above diskSpaceWarningLevelRatio 90%: "
                 "sends refused until space returns")


def _history(t_fill_end: float = 100.0) -> list:
    return [
        {"t": 99.0, "type": "ack", "id": "a"},
        {"t": t_fill_end - 0.012, "type": "fail", "id": "b", "error": "SERVICE_NOT_AVAILABLE",
         "message": DISK_FULL_MSG},
        {"t": t_fill_end, "type": "fault", "phase": "start"},
        {"t": t_fill_end + 0.017, "type": "fail", "id": "c", "error": "NOT_LEADER",
         "message": "this node is not the leader"},
        {"t": t_fill_end + 0.085, "type": "ack", "id": "d"},
        {"t": 108.0, "type": "fault", "phase": "end"},
        {"t": 108.1, "type": "ack", "id": "e"},
    ]


def test_a_disk_full_refusal_during_the_fill_before_the_fault_stamp_counts():
    st = {"fill_started_t": 99.5}
    assert _disk_full_leader_checks(_history(), st) == []
    assert st["disk_full_errors"] == 1
    assert st["fault_fail_errors"] == ["NOT_LEADER", "SERVICE_NOT_AVAILABLE"]
    assert st["acks_while_full"] == 1


def test_a_refusal_before_the_fill_started_does_not_count():
    st = {"fill_started_t": 99.995}     # after the 507 at 99.988: it cannot be this fill's
    problems = _disk_full_checks(_history(), st)
    assert len(problems) == 1 and "no send failed with a disk-full message" in problems[0]


def test_no_ack_after_the_heal_is_a_problem():
    events = [e for e in _history() if e.get("id") != "e"]
    problems = _disk_full_checks(events, {"fill_started_t": 99.5})
    assert problems == ["no ack after the space came back"]


def test_a_full_leader_that_kept_every_send_failing_is_a_problem():
    events = [e for e in _history() if e.get("id") != "d"]
    problems = _disk_full_leader_checks(events, {"fill_started_t": 99.5})
    assert any("leadership did not move" in p for p in problems)


def _handed_over_first() -> list:
    """A CI run's history: the full leader handed over 0.03 s into the fault, before any send
    reached it while full, so its only refusal was NOT_LEADER and no 507 was ever produced."""
    return [
        {"t": 99.0, "type": "send", "id": "a", "node": "n0"},
        {"t": 99.01, "type": "ack", "id": "a"},
        {"t": 100.01, "type": "send", "id": "b", "node": "n0"},
        {"t": 100.0, "type": "fault", "phase": "start"},
        {"t": 100.02, "type": "fail", "id": "b", "error": "NOT_LEADER", "message": "this node is not the leader"},
        {"t": 100.1, "type": "send", "id": "c", "node": "n1"},
        {"t": 100.11, "type": "ack", "id": "c"},
        {"t": 108.0, "type": "fault", "phase": "end"},
        {"t": 108.1, "type": "send", "id": "d", "node": "n1"},
        {"t": 108.11, "type": "ack", "id": "d"},
    ]


def test_regression_a_leader_that_handed_over_before_any_send_reached_it_passes():
    st = {"fill_started_t": 99.5, "victim": "n0"}
    assert _disk_full_leader_checks(_handed_over_first(), st) == []
    assert st["disk_full_errors"] == 0 and st["handed_over_before_any_send"] is True
    # the classic master's check has no handover to stand in for the refusal
    assert any("no send failed with a disk-full message" in p
               for p in _disk_full_checks(_handed_over_first(), {"fill_started_t": 99.5, "victim": "n0"}))


def test_a_victim_that_refused_a_send_with_another_error_still_needs_a_disk_full_refusal():
    events = _handed_over_first()
    events.insert(4, {"t": 100.03, "type": "send", "id": "x", "node": "n0"})
    events.insert(5, {"t": 100.04, "type": "fail", "id": "x", "error": "IO:timeout"})
    problems = _disk_full_leader_checks(events, {"fill_started_t": 99.5, "victim": "n0"})
    assert len(problems) == 1 and "no send failed with a disk-full message" in problems[0]

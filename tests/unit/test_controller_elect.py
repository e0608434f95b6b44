"""Goal: the controller's pure decisions. Election order (epoch, then offset, then
priority, then id), unclean election off by default, epochs never go backwards (even
after the controller lost its state), SyncStateSet alteration rules, and ops that are
idempotent under replay. Method: hand-built group states and heartbeats; Hypothesis for
the ordering against a dumb reference."""

import itertools

from hypothesis import given, strategies as st

from ha.controller import (ROLE_TRANSITIONS, BrokerHeartbeat, BrokerRole, DecisionKind, ElectOptions, Liveness,
                           RoleInput, alter_sync_state_set, apply_op, assign_queues, elect, election_key,
                           empty_state, heartbeat_reply, merge_states, ops_for_heartbeat, plan_ops, role_of,
                           route_of, sss_report)

OPTS = ElectOptions()
NOW = 100_000


def hb(b, epoch=1, offset=0, prio=0, seen=NOW, in_sync=(), group="g", session=1, seq=1, pending=False):
    return BrokerHeartbeat(group, b, f"h{b}:1", f"h{b}:2", epoch, offset, prio, in_sync=in_sync, last_seen_ms=seen,
                           session=session, seq=seq, pending=pending)


def group(master=0, epoch=1, sss=(0, 1, 2), brokers=(0, 1, 2), **kw):
    g = {"name": "g", "mode": "classic", "master_id": master, "master_addr": f"h{master}:1",
         "master_ha_addr": f"h{master}:2", "master_epoch": epoch, "max_reported_epoch": epoch,
         "sss": list(sss), "sss_epoch": 1, "brokers": {str(b): {"addr": f"h{b}:1", "ha_addr": f"h{b}:2"} for b in brokers},
         "leader_term": 0}
    g.update(kw)
    return g


def dead(t):
    return NOW - OPTS.heartbeat_timeout_ms - 1 if t else NOW


def test_alive_master_is_kept():
    d = elect(group(), {0: hb(0), 1: hb(1, offset=99)}, NOW, OPTS)
    assert d.kind is DecisionKind.NO_CHANGE


def test_master_missing_beats_past_timeout_is_replaced():
    beats = {0: hb(0, seen=NOW - OPTS.heartbeat_timeout_ms), 1: hb(1)}
    assert elect(group(), beats, NOW, OPTS).kind is DecisionKind.NO_CHANGE   # exactly at the timeout: still alive
    beats[0] = hb(0, seen=dead(True))
    d = elect(group(), beats, NOW, OPTS)
    assert d.kind is DecisionKind.NEW_MASTER and d.master_id == 1


def test_order_epoch_beats_offset():
    beats = {0: hb(0, seen=dead(True)), 1: hb(1, epoch=3, offset=10), 2: hb(2, epoch=2, offset=10**12)}
    assert elect(group(), beats, NOW, OPTS).master_id == 1


def test_order_offset_beats_priority():
    beats = {0: hb(0, seen=dead(True)), 1: hb(1, offset=10, prio=0), 2: hb(2, offset=11, prio=9)}
    assert elect(group(), beats, NOW, OPTS).master_id == 2


def test_order_lower_priority_value_wins_then_lower_id():
    beats = {0: hb(0, seen=dead(True)), 1: hb(1, prio=5), 2: hb(2, prio=1)}
    assert elect(group(), beats, NOW, OPTS).master_id == 2
    beats = {0: hb(0, seen=dead(True)), 1: hb(1), 2: hb(2)}
    assert elect(group(), beats, NOW, OPTS).master_id == 1


def test_huge_offsets_and_epochs_compare_exactly():
    big = 2**64
    beats = {0: hb(0, seen=dead(True)), 1: hb(1, epoch=big, offset=big), 2: hb(2, epoch=big, offset=big + 1)}
    d = elect(group(epoch=big), beats, NOW, OPTS)
    assert d.master_id == 2 and d.epoch == big + 1


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2**70), st.integers(-3, 3)), min_size=1, max_size=8))
def test_election_key_matches_a_dumb_reference(rows):
    beats = [hb(i + 1, e, o, p) for i, (e, o, p) in enumerate(rows)]
    best = min(beats, key=election_key)
    # Reference: filter step by step.
    pool = [b for b in beats if b.epoch == max(x.epoch for x in beats)]
    pool = [b for b in pool if b.max_offset == max(x.max_offset for x in pool)]
    pool = [b for b in pool if b.priority == min(x.priority for x in pool)]
    assert best.broker_id == min(b.broker_id for b in pool)


def test_only_sync_state_set_members_are_candidates():
    beats = {0: hb(0, seen=dead(True)), 2: hb(2, offset=10**9)}
    d = elect(group(sss=(0, 1)), beats, NOW, OPTS)
    assert d.kind is DecisionKind.NO_CANDIDATE and "unclean" in d.reason


def test_unclean_election_is_an_explicit_option():
    beats = {0: hb(0, seen=dead(True)), 2: hb(2)}
    d = elect(group(sss=(0, 1)), beats, NOW, ElectOptions(unclean=True))
    assert d.kind is DecisionKind.NEW_MASTER and d.master_id == 2


def test_first_master_of_a_new_group_from_any_alive_broker():
    g = group(master=None, epoch=0, sss=(), max_reported_epoch=0)
    d = elect(g, {1: hb(1, epoch=0, prio=1), 0: hb(0, epoch=0, prio=0)}, NOW, OPTS)
    assert d.kind is DecisionKind.NEW_MASTER and d.master_id == 0 and d.epoch == 1


def test_new_sync_state_set_is_the_new_master_alone():
    d = elect(group(), {0: hb(0, seen=dead(True)), 1: hb(1), 2: hb(2)}, NOW, OPTS)
    assert d.sync_state_set == {1} and d.sss_epoch == 2


def test_epoch_is_above_controller_and_every_broker_report():
    beats = {0: hb(0, epoch=9, seen=dead(True)), 1: hb(1, epoch=4)}
    assert elect(group(epoch=4), beats, NOW, OPTS).epoch == 10


def test_controller_that_lost_its_state_never_elects_backwards():
    # Fresh controller: epoch 0 in its state, but brokers remember epoch 7.
    g = group(master=None, epoch=0, sss=(), max_reported_epoch=0)
    d = elect(g, {1: hb(1, epoch=7), 2: hb(2, epoch=5)}, NOW, OPTS)
    assert d.epoch == 8


@given(st.integers(0, 100), st.integers(0, 100), st.lists(st.integers(0, 100), min_size=1, max_size=5))
def test_epoch_never_goes_backwards(ctrl_epoch, stored_max, reports):
    g = group(master=None, epoch=ctrl_epoch, sss=list(range(len(reports))), max_reported_epoch=stored_max)
    beats = {i: hb(i, epoch=e) for i, e in enumerate(reports)}
    d = elect(g, beats, NOW, OPTS)
    assert d.kind is DecisionKind.NEW_MASTER
    assert d.epoch > max(ctrl_epoch, stored_max, *reports)


def test_manual_elect_master_switches_a_healthy_master():
    d = elect(group(), {0: hb(0), 1: hb(1), 2: hb(2)}, NOW, OPTS, force_broker=2)
    assert d.kind is DecisionKind.NEW_MASTER and d.master_id == 2


def test_manual_elect_of_dead_or_ineligible_broker_is_refused():
    assert elect(group(), {0: hb(0)}, NOW, OPTS, force_broker=2).kind is DecisionKind.NO_CANDIDATE
    assert elect(group(sss=(0,)), {0: hb(0), 2: hb(2)}, NOW, OPTS, force_broker=2).kind is DecisionKind.NO_CANDIDATE


# --- SyncStateSet alteration ------------------------------------------------------------------
def test_master_report_expands_sss_with_alive_registered_slaves():
    g = group(sss=(0,))
    op = alter_sync_state_set(g, {0: hb(0, in_sync=(1, 2, 7)), 1: hb(1)}, NOW, OPTS)
    assert op["sss"] == [0, 1] and op["sss_epoch"] == 2   # 2 is dead, 7 is unknown


def test_stale_master_cannot_alter_sss():
    g = group(sss=(0,), epoch=5)
    assert alter_sync_state_set(g, {0: hb(0, epoch=4, in_sync=(1,)), 1: hb(1)}, NOW, OPTS) is None


def test_unchanged_sss_is_no_op():
    g = group(sss=(0, 1))
    assert alter_sync_state_set(g, {0: hb(0, in_sync=(1,)), 1: hb(1)}, NOW, OPTS) is None


def test_an_alter_carries_its_report_and_an_older_report_never_applies():
    """Regression (tests/integration/ha_nemesis.py, seeds 17 and 18: 285 and 492 acked
    messages lost): a master reported slave 1 in sync, then stepped down on its lease and was
    promoted again (or restarted) with no slave; the controller, still holding that older
    heartbeat, grew the SyncStateSet to {0, 1} while the master acked alone, and elected 1
    when the master died. Each alter now carries its report, (session, seq), and one older
    than the report the set reflects is refused when applied."""
    s = _seeded()
    apply_op(s, {"op": "set_master", "group": "g", "master_id": 0, "master_addr": "a:1", "master_ha_addr": "a:2",
                 "epoch": 1, "sss": [0], "sss_epoch": 1})
    g = s["groups"]["g"]
    op = alter_sync_state_set(g, {0: hb(0, in_sync=(1,), session=7, seq=3), 1: hb(1)}, NOW, OPTS)
    assert (op["session"], op["seq"], op["sss"]) == (7, 3, [0, 1])
    newer = {"op": "alter_sss", "group": "g", "epoch": 1, "sss": [0], "sss_epoch": 2, "session": 8, "seq": 1}
    assert apply_op(s, newer) and sss_report(g) == (8, 1)
    assert not apply_op(s, dict(op, sss_epoch=3))            # session 7 is older than 8: refused
    assert g["sss"] == [0]
    assert not apply_op(s, dict(newer, sss=[0, 1], sss_epoch=3))   # the same report again: refused
    assert apply_op(s, dict(newer, sss=[0, 1], sss_epoch=3, seq=2)) and g["sss"] == [0, 1]
    # No op is planned from a heartbeat the set already reflects, whatever it says.
    assert alter_sync_state_set(g, {0: hb(0, in_sync=(), session=8, seq=2), 1: hb(1)}, NOW, OPTS) is None
    # An election starts the reports over: the new master's first one applies.
    apply_op(s, {"op": "set_master", "group": "g", "master_id": 1, "master_addr": "b:1", "master_ha_addr": "b:2",
                 "epoch": 2, "sss": [1], "sss_epoch": 4})
    assert sss_report(g) == (0, 0)
    assert apply_op(s, {"op": "alter_sss", "group": "g", "epoch": 2, "sss": [0, 1], "sss_epoch": 5,
                        "session": 1, "seq": 1})


def test_a_pending_report_brings_the_set_up_to_it_without_a_change():
    """A master still counting members from reports the set does not reflect asks (pending)
    for the set to be brought up to its newest report, so it can stop counting them."""
    g = group(sss=(0,), sss_session=4, sss_seq=5)
    assert alter_sync_state_set(g, {0: hb(0, session=4, seq=9), 1: hb(1)}, NOW, OPTS) is None
    op = alter_sync_state_set(g, {0: hb(0, session=4, seq=9, pending=True), 1: hb(1)}, NOW, OPTS)
    assert (op["sss"], op["session"], op["seq"], op["sss_epoch"]) == ([0], 4, 9, 2)
    assert alter_sync_state_set(g, {0: hb(0, session=4, seq=5, pending=True), 1: hb(1)}, NOW, OPTS) is None


def test_the_reply_names_the_report_the_set_reflects_and_the_group_s_brokers():
    s = _seeded()
    apply_op(s, {"op": "set_master", "group": "g", "master_id": 0, "master_addr": "a:1", "master_ha_addr": "a:2",
                 "epoch": 1, "sss": [0], "sss_epoch": 1})
    apply_op(s, {"op": "alter_sss", "group": "g", "epoch": 1, "sss": [0, 1], "sss_epoch": 2, "session": 3, "seq": 4})
    r = heartbeat_reply(s, "g", 0)
    assert (r["sync_state_set"], r["sss_session"], r["sss_seq"], r["brokers"]) == ([0, 1], 3, 4, [0, 1])
    assert r["broker_addrs"] == {"0": "a:1", "1": "b:1"}      # a broker lists its group (clusterList)


# --- replicated ops ----------------------------------------------------------------------------
def _seeded():
    s = empty_state()
    apply_op(s, {"op": "register", "group": "g", "broker_id": 0, "addr": "a:1", "ha_addr": "a:2"})
    apply_op(s, {"op": "register", "group": "g", "broker_id": 1, "addr": "b:1", "ha_addr": "b:2"})
    return s


def test_set_master_is_idempotent_and_never_backwards():
    s = _seeded()
    op = {"op": "set_master", "group": "g", "master_id": 1, "master_addr": "b:1", "master_ha_addr": "b:2",
          "epoch": 3, "sss": [1], "sss_epoch": 1}
    assert apply_op(s, op)
    assert not apply_op(s, op)                        # journal replay
    assert not apply_op(s, {**op, "epoch": 2, "master_id": 0})
    assert s["groups"]["g"]["master_id"] == 1


def test_alter_sss_requires_current_epoch_and_newer_sss_epoch():
    s = _seeded()
    apply_op(s, {"op": "set_master", "group": "g", "master_id": 0, "master_addr": "a:1", "master_ha_addr": "a:2",
                 "epoch": 1, "sss": [0], "sss_epoch": 1})
    assert not apply_op(s, {"op": "alter_sss", "group": "g", "epoch": 0, "sss": [0, 1], "sss_epoch": 9})
    assert apply_op(s, {"op": "alter_sss", "group": "g", "epoch": 1, "sss": [0, 1], "sss_epoch": 2})
    assert not apply_op(s, {"op": "alter_sss", "group": "g", "epoch": 1, "sss": [0], "sss_epoch": 2})
    assert s["groups"]["g"]["sss"] == [0, 1]


def test_merge_prefers_newer_epoch_and_never_rolls_back():
    old = _seeded()
    new = merge_states(old, {})
    apply_op(new, {"op": "set_master", "group": "g", "master_id": 1, "master_addr": "b:1", "master_ha_addr": "b:2",
                   "epoch": 2, "sss": [1], "sss_epoch": 1})
    assert merge_states(old, new)["groups"]["g"]["master_id"] == 1
    assert merge_states(new, old)["groups"]["g"]["master_id"] == 1


def test_topic_routes_spread_queues_over_groups():
    s = _seeded()
    apply_op(s, {"op": "set_master", "group": "g", "master_id": 0, "master_addr": "a:1", "master_ha_addr": "a:2",
                 "epoch": 1, "sss": [0], "sss_epoch": 1})
    apply_op(s, {"op": "create_topic", "topic": "T", "queues": 4, "assign": assign_queues(4, ["g", "h"]), "version": 1})
    r = route_of(s, "T")
    assert [q["queue_id"] for q in r["queues"]] == [0, 1, 2, 3]
    assert r["queues"][0]["addr"] == "a:1" and r["queues"][1]["broker_name"] == "h"
    assert heartbeat_reply(s, "g", 0)["topics"] == {"T": [0, 2]}
    assert route_of(s, "nope") is None


def test_heartbeat_registers_once_and_dledger_leader_follows_terms():
    s = empty_state()
    beat = BrokerHeartbeat("d", 1, "n1:1", mode="dledger", term=3, is_leader=True)
    ops = ops_for_heartbeat(s, beat)
    for op in ops:
        apply_op(s, op)
    assert ops_for_heartbeat(s, beat) == []
    assert s["groups"]["d"]["master_addr"] == "n1:1"
    assert not apply_op(s, {"op": "dledger_leader", "group": "d", "broker_id": 2, "addr": "n2:1", "term": 2})


def test_plan_ops_elects_then_alters():
    s = _seeded()
    live = Liveness()
    live.record(hb(0, epoch=0))
    live.record(hb(1, epoch=0, prio=5))
    (op,) = plan_ops(s, live, NOW, OPTS)
    assert op["op"] == "set_master" and op["master_id"] == 0
    apply_op(s, op)
    live.record(hb(0, epoch=1, in_sync=(1,)))
    (op,) = plan_ops(s, live, NOW, OPTS)
    assert op["op"] == "alter_sss" and op["sss"] == [0, 1]


def test_role_table_is_total_and_role_of_follows_it():
    for pair in itertools.product(BrokerRole, RoleInput):
        assert pair in ROLE_TRANSITIONS
    g = group(sss=(0, 1))
    assert role_of(g, 0) is BrokerRole.MASTER
    assert role_of(g, 1) is BrokerRole.IN_SYNC_SLAVE
    assert role_of(g, 2) is BrokerRole.SLAVE
    assert role_of(g, 9) is BrokerRole.UNKNOWN
    assert ROLE_TRANSITIONS[(BrokerRole.MASTER, RoleInput.OTHER_ELECTED)] is BrokerRole.SLAVE

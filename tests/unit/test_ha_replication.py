"""Goal: every classic-HA rule of the pure cores, one test each (setup / step / check),
and every (state, input) pair of each machine's table. Method: drive the cores with
explicit offsets and times; no sockets, no clock."""

import itertools

import pytest

from ha.replication import (CLIENT_TRANSITIONS, CONN_TRANSITIONS, WAIT_TRANSITIONS, ClientInput, ClientState,
                            CloseLink, ConnInput, ConnState, HAClientCore, HAConnectionCore, HAServiceCore,
                            HATimings, MiB, NO_LIMIT, PushVerdict, SendPush, WaitInput, WaitState)

SEG = 1 << 20
T = HATimings()


# --- tables -------------------------------------------------------------------------------
@pytest.mark.parametrize("table,states,inputs", [
    (CONN_TRANSITIONS, ConnState, ConnInput),
    (CLIENT_TRANSITIONS, ClientState, ClientInput),
    (WAIT_TRANSITIONS, WaitState, WaitInput),
])
def test_every_state_input_pair_has_exactly_one_next_state(table, states, inputs):
    for s, i in itertools.product(states, inputs):
        assert (s, i) in table, (s, i)
    assert len(table) == len(states) * len(inputs)


@pytest.mark.parametrize("table,closed", [(CONN_TRANSITIONS, ConnState.CLOSED), (CLIENT_TRANSITIONS, ClientState.CLOSED)])
def test_closed_is_absorbing(table, closed):
    assert all(nxt is closed for (s, _), nxt in table.items() if s is closed)


def test_wait_terminal_states_absorb():
    for (s, _), nxt in WAIT_TRANSITIONS.items():
        if s is not WaitState.WAITING:
            assert nxt is s


# --- master side: HAConnectionCore ---------------------------------------------------------
def test_nothing_is_pushed_before_the_first_report():
    c = HAConnectionCore(SEG, now_ms=0)
    assert c.next_action(1, master_max=5000) is None


def test_slave_reporting_zero_starts_at_masters_last_segment_base():
    c = HAConnectionCore(SEG, now_ms=0)
    c.on_report(0, master_max=3 * SEG + 100, now_ms=1)
    assert c.next_offset == 3 * SEG
    assert c.next_action(2, master_max=3 * SEG + 100) == SendPush(3 * SEG, 100)


def test_slave_reporting_nonzero_starts_there():
    c = HAConnectionCore(SEG, now_ms=0)
    c.on_report(1234, master_max=5000, now_ms=1)
    assert c.next_action(2, master_max=5000) == SendPush(1234, 5000 - 1234)


def test_push_is_capped_at_32k():
    c = HAConnectionCore(SEG, now_ms=0)
    c.on_report(10, master_max=SEG - 1, now_ms=1)
    assert c.next_action(2, master_max=SEG - 1) == SendPush(10, 32 * 1024)


def test_push_never_crosses_a_segment():
    c = HAConnectionCore(SEG, now_ms=0)
    c.on_report(SEG - 100, master_max=SEG + 5000, now_ms=1)
    a = c.next_action(2, master_max=SEG + 5000)
    assert a == SendPush(SEG - 100, 100)
    c.pushed(a.offset, a.size, 2)
    assert c.next_action(3, master_max=SEG + 5000) == SendPush(SEG, 5000)


def test_pushes_are_contiguous_and_advance():
    c = HAConnectionCore(SEG, now_ms=0)
    c.on_report(100, master_max=200, now_ms=1)
    c.pushed(100, 100, 2)
    assert c.next_offset == 200
    assert c.next_action(3, master_max=200) is None   # caught up, not idle long enough
    with pytest.raises(AssertionError):
        c.pushed(150, 10, 4)


def test_heartbeat_after_5s_idle():
    c = HAConnectionCore(SEG, now_ms=0)
    c.on_report(200, master_max=200, now_ms=0)
    assert c.next_action(T.heartbeat_interval_ms - 1, 200) is None
    a = c.next_action(T.heartbeat_interval_ms, 200)
    assert a == SendPush(200, 0)
    c.pushed(200, 0, T.heartbeat_interval_ms)
    assert c.next_action(T.heartbeat_interval_ms + 1, 200) is None


def test_close_after_20s_without_report():
    c = HAConnectionCore(SEG, now_ms=0)
    c.on_report(200, master_max=200, now_ms=0)
    assert not isinstance(c.next_action(T.housekeeping_ms, 200), CloseLink)
    assert isinstance(c.next_action(T.housekeeping_ms + 1, 200), CloseLink)
    assert c.state is ConnState.CLOSED


def test_silent_connection_that_never_reports_is_closed_too():
    c = HAConnectionCore(SEG, now_ms=0)
    assert isinstance(c.next_action(T.housekeeping_ms + 1, 0), CloseLink)


def test_report_going_backwards_closes():
    c = HAConnectionCore(SEG, now_ms=0)
    c.on_report(500, master_max=1000, now_ms=1)
    c.on_report(400, master_max=1000, now_ms=2)
    assert c.state is ConnState.CLOSED and "back" in c.close_reason


def test_slave_ahead_of_master_closes():
    c = HAConnectionCore(SEG, now_ms=0)
    c.on_report(2000, master_max=1000, now_ms=1)
    assert c.state is ConnState.CLOSED and "ahead" in c.close_reason


def test_slave_below_masters_first_offset_is_closed():
    c = HAConnectionCore(SEG, now_ms=0)
    c.on_report(10, master_max=3 * SEG, now_ms=1)
    assert isinstance(c.next_action(2, 3 * SEG, master_min=SEG), CloseLink)


# --- slave side: HAClientCore ------------------------------------------------------------------
def test_client_reports_at_once_after_connect():
    c = HAClientCore(now_ms=0)
    assert c.report_due(own_max=777, now_ms=0) == 777
    c.reported(777, 0)
    assert c.state is ClientState.TRANSFER
    assert c.report_due(777, 1) is None


def test_client_reports_after_each_batch():
    c = HAClientCore(now_ms=0)
    c.reported(100, 0)
    assert c.on_push(100, 50, own_max=100, now_ms=1) is PushVerdict.APPEND
    assert c.report_due(own_max=150, now_ms=1) == 150


def test_client_reports_at_least_every_5s():
    c = HAClientCore(now_ms=0)
    c.reported(100, 0)
    assert c.report_due(100, T.heartbeat_interval_ms - 1) is None
    assert c.report_due(100, T.heartbeat_interval_ms) == 100


def test_push_at_wrong_offset_drops_link():
    c = HAClientCore(now_ms=0)
    c.reported(100, 0)
    assert c.on_push(120, 10, own_max=100, now_ms=1) is PushVerdict.DROP
    assert c.state is ClientState.CLOSED
    assert c.report_due(100, 2) is None


def test_heartbeat_at_wrong_offset_drops_link_too():
    c = HAClientCore(now_ms=0)
    c.reported(100, 0)
    assert c.on_push(90, 0, own_max=100, now_ms=1) is PushVerdict.DROP


def test_heartbeat_in_step_is_accepted():
    c = HAClientCore(now_ms=0)
    c.reported(100, 0)
    assert c.on_push(100, 0, own_max=100, now_ms=1) is PushVerdict.HEARTBEAT


def test_empty_slave_accepts_first_push_anywhere_and_resets():
    c = HAClientCore(now_ms=0)
    c.reported(0, 0)
    assert c.on_push(5 * SEG, 10, own_max=0, now_ms=1) is PushVerdict.RESET_AND_APPEND
    assert c.on_push(0, 10, own_max=0, now_ms=1) is PushVerdict.APPEND


def test_client_closes_after_20s_without_push():
    c = HAClientCore(now_ms=0)
    c.reported(0, 0)
    c.on_push(0, 0, own_max=0, now_ms=1000)
    assert not c.check_silence(1000 + T.housekeeping_ms)
    assert c.check_silence(1000 + T.housekeeping_ms + 1)
    assert c.state is ClientState.CLOSED


# --- HAServiceCore: SYNC_MASTER wait ---------------------------------------------------------
def test_ack_past_end_offset_acks():
    s = HAServiceCore()
    s.on_report(1, 1, 900, now_ms=0)
    t = s.begin(end_offset=1000, now_ms=0)
    assert t.state is WaitState.WAITING
    s.on_report(1, 1, 1000, now_ms=10)
    assert s.check(t, 10).state is WaitState.ACKED


def test_ack_below_end_offset_does_not_ack():
    s = HAServiceCore()
    s.on_report(1, 1, 999, now_ms=0)
    assert s.begin(1000, 0).state is WaitState.WAITING


def test_timeout_after_5s_is_flush_slave_timeout():
    s = HAServiceCore()
    s.on_report(1, 1, 0, now_ms=0)
    t = s.begin(1000, 0)
    assert s.check(t, T.slave_ack_timeout_ms - 1).state is WaitState.WAITING
    assert s.check(t, T.slave_ack_timeout_ms).state is WaitState.FLUSH_SLAVE_TIMEOUT
    s.on_report(1, 1, 2000, now_ms=T.slave_ack_timeout_ms + 1)
    assert s.check(t, T.slave_ack_timeout_ms + 1).state is WaitState.FLUSH_SLAVE_TIMEOUT  # one answer only


def test_no_slave_connected_is_slave_not_available_at_once():
    s = HAServiceCore()
    assert s.begin(1000, 0).state is WaitState.SLAVE_NOT_AVAILABLE


def test_slave_further_than_256MiB_is_not_available():
    s = HAServiceCore()
    s.on_report(1, 1, 0, now_ms=0)
    assert s.begin(256 * MiB, 0).state is WaitState.SLAVE_NOT_AVAILABLE
    assert s.begin(256 * MiB - 1, 0).state is WaitState.WAITING


def test_any_one_slave_suffices_by_default():
    s = HAServiceCore()
    s.on_report(1, 1, 10, now_ms=0)
    s.on_report(2, 2, 5000, now_ms=0)
    assert s.begin(4000, 0).state is WaitState.ACKED


def test_all_ack_in_sync_state_set_needs_every_member():
    s = HAServiceCore(master_id=0, all_ack_in_sync_state_set=True, sync_state_set=frozenset({0, 1, 2}))
    s.on_report(11, 1, 5000, now_ms=0)
    s.on_report(12, 2, 10, now_ms=0)
    t = s.begin(4000, 0)
    assert t.state is WaitState.WAITING
    s.on_report(12, 2, 4000, now_ms=1)
    assert s.check(t, 1).state is WaitState.ACKED


def test_all_ack_ignores_slaves_outside_the_set():
    s = HAServiceCore(master_id=0, all_ack_in_sync_state_set=True, sync_state_set=frozenset({0, 1}))
    s.on_report(11, 1, 5000, now_ms=0)
    assert s.begin(100, 0).state is WaitState.ACKED    # confirm offset 100
    s.on_report(13, 3, 0, now_ms=0)     # broker 3: not in the SyncStateSet, and behind the confirm offset
    assert s.begin(4000, 0).state is WaitState.ACKED


def test_all_ack_below_min_in_sync_replicas_is_not_available():
    s = HAServiceCore(master_id=0, all_ack_in_sync_state_set=True, min_in_sync_replicas=2,
                      sync_state_set=frozenset({0}))
    assert s.begin(10, 0).state is WaitState.SLAVE_NOT_AVAILABLE


def test_removed_slave_no_longer_counts():
    s = HAServiceCore()
    s.on_report(1, 1, 100, now_ms=0)
    s.remove(1)
    assert s.best_ack() == -1
    assert s.begin(50, 0).state is WaitState.SLAVE_NOT_AVAILABLE


def test_in_sync_set_uses_gap_and_silence():
    s = HAServiceCore()
    s.on_report(1, 1, 300 * MiB, now_ms=0, master_max=300 * MiB)
    s.on_report(2, 2, 10, now_ms=0, master_max=300 * MiB)
    s.on_report(3, 3, 300 * MiB, now_ms=-T.housekeeping_ms - 1, master_max=300 * MiB)
    assert s.in_sync_broker_ids(300 * MiB, now_ms=0) == {1}


def test_timings_validate():
    HATimings().validate()
    with pytest.raises(ValueError):
        HATimings(heartbeat_interval_ms=0).validate()
    with pytest.raises(ValueError):
        HATimings(heartbeat_interval_ms=30_000).validate()


def test_in_sync_requires_every_acked_message():
    s = HAServiceCore(master_id=0, all_ack_in_sync_state_set=True, sync_state_set=frozenset({0, 1}))
    s.on_report(11, 1, 1000, now_ms=0, master_max=1000)
    assert s.begin(1000, 0).state is WaitState.ACKED
    assert s.confirm_offset == 1000
    s.on_report(12, 2, 900, now_ms=0, master_max=1000)   # broker 2 is within the gap but lacks an acked message
    assert s.in_sync_broker_ids(1000, now_ms=0) == {1}
    s.on_report(12, 2, 1000, now_ms=1, master_max=1000)
    assert s.in_sync_broker_ids(1000, now_ms=1) == {1, 2}


def test_a_master_promoted_again_in_its_epoch_requires_every_broker_until_its_report_is_reflected():
    """Regression (ha_nemesis seeds 17 and 18): a master promoted again within its epoch (after
    stepping down on its lease, or after a restart) cannot know what its earlier reports said,
    and the controller may still widen the set from one; until a reply shows the set
    reflecting one of this promotion's reports, every broker of the group must ack."""
    s = HAServiceCore(master_id=0, all_ack_in_sync_state_set=True)
    s.become_master(0, session=5, new_epoch=False)
    assert s.on_controller_view(frozenset({0}), 4, 9, frozenset({0, 1}))   # promotion 4's report 9
    t = s.begin(100, 0)
    assert t.state is WaitState.WAITING
    assert s.report(1, frozenset()) is True       # pending: asks for the set to reflect this report
    s.on_controller_view(frozenset({0}), 5, 1, frozenset({0, 1}))
    assert s.check(t, 1).state is WaitState.ACKED


def test_a_master_of_a_new_epoch_acks_on_the_election_s_set():
    """At a new epoch only this promotion's reports can alter the set: the election's set,
    the master alone, is enough at once (failover is not slowed)."""
    s = HAServiceCore(master_id=1, all_ack_in_sync_state_set=True)
    s.become_master(0, session=7, new_epoch=True)
    assert s.on_controller_view(frozenset({1}), 0, 0, frozenset({0, 1}))
    assert s.begin(100, 0).state is WaitState.ACKED


def test_a_slave_reported_in_sync_stays_required_until_a_later_report_is_reflected():
    """A master that reported slave 1 in sync and then lost it still needs its acks: the
    controller may yet apply that report. Once the set reflects a later report (the master
    asks for it: pending), the master acks alone."""
    s = HAServiceCore(master_id=0, all_ack_in_sync_state_set=True)
    s.become_master(0, session=5)
    s.on_controller_view(frozenset({0}), 0, 0, frozenset({0, 1}))
    assert s.report(1, frozenset()) is False
    assert s.begin(10, 0).state is WaitState.ACKED
    s.on_report(11, 1, 10, now_ms=0, master_max=10)
    assert s.in_sync == {1}
    assert s.report(2, frozenset({1})) is False
    s.remove(11)                                   # slave 1 goes away before the report applies
    assert s.in_sync == set()
    t = s.begin(20, 1)
    assert t.state is WaitState.WAITING            # the controller may still add 1 from report 2
    assert s.report(3, frozenset()) is True
    s.on_controller_view(frozenset({0}), 5, 3, frozenset({0, 1}))
    assert s.check(t, 2).state is WaitState.ACKED and s.reported == {}


def test_reports_of_one_set_keep_one_entry():
    s = HAServiceCore(master_id=0, all_ack_in_sync_state_set=True)
    s.become_master(0, session=5)
    for seq in range(1, 1000):
        s.report(seq, frozenset({1}))
    assert s.reported == {999: frozenset({1})}


def test_an_older_controller_view_is_ignored():
    """A lagging controller's reply pairs an older set with an older report: it must not
    replace a newer view (its set could lack a member the newer one has)."""
    s = HAServiceCore(master_id=0, all_ack_in_sync_state_set=True)
    s.become_master(0, session=5)
    assert s.on_controller_view(frozenset({0, 1}), 5, 4, frozenset({0, 1}))
    assert not s.on_controller_view(frozenset({0}), 5, 2, frozenset({0, 1}))
    assert not s.on_controller_view(frozenset({0}), 3, 9, frozenset({0, 1}))   # an earlier promotion's
    assert s.sync_state_set == {0, 1} and s.reflected == (5, 4)


# --- property: random event sequences ----------------------------------------------------------
from hypothesis import given, settings, strategies as st  # noqa: E402

events = st.lists(st.tuples(st.sampled_from(["report", "act", "grow", "tick", "close"]),
                            st.integers(0, 3 * SEG), st.integers(0, 30_000)), max_size=60)


@given(events)
@settings(max_examples=300)
def test_connection_core_pushes_are_contiguous_capped_and_inside_one_segment(evs):
    c = HAConnectionCore(SEG, now_ms=0)
    master_max, now, last_next = SEG // 2, 0, -1
    for kind, n, dt in evs:
        now += dt
        if kind == "grow":
            master_max += n
        elif kind == "report":
            c.on_report(min(n, master_max), master_max, now)
        elif kind == "close":
            c.close("test")
        act = c.next_action(now, master_max)
        if isinstance(act, SendPush):
            assert act.offset == c.next_offset >= last_next
            assert 0 <= act.size <= T.max_transfer_bytes
            assert act.offset + act.size <= master_max
            assert act.size == 0 or act.offset // SEG == (act.offset + act.size - 1) // SEG
            c.pushed(act.offset, act.size, now)
            last_next = c.next_offset
        if c.state is ConnState.CLOSED:
            assert c.next_action(now + 10**6, master_max) is None   # closed stays closed, says nothing


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 100), st.integers(0, 8000)), max_size=60))
@settings(max_examples=300)
def test_client_core_accepts_only_in_step_pushes(evs):
    c = HAClientCore(now_ms=0)
    own, now = 100, 0
    for jitter, size, dt in evs:
        now += dt
        offset = own + (jitter - 2 if jitter in (0, 1) else 0)   # mostly in step, sometimes not
        verdict = c.on_push(offset, size, own, now)
        if verdict in (PushVerdict.APPEND, PushVerdict.HEARTBEAT):
            assert offset == own
            own += size
        elif verdict is PushVerdict.DROP:
            assert c.state is ClientState.CLOSED
        due = c.report_due(own, now)
        if due is not None:
            assert due == own
            c.reported(due, now)


# --- regressions: the SyncStateSet under steady load (allAckInSyncStateSet) ------------------------

def test_slave_counted_in_sync_must_ack_before_the_controller_confirms_it():
    """A master that reports a slave in sync requires that slave's ack at once: the controller
    may put it in the SyncStateSet (and elect it) before the master hears the new set back."""
    s = HAServiceCore(master_id=0, all_ack_in_sync_state_set=True, sync_state_set=frozenset({0}))
    assert s.begin(1000, 0).state is WaitState.ACKED          # lone master: SSS = {0}
    s.on_report(11, 1, 1000, now_ms=0, master_max=1000)       # the slave reaches the confirm offset
    assert s.in_sync_broker_ids(1000, now_ms=0) == {1}
    t = s.begin(2000, 0)
    assert t.state is WaitState.WAITING, "acked without the slave the master just reported in sync"
    assert s.check(t, T.slave_ack_timeout_ms).state is WaitState.FLUSH_SLAVE_TIMEOUT
    assert s.confirm_offset == 1000
    s.on_report(11, 1, 2000, now_ms=1, master_max=2000)
    assert s.begin(2000, 1).state is WaitState.ACKED
    assert s.in_sync_broker_ids(2100, now_ms=1) == {1}        # not re-sampled against later writes


def test_in_sync_slave_leaves_on_disconnect_and_rejoins_at_the_confirm_offset():
    s = HAServiceCore(master_id=0, all_ack_in_sync_state_set=True, sync_state_set=frozenset({0}))
    s.on_report(11, 1, 0, now_ms=0, master_max=0)
    assert s.in_sync_broker_ids(0, now_ms=0) == {1}
    s.remove(11)
    assert s.in_sync_broker_ids(0, now_ms=0) == frozenset()
    assert s.begin(500, 0).state is WaitState.ACKED          # not required any more: SSS is {0}
    s.on_report(12, 1, 400, now_ms=1, master_max=500)          # reconnected, behind the confirm offset
    assert s.in_sync_broker_ids(500, now_ms=1) == frozenset()
    s.on_report(12, 1, 500, now_ms=2, master_max=500)
    assert s.in_sync_broker_ids(500, now_ms=2) == {1}


def test_slave_in_controller_sss_stays_required_after_the_master_drops_it():
    s = HAServiceCore(master_id=0, all_ack_in_sync_state_set=True, sync_state_set=frozenset({0, 1}))
    s.on_report(11, 1, 100, now_ms=0)
    s.on_report(11, 1, 100, now_ms=T.housekeeping_ms + 1)      # still connected, but ...
    assert s.in_sync_broker_ids(100 + 300 * MiB, now_ms=T.housekeeping_ms + 1) == frozenset()   # ... past the gap
    assert s.begin(200, 0).state is WaitState.WAITING          # the controller has not shrunk the SSS yet


# --- haMaxTimeSlaveNotCatchup, promotion, ack release ------------------------------------------

def test_slave_behind_for_max_time_not_catchup_leaves_the_in_sync_set():
    """RocketMQ haMaxTimeSlaveNotCatchup: a slave that has not held everything the master held
    at some moment within the last 15 s leaves the in-sync set, even inside the byte gap."""
    lim = T.max_time_slave_not_catchup_ms
    s = HAServiceCore(master_id=0)
    s.on_report(11, 1, 1000, now_ms=0, master_max=1000)
    assert s.in_sync_broker_ids(1000, now_ms=0) == {1}
    # The master writes 1000 bytes/s; the slave applies at half that rate: it keeps acking, stays
    # far inside the byte gap, but what it holds is ever older: at time t it holds the master's t/2.
    end = 2 * lim + 4000
    for t in range(1000, end + 1, 1000):
        s.on_push(11, 1000 + t, t)
        s.on_report(11, 1, 1000 + t // 2, now_ms=t, master_max=1000 + t)
        expect = frozenset({1}) if t - t // 2 <= lim else frozenset()
        assert s.in_sync_broker_ids(1000 + t, now_ms=t) == expect, t
    assert s.caught_up_ms[1] == end // 2
    # It catches up with the latest sample: back in (it holds the confirm offset).
    s.on_report(11, 1, 1000 + end, now_ms=end + 500, master_max=1000 + end + 100)
    assert s.caught_up_ms[1] == end
    assert s.in_sync_broker_ids(1000 + end + 100, now_ms=end + 500) == {1}


def test_slave_that_trails_by_a_little_stays_in_sync():
    """Reaching what the master held a moment ago is caught up: steady lag does not evict."""
    s = HAServiceCore(master_id=0)
    s.on_report(11, 1, 0, now_ms=0, master_max=0)
    for t in range(10, 60_000, 10):
        s.on_push(11, t * 100, t)
        s.on_report(11, 1, (t - 200) * 100 if t > 200 else 0, now_ms=t, master_max=t * 100 + 50)
    assert s.in_sync_broker_ids(60_000 * 100, now_ms=60_000) == {1}
    assert 60_000 - s.caught_up_ms[1] < 1000


def test_catch_up_samples_are_bounded_per_connection():
    s = HAServiceCore(master_id=0)
    for t in range(0, 10_000_000, 50):
        s.on_push(11, t, t)
    assert len(s._samples[11]) <= 1024
    s.remove(11)
    assert 11 not in s._samples


def test_new_master_admits_slaves_only_at_its_log_end():
    """Regression: a broker promoted from slave had confirm offset 0, so a lagging slave (missing
    messages an earlier master acked) joined the in-sync set at once; the controller could then
    add it to the SyncStateSet and elect it, losing acked messages. The confirm offset of a new
    master is its whole log (its SyncStateSet is itself)."""
    s = HAServiceCore(master_id=2, all_ack_in_sync_state_set=True, sync_state_set=frozenset({2}))
    s.become_master(10_000)
    s.on_push(11, 10_000, 0)
    s.on_report(11, 1, 6_000, now_ms=0, master_max=10_000)
    assert s.in_sync_broker_ids(10_000, now_ms=0) == frozenset()
    s.on_report(11, 1, 10_000, now_ms=1, master_max=10_500)
    assert s.in_sync_broker_ids(10_500, now_ms=1) == {1}


def test_covered_offset_is_the_release_point_for_waiters():
    s = HAServiceCore(master_id=0)
    assert s.covered_offset() == -1
    s.on_report(11, 1, 700, now_ms=0, master_max=900)
    s.on_report(12, 2, 300, now_ms=0, master_max=900)
    assert s.covered_offset() == 700                       # any slave's ack covers
    a = HAServiceCore(master_id=0, all_ack_in_sync_state_set=True, sync_state_set=frozenset({0}))
    assert a.covered_offset() == NO_LIMIT                  # nobody else required
    a.sync_state_set = frozenset({0, 1, 2})
    a.on_report(11, 1, 700, now_ms=0, master_max=900)
    a.on_report(12, 2, 300, now_ms=0, master_max=900)
    assert a.covered_offset() == 300                       # every member must hold it
    assert a.begin(300, 0).state is WaitState.ACKED and a.begin(301, 0).state is WaitState.WAITING

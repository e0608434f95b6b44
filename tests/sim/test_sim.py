"""Deterministic simulation tests.

Goal: no committed entry is ever lost or changed, whatever the network and
disks do, and a healed cluster makes progress. Method: `run_seed` drives a
3- or 5-node group through random faults for a few hundred ticks (drops,
duplicates, reordering, every partition shape, crashes with lost or torn
tails, one bit flip at a time, compaction, leadership transfers) with the
checkers of tests/sim/checkers.py after every tick, then heals everything and
demands a new committed entry. Named scenarios script the classic hard cases.
A failure names its seed; `python -m tests.sim.run --seed N` replays it.
"""

from __future__ import annotations

from typing import Callable

import pytest

from dledger.core import RaftConfig, Role
from dledger.messages import Append, EntryType, RequestVote
from tests.sim.checkers import SimFailure
from tests.sim.cluster import SIM_CONFIG, Cluster, SimNode, run_seed

SEEDS = range(300)
STEPS = 400


@pytest.mark.parametrize("seed", SEEDS)
def test_random_faults_preserve_committed_entries(seed):
    run_seed(seed, steps=STEPS)


def run_until(cluster: Cluster, condition: Callable[[], bool], max_ticks: int, what: str) -> None:
    for _ in range(max_ticks):
        if condition():
            return
        cluster.tick()
    if not condition():
        cluster.checker.fail(f"scenario: {what} did not happen within {max_ticks} ticks")


def leader_of(cluster: Cluster, among: tuple[str, ...]) -> SimNode | None:
    leaders = [node for node in cluster.leaders() if node.node_id in among]
    return max(leaders, key=lambda node: node.core.term) if leaders else None


# --- named scenarios -----------------------------------------------------------------------------


def test_leader_isolated_by_one_way_partition_steps_down():
    cluster = Cluster(seed=11, node_count=3)
    old = cluster.wait_for_leader()
    old_term = old.core.term
    cluster.commit_fresh_entry()
    others = tuple(node for node in cluster.ids if node != old.node_id)
    cluster.net.one_way(old.node_id)  # old leader still reaches the others, hears nobody
    run_until(cluster, lambda: old.core.role is not Role.LEADER, 2 * SIM_CONFIG.election_timeout_ticks_min + 1,
              "the deaf leader stepping down (check quorum)")
    run_until(cluster, lambda: leader_of(cluster, others) is not None, 10 * SIM_CONFIG.election_timeout_ticks_max,
              "a new leader among the others")
    new = leader_of(cluster, others)
    assert new.core.term > old_term
    cluster.commit_fresh_entry()
    # The deaf node keeps pre-voting but never drives the term up (pre-vote + stickiness).
    settled_term = new.core.term
    cluster.run(10 * SIM_CONFIG.election_timeout_ticks_max)
    assert new.core.role is Role.LEADER
    assert max(node.core.term for node in cluster.live_nodes()) == settled_term


def test_bridge_partition_keeps_a_single_leader():
    cluster = Cluster(seed=12, node_count=3)
    leader = cluster.wait_for_leader()
    term = leader.core.term
    middle, far = [node for node in cluster.ids if node != leader.node_id]
    cluster.net.bridge(leader.node_id, middle, far)  # leader-middle-far, leader and far cut
    committed_before = cluster.checker.max_committed
    for tick in range(30 * SIM_CONFIG.election_timeout_ticks_max):
        if tick % 3 == 0:
            cluster.propose(1)
        cluster.tick()
        assert len(cluster.leaders()) == 1
    assert leader.core.role is Role.LEADER
    assert max(node.core.term for node in cluster.live_nodes()) == term
    assert cluster.checker.max_committed > committed_before + 50
    cluster.net.heal()
    cluster.commit_fresh_entry()
    cluster.final_checks()


def test_figure_8_old_term_entry_not_committed_by_count():
    config = RaftConfig(**{**SIM_CONFIG.__dict__, "max_batch_entries": 1, "check_quorum": True})
    cluster = Cluster(seed=8, node_count=5, config=config)
    first = cluster.wait_for_leader()
    cluster.commit_fresh_entry()
    # (a) the leader copies entry X (index i) to one follower only, then dies.
    follower = next(node for node in cluster.ids if node != first.node_id)
    rest = tuple(node for node in cluster.ids if node not in (first.node_id, follower))
    cluster.net.split([[first.node_id, follower], list(rest)])
    index, _ = cluster.propose(1)
    run_until(cluster, lambda: cluster.nodes[follower].disk.synced_index() >= index, 20, "X reaching the follower")
    x_term = first.core.term
    cluster.crash(first.node_id)
    # (b) one of the rest leads a newer term and appends its no-op at i, then dies
    #     before anyone else gets it.
    cluster.net.drop_if = lambda src, dst, msg: isinstance(msg, Append)
    run_until(cluster, lambda: leader_of(cluster, rest) is not None, 400, "a leader among the rest")
    usurper = leader_of(cluster, rest)
    assert usurper.core.term_at(index) == usurper.core.term > x_term
    cluster.crash(usurper.node_id)
    # (c) the first leader returns and wins again with X; its own no-op never
    #     reaches anyone, but X does: X is on a majority and yet not committed.
    cluster.net.heal()
    cluster.start(first.node_id)
    cluster.net.drop_if = lambda src, dst, msg: (
        isinstance(msg, Append) and any(entry.type is EntryType.NOOP and entry.index > index for entry in msg.entries)
    )
    holders = (first.node_id, follower)
    run_until(cluster, lambda: leader_of(cluster, holders) is not None, 600, "a leader holding X")
    leader = leader_of(cluster, holders)

    def x_on_majority() -> bool:
        return sum(node.disk.synced_term(index) == x_term for node in cluster.nodes.values()) >= 3

    run_until(cluster, x_on_majority, 200, "X replicated to a majority")
    cluster.run(3 * SIM_CONFIG.election_timeout_ticks_max)
    assert leader.core.role is Role.LEADER
    assert leader.core.commit_index < index  # counted replicas of an old term do not commit
    assert not cluster.is_acked(index)
    # (d) that leader dies; the usurper returns with a later term at i and wins,
    #     replacing X everywhere: safe, because X was never committed.
    cluster.crash(leader.node_id)
    # Only the usurper's campaign gets through (the others could win too, also safely).
    cluster.net.drop_if = lambda src, dst, msg: isinstance(msg, RequestVote) and src != usurper.node_id
    cluster.start(usurper.node_id)
    run_until(cluster, lambda: usurper.core.role is Role.LEADER, 600, "the usurper winning")
    cluster.net.drop_if = None
    cluster.commit_fresh_entry()
    overwritten = [node for node in cluster.live_nodes() if node.disk.synced_term(index) == usurper.core.term_at(index)]
    assert len(overwritten) >= 3
    cluster.final_checks()


def test_bit_flip_on_one_replica_does_not_lose_committed_entries():
    cluster = Cluster(seed=21, node_count=3)
    leader = cluster.wait_for_leader()
    for _ in range(30):
        cluster.propose(2)
        cluster.tick()
    cluster.commit_fresh_entry()
    follower, third = [cluster.nodes[node] for node in cluster.ids if node != leader.node_id]
    last_before = follower.disk.last_index()
    cluster.crash(follower.node_id, flip=True)
    cluster.start(follower.node_id)
    assert follower.disk.last_index() < last_before  # recovery cut the log at the bad record
    assert follower.core.needs_catchup_to == last_before
    # The leader dies. The corrupted replica must not help the third node win
    # (nor win itself): only the third node now holds everything committed...
    cluster.net.isolate(third.node_id)  # ...and, cut off, cannot campaign either
    cluster.crash(leader.node_id)
    cluster.run(10 * SIM_CONFIG.election_timeout_ticks_max)
    assert cluster.leaders() == []
    assert follower.core.term == leader.disk.initial_state().term or follower.core.role is Role.FOLLOWER
    # Heal: a leader is elected, the corrupted replica catches up and may vote again.
    cluster.net.heal()
    cluster.start(leader.node_id)
    cluster.wait_for_leader()
    cluster.commit_fresh_entry()
    run_until(cluster, lambda: follower.core.needs_catchup_to is None, 400, "the corrupted replica catching up")
    assert follower.disk.initial_state().needs_catchup_to is None
    cluster.final_checks()


def test_seed_108657_a_duplicate_truncate_after_a_restart_loses_no_committed_entry():
    """Regression: pushes that raced a probe made a follower answer "matched" with extra
    entries that were the leader's own; the leader sent TRUNCATE for them, committed on the
    follower's ack (it had kept them), and a duplicate of the TRUNCATE deleted the committed
    entry after the follower restarted (tests/unit/test_raft_core.py has the minimal case)."""
    run_seed(108657, steps=1000, nodes=3)


def test_failure_message_names_the_seed_and_the_replay_command():
    cluster = Cluster(seed=4242, node_count=3, steps_hint=77)
    with pytest.raises(SimFailure) as failure:
        cluster.checker.fail("demonstration")
    message = str(failure.value)
    assert "seed 4242" in message
    assert "python -m tests.sim.run --seed 4242 --steps 77" in message

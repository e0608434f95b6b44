"""Unit tests for the Raft core, one per rule, in setup / step / check form.

Goal: pin every rule of docs/raft.md to a test named after it (the style of
etcd's raft_paper_test.go). Method: cores on MemoryStorage behind a manual
message queue (`Group`); each test decides exactly which messages are
delivered, dropped or inspected, and which ticks happen on which node.
"""

from __future__ import annotations

import random
from typing import Callable, Iterable

import pytest

from dledger.core import (
    ConfigError,
    InvalidTransition,
    NotLeader,
    PeerEvent,
    PeerState,
    ProposalDropped,
    RaftConfig,
    RaftCore,
    Ready,
    Role,
    next_peer_state,
)
from dledger.messages import (
    Append,
    AppendResponse,
    Compare,
    Entry,
    EntryType,
    HardState,
    Heartbeat,
    HeartbeatResponse,
    InstallBase,
    InvalidMessage,
    RequestVote,
    TimeoutNow,
    Truncate,
    TruncateResponse,
    VoteResponse,
)
from dledger.raft_storage import MemoryStorage, NotCached

# --- harness ---------------------------------------------------------------------------------
IDS = ("a", "b", "c")
# Fixed election timeout (min == max) so tests know exactly when a node campaigns.
CONFIG = RaftConfig(
    election_timeout_ticks_min=10,
    election_timeout_ticks_max=10,
    heartbeat_ticks=2,
    push_timeout_ticks=8,
    max_inflight_pushes=4,
    max_batch_entries=2,
    max_batch_bytes=4096,
    max_parked_pushes=4,
)

Queued = tuple[str, str, object]  # (source, destination, message)
DropRule = Callable[[str, str, object], bool]


def entry(index: int, term: int, body: bytes | None = None, type: EntryType = EntryType.NORMAL) -> Entry:
    return Entry(index, term, type, body if body is not None else f"e{index}t{term}".encode())


def log_of(*terms: int) -> list[Entry]:
    """Entries 1..n whose terms are given: log_of(1, 1, 2) -> [(1,1), (2,1), (3,2)]."""
    return [entry(index, term) for index, term in enumerate(terms, start=1)]


class Group:
    def __init__(
        self,
        ids: Iterable[str] = IDS,
        config: RaftConfig = CONFIG,
        storages: dict[str, MemoryStorage] | None = None,
        seed: int = 0,
    ) -> None:
        self.ids = tuple(ids)
        self.config = config
        self.storages = storages or {}
        for node_id in self.ids:
            self.storages.setdefault(node_id, MemoryStorage())
        self.cores = {
            node_id: RaftCore(node_id, self.ids, self.storages[node_id], random.Random(seed + number), config)
            for number, node_id in enumerate(self.ids)
        }
        self.queue: list[Queued] = []
        self.readies: dict[str, list[Ready]] = {node_id: [] for node_id in self.ids}
        # node -> persisted_index to report (None: all written entries are durable)
        self.durable_limit: dict[str, int | None] = {node_id: None for node_id in self.ids}

    def __getitem__(self, node_id: str) -> RaftCore:
        return self.cores[node_id]

    # --- the shell -----------------------------------------------------------------------

    def drain(self, node_id: str, rounds: int = 20) -> None:
        core, storage = self.cores[node_id], self.storages[node_id]
        for _ in range(rounds):
            if not core.has_ready():
                return
            ready = core.ready()
            self.readies[node_id].append(ready)
            if ready.reset_base is not None:
                storage.reset_to(*ready.reset_base)
            if ready.truncate_from is not None:
                storage.truncate_from(ready.truncate_from)
            storage.append(ready.entries)
            if ready.hard_state is not None:
                storage.set_hard_state(ready.hard_state)
            self.queue.extend((node_id, destination, message) for destination, message in ready.messages)
            limit = self.durable_limit[node_id]
            core.advance(ready, None if limit is None else min(limit, storage.last_index()))
        raise AssertionError(f"{node_id} never settled")

    def tick(self, node_id: str, ticks: int = 1) -> None:
        for _ in range(ticks):
            self.cores[node_id].tick()
            self.drain(node_id)

    def tick_all(self, ticks: int = 1, drop: DropRule | None = None) -> None:
        for _ in range(ticks):
            for node_id in self.ids:
                self.tick(node_id)
            self.deliver(drop)

    def deliver(self, drop: DropRule | None = None, rounds: int | None = None) -> int:
        """Deliver queued messages (and their consequences) until quiet, or
        for exactly `rounds` rounds."""
        delivered = 0
        for _ in range(rounds or 100):
            if not self.queue:
                return delivered
            batch, self.queue = self.queue, []
            for source, destination, message in batch:
                if drop is not None and drop(source, destination, message):
                    continue
                self.cores[destination].step(source, message)
                self.drain(destination)
                delivered += 1
        if rounds is None:
            raise AssertionError("messages never stopped flowing")
        return delivered

    def take(self, kind: type | None = None, source: str | None = None, destination: str | None = None) -> list[Queued]:
        """Remove and return queued messages that match."""
        taken = [
            item
            for item in self.queue
            if (kind is None or isinstance(item[2], kind))
            and (source is None or item[0] == source)
            and (destination is None or item[1] == destination)
        ]
        self.queue = [item for item in self.queue if item not in taken]
        return taken

    def step(self, source: str, destination: str, message: object) -> None:
        self.cores[destination].step(source, message)
        self.drain(destination)

    # --- scenarios -----------------------------------------------------------------------

    def elect(self, node_id: str, drop: DropRule | None = None) -> RaftCore:
        """Let `node_id` time out first and win; deliver everything that follows."""
        core = self.cores[node_id]
        for _ in range(self.config.election_timeout_ticks_max + 1):
            if core.role is not Role.FOLLOWER:
                break
            self.tick(node_id)
        self.deliver(drop)
        assert core.role is Role.LEADER, core.role
        return core

    def propose(self, node_id: str, *bodies: bytes) -> tuple[int, int]:
        span = self.cores[node_id].propose(list(bodies))
        self.drain(node_id)
        return span

    def log_terms(self, node_id: str) -> list[int]:
        storage = self.storages[node_id]
        return [storage.term(index) for index in range(storage.first_index(), storage.last_index() + 1)]


def storage_with(terms: Iterable[int], term: int, voted_for: str | None = None) -> MemoryStorage:
    return MemoryStorage(hard_state=HardState(term, voted_for), entries=log_of(*terms))


def queued(group: Group, kind: type, source: str | None = None, destination: str | None = None) -> list:
    return [
        message
        for sender, receiver, message in group.queue
        if isinstance(message, kind)
        and (source is None or sender == source)
        and (destination is None or receiver == destination)
    ]


def drop_node(node_id: str) -> DropRule:
    return lambda source, destination, message: node_id in (source, destination)


def record_into(seen: list[Queued]) -> DropRule:
    """A drop rule that drops nothing and remembers every delivery."""

    def rule(source: str, destination: str, message: object) -> bool:
        seen.append((source, destination, message))
        return False

    return rule


def leader_group(ids: Iterable[str] = IDS, config: RaftConfig = CONFIG, **kwargs) -> Group:
    group = Group(ids, config, **kwargs)
    group.elect(group.ids[0])
    group.tick_all(1)
    return group


# --- elections -------------------------------------------------------------------------------


def test_follower_starts_pre_vote_after_election_timeout_without_bumping_term():
    group = Group()
    group.tick("a", CONFIG.election_timeout_ticks_min)
    core = group["a"]
    assert core.role is Role.PRE_CANDIDATE
    assert core.term == 0
    requests = queued(group, RequestVote, source="a")
    assert sorted(group.queue[i][1] for i in range(len(group.queue))) == ["b", "c"]
    assert all(request.pre_vote and request.term == 1 for request in requests)
    assert group.storages["a"].initial_state().term == 0


def test_pre_vote_majority_starts_a_real_election_with_a_bumped_term():
    group = Group()
    group.tick("a", CONFIG.election_timeout_ticks_min)
    (_, _, request), = group.take(RequestVote, destination="b")
    group.step("a", "b", request)
    (_, _, response), = group.take(VoteResponse, source="b")
    assert response.granted and response.pre_vote
    assert group["b"].term == 0  # granting a pre-vote changes nobody's term
    group.step("b", "a", response)
    core = group["a"]
    assert core.role is Role.CANDIDATE
    assert core.term == 1
    assert group.storages["a"].initial_state() == HardState(1, "a")
    assert all(not request.pre_vote for request in queued(group, RequestVote, source="a", destination="b"))


def test_candidate_with_vote_majority_becomes_leader_and_appends_a_noop():
    group = Group()
    leader = group.elect("a")
    assert leader.term == 1
    assert group.storages["a"].entries(1, 2, 1 << 20) == [Entry(1, 1, EntryType.NOOP, b"")]
    group.tick_all(CONFIG.heartbeat_ticks)
    assert [group[node].commit_index for node in IDS] == [1, 1, 1]
    assert [group[node].leader_id for node in IDS] == ["a", "a", "a"]


def test_election_timeout_is_randomized_from_the_injected_rng():
    config = RaftConfig(election_timeout_ticks_min=10, election_timeout_ticks_max=20, heartbeat_ticks=2)

    def ticks_until_campaign(seed: int) -> int:
        core = RaftCore("a", IDS, MemoryStorage(), random.Random(seed), config)
        for ticks in range(1, 100):
            core.tick()
            if core.role is not Role.FOLLOWER:
                return ticks
        raise AssertionError("never campaigned")

    timeouts = [ticks_until_campaign(seed) for seed in range(20)]
    assert all(10 <= timeout <= 20 for timeout in timeouts)
    assert len(set(timeouts)) > 3
    assert timeouts == [ticks_until_campaign(seed) for seed in range(20)]  # deterministic


def test_node_grants_at_most_one_vote_per_term():
    group = Group()
    voter = group["c"]
    voter.step("a", RequestVote(1, "a", 0, 0, pre_vote=False))
    voter.step("b", RequestVote(1, "b", 0, 0, pre_vote=False))
    group.drain("c")
    responses = queued(group, VoteResponse, source="c")
    assert [response.granted for response in responses] == [True, False]
    assert group.storages["c"].initial_state() == HardState(1, "a")


def test_vote_and_pre_vote_refused_to_a_candidate_with_a_less_up_to_date_log():
    group = Group(storages={"a": storage_with([1, 1], term=1), "b": storage_with([1], term=1)})
    group["a"].step("b", RequestVote(2, "b", 1, 1, pre_vote=True))
    group["a"].step("b", RequestVote(2, "b", 1, 1, pre_vote=False))
    group.drain("a")
    assert [response.granted for response in queued(group, VoteResponse, source="a")] == [False, False]


def test_pre_vote_refused_while_a_leader_was_heard_within_the_min_election_timeout():
    group = leader_group()
    follower = group["b"]
    follower.step("c", RequestVote(2, "c", follower.last_index, 1, pre_vote=True))
    group.drain("b")
    assert not [response for response in queued(group, VoteResponse, source="b") if response.granted]
    assert follower.term == 1
    # A node that has heard no leader grants the same pre-vote.
    fresh = Group()
    fresh["b"].step("c", RequestVote(1, "c", 0, 0, pre_vote=True))
    fresh.drain("b")
    assert [response.granted for response in queued(fresh, VoteResponse, source="b")] == [True]


def test_vote_request_ignored_during_leader_lease_for_leader_stickiness():
    group = leader_group()
    group.queue.clear()
    group.step("c", "b", RequestVote(5, "c", 100, 100, pre_vote=False))
    assert group["b"].term == 1
    assert group["b"].leader_id == "a"
    assert group.queue == []


def test_leader_steps_down_when_it_has_not_heard_from_a_majority_for_an_election_timeout():
    group = leader_group()
    group.queue.clear()
    for _ in range(2 * CONFIG.election_timeout_ticks_min):
        group.tick("a")
        group.queue.clear()  # followers hear nothing, answer nothing
    assert group["a"].role is Role.FOLLOWER
    assert group["a"].term == 1


def test_leader_without_check_quorum_keeps_leading_alone():
    config = RaftConfig(**{**CONFIG.__dict__, "check_quorum": False})
    group = leader_group(config=config)
    for _ in range(3 * CONFIG.election_timeout_ticks_max):
        group.tick("a")
        group.queue.clear()
    assert group["a"].role is Role.LEADER


def test_isolated_node_pre_votes_without_raising_its_term_and_does_not_disrupt_on_return():
    group = leader_group()
    isolated = drop_node("c")
    for _ in range(5 * CONFIG.election_timeout_ticks_max):
        group.tick_all(1, drop=isolated)
    assert group["c"].term == 1
    assert group["c"].role is Role.PRE_CANDIDATE
    group.tick_all(3 * CONFIG.heartbeat_ticks)  # heal
    assert group["a"].role is Role.LEADER
    assert group["a"].term == 1
    assert group["c"].leader_id == "a"


def test_higher_term_message_makes_a_leader_step_down():
    group = leader_group()
    group.step("b", "a", HeartbeatResponse(term=3, durable_index=0))
    assert group["a"].role is Role.FOLLOWER
    assert group["a"].term == 3
    assert group.storages["a"].initial_state() == HardState(3, None)


def test_stale_leader_is_told_the_newer_term_and_steps_down():
    group = leader_group()
    # b moves to term 5 (a transfer campaign may break the lease).
    group.step("c", "b", RequestVote(5, "c", 100, 100, pre_vote=False, transfer=True))
    assert group["b"].term == 5
    group.queue.clear()
    group.tick("a", CONFIG.heartbeat_ticks)  # a heartbeats in term 1
    group.deliver(drop=drop_node("c"))
    assert group["a"].role is Role.FOLLOWER
    assert group["a"].term == 5


def test_single_node_group_elects_itself_and_commits_once_persisted():
    group = Group(ids=("solo",))
    group.tick("solo", CONFIG.election_timeout_ticks_max)
    core = group["solo"]
    assert core.role is Role.LEADER
    first, last = group.propose("solo", b"x", b"y")
    assert (first, last) == (2, 3)
    assert core.commit_index == 3


# --- DLedger-shaped replication ----------------------------------------------------------------


def test_append_pipelines_pushes_without_waiting_for_acks_bounded_by_max_inflight():
    group = leader_group()
    group.queue.clear()
    for number in range(10):
        group["a"].propose([f"m{number}".encode()])
    group.drain("a")
    pushes = queued(group, Append, destination="b")
    assert len(pushes) == CONFIG.max_inflight_pushes
    assert all(len(push.entries) <= CONFIG.max_batch_entries for push in pushes)
    assert [push.first_index for push in pushes] == [2, 4, 6, 8]
    group.deliver()
    group.tick_all(CONFIG.heartbeat_ticks)
    assert group.log_terms("b") == group.log_terms("a")
    assert group["b"].commit_index == group["a"].commit_index == 11


def test_compare_mismatch_hint_lets_the_leader_skip_a_whole_conflicting_term():
    storages = {
        "a": storage_with([1, 1, 4, 4, 4, 4], term=4),
        "b": storage_with([1, 1, 2, 2, 2, 2, 2, 2, 2], term=4),
        "c": storage_with([1, 1, 4, 4, 4, 4], term=4),
    }
    group = Group(storages=storages)
    probes: list[int] = []

    def record(source: str, destination: str, message: object) -> bool:
        if isinstance(message, Compare) and destination == "b":
            probes.append(message.index)
        return False

    group.elect("a", drop=record)
    assert probes == [6, 2]  # one miss, then straight past the term-2 run
    assert group.log_terms("b") == [1, 1, 4, 4, 4, 4, 5]


def test_follower_truncates_extra_entries_durably_before_acknowledging():
    storages = {
        "a": storage_with([1, 1], term=2),
        "b": storage_with([1, 1, 2, 2], term=2),
        "c": storage_with([1, 1], term=2),
    }
    group = Group(storages=storages)
    group.tick("a", CONFIG.election_timeout_ticks_max)
    group.deliver(drop=drop_node("b"))  # a wins with c's vote
    assert group["a"].role is Role.LEADER
    group.tick_all(CONFIG.heartbeat_ticks)  # the lost probe to b is repeated
    truncating = [ready for ready in group.readies["b"] if ready.truncate_from is not None]
    assert [ready.truncate_from for ready in truncating] == [3]
    assert not [message for _, message in truncating[0].messages if isinstance(message, TruncateResponse)]
    position = group.readies["b"].index(truncating[0])
    later = [message for ready in group.readies["b"][position + 1 :] for _, message in ready.messages]
    assert any(isinstance(message, TruncateResponse) for message in later)
    assert group.log_terms("b") == [1, 1, 3]


def test_delayed_duplicate_truncate_does_not_delete_entries_acknowledged_since():
    storages = {
        "a": storage_with([1, 1], term=2),
        "b": storage_with([1, 1, 2, 2], term=2),
        "c": storage_with([1, 1], term=2),
    }
    group = Group(storages=storages)
    seen: list[Queued] = []
    group.elect("a", drop=record_into(seen))
    (stale,) = [item for item in seen if isinstance(item[2], Truncate)]
    group.propose("a", b"x", b"y")
    group.deliver()
    before = group.log_terms("b")
    assert before == [1, 1, 3, 3, 3]
    group.queue.clear()
    group.step(*stale)
    assert group.log_terms("b") == before
    assert [response.success for response in queued(group, TruncateResponse, source="b")] == [False]


def test_a_follower_whose_extra_entries_are_the_leaders_own_is_not_sent_a_truncate():
    """Regression (simulator seed 108657 at 1,000 steps): pushes delayed in the network reached
    a follower between the leader's second probe and its answer, so the follower answered
    "matched" with a log longer than the probe, the extra entries being the leader's own. The
    leader sent TRUNCATE for them; the follower, having verified them, kept them and acked them
    durable, and the leader committed on that ack. A duplicate of the TRUNCATE then reached the
    follower after a restart, its log still ending where the TRUNCATE expected, and deleted the
    committed entry. A follower log that ends on an entry of the leader's is the leader's
    prefix (log matching): no TRUNCATE, and the match is the follower's last entry."""
    group = leader_group()
    group.queue.clear()
    group.propose("a", b"x", b"y", b"z")
    delayed = group.take(Append, destination="b")          # b's pushes are late in the network
    group.deliver()                                         # committed with c
    probes: list[Queued] = []
    for _ in range(CONFIG.push_timeout_ticks + 1):          # b's pushes time out: COMPARE
        group.tick("a")
        probes = group.take(Compare, destination="b")
        if probes:
            break
        group.deliver()
    group.step(*probes[0])                                  # b: no match at a's last index
    for item in group.take(source="b"):
        group.step(*item)
    (second,) = group.take(Compare, destination="b")        # a probes b's last entry
    for item in delayed:                                    # the late pushes land first
        group.step(*item)
    group.take(source="b")                                  # and their acks are lost
    assert group.log_terms("b") == group.log_terms("a")
    group.step(*second)
    for item in group.take(source="b"):
        group.step(*item)
    assert second[2].index < group["a"].last_index         # the probe was below b's last entry
    assert not queued(group, Truncate, destination="b")
    assert group["a"].peer_state("b") is PeerState.APPEND
    assert group["a"].match_index("b") == group["a"].last_index
    group.tick_all(2 * CONFIG.heartbeat_ticks)
    assert group.log_terms("b") == group.log_terms("a")


def test_delayed_duplicate_install_base_does_not_reset_a_follower_that_moved_on():
    leader_storage = storage_with([1, 1, 1, 1, 1], term=1)
    leader_storage.compact(3)
    storages = {"a": leader_storage, "b": storage_with([1, 1, 1, 1, 1], term=1), "c": MemoryStorage()}
    group = Group(storages=storages)
    seen: list[Queued] = []
    group.elect("a", drop=record_into(seen))
    (stale,) = [item for item in seen if isinstance(item[2], InstallBase)]
    group.propose("a", b"x")
    group.deliver()
    before = group.log_terms("c")
    group.step(*stale)
    assert group.log_terms("c") == before
    assert not [ready for ready in group.readies["c"][-2:] if ready.reset_base is not None]


def test_follower_parks_an_out_of_order_push_and_applies_it_when_the_gap_fills():
    group = leader_group()
    group.queue.clear()
    group.propose("a", b"w", b"x", b"y", b"z")
    first, second = [message for _, _, message in group.take(Append, destination="b")]
    group.step("a", "b", second)
    assert group["b"].last_index == 1  # parked, not applied
    assert not queued(group, AppendResponse, source="b")
    group.step("a", "b", first)
    assert group["b"].last_index == 5
    acks = queued(group, AppendResponse, source="b")
    assert acks[-1].success and acks[-1].durable_index == 5


def test_parked_pushes_are_bounded_and_overflow_sends_the_leader_back_to_compare():
    config = RaftConfig(**{**CONFIG.__dict__, "max_parked_pushes": 1})
    group = leader_group(config=config)
    group.queue.clear()
    group.propose("a", b"1", b"2", b"3", b"4", b"5", b"6")
    pushes = [message for _, _, message in group.take(Append, destination="b")]
    group.step("a", "b", pushes[1])  # parked
    group.step("a", "b", pushes[2])  # no room: refused at once
    (refusal,) = queued(group, AppendResponse, source="b")
    assert not refusal.success
    assert group["b"].last_index == 1  # the refusal also dropped what was parked
    group.step("b", "a", refusal)
    assert group["a"].peer_state("b") is PeerState.COMPARE
    group.deliver()  # COMPARE finds the match at 1, APPEND resends 2..7
    assert group.log_terms("b") == group.log_terms("a")


def test_duplicate_push_is_acknowledged_idempotently():
    group = leader_group()
    group.queue.clear()
    group.propose("a", b"x")
    (push,) = [message for _, _, message in group.take(Append, destination="b")]
    group.step("a", "b", push)
    group.queue.clear()
    group.step("a", "b", push)
    assert group["b"].last_index == 2
    (ack,) = queued(group, AppendResponse, source="b")
    assert ack.success and ack.last_index == 2 and ack.durable_index == 2


def test_rejected_push_sends_the_follower_back_to_compare():
    group = leader_group()
    group.queue.clear()
    assert group["a"].peer_state("b") is PeerState.APPEND
    group.step("b", "a", AppendResponse(1, success=False, last_index=0, durable_index=0))
    assert group["a"].peer_state("b") is PeerState.COMPARE
    assert queued(group, Compare, destination="b")


def test_push_timeout_sends_the_follower_back_to_compare():
    group = leader_group()
    group.queue.clear()
    group.propose("a", b"x")
    group.take(Append, destination="b")  # lost
    for _ in range(CONFIG.push_timeout_ticks):
        group.tick("a")
        group.deliver(drop=lambda source, destination, message: "b" in (source, destination)
                      and not isinstance(message, (Heartbeat, HeartbeatResponse)))
    assert group["a"].peer_state("b") is PeerState.COMPARE
    group.tick_all(2 * CONFIG.heartbeat_ticks)  # heal: the probe is repeated, then pushes
    assert group.log_terms("b") == group.log_terms("a")


def test_commit_index_rides_on_pushes_and_heartbeats():
    group = leader_group()
    group.queue.clear()
    group.propose("a", b"x")
    assert all(push.commit_index == 1 for push in queued(group, Append, source="a"))
    group.deliver()
    assert group["a"].commit_index == 2
    assert group["b"].commit_index == 1  # nothing told b yet
    group.tick("a", CONFIG.heartbeat_ticks)
    assert [heartbeat.commit_index for heartbeat in queued(group, Heartbeat, destination="b")] == [2]
    group.deliver()
    assert group["b"].commit_index == 2


def test_follower_commit_is_capped_by_the_entries_it_matched_with_this_leader():
    group = Group(storages={"b": storage_with([1, 1, 1], term=1)})
    follower = group["b"]
    follower.step("a", Heartbeat(term=2, leader_id="a", commit_index=3))
    assert follower.commit_index == 0  # its entries are not verified against a yet
    follower.step("a", Compare(term=2, leader_id="a", index=3, log_term=1, commit_index=3))
    assert follower.commit_index == 3


def test_figure_8_leader_does_not_commit_an_old_term_entry_by_counting_replicas():
    ids = ("a", "b", "c", "d", "e")
    config = RaftConfig(**{**CONFIG.__dict__, "max_batch_entries": 1})
    storages = {
        "a": storage_with([1, 2], term=3),
        "b": storage_with([1, 2], term=3),
        "c": storage_with([1], term=3),
        "d": storage_with([1], term=3),
        "e": storage_with([1, 3], term=3),
    }
    group = Group(ids, config, storages=storages)

    def lose_noops_and_e(source: str, destination: str, message: object) -> bool:
        carries_noop = isinstance(message, Append) and message.entries[-1].type is EntryType.NOOP
        return carries_noop or "e" in (source, destination)

    # (c) a leads term 4 and copies (2, term 2) to a majority, but not its no-op.
    leader = group.elect("a", drop=lose_noops_and_e)
    assert leader.term == 4
    assert [group.storages[node].term(2) for node in "abc"] == [2, 2, 2]
    assert leader.commit_index == 0  # a majority holds index 2, but of term 2
    # (d) a dies; e (last term 3) wins term 5 and overwrites index 2 everywhere.
    group.queue.clear()
    survivors = ("b", "c", "d", "e")
    for _ in range(4 * config.election_timeout_ticks_max):
        for node in survivors:
            group.tick(node)
        group.deliver(drop=lambda source, destination, message: "a" in (source, destination)
                      or (group[source].role is not Role.LEADER and source != "e"
                          and isinstance(message, RequestVote)))
        if group["e"].role is Role.LEADER:
            break
    assert group["e"].role is Role.LEADER
    group.tick_all(2 * config.heartbeat_ticks, drop=drop_node("a"))
    assert [group.storages[node].term(2) for node in "bcde"] == [3, 3, 3, 3]
    assert all(ready.committed < 2 for ready in group.readies["a"])


def test_noop_of_the_new_term_commits_entries_of_older_terms():
    ids = ("a", "b", "c", "d", "e")
    storages = {
        "a": storage_with([1, 2], term=3),
        "b": storage_with([1, 2], term=3),
        "c": storage_with([1], term=3),
        "d": storage_with([1], term=3),
        "e": storage_with([1, 3], term=3),
    }
    jittered = RaftConfig(**{**CONFIG.__dict__, "election_timeout_ticks_max": 20})  # no split votes forever
    group = Group(ids, jittered, storages=storages)
    leader = group.elect("a", drop=drop_node("e"))
    assert leader.commit_index == 3  # the term-4 no-op at 3 commits 1 and 2 with it
    # a dies. e (last term 3) cannot win against a majority whose last term is 4,
    # so the committed (2, term 2) survives.
    for _ in range(6 * CONFIG.election_timeout_ticks_max):
        group.tick_all(1, drop=drop_node("a"))
        assert group["e"].role is not Role.LEADER
    assert [group.storages[node].term(2) for node in "bcd"] == [2, 2, 2]
    assert any(group[node].role is Role.LEADER for node in "bcd")


# --- durability (SYNC_FLUSH via persisted_index) ----------------------------------------------


def test_leader_counts_itself_only_for_entries_it_reported_persisted():
    group = leader_group()
    group.durable_limit["a"] = 1  # the leader's fsync lags behind its writes
    lose_c = drop_node("c")
    group.propose("a", b"x")
    group.deliver(drop=lose_c)
    assert group["b"].durable_index == 2
    assert group["a"].commit_index == 1  # b has it, but a majority needs a's own copy
    ready = group["a"].ready()
    group["a"].advance(ready, persisted_index=2)
    assert group["a"].commit_index == 2


def test_follower_acknowledges_only_entries_it_reported_persisted():
    group = leader_group()
    group.durable_limit["b"] = 1  # b writes but its fsync lags
    group.propose("a", b"x", b"y")
    group.deliver()
    acks = [message for ready in group.readies["b"] for _, message in ready.messages
            if isinstance(message, AppendResponse)]
    assert acks and all(ack.durable_index <= 1 for ack in acks)
    assert max(ack.last_index for ack in acks) == 3  # received: frees the leader's pipeline slots
    assert group["a"].match_index("b") == 1
    follower = group["b"]
    ready = follower.ready()
    follower.advance(ready, persisted_index=3)  # the fsync completes
    next_ready = follower.ready()
    follower.advance(next_ready)
    assert [message.durable_index for _, message in next_ready.messages
            if isinstance(message, AppendResponse)] == [3]


# --- leadership transfer and preferred leader ----------------------------------------------------


def test_leadership_transfer_stops_proposals_and_sends_timeout_now_once_the_target_is_caught_up():
    group = leader_group()
    lose_b = drop_node("b")
    group.propose("a", b"x")
    group.deliver(drop=lose_b)
    leader = group["a"]
    leader.transfer_leadership("b")
    with pytest.raises(NotLeader) as refused:
        leader.propose([b"y"])
    assert refused.value.retriable and refused.value.leader == "b"
    assert not queued(group, TimeoutNow)  # b is behind
    seen: list[Queued] = []
    # The pushes to b were lost: they time out, b is compared and caught up.
    group.tick_all(CONFIG.push_timeout_ticks + 3 * CONFIG.heartbeat_ticks,
                   drop=record_into(seen))
    sent = [message for _, _, message in seen]
    assert any(isinstance(message, TimeoutNow) for message in sent)
    transfer_votes = [message for message in sent if isinstance(message, RequestVote)]
    assert transfer_votes and all(vote.transfer and not vote.pre_vote for vote in transfer_votes)
    assert group["b"].role is Role.LEADER
    assert group["b"].term == 2
    assert group["a"].role is Role.FOLLOWER


def test_leadership_transfer_is_abandoned_after_an_election_timeout():
    group = leader_group()
    leader = group["a"]
    leader.transfer_leadership("c")
    group.tick_all(CONFIG.election_timeout_ticks_max + 1, drop=drop_node("c"))
    assert leader.role is Role.LEADER
    assert leader.transfer_target is None
    assert leader.propose([b"after"])[0] == leader.last_index


def test_a_node_that_declines_transfers_ignores_timeout_now_and_the_leader_keeps_leading():
    group = leader_group()
    group["c"].decline_transfers = True      # its disk is full: it could not take a write
    group["a"].transfer_leadership("c")
    seen: list[Queued] = []
    group.tick_all(CONFIG.election_timeout_ticks_max + 1, drop=record_into(seen))
    assert any(isinstance(message, TimeoutNow) for _, _, message in seen)
    assert not [message for _, _, message in seen if isinstance(message, RequestVote)]
    assert group["a"].role is Role.LEADER and group["a"].transfer_target is None
    group["c"].decline_transfers = False
    group["a"].transfer_leadership("c")
    group.tick_all(3 * CONFIG.heartbeat_ticks)
    assert group["c"].role is Role.LEADER


def test_preferred_leader_receives_leadership_once_caught_up():
    config = RaftConfig(**{**CONFIG.__dict__, "preferred_leader_id": "c"})
    group = leader_group(config=config)
    group.tick_all(3 * config.election_timeout_ticks_max)
    assert group["c"].role is Role.LEADER
    assert group["a"].role is Role.FOLLOWER
    assert group["c"].leader_id == "c"


# --- compaction and corruption --------------------------------------------------------------------


def test_follower_below_the_leaders_first_retained_entry_is_reset_to_the_leaders_base():
    leader_storage = storage_with([1, 1, 1, 1, 1], term=1)
    leader_storage.compact(3, b"state as of 3")
    storages = {"a": leader_storage, "b": storage_with([1, 1, 1, 1, 1], term=1), "c": MemoryStorage()}
    group = Group(storages=storages)
    group.elect("a")
    resets = [ready.reset_base for ready in group.readies["c"] if ready.reset_base is not None]
    assert resets == [(3, 1, b"state as of 3")]   # the base's state travels with it
    assert group.storages["c"].first_index() == 4
    assert group.storages["c"].base_state() == b"state as of 3"
    assert group.log_terms("c") == [1, 1, 2]
    assert group["c"].commit_index >= 3
    installs = [message for ready in group.readies["a"] for _, message in ready.messages
                if isinstance(message, InstallBase)]
    assert [(message.base_index, message.base_term) for message in installs] == [(3, 1)]


def test_replica_that_lost_entries_neither_votes_nor_campaigns_until_caught_up():
    corrupted = MemoryStorage(hard_state=HardState(1, None, needs_catchup_to=3), entries=log_of(1))
    group = Group(storages={"c": corrupted})
    group.tick("c", 5 * CONFIG.election_timeout_ticks_max)
    assert group["c"].role is Role.FOLLOWER
    assert not queued(group, RequestVote, source="c")
    group.step("b", "c", RequestVote(2, "b", 0, 0, pre_vote=True))
    group.step("b", "c", RequestVote(2, "b", 0, 0, pre_vote=False))
    assert [response.granted for response in queued(group, VoteResponse, source="c")] == [False, False]


def test_replica_that_lost_entries_still_accepts_appends_and_clears_the_mark_when_caught_up():
    corrupted = MemoryStorage(hard_state=HardState(1, None, needs_catchup_to=3), entries=log_of(1))
    storages = {"a": storage_with([1, 1, 1], term=1), "b": storage_with([1, 1, 1], term=1), "c": corrupted}
    group = Group(storages=storages)
    group.elect("a")
    assert group["c"].last_index == 4
    assert group["c"].needs_catchup_to is None
    assert group.storages["c"].initial_state().needs_catchup_to is None


def test_restarted_follower_that_lost_unsynced_entries_is_caught_up():
    group = leader_group()
    group.propose("a", b"x", b"y", b"z")
    group.deliver()
    storage = group.storages["b"]
    storage.truncate_from(3)  # the crash lost 3..4
    group.cores["b"] = RaftCore("b", IDS, storage, random.Random(9), CONFIG)
    group.propose("a", b"after")
    group.tick_all(CONFIG.push_timeout_ticks + 2 * CONFIG.heartbeat_ticks)
    assert group.log_terms("b") == group.log_terms("a")


# --- limits, errors and contracts -----------------------------------------------------------------


def test_push_batches_respect_entry_and_byte_limits():
    config = RaftConfig(**{**CONFIG.__dict__, "max_batch_entries": 3, "max_batch_bytes": 120,
                           "max_inflight_pushes": 64})
    group = leader_group(config=config)
    group.queue.clear()
    group.propose("a", *[b"0123456789"] * 7, b"x" * 500)
    pushes = queued(group, Append, destination="b")
    assert [len(push.entries) for push in pushes] == [2, 2, 2, 1, 1]  # 58-byte entries, 2 per 120 bytes
    assert len(pushes[-1].entries[0].body) == 500  # a lone oversized entry still goes


def test_propose_on_a_follower_raises_not_leader_with_a_hint():
    group = leader_group()
    with pytest.raises(NotLeader) as refused:
        group["b"].propose([b"x"])
    assert refused.value.leader == "a"
    assert refused.value.retriable is True


def test_proposals_beyond_the_uncommitted_limit_are_dropped():
    config = RaftConfig(**{**CONFIG.__dict__, "max_uncommitted_entries": 3})
    group = leader_group(config=config)
    group["a"].propose([b"1", b"2", b"3"])
    with pytest.raises(ProposalDropped) as dropped:
        group["a"].propose([b"4"])
    assert dropped.value.retriable


@pytest.mark.parametrize(
    "field, value",
    [
        ("election_timeout_ticks_min", 0),
        ("election_timeout_ticks_max", 3),
        ("heartbeat_ticks", 50),
        ("max_inflight_pushes", 0),
        ("max_batch_bytes", -1),
        ("pre_vote", "yes"),
        ("preferred_leader_id", ""),
    ],
)
def test_config_validate_names_the_bad_field(field, value):
    with pytest.raises(ConfigError) as bad:
        RaftConfig(**{**CONFIG.__dict__, field: value}).validate()
    assert bad.value.field == field
    assert field in str(bad.value)


def test_core_refuses_input_between_ready_and_advance():
    group = leader_group()
    core = group["a"]
    ready = core.ready()
    with pytest.raises(AssertionError):
        core.tick()
    core.advance(ready)
    core.tick()


def test_every_peer_state_and_event_pair_is_defined_or_refused():
    for state in PeerState:
        for event in PeerEvent:
            try:
                next_state = next_peer_state(state, event)
            except InvalidTransition:
                continue
            assert isinstance(next_state, PeerState)
    assert next_peer_state(PeerState.COMPARE, PeerEvent.MATCHED) is PeerState.APPEND
    assert next_peer_state(PeerState.COMPARE, PeerEvent.MATCHED_EXTRA) is PeerState.TRUNCATE
    assert next_peer_state(PeerState.TRUNCATE, PeerEvent.TRUNCATED) is PeerState.APPEND
    for state in PeerState:
        assert next_peer_state(state, PeerEvent.RESET) is PeerState.COMPARE
    for state in (PeerState.TRUNCATE, PeerState.APPEND):
        assert next_peer_state(state, PeerEvent.REJECTED) is PeerState.COMPARE
        assert next_peer_state(state, PeerEvent.TIMED_OUT) is PeerState.COMPARE
    with pytest.raises(InvalidTransition):
        next_peer_state(PeerState.APPEND, PeerEvent.MATCHED)


@pytest.mark.parametrize(
    "build",
    [
        lambda: Entry(0, 1, EntryType.NORMAL, b""),
        lambda: Entry(1, 1, 1, b""),
        lambda: Entry(1, 1, EntryType.NORMAL, "text"),
        lambda: RequestVote(-1, "a", 0, 0, pre_vote=False),
        lambda: RequestVote(1, "", 0, 0, pre_vote=False),
        lambda: Heartbeat(1, "a", True),
        lambda: Append(1, "a", 0, 0, (), 0),
        lambda: Append(1, "a", 0, 0, (Entry(2, 1, EntryType.NORMAL, b""),), 0),
        lambda: Append(1, "a", 0, 0, (Entry(1, 2, EntryType.NORMAL, b""),), 0),
        lambda: HardState(1, None, needs_catchup_to=0),
    ],
)
def test_invalid_messages_are_refused(build):
    with pytest.raises(InvalidMessage):
        build()


def test_ready_orders_hard_state_before_the_votes_it_backs():
    group = Group()
    group.tick("a", CONFIG.election_timeout_ticks_min)
    group.deliver(rounds=2)  # pre-votes granted: a becomes a candidate
    candidate_ready = next(ready for ready in group.readies["a"] if ready.soft_role is Role.CANDIDATE)
    assert candidate_ready.hard_state == HardState(1, "a")
    assert any(isinstance(message, RequestVote) for _, message in candidate_ready.messages)


class ColdStorage(MemoryStorage):
    """Entries below `cold_below` answer a push's read with NotCached until `fetch()`."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cold_below = 0
        self.deferred = 0

    def entries(self, lo: int, hi: int, max_bytes: int, may_defer: bool = False) -> list[Entry]:
        if may_defer and lo < self.cold_below:
            self.deferred += 1
            raise NotCached(lo)
        return super().entries(lo, hi, max_bytes)


def test_a_push_whose_entries_are_not_cached_waits_for_entries_fetched_without_spinning():
    cold = ColdStorage()
    group = leader_group(storages={"a": cold})
    group.deliver()
    group.tick_all(CONFIG.heartbeat_ticks)
    group.queue.clear()
    group.cores["b"] = RaftCore("b", group.ids, MemoryStorage(), random.Random(9), CONFIG)   # "b" lost its log
    group.storages["b"] = group.cores["b"]._log._storage
    for number in range(6):
        group["a"].propose([f"m{number}".encode()])
    group.drain("a")
    cold.cold_below = group["a"].last_index + 1        # everything the leader holds is cold now
    group.tick_all(CONFIG.push_timeout_ticks + CONFIG.heartbeat_ticks * 3)   # b is probed, matched at 0
    assert cold.deferred >= 1
    assert not queued(group, Append, destination="b"), "nothing pushed to b while its entries are cold"
    assert not group["a"].has_ready(), "a cold peer gives the leader nothing to do (no spinning round)"
    cold.cold_below = 0
    group["a"].entries_fetched()
    group.drain("a")
    assert queued(group, Append, destination="b"), "pushed once fetched"
    group.tick_all(CONFIG.heartbeat_ticks * 4)
    assert group.log_terms("b") == group.log_terms("a")


# --- push quota (DLedger's peerPushThrottlePoint / peerPushQuota) ---------------------------

QUOTA_CONFIG = RaftConfig(**{**CONFIG.__dict__, "push_throttle_point_bytes": 1000, "push_quota_bytes_per_tick": 300,
                             "push_quota_window_ticks": 2, "max_inflight_pushes": 64})
BODY = b"x" * 100                   # 148 bytes an entry (header included); a batch of 2: 296


def _behind(group: Group, down: str, entries: int) -> None:
    """The leader `a` commits `entries` entries while `down` hears nothing."""
    for _ in range(entries // 2):
        group.propose("a", BODY, BODY)
        group.deliver(drop_node(down))
    group.tick_all(CONFIG.push_timeout_ticks + 1, drop=drop_node(down))   # its pushes time out


def _bytes_pushed_each_tick(group: Group, to: str, ticks: int, drop: DropRule | None = None) -> list[int]:
    out = []
    for _ in range(ticks):
        seen: list[Queued] = []
        rule = record_into(seen)
        group.tick_all(1, drop=(lambda s, d, m: drop(s, d, m) or rule(s, d, m)) if drop else rule)
        out.append(sum(48 + len(e.body) for s, d, m in seen if d == to and isinstance(m, Append) for e in m.entries))
    return out


def test_push_quota_a_follower_far_behind_is_pushed_at_most_its_quota_then_catches_up():
    group = leader_group(config=QUOTA_CONFIG)
    _behind(group, "c", 40)                        # c is 40 entries (5,920 bytes) behind
    a = group["a"]
    pushed = _bytes_pushed_each_tick(group, "c", 30)
    far = [n for n in pushed[:8] if n]
    assert far and max(far) <= 2 * 300 + 296, pushed      # a full bucket, plus the batch that overdrew it
    assert sum(pushed[:8]) < 8 * 600, pushed
    assert group.storages["c"].last_index() == a.last_index, "caught up in the end"
    assert group.log_terms("c") == group.log_terms("a")


def test_push_quota_never_holds_back_a_follower_whose_acks_a_commit_needs():
    group = leader_group(config=QUOTA_CONFIG)
    _behind(group, "c", 40)
    group.tick_all(CONFIG.push_timeout_ticks + 1, drop=drop_node("b"))   # b stops answering: it needs c now
    a = group["a"]
    last = a.propose([b"after"])[1]
    group.drain("a")
    for _ in range(6):
        group.tick_all(1, drop=drop_node("b"))
    assert a.commit_index >= last, "c was fed at full speed: its acks make the majority"

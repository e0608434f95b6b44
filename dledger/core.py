"""The sans-IO Raft core for DLedger mode.

`RaftCore` is a plain object: no asyncio, sockets, clock or files. Inputs are
`tick()` (the shell's clock), `step(sender, message)`, `propose(bodies)` and
`transfer_leadership(target)`. Output is a `Ready` from `ready()`; the shell
persists it, sends its messages, applies committed entries and calls
`advance()`. See docs/raft.md for the roles, the replication machine and the
rules, each of which has a unit test in tests/unit/test_raft_core.py.

The Ready/advance contract (etcd's RawNode, made stricter):
1. `ready()` hands out everything produced since the last call. Until
   `advance(ready)` returns the shell must not feed the core (tick, step,
   propose, transfer): asserted.
2. Before sending `ready.messages` the shell makes durable, in this order:
   `reset_base` (storage.reset_to), `truncate_from` (storage.truncate_from),
   then appends `entries`, then `hard_state` (atomically).
   Entries may be written without fsync; `advance(ready, persisted_index)`
   then says how far the log is durable (None: all of it). The leader counts
   itself, and followers acknowledge, only up to that index (SYNC_FLUSH when
   the shell fsyncs before advance; ASYNC_FLUSH when it reports a lagging
   index later through `advance(core.ready(), persisted_index=...)`, which is
   legal with an empty Ready).
3. Acknowledgements that depend on durability (append, truncate, install-base
   acks) are produced inside `advance()` and go out with the *next* Ready, so
   the shell loops `while core.has_ready()`.
4. `ready.committed` never exceeds the log's last index after the Ready is
   persisted; entries up to it may be applied.
"""

from __future__ import annotations

import enum
import random
from collections import deque
from dataclasses import dataclass, field
from itertools import repeat
from typing import Callable, Sequence

from dledger.messages import (
    ENTRY_SLOT_SETTERS,
    LEADER_MESSAGES,
    Append,
    AppendResponse,
    Compare,
    CompareResponse,
    Entry,
    EntryType,
    HardState,
    Heartbeat,
    HeartbeatResponse,
    InstallBase,
    InstallBaseResponse,
    RequestVote,
    TimeoutNow,
    Truncate,
    TruncateResponse,
    VoteResponse,
    append_of_checked_entries,
)
from dledger.quorum import VoteResult, commit_index, majority, vote_result
from dledger.raft_storage import Compacted, NotCached, RaftLog, RaftStorage, entry_size_bytes
from node.store.crc import crc32 as _crc32

__all__ = [
    "ConfigError",
    "InvalidTransition",
    "NotLeader",
    "ProposalDropped",
    "PeerEvent",
    "PeerState",
    "RaftConfig",
    "RaftCore",
    "Ready",
    "Role",
    "next_peer_state",
]


class Role(enum.Enum):
    FOLLOWER = "follower"
    PRE_CANDIDATE = "pre_candidate"
    CANDIDATE = "candidate"
    LEADER = "leader"


class NotLeader(Exception):
    """This node cannot accept the proposal; retry at `leader` (may be None).

    The fault is local to this node (it is not, or not yet, the writable
    leader); retrying elsewhere or later may help."""

    retriable = True
    local = True

    def __init__(self, leader: str | None, reason: str = "not the leader") -> None:
        super().__init__(f"{reason} (leader hint: {leader})")
        self.leader = leader
        self.reason = reason


class ProposalDropped(Exception):
    """Too many entries are appended but not yet committed; retry later."""

    retriable = True
    local = True

    def __init__(self, uncommitted: int, limit: int) -> None:
        super().__init__(f"{uncommitted} uncommitted entries would exceed the limit of {limit}")
        self.uncommitted = uncommitted
        self.limit = limit


class ConfigError(ValueError):
    """A RaftConfig field is invalid; `field` names it."""

    retriable = False
    local = True

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"RaftConfig.{field_name}: {problem}")
        self.field = field_name


@dataclass(frozen=True)
class RaftConfig:
    """Raft timing and limits, in ticks. The shell picks the tick length; the
    defaults assume 50 ms: heartbeat 100 ms, election timeout 300-600 ms, so a
    dead leader is replaced well within the 2 s failover budget."""

    # A follower campaigns after a random number of ticks in [min, max] without
    # hearing a leader. min is also the leader lease: within it, followers
    # ignore vote requests and pre-votes are refused (leader stickiness).
    election_timeout_ticks_min: int = 6
    election_timeout_ticks_max: int = 12
    # The leader sends heartbeats (carrying the commit index) this often;
    # must be well below election_timeout_ticks_min.
    heartbeat_ticks: int = 2
    # A push, truncate or probe unanswered this long sends the follower back
    # to COMPARE (the DLedger "timeout" edge).
    push_timeout_ticks: int = 20
    # APPEND batches in flight per follower, not yet acknowledged.
    max_inflight_pushes: int = 64
    # APPEND batches sent to one follower per turn (a ready() call, an ack): a follower far
    # behind fills its pipeline over many short turns, and the shell can end a round between
    # them, so the event loop serves producers meanwhile instead of encoding the whole
    # pipeline (64 batches of up to max_batch_bytes) at once.
    pushes_per_turn: int = 2
    # Size bounds of one APPEND batch (a batch always carries >= 1 entry).
    max_batch_entries: int = 256
    max_batch_bytes: int = 1024 * 1024
    # Out-of-order pushes a follower keeps while waiting for a gap to fill.
    max_parked_pushes: int = 64
    # The leader refuses proposals (ProposalDropped) beyond this many entries
    # appended but not committed: bounds memory when followers are slow.
    max_uncommitted_entries: int = 65536
    # PreVote round before every ordinary election (not for TimeoutNow).
    pre_vote: bool = True
    # Leader steps down when it has not heard from a majority for
    # election_timeout_ticks_min; followers honour the lease above.
    check_quorum: bool = True
    # If set, a leader hands leadership to this node once it is caught up.
    preferred_leader_id: str | None = None
    # DLedger's push quota (peerPushThrottlePoint, peerPushQuota): a follower more than
    # push_throttle_point_bytes behind our last entry gets pushes of at most
    # push_quota_bytes_per_tick a tick (a bucket of push_quota_window_ticks ticks' worth),
    # so that catching it up cannot take the leader from its producers. Never while the
    # followers not that far behind and the leader fall short of a majority (their acks are
    # needed to commit), nor for a leadership transfer's target. 0 bytes a tick: no quota.
    push_throttle_point_bytes: int = 0
    push_quota_bytes_per_tick: int = 0
    push_quota_window_ticks: int = 20

    def validate(self) -> None:
        positive = (
            "election_timeout_ticks_min",
            "election_timeout_ticks_max",
            "heartbeat_ticks",
            "push_timeout_ticks",
            "max_inflight_pushes",
            "pushes_per_turn",
            "max_batch_entries",
            "max_batch_bytes",
            "max_parked_pushes",
            "max_uncommitted_entries",
            "push_quota_window_ticks",
        )
        for name in positive:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(name, f"must be a positive int, got {value!r}")
        for name in ("push_throttle_point_bytes", "push_quota_bytes_per_tick"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ConfigError(name, f"must be an int >= 0, got {value!r}")
        if self.election_timeout_ticks_max < self.election_timeout_ticks_min:
            raise ConfigError("election_timeout_ticks_max", "must be >= election_timeout_ticks_min")
        if self.heartbeat_ticks >= self.election_timeout_ticks_min:
            raise ConfigError("heartbeat_ticks", "must be below election_timeout_ticks_min")
        for name in ("pre_vote", "check_quorum"):
            if type(getattr(self, name)) is not bool:
                raise ConfigError(name, "must be a bool")
        preferred = self.preferred_leader_id
        if preferred is not None and (not isinstance(preferred, str) or not preferred):
            raise ConfigError("preferred_leader_id", "must be None or a node id")


@dataclass(frozen=True, slots=True)
class Ready:
    """Everything the shell must do, in order; see the module docstring."""

    messages: tuple[tuple[str, object], ...]  # (destination node id, message)
    truncate_from: int | None  # durably delete entries >= this before appending
    entries: tuple[Entry, ...]  # append after truncation; contiguous
    hard_state: HardState | None  # persist atomically before sending messages
    committed: int  # entries <= this are committed and may be applied
    soft_role: Role
    leader_id: str | None
    term: int
    # If set: storage.reset_to(base_index, base_term, base_state) first of all (InstallBase).
    reset_base: tuple[int, int, bytes] | None = None


# --- the leader's per-follower replication machine --------------------------------


class PeerState(enum.Enum):
    COMPARE = "compare"  # probing for the highest index where both logs agree
    TRUNCATE = "truncate"  # match found; follower must drop its extra entries
    APPEND = "append"  # pipelined pushes in flight


class PeerEvent(enum.Enum):
    MATCHED = "matched"  # compare hit, follower has nothing beyond it
    MATCHED_EXTRA = "matched_extra"  # compare hit, follower has entries beyond it
    MISMATCHED = "mismatched"  # compare miss: probe lower (or install base)
    BASE_INSTALLED = "base_installed"  # follower restarted its log at our base
    TRUNCATED = "truncated"  # follower durably dropped its extra entries
    ACKED = "acked"  # a push was acknowledged
    REJECTED = "rejected"  # the follower refused a push, truncate or base
    TIMED_OUT = "timed_out"  # no answer within push_timeout_ticks
    COMPACTED = "compacted"  # the entries to push next were compacted away
    RESET = "reset"  # new leadership: start over


class InvalidTransition(AssertionError):
    """A (state, event) pair the machine does not define: our bug."""


_TRANSITIONS: dict[tuple[PeerState, PeerEvent], PeerState] = {
    (PeerState.COMPARE, PeerEvent.MATCHED): PeerState.APPEND,
    (PeerState.COMPARE, PeerEvent.MATCHED_EXTRA): PeerState.TRUNCATE,
    (PeerState.COMPARE, PeerEvent.MISMATCHED): PeerState.COMPARE,
    (PeerState.COMPARE, PeerEvent.BASE_INSTALLED): PeerState.APPEND,
    (PeerState.COMPARE, PeerEvent.REJECTED): PeerState.COMPARE,
    (PeerState.COMPARE, PeerEvent.TIMED_OUT): PeerState.COMPARE,
    (PeerState.COMPARE, PeerEvent.RESET): PeerState.COMPARE,
    (PeerState.TRUNCATE, PeerEvent.TRUNCATED): PeerState.APPEND,
    (PeerState.TRUNCATE, PeerEvent.REJECTED): PeerState.COMPARE,
    (PeerState.TRUNCATE, PeerEvent.TIMED_OUT): PeerState.COMPARE,
    (PeerState.TRUNCATE, PeerEvent.RESET): PeerState.COMPARE,
    (PeerState.APPEND, PeerEvent.ACKED): PeerState.APPEND,
    (PeerState.APPEND, PeerEvent.REJECTED): PeerState.COMPARE,
    (PeerState.APPEND, PeerEvent.TIMED_OUT): PeerState.COMPARE,
    (PeerState.APPEND, PeerEvent.COMPACTED): PeerState.COMPARE,
    (PeerState.APPEND, PeerEvent.RESET): PeerState.COMPARE,
}


# Proposed entries are built without a per-entry Entry.__post_init__ (about 2 us each on
# the leader's hot path): _new_entries validates what differs per entry (the body) and,
# through one full Entry(), what the whole batch shares (index, term, type).
_NEW = object.__new__
_consume = deque      # _consume(iterator, 0) runs it to the end, keeping nothing
_SET_INDEX, _SET_TERM, _SET_TYPE, _SET_BODY, _SET_CRC = ENTRY_SLOT_SETTERS


def _new_entries(first: int, term: int, type: EntryType, bodies: Sequence[bytes]) -> list[Entry]:
    """[Entry(first, term, type, b0), Entry(first + 1, term, type, b1), ...], the same
    objects and the same InvalidMessage on a bad field as building each with Entry()."""
    head = Entry(first, term, type, bodies[0])
    rest = bodies[1:]
    if not all(map(isinstance, rest, repeat(bytes))):
        for k, body in enumerate(rest):
            Entry(first + 1 + k, term, type, body)      # raises InvalidMessage, with the words
    # Objects made and slots filled column by column at C speed (no per-entry Python call).
    n = len(rest)
    entries = list(map(_NEW, repeat(Entry, n)))
    _consume(map(_SET_INDEX, entries, range(first + 1, first + 1 + n)), 0)
    _consume(map(_SET_TERM, entries, repeat(term, n)), 0)
    _consume(map(_SET_TYPE, entries, repeat(type, n)), 0)
    _consume(map(_SET_BODY, entries, rest), 0)
    _consume(map(_SET_CRC, entries, map(_crc32, rest)), 0)
    entries.insert(0, head)
    return entries


def next_peer_state(state: PeerState, event: PeerEvent) -> PeerState:
    try:
        return _TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(f"no transition from {state.name} on {event.name}") from None


@dataclass(slots=True)
class _Progress:
    """What the leader knows about one follower (reset every term)."""

    probe: int  # COMPARE: index being probed
    state: PeerState = PeerState.COMPARE
    match: int = 0  # highest index durable on the follower and equal to ours
    next: int = 0  # APPEND: next index to push
    truncate_at: int = 0  # TRUNCATE: follower drops entries >= this
    base_sent: int | None = None  # COMPARE: outstanding InstallBase(base_index)
    follower_last: tuple[int, int] = (0, 0)  # (index, term) of its last entry, last reported
    awaiting_since: int | None = None  # tick an outstanding probe/truncate/base was sent
    inflight: deque[tuple[int, int]] = field(default_factory=deque)  # (push last index, sent tick)
    recent_active: bool = False  # heard from since the last quorum check
    heard_at: int = -(1 << 62)  # tick it was last heard from
    storage_wait: bool = False  # its next entries are being read in (NotCached): no push until entries_fetched()
    far_behind: bool = False  # pushes to it count against its quota (RaftConfig.push_throttle_point_bytes)
    quota: int = 0  # bytes it may still be pushed now while far behind; refilled each tick


class _Push(enum.Enum):
    APPENDED = "appended"
    DUPLICATE = "duplicate"
    REJECTED = "rejected"


# --- the core ----------------------------------------------------------------------


class RaftCore:
    """One Raft replica. Single-threaded; see the module docstring for the contract."""

    def __init__(
        self,
        node_id: str,
        peers: Sequence[str],
        storage: RaftStorage,
        rng: random.Random,
        config: RaftConfig,
    ) -> None:
        config.validate()
        if not isinstance(node_id, str) or not node_id:
            raise ConfigError("node_id", "must be a non-empty string")
        # `peers` is the voter set; it may or may not include node_id.
        self._id = node_id
        self._voters = frozenset(peers) | {node_id}
        self._peers = tuple(sorted(self._voters - {node_id}))
        self._cfg = config
        self._rng = rng
        self._log = RaftLog(storage)

        hard_state = storage.initial_state()
        self._term = hard_state.term
        self._voted_for = hard_state.voted_for
        self._catchup_to = hard_state.needs_catchup_to
        self._persisted_hs = hard_state
        # The commit index is not persisted: the base is committed by definition.
        self._commit = self._log.first_index() - 1
        self._durable = self._log.last_index()  # what storage holds survived a restart
        self._matched = self._commit  # follower: verified prefix shared with the current leader
        self._now = 0  # ticks since construction; only used for timeouts

        self._role = Role.FOLLOWER
        self._leader: str | None = None
        self._election_elapsed = 0
        self._election_timeout = self._random_timeout()
        self._heartbeat_elapsed = 0
        self._check_elapsed = 0
        self._votes: dict[str, bool] = {}
        self._progress: dict[str, _Progress] = {}
        self._transfer_target: str | None = None
        self._transfer_elapsed = 0
        self._timeout_now_sent = False
        self._preferred_backoff = 0
        # Set by the shell while a committed range of this log is known corrupt (dledger/repair.py):
        # the node does not campaign (a leader must be able to serve every committed entry) but
        # still votes, since its last index/term, which votes compare, are unchanged.
        self.campaign_blocked = False
        # Set by the shell while this node cannot take writes (its disk is full): a TimeoutNow
        # is ignored, so a leadership transfer to it times out and the leader tries elsewhere.
        # Elections are unaffected: a full node may still lead (it serves reads and commits).
        self.decline_transfers = False

        self._parked: dict[int, Append] = {}  # follower: first index -> out-of-order push
        self._ack_due = False
        self._last_acked = -1
        self._truncate_ack: int | None = None
        self._base_ack: int | None = None

        self._outbox: list[tuple[str, object]] = []
        self._outstanding: Ready | None = None
        self._ready_commit = -1
        self._maybe_finish_catchup()

    # --- read-only views -------------------------------------------------------------

    @property
    def node_id(self) -> str:
        return self._id

    @property
    def role(self) -> Role:
        return self._role

    @property
    def term(self) -> int:
        return self._term

    @property
    def leader_id(self) -> str | None:
        return self._leader

    @property
    def commit_index(self) -> int:
        return self._commit

    @property
    def last_index(self) -> int:
        return self._log.last_index()

    @property
    def first_index(self) -> int:
        return self._log.first_index()

    @property
    def durable_index(self) -> int:
        return self._durable

    @property
    def voted_for(self) -> str | None:
        return self._voted_for

    @property
    def needs_catchup_to(self) -> int | None:
        return self._catchup_to

    @property
    def transfer_target(self) -> str | None:
        return self._transfer_target

    @property
    def peers(self) -> tuple[str, ...]:
        return self._peers

    def match_index(self, peer: str) -> int | None:
        """Leader only: highest index durable on `peer` (self: our durable index)."""
        if self._role is not Role.LEADER:
            return None
        if peer == self._id:
            return self._durable
        return self._progress[peer].match

    def peer_state(self, peer: str) -> PeerState | None:
        progress = self._progress.get(peer)
        return progress.state if progress is not None else None

    def term_at(self, index: int) -> int | None:
        """Term of the entry at `index` in our log (None beyond it; Compacted below)."""
        return self._log.term(index)

    # --- inputs ---------------------------------------------------------------------

    def tick(self) -> None:
        self._check_idle()
        self._now += 1
        if self._role is Role.LEADER:
            self._tick_leader()
        else:
            self._tick_election()
        self._check_invariants()

    def step(self, sender: str, msg: object) -> None:
        self._check_idle()
        if sender not in self._peers:
            return  # not a member (or ourselves): the transport misrouted it
        handler = self._HANDLERS.get(type(msg))
        if handler is None:
            raise TypeError(f"not a Raft message: {type(msg).__name__}")
        term = msg.term  # type: ignore[attr-defined]
        if term > self._term and not self._step_higher_term(sender, msg):
            return
        if term < self._term:
            self._reply_to_stale(sender, msg)
            return
        handler(self, sender, msg)
        self._check_invariants()

    def propose(self, bodies: Sequence[bytes], type: EntryType = EntryType.NORMAL) -> tuple[int, int]:
        """Append bodies as entries of the current term; returns (first, last) index.

        Proposals are accepted as soon as this node is leader: the term's no-op
        is already the first entry of the term, so nothing proposed can commit
        before it. Pushes are built in `ready()`, which batches proposals."""
        self._check_idle()
        if self._role is not Role.LEADER:
            raise NotLeader(self._leader)
        if self._transfer_target is not None:
            raise NotLeader(self._transfer_target, "leadership transfer in progress")
        if not bodies:
            raise ValueError("propose needs at least one body")
        uncommitted = self._log.last_index() - self._commit + len(bodies)
        if uncommitted > self._cfg.max_uncommitted_entries:
            raise ProposalDropped(uncommitted, self._cfg.max_uncommitted_entries)
        first = self._log.last_index() + 1
        entries = _new_entries(first, self._term, type, bodies)
        self._log.append(entries)
        self._check_invariants()
        return first, entries[-1].index

    def entries_fetched(self) -> None:
        """The storage has read in entries it answered NotCached for: push again."""
        self._check_idle()
        for progress in self._progress.values():
            progress.storage_wait = False

    def transfer_leadership(self, target: str) -> None:
        """Stop accepting proposals, bring `target` up to date, then TimeoutNow.

        Abandoned after election_timeout_ticks_max ticks if it has not happened."""
        self._check_idle()
        if self._role is not Role.LEADER:
            raise NotLeader(self._leader)
        if target == self._id or target == self._transfer_target:
            return
        if target not in self._progress:
            raise ValueError(f"unknown transfer target {target!r}")
        self._transfer_target = target
        self._transfer_elapsed = 0
        self._timeout_now_sent = False
        self._maybe_send_timeout_now(target)

    # --- Ready / advance --------------------------------------------------------------

    def has_ready(self) -> bool:
        # Called several times per round: the fields are compared in place, no HardState is built.
        if self._outbox or self._log.has_pending() or self._commit != self._ready_commit:
            return True
        hs = self._persisted_hs
        if self._term != hs.term or self._voted_for != hs.voted_for or self._catchup_to != hs.needs_catchup_to:
            return True
        return self._role is Role.LEADER and any(
            self._can_push(progress) for progress in self._progress.values()
        )

    def ready(self) -> Ready:
        self._check_idle()
        if self._role is Role.LEADER:
            for peer, progress in self._progress.items():
                if progress.state is PeerState.APPEND:
                    self._send_pushes(peer, progress)
        reset_base, truncate_from, entries = self._log.pending()
        hard_state = self._hard_state()
        ready = Ready(
            messages=tuple(self._outbox),
            truncate_from=truncate_from,
            entries=entries,
            hard_state=hard_state if hard_state != self._persisted_hs else None,
            committed=self._commit,
            soft_role=self._role,
            leader_id=self._leader,
            term=self._term,
            reset_base=reset_base,
        )
        self._outbox = []
        self._ready_commit = self._commit
        self._outstanding = ready
        return ready

    def advance(self, ready: Ready, persisted_index: int | None = None) -> None:
        """The shell has applied `ready`; `persisted_index` is the last index now
        durable locally (None: everything written so far)."""
        assert self._outstanding is ready, "advance() must get the Ready from the last ready()"
        self._outstanding = None
        self._log.persisted()
        if ready.hard_state is not None:
            self._persisted_hs = ready.hard_state
        stable_last = self._log.stable_last_index()
        if persisted_index is None:
            self._durable = stable_last
        else:
            assert 0 <= persisted_index <= stable_last, (persisted_index, stable_last)
            # The base is durable by definition (reset_to and compaction are).
            self._durable = max(persisted_index, self._log.first_index() - 1)
        self._maybe_finish_catchup()
        if self._role is Role.LEADER:
            self._maybe_commit()
        elif self._role is Role.FOLLOWER and self._leader is not None:
            self._send_durable_acks(self._leader)
        self._check_invariants()

    # --- elections --------------------------------------------------------------------

    def _tick_election(self) -> None:
        self._election_elapsed += 1
        if self._election_elapsed < self._election_timeout:
            return
        self._leader = None  # a whole timeout without a leader: its lease is over
        if self._promotable():
            self._campaign(pre_vote=self._cfg.pre_vote)
        else:
            self._reset_election_timer()

    def _promotable(self) -> bool:
        # A node whose log lost entries it may have acknowledged must not help
        # elect anybody (or itself) until it has them back.
        return self._id in self._voters and self._catchup_to is None

    def _heard_from_leader_recently(self) -> bool:
        if self._role is Role.LEADER:
            return True
        return self._leader is not None and self._election_elapsed < self._cfg.election_timeout_ticks_min

    def _campaign(self, pre_vote: bool, transfer: bool = False) -> None:
        if self.campaign_blocked:
            if self._role is not Role.LEADER:
                self._role = Role.FOLLOWER
            self._reset_election_timer()
            return
        if pre_vote:
            self._role = Role.PRE_CANDIDATE
            vote_term = self._term + 1  # what we would use; nobody adopts it yet
        else:
            self._term += 1
            self._voted_for = self._id
            self._role = Role.CANDIDATE
            vote_term = self._term
        self._leader = None
        self._progress = {}
        self._parked.clear()
        self._votes = {self._id: True}
        self._reset_election_timer()
        if vote_result(self._votes, self._voters) is VoteResult.WON:  # single-node group
            self._on_election_won()
            return
        request = RequestVote(
            term=vote_term,
            candidate_id=self._id,
            last_index=self._log.last_index(),
            last_term=self._log.last_term(),
            pre_vote=pre_vote,
            transfer=transfer,
        )
        for peer in self._peers:
            self._send(peer, request)

    def _on_election_won(self) -> None:
        if self._role is Role.PRE_CANDIDATE:
            self._campaign(pre_vote=False)
        else:
            self._become_leader()

    def _on_request_vote(self, sender: str, m: RequestVote) -> None:
        if m.candidate_id != sender:
            return
        can_vote = (
            self._voted_for == sender
            or (self._voted_for is None and self._leader is None)
            or (m.pre_vote and m.term > self._term)
        )
        grant = (
            can_vote
            and self._promotable()
            and self._log.is_up_to_date(m.last_index, m.last_term)
            and not (m.pre_vote and not m.transfer and self._heard_from_leader_recently())
        )
        if not grant:
            self._send(sender, VoteResponse(term=self._term, granted=False, pre_vote=m.pre_vote))
            return
        if not m.pre_vote:
            self._voted_for = sender
            self._reset_election_timer()
        self._send(sender, VoteResponse(term=m.term, granted=True, pre_vote=m.pre_vote))

    def _on_vote_response(self, sender: str, m: VoteResponse) -> None:
        if self._role is Role.PRE_CANDIDATE and m.pre_vote:
            if m.granted and m.term != self._term + 1:
                return  # a grant for some other pre-vote round
        elif self._role is Role.CANDIDATE and not m.pre_vote:
            if m.term != self._term:
                return
        else:
            return
        self._votes[sender] = m.granted
        result = vote_result(self._votes, self._voters)
        if result is VoteResult.WON:
            self._on_election_won()
        elif result is VoteResult.LOST:
            self._become_follower(self._term, None)

    def _on_timeout_now(self, sender: str, m: TimeoutNow) -> None:
        self._follow(sender)
        if self._promotable() and not self.decline_transfers:
            self._campaign(pre_vote=False, transfer=True)

    # --- term handling ----------------------------------------------------------------

    def _step_higher_term(self, sender: str, msg: object) -> bool:
        """Handle a message whose term is above ours; False means drop it."""
        if isinstance(msg, RequestVote):
            if self._cfg.check_quorum and not msg.transfer and self._heard_from_leader_recently():
                return False  # leader stickiness: a live leader's lease holds
            if not msg.pre_vote:
                self._become_follower(msg.term, None)
            return True
        if isinstance(msg, VoteResponse) and msg.pre_vote and msg.granted:
            return True  # a granted pre-vote echoes our would-be term
        leader = sender if isinstance(msg, LEADER_MESSAGES) else None
        self._become_follower(msg.term, leader)  # type: ignore[attr-defined]
        return True

    def _reply_to_stale(self, sender: str, msg: object) -> None:
        """A message from an older term. Tell a stale leader or pre-candidate
        our term, so that it steps down instead of waiting for a timeout."""
        if isinstance(msg, LEADER_MESSAGES):
            self._send(sender, HeartbeatResponse(term=self._term, durable_index=self._ack_index()))
        elif isinstance(msg, RequestVote) and msg.pre_vote:
            self._send(sender, VoteResponse(term=self._term, granted=False, pre_vote=True))

    def _become_follower(self, term: int, leader: str | None) -> None:
        assert term >= self._term, (term, self._term)
        if term > self._term:
            self._term = term
            self._voted_for = None
        self._role = Role.FOLLOWER
        self._leader = leader
        self._reset_election_timer()
        self._votes = {}
        self._progress = {}
        self._transfer_target = None
        self._parked.clear()
        self._matched = self._commit  # committed entries are the only ones known to match
        self._ack_due = False
        self._last_acked = -1
        self._truncate_ack = None
        self._base_ack = None

    def _follow(self, leader: str) -> None:
        """We heard from `leader` in our current term."""
        assert self._role is not Role.LEADER, f"two leaders in term {self._term}: {self._id}, {leader}"
        if self._role is not Role.FOLLOWER or self._leader != leader:
            assert self._leader is None or self._leader == leader, (
                f"two leaders in term {self._term}: {self._leader}, {leader}"
            )
            self._become_follower(self._term, leader)
        self._election_elapsed = 0

    def _become_leader(self) -> None:
        assert self._role is Role.CANDIDATE
        self._role = Role.LEADER
        self._leader = self._id
        self._heartbeat_elapsed = 0
        self._check_elapsed = 0
        self._transfer_target = None
        self._preferred_backoff = 0
        # Probe at our last index *before* the no-op: nobody can hold the no-op.
        last = self._log.last_index()
        self._progress = {peer: _Progress(probe=last) for peer in self._peers}
        self._log.append([Entry(last + 1, self._term, EntryType.NOOP, b"")])
        for peer in self._peers:
            self._send_probe(peer, self._progress[peer])

    # --- leader: ticking ----------------------------------------------------------------

    def _tick_leader(self) -> None:
        self._check_elapsed += 1
        if self._check_elapsed >= self._cfg.election_timeout_ticks_min:
            self._check_elapsed = 0
            if self._cfg.check_quorum and not self._quorum_active():
                self._become_follower(self._term, None)
                return
        self._heartbeat_elapsed += 1
        if self._heartbeat_elapsed >= self._cfg.heartbeat_ticks:
            self._heartbeat_elapsed = 0
            self._broadcast_heartbeat()
        self._refill_push_quota()
        for peer, progress in self._progress.items():
            self._check_timeouts(peer, progress)
        self._tick_transfer()
        self._maybe_transfer_to_preferred()

    def _refill_push_quota(self) -> None:
        """Each tick: the push quota's buckets refilled (a full one for a follower not far
        behind, so that it starts with one when it falls behind)."""
        per_tick = self._cfg.push_quota_bytes_per_tick
        if per_tick <= 0:
            return
        full = per_tick * self._cfg.push_quota_window_ticks
        for progress in self._progress.values():
            progress.quota = min(full, progress.quota + per_tick) if progress.far_behind else full

    def _far_behind(self, peer: str, progress: _Progress) -> bool:
        """Whether a push to `peer` now counts against its quota: it is more than
        push_throttle_point_bytes behind our last entry, it is not a transfer's target, and
        the leader with the followers not that far behind and heard from within an election
        timeout make a majority (else a commit needs its acks)."""
        cfg = self._cfg
        if (peer == self._transfer_target or progress.next < self._log.first_index()
                or self._log.bytes_from(progress.next) <= cfg.push_throttle_point_bytes):
            return False
        since = self._now - cfg.election_timeout_ticks_min
        near = 1 + sum(1 for other, p in self._progress.items()
                       if other != peer and p.state is PeerState.APPEND and not p.far_behind and p.heard_at >= since)
        return near >= majority(len(self._voters))

    def _quorum_active(self) -> bool:
        active = 1 + sum(1 for progress in self._progress.values() if progress.recent_active)
        for progress in self._progress.values():
            progress.recent_active = False
        return active >= majority(len(self._voters))

    def _broadcast_heartbeat(self) -> None:
        heartbeat = Heartbeat(term=self._term, leader_id=self._id, commit_index=self._commit)
        for peer, progress in self._progress.items():
            self._send(peer, heartbeat)
            # A probe or truncate may have been lost: repeat it (answers are idempotent).
            since = progress.awaiting_since
            if since is not None and self._now - since >= self._cfg.heartbeat_ticks:
                self._send_probe(peer, progress, repeat=True)

    def _check_timeouts(self, peer: str, progress: _Progress) -> None:
        timeout = self._cfg.push_timeout_ticks
        if progress.state is PeerState.APPEND:
            if progress.inflight and self._now - progress.inflight[0][1] >= timeout:
                self._enter_compare(progress, PeerEvent.TIMED_OUT)
                self._replicate(peer, progress)
        elif progress.awaiting_since is not None and self._now - progress.awaiting_since >= timeout:
            self._enter_compare(progress, PeerEvent.TIMED_OUT)
            self._replicate(peer, progress)

    # --- leader: replication ------------------------------------------------------------

    def _transition(self, progress: _Progress, event: PeerEvent) -> None:
        progress.state = next_peer_state(progress.state, event)

    def _enter_compare(self, progress: _Progress, event: PeerEvent) -> None:
        """Start over from our last index (DLedger does the same): the highest
        match is then found without skipping, which keeps TRUNCATE safe."""
        self._transition(progress, event)
        assert progress.state is PeerState.COMPARE
        progress.probe = self._log.last_index()
        progress.inflight.clear()
        progress.base_sent = None
        progress.awaiting_since = None

    def _replicate(self, peer: str, progress: _Progress) -> None:
        if progress.state is PeerState.APPEND:
            self._send_pushes(peer, progress)
        elif progress.awaiting_since is None:
            self._send_probe(peer, progress)

    def _send_probe(self, peer: str, progress: _Progress, repeat: bool = False) -> None:
        """Send (or repeat) the COMPARE probe, the InstallBase or the TRUNCATE.

        A repeat keeps the original send time, so an unanswered probe still
        times out and the follower starts over from our last index."""
        if not repeat:
            progress.awaiting_since = self._now
        if progress.state is PeerState.TRUNCATE:
            message: object = Truncate(
                term=self._term,
                leader_id=self._id,
                index=progress.truncate_at,
                last_index=progress.follower_last[0],
                last_term=progress.follower_last[1],
                commit_index=self._commit,
            )
        elif progress.probe < self._log.first_index() - 1:
            base = self._log.first_index() - 1
            progress.base_sent = base
            message = InstallBase(
                term=self._term,
                leader_id=self._id,
                base_index=base,
                base_term=self._term_known(base),
                last_index=progress.follower_last[0],
                last_term=progress.follower_last[1],
                commit_index=self._commit,
                state=self._log.base_state(),
            )
        else:
            assert progress.state is PeerState.COMPARE
            progress.base_sent = None
            message = Compare(
                term=self._term,
                leader_id=self._id,
                index=progress.probe,
                log_term=self._term_known(progress.probe),
                commit_index=self._commit,
            )
        self._send(peer, message)

    def _can_push(self, progress: _Progress) -> bool:
        return (
            progress.state is PeerState.APPEND
            and len(progress.inflight) < self._cfg.max_inflight_pushes
            and progress.next <= self._log.last_index()
            and not progress.storage_wait
            and not (progress.far_behind and progress.quota <= 0)
        )

    def _send_pushes(self, peer: str, progress: _Progress) -> None:
        """Fill the pipeline, `pushes_per_turn` batches at a time: batches go out without
        waiting for acks."""
        quota = self._cfg.push_quota_bytes_per_tick > 0
        for _ in range(self._cfg.pushes_per_turn):
            if quota:
                progress.far_behind = self._far_behind(peer, progress)
            if not self._can_push(progress):
                return
            if progress.next < self._log.first_index():
                # Compare again: InstallBase needs the follower's last entry.
                self._enter_compare(progress, PeerEvent.COMPACTED)
                self._send_probe(peer, progress)
                return
            hi = min(self._log.last_index() + 1, progress.next + self._cfg.max_batch_entries)
            try:
                batch = self._log.entries(progress.next, hi, self._cfg.max_batch_bytes, may_defer=True)
            except NotCached:
                # Old entries not in memory (a follower far behind): the storage reads them in
                # off the event loop and the shell calls entries_fetched(); the pipeline waits.
                progress.storage_wait = True
                return
            prev = progress.next - 1
            # Our own log: contiguous, terms between prev's and ours; no per-entry re-check.
            push = append_of_checked_entries(self._term, self._id, prev, self._term_known(prev), tuple(batch),
                                             self._commit)
            self._send(peer, push)
            progress.inflight.append((push.last_index, self._now))
            progress.next = push.last_index + 1
            if progress.far_behind:
                progress.quota -= sum(map(entry_size_bytes, batch))

    def _leader_progress(self, sender: str) -> _Progress | None:
        if self._role is not Role.LEADER:
            return None
        progress = self._progress.get(sender)
        if progress is not None:
            progress.recent_active = True
            progress.heard_at = self._now
        return progress

    def _on_compare_response(self, sender: str, m: CompareResponse) -> None:
        progress = self._leader_progress(sender)
        if progress is None or progress.state is not PeerState.COMPARE:
            return
        if progress.base_sent is not None or m.index != progress.probe:
            return  # an answer to an older probe
        progress.awaiting_since = None
        progress.follower_last = (m.last_index, m.last_term)
        if m.matched:
            # Authoritative: the follower holds our prefix up to m.index and has
            # m.durable_index of it on disk (lower than before if it lost data). A log
            # that ends on an entry of ours is our prefix all the way (log matching), its
            # extra entries included (pushes that raced the probe): never TRUNCATE those.
            # The follower may have verified and acknowledged them, so it keeps them and
            # says so; a duplicate of that TRUNCATE reaching it after a restart, its log
            # still ending where the TRUNCATE expects, would delete them even if committed.
            held = m.last_index if m.last_index > m.index and self._log.matches(m.last_index, m.last_term) \
                else m.index
            progress.match = min(held, m.durable_index)
            if m.last_index > held:
                progress.truncate_at = held + 1
                self._transition(progress, PeerEvent.MATCHED_EXTRA)
            else:
                progress.next = held + 1
                progress.inflight.clear()
                self._transition(progress, PeerEvent.MATCHED)
            self._maybe_commit()
        else:
            progress.match = min(progress.match, m.index - 1)
            progress.probe = self._next_probe(m)
            self._transition(progress, PeerEvent.MISMATCHED)
        self._replicate(sender, progress)

    def _next_probe(self, m: CompareResponse) -> int:
        """Skip back using the follower's hint without passing a matching index.

        Any index j <= m.index where both logs agree has follower term <= our
        probed term, so j <= hint_index; and our term at j equals the
        follower's, which is <= hint_term, so j <= find_conflict_by_term(...)."""
        try:
            if self._log.term(m.hint_index) == m.hint_term:
                return m.hint_index  # the follower holds exactly this entry
        except Compacted:
            return m.hint_index  # below our base: _send_probe turns it into InstallBase
        candidate = self._log.find_conflict_by_term(m.hint_index, m.hint_term)
        return max(0, min(candidate, m.index - 1))

    def _on_truncate_response(self, sender: str, m: TruncateResponse) -> None:
        progress = self._leader_progress(sender)
        if progress is None or progress.state is not PeerState.TRUNCATE or m.index != progress.truncate_at:
            return
        if not m.success:
            self._enter_compare(progress, PeerEvent.REJECTED)
            self._replicate(sender, progress)
            return
        progress.awaiting_since = None
        progress.match = m.durable_index
        progress.next = m.last_index + 1
        progress.inflight.clear()
        self._transition(progress, PeerEvent.TRUNCATED)
        self._replicate(sender, progress)

    def _on_install_base_response(self, sender: str, m: InstallBaseResponse) -> None:
        progress = self._leader_progress(sender)
        if progress is None or progress.state is not PeerState.COMPARE or progress.base_sent != m.base_index:
            return
        if m.success:
            progress.base_sent = None
            progress.awaiting_since = None
            progress.match = m.durable_index
            progress.next = m.base_index + 1
            progress.inflight.clear()
            self._transition(progress, PeerEvent.BASE_INSTALLED)
        else:
            self._enter_compare(progress, PeerEvent.REJECTED)
        self._replicate(sender, progress)

    def _on_append_response(self, sender: str, m: AppendResponse) -> None:
        progress = self._leader_progress(sender)
        if progress is None or progress.state is not PeerState.APPEND:
            return
        if not m.success:
            self._enter_compare(progress, PeerEvent.REJECTED)
            self._replicate(sender, progress)
            return
        self._transition(progress, PeerEvent.ACKED)
        while progress.inflight and progress.inflight[0][0] <= m.last_index:
            progress.inflight.popleft()
        if m.durable_index > progress.match:
            progress.match = m.durable_index
            self._maybe_commit()
        self._maybe_send_timeout_now(sender)
        self._send_pushes(sender, progress)

    def _on_heartbeat_response(self, sender: str, m: HeartbeatResponse) -> None:
        progress = self._leader_progress(sender)
        if progress is None:
            return
        # Durability grows between pushes when the follower fsyncs lazily.
        if progress.state is PeerState.APPEND and m.durable_index > progress.match:
            progress.match = m.durable_index
            self._maybe_commit()
            self._maybe_send_timeout_now(sender)

    def _maybe_commit(self) -> None:
        matches = [self._durable] + [progress.match for progress in self._progress.values()]
        self._commit = commit_index(self._commit, matches, self._term_known, self._term)

    # --- leader: transfer -------------------------------------------------------------

    def _maybe_send_timeout_now(self, peer: str) -> None:
        if peer != self._transfer_target or self._timeout_now_sent:
            return
        if self._progress[peer].match >= self._log.last_index():
            self._send(peer, TimeoutNow(term=self._term, leader_id=self._id))
            self._timeout_now_sent = True

    def _tick_transfer(self) -> None:
        if self._transfer_target is None:
            return
        self._transfer_elapsed += 1
        if self._transfer_elapsed >= self._cfg.election_timeout_ticks_max:
            self._transfer_target = None  # the target did not take over: resume service

    def _maybe_transfer_to_preferred(self) -> None:
        preferred = self._cfg.preferred_leader_id
        if preferred is None or preferred == self._id or preferred not in self._progress:
            return
        if self._transfer_target is not None or self._role is not Role.LEADER:
            return
        if self._preferred_backoff > 0:
            self._preferred_backoff -= 1
            return
        progress = self._progress[preferred]
        if self._term_known(self._commit) != self._term:
            return  # our no-op is not committed yet: let the term settle first
        if progress.state is PeerState.APPEND and progress.recent_active and progress.match >= self._commit:
            # If the transfer fails (the preferred node died), do not block writes again soon.
            self._preferred_backoff = 4 * self._cfg.election_timeout_ticks_max
            self.transfer_leadership(preferred)

    # --- follower: replication ----------------------------------------------------------

    def _ack_index(self) -> int:
        """What we may acknowledge: durable and verified against the leader."""
        return min(self._durable, self._matched)

    def _advance_follower_commit(self, leader_commit: int) -> None:
        # Only entries verified against this leader may be committed locally.
        candidate = min(leader_commit, self._matched)
        if candidate > self._commit:
            self._commit = candidate

    def _on_heartbeat(self, sender: str, m: Heartbeat) -> None:
        self._follow(sender)
        self._advance_follower_commit(m.commit_index)
        self._send(sender, HeartbeatResponse(term=self._term, durable_index=self._ack_index()))

    def _on_compare(self, sender: str, m: Compare) -> None:
        self._follow(sender)
        matched = self._log.matches(m.index, m.log_term)
        if matched:
            self._matched = max(self._matched, m.index)
            self._advance_follower_commit(m.commit_index)
            hint_index, hint_term = m.index, m.log_term
        else:
            hint_index, hint_term = self._conflict_hint(m)
        self._send(
            sender,
            CompareResponse(
                term=self._term,
                index=m.index,
                matched=matched,
                last_index=self._log.last_index(),
                last_term=self._log.last_term(),
                durable_index=self._durable,
                hint_index=hint_index,
                hint_term=hint_term,
            ),
        )

    def _conflict_hint(self, m: Compare) -> tuple[int, int]:
        base = self._log.first_index() - 1
        if m.index < base:
            return base, self._term_known(base)  # our base is committed: the leader has it
        hint = self._log.find_conflict_by_term(min(m.index, self._log.last_index()), m.log_term)
        return hint, self._term_known(hint)

    def _log_ends_at(self, index: int, term: int) -> bool:
        return self._log.last_index() == index and self._log.last_term() == term

    def _on_truncate(self, sender: str, m: Truncate) -> None:
        self._follow(sender)
        if not self._log_ends_at(m.last_index, m.last_term):
            # Our log changed since the COMPARE this is based on (a delayed
            # duplicate, or we restarted): the extra entries it meant may be gone.
            self._send(sender, TruncateResponse(self._term, m.index, False, self._matched, self._ack_index()))
            return
        # Never drop what this leader already verified nor anything committed.
        start = max(m.index, self._matched + 1)
        if start <= self._log.last_index():
            self._truncate_log(start)
        self._matched = self._log.last_index()
        self._truncate_ack = m.index  # acknowledged in advance(), once durable

    def _truncate_log(self, start: int) -> None:
        assert start > self._commit, (start, self._commit)
        self._log.truncate_from(start)
        self._durable = min(self._durable, start - 1)
        self._parked.clear()

    def _on_install_base(self, sender: str, m: InstallBase) -> None:
        self._follow(sender)
        if m.base_index <= self._matched or not self._log_ends_at(m.last_index, m.last_term):
            # We already hold (committed) entries at or above that base, or our
            # log changed since the COMPARE it is based on: a stale or duplicated
            # message. Refusing sends the leader back to COMPARE.
            self._send(sender, InstallBaseResponse(self._term, m.base_index, False, self._ack_index()))
            return
        self._log.reset(m.base_index, m.base_term, m.state)
        self._commit = max(self._commit, m.base_index)
        self._matched = m.base_index
        self._durable = min(self._durable, m.base_index)
        self._parked.clear()
        self._base_ack = m.base_index  # acknowledged in advance(), once durable

    def _on_append(self, sender: str, m: Append) -> None:
        self._follow(sender)
        if m.prev_index > self._log.last_index():
            if not self._park(m):
                self._reject_push(sender)
            return
        result = self._accept_push(m)
        if result is _Push.REJECTED:
            self._reject_push(sender)
            return
        if result is _Push.APPENDED:
            self._drain_parked(sender)
            self._ack_due = True  # acknowledged in advance(), once durable
        self._advance_follower_commit(m.commit_index)
        if result is _Push.DUPLICATE:
            self._send(sender, AppendResponse(self._term, True, self._matched, self._ack_index()))

    def _reject_push(self, sender: str) -> None:
        self._parked.clear()
        self._send(sender, AppendResponse(self._term, False, self._matched, self._ack_index()))

    def _accept_push(self, m: Append) -> _Push:
        """Apply a push that starts at or before our last index.

        It must extend a prefix we share with the leader (prev matches) and
        must agree with whatever of it we already hold; by log matching it is
        enough to compare the last overlapping entry."""
        prev, prev_term, entries = m.prev_index, m.prev_term, m.entries
        base = self._log.first_index() - 1
        if prev < base:  # the push starts inside our compacted, committed prefix
            skip = base - prev
            if skip >= len(entries):
                return _Push.DUPLICATE
            prev, prev_term, entries = base, entries[skip - 1].term, entries[skip:]
        if not self._log.matches(prev, prev_term):
            return _Push.REJECTED
        overlap_end = min(self._log.last_index(), entries[-1].index)
        if overlap_end > prev and self._log.term(overlap_end) != entries[overlap_end - prev - 1].term:
            return _Push.REJECTED  # we hold entries the leader should have truncated
        fresh = entries[max(0, overlap_end - prev) :]
        if fresh:
            self._log.append(fresh)
        self._matched = max(self._matched, entries[-1].index)
        return _Push.APPENDED if fresh else _Push.DUPLICATE

    def _park(self, m: Append) -> bool:
        """A push ahead of our log: keep it until the gap fills. If the map is
        full, refuse it (False): the leader would otherwise wait for its push
        timeout before resending, so we send it back to COMPARE at once."""
        self._advance_follower_commit(m.commit_index)
        if m.first_index in self._parked or len(self._parked) < self._cfg.max_parked_pushes:
            self._parked[m.first_index] = m
            return True
        return False

    def _drain_parked(self, sender: str) -> None:
        for _ in range(len(self._parked)):  # each round removes at least one push
            last = self._log.last_index()
            for first in [first for first, push in self._parked.items() if push.last_index <= last]:
                del self._parked[first]  # already covered
            push = next((push for push in self._parked.values() if push.prev_index <= last), None)
            if push is None:
                return
            del self._parked[push.first_index]
            if self._accept_push(push) is _Push.REJECTED:
                self._reject_push(sender)
                return
            self._advance_follower_commit(push.commit_index)

    def _send_durable_acks(self, leader: str) -> None:
        """Acknowledgements that promise durability, sent after advance()."""
        if self._truncate_ack is not None:
            self._send(
                leader,
                TruncateResponse(self._term, self._truncate_ack, True, self._matched, self._ack_index()),
            )
            self._truncate_ack = None
        if self._base_ack is not None:
            self._send(leader, InstallBaseResponse(self._term, self._base_ack, True, self._ack_index()))
            self._base_ack = None
        ack = self._ack_index()
        if self._ack_due or ack > self._last_acked:
            self._send(leader, AppendResponse(self._term, True, self._matched, ack))
            self._ack_due = False
            self._last_acked = ack

    # --- helpers ----------------------------------------------------------------------

    def _maybe_finish_catchup(self) -> None:
        if self._catchup_to is not None and self._durable >= self._catchup_to:
            self._catchup_to = None  # persisted through the next Ready's hard_state

    def _hard_state(self) -> HardState:
        return HardState(self._term, self._voted_for, self._catchup_to)

    def _term_known(self, index: int) -> int:
        term = self._log.term(index)
        assert term is not None, (index, self._log.last_index())
        return term

    def _random_timeout(self) -> int:
        return self._rng.randint(self._cfg.election_timeout_ticks_min, self._cfg.election_timeout_ticks_max)

    def _reset_election_timer(self) -> None:
        self._election_elapsed = 0
        self._election_timeout = self._random_timeout()

    def _send(self, to: str, msg: object) -> None:
        self._outbox.append((to, msg))
        # The shell drains the outbox on every ready(); a huge one is a shell bug.
        assert len(self._outbox) <= 64 * (len(self._peers) + 1) * (self._cfg.max_inflight_pushes + 4)

    def _check_idle(self) -> None:
        assert self._outstanding is None, "call advance() before feeding the core more input"

    def _check_invariants(self) -> None:
        last = self._log.last_index()
        assert self._commit <= last, (self._commit, last)
        assert self._durable <= last, (self._durable, last)
        assert self._matched <= last or self._role is not Role.FOLLOWER, (self._matched, last)
        assert self._term >= self._persisted_hs.term, (self._term, self._persisted_hs.term)

    _HANDLERS: dict[type, Callable[..., None]] = {
        RequestVote: _on_request_vote,
        VoteResponse: _on_vote_response,
        TimeoutNow: _on_timeout_now,
        Heartbeat: _on_heartbeat,
        Compare: _on_compare,
        Truncate: _on_truncate,
        Append: _on_append,
        InstallBase: _on_install_base,
        HeartbeatResponse: _on_heartbeat_response,
        CompareResponse: _on_compare_response,
        TruncateResponse: _on_truncate_response,
        AppendResponse: _on_append_response,
        InstallBaseResponse: _on_install_base_response,
    }

"""Raft messages and log records for DLedger mode.

Every type here is a frozen, slotted dataclass that validates its own fields on
construction (an Entry also derives its body's CRC) and does nothing else: no IO,
no encoding (the wire codec lives in the transport), no behaviour. A message that
fails validation came from a broken or hostile peer, so validation raises
`InvalidMessage` (an exception for the world), never `assert`.

Naming follows DLedger where DLedger has a name: the leader *pushes* to each
follower in three phases, COMPARE (find the match point), TRUNCATE (drop the
follower's extra entries) and APPEND (pipelined batches), and a heartbeat
carries the commit index when there is nothing to push. `InstallBase` is ours:
DLedger has no answer for a follower whose data lies below the leader's first
retained entry.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Union

from node.store.crc import crc32 as _crc32

__all__ = [
    "Append",
    "AppendResponse",
    "Compare",
    "CompareResponse",
    "Entry",
    "EntryType",
    "FetchEntries",
    "FetchEntriesResponse",
    "HardState",
    "Heartbeat",
    "HeartbeatResponse",
    "InstallBase",
    "InstallBaseResponse",
    "InvalidMessage",
    "LEADER_MESSAGES",
    "Message",
    "RequestVote",
    "REPAIR_MESSAGES",
    "TimeoutNow",
    "Truncate",
    "TruncateResponse",
    "VoteResponse",
]


class InvalidMessage(ValueError):
    """A message or record field is out of range. The fault is remote (the sender)."""

    retriable = False
    local = False


def _check_int(name: str, value: object, minimum: int = 0) -> None:
    # bool is an int subclass; a bool where an index belongs is a codec bug.
    if type(value) is not int or value < minimum:
        raise InvalidMessage(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_id(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidMessage(f"{name} must be a non-empty node id, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if type(value) is not bool:
        raise InvalidMessage(f"{name} must be a bool, got {value!r}")


class EntryType(enum.IntEnum):
    """DLedger's entry magic values."""

    NORMAL = 1   # a batch body from the broker (one commitlog record)
    NOOP = 2     # appended by every new leader; commits older-term entries (Raft 5.4.2)
    CONFIG = 3   # reserved for membership changes (not implemented by the core yet)


@dataclass(frozen=True, slots=True)
class Entry:
    """One log entry. Index 0 is the empty log's base and never a real entry.

    `crc` is the body's CRC32, derived from `body` when the entry is made (not an argument,
    so no entry holds another body's CRC; `dataclasses.replace` derives it again). It is the
    store's bodyCrc and the wire's body CRC, computed once per entry: the column-wise fast
    paths that skip `__init__` (the core's new entries, the codec's received ones, checked
    against the sender's CRC) fill it from the very bytes of `body`."""

    index: int
    term: int
    type: EntryType
    body: bytes
    crc: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_int("index", self.index, minimum=1)
        _check_int("term", self.term, minimum=1)
        if not isinstance(self.type, EntryType):
            raise InvalidMessage(f"type must be an EntryType, got {self.type!r}")
        if not isinstance(self.body, bytes):
            raise InvalidMessage(f"body must be bytes, got {type(self.body).__name__}")
        object.__setattr__(self, "crc", _crc32(self.body))


# Entry's slot setters, (index, term, type, body, crc) in order, for the fast paths that fill
# checked entries without Entry(): entry_of_checked below, the core's new entries (core.py)
# and the codec's received ones (codec.py).
ENTRY_SLOT_SETTERS = tuple(Entry.__dict__[n].__set__ for n in ("index", "term", "type", "body", "crc"))
_SET_INDEX, _SET_TERM, _SET_TYPE, _SET_BODY, _SET_CRC = ENTRY_SLOT_SETTERS


def entry_of_checked(index: int, term: int, type: EntryType, body: bytes, crc: int) -> Entry:
    """`Entry(index, term, type, body)` for fields already checked, `crc` being the CRC32 of
    `body` already computed and compared (a store's read checks it against the entry's header)."""
    e = object.__new__(Entry)
    _SET_INDEX(e, index)
    _SET_TERM(e, term)
    _SET_TYPE(e, type)
    _SET_BODY(e, body)
    _SET_CRC(e, crc)
    return e


@dataclass(frozen=True, slots=True)
class HardState:
    """What must be durable before any message of the same Ready is sent.

    needs_catchup_to: set by recovery when the local log lost entries it may
    have acknowledged (a bad CRC in the middle of the log). Until the log
    reaches this index again the node neither votes nor campaigns, so its lost
    acknowledgements cannot help elect a leader that lacks them. The core
    clears it (emits a HardState with None) once the log is durable that far.
    """

    term: int
    voted_for: str | None
    needs_catchup_to: int | None = None

    def __post_init__(self) -> None:
        _check_int("term", self.term)
        if self.voted_for is not None:
            _check_id("voted_for", self.voted_for)
        if self.needs_catchup_to is not None:
            _check_int("needs_catchup_to", self.needs_catchup_to, minimum=1)


# --- elections -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestVote:
    """Ask for a vote. A pre-vote carries the term the candidate *would* use
    (its term + 1) and changes nobody's term. `transfer` marks a campaign started
    by TimeoutNow: it may disturb a live leader's lease."""

    term: int
    candidate_id: str
    last_index: int
    last_term: int
    pre_vote: bool
    transfer: bool = False

    def __post_init__(self) -> None:
        _check_int("term", self.term, minimum=1)
        _check_id("candidate_id", self.candidate_id)
        _check_int("last_index", self.last_index)
        _check_int("last_term", self.last_term)
        _check_bool("pre_vote", self.pre_vote)
        _check_bool("transfer", self.transfer)


@dataclass(frozen=True, slots=True)
class VoteResponse:
    """A granted response echoes the request's term; a rejection carries the
    responder's own term so a stale candidate learns it."""

    term: int
    granted: bool
    pre_vote: bool

    def __post_init__(self) -> None:
        _check_int("term", self.term)
        _check_bool("granted", self.granted)
        _check_bool("pre_vote", self.pre_vote)


@dataclass(frozen=True, slots=True)
class TimeoutNow:
    """Leadership transfer: the target campaigns at once, skipping pre-vote."""

    term: int
    leader_id: str

    def __post_init__(self) -> None:
        _check_int("term", self.term, minimum=1)
        _check_id("leader_id", self.leader_id)


# --- replication: leader -> follower ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Heartbeat:
    term: int
    leader_id: str
    commit_index: int

    def __post_init__(self) -> None:
        _check_int("term", self.term, minimum=1)
        _check_id("leader_id", self.leader_id)
        _check_int("commit_index", self.commit_index)


@dataclass(frozen=True, slots=True)
class Compare:
    """COMPARE phase: does the follower hold entry `index` with term `log_term`?"""

    term: int
    leader_id: str
    index: int
    log_term: int
    commit_index: int

    def __post_init__(self) -> None:
        _check_int("term", self.term, minimum=1)
        _check_id("leader_id", self.leader_id)
        _check_int("index", self.index)
        _check_int("log_term", self.log_term)
        _check_int("commit_index", self.commit_index)


@dataclass(frozen=True, slots=True)
class Truncate:
    """TRUNCATE phase: durably delete every entry with index >= `index`.

    `last_index`/`last_term` are the follower's last entry as its CompareResponse
    reported it. The follower truncates only if its log still ends there: a
    delayed or duplicated Truncate reaching a follower that has since been
    caught up (or restarted) must not delete entries it acknowledged."""

    term: int
    leader_id: str
    index: int
    last_index: int
    last_term: int
    commit_index: int

    def __post_init__(self) -> None:
        _check_int("term", self.term, minimum=1)
        _check_id("leader_id", self.leader_id)
        _check_int("index", self.index, minimum=1)
        _check_int("last_index", self.last_index)
        _check_int("last_term", self.last_term)
        _check_int("commit_index", self.commit_index)


@dataclass(frozen=True, slots=True)
class Append:
    """APPEND phase: one pipelined batch. `prev_index`/`prev_term` let the
    follower verify the batch extends the prefix it matched (Raft's log-matching
    check; DLedger relies on ordering alone)."""

    term: int
    leader_id: str
    prev_index: int
    prev_term: int
    entries: tuple[Entry, ...]
    commit_index: int

    def __post_init__(self) -> None:
        _check_int("term", self.term, minimum=1)
        _check_id("leader_id", self.leader_id)
        _check_int("prev_index", self.prev_index)
        _check_int("prev_term", self.prev_term)
        _check_int("commit_index", self.commit_index)
        if not isinstance(self.entries, tuple) or not self.entries:
            raise InvalidMessage("entries must be a non-empty tuple (an empty push is a heartbeat)")
        expected_index, floor_term = self.prev_index + 1, self.prev_term
        for entry in self.entries:
            if not isinstance(entry, Entry) or entry.index != expected_index:
                raise InvalidMessage(f"entries must be contiguous from {self.prev_index + 1}")
            if not floor_term <= entry.term <= self.term:
                raise InvalidMessage(f"entry {entry.index} has term {entry.term} out of order")
            expected_index, floor_term = expected_index + 1, entry.term

    @property
    def first_index(self) -> int:
        return self.prev_index + 1

    @property
    def last_index(self) -> int:
        return self.prev_index + len(self.entries)


_APPEND_SETTERS = None


def append_of_checked_entries(term: int, leader_id: str, prev_index: int, prev_term: int,
                              entries: tuple[Entry, ...], commit_index: int) -> Append:
    """`Append(...)` whose entries the caller has already checked to be contiguous from
    prev_index + 1 with terms in [prev_term, term] (the leader's own log; the codec, which
    checks them while it decodes). The scalars are validated as Append() does, through one
    Append of the first entry; the per-entry loop of __post_init__ is skipped."""
    global _APPEND_SETTERS
    if not entries:
        raise InvalidMessage("entries must be a non-empty tuple (an empty push is a heartbeat)")
    m = Append(term, leader_id, prev_index, prev_term, entries[:1], commit_index)
    if len(entries) == 1:
        return m
    if _APPEND_SETTERS is None:
        _APPEND_SETTERS = Append.__dict__["entries"].__set__
    if type(entries) is not tuple:
        raise InvalidMessage("entries must be a non-empty tuple (an empty push is a heartbeat)")
    _APPEND_SETTERS(m, entries)
    return m


@dataclass(frozen=True, slots=True)
class InstallBase:
    """The follower needs entries the leader no longer retains: restart your log
    after (base_index, base_term), whose state is `state` (the leader's base state,
    opaque to Raft). The base is committed, so nothing is lost. Guarded like
    Truncate by the follower's last entry as last reported."""

    term: int
    leader_id: str
    base_index: int
    base_term: int
    last_index: int
    last_term: int
    commit_index: int
    state: bytes = b""

    def __post_init__(self) -> None:
        _check_int("term", self.term, minimum=1)
        _check_id("leader_id", self.leader_id)
        _check_int("base_index", self.base_index, minimum=1)
        _check_int("base_term", self.base_term, minimum=1)
        _check_int("last_index", self.last_index)
        _check_int("last_term", self.last_term)
        _check_int("commit_index", self.commit_index)
        if not isinstance(self.state, bytes):
            raise InvalidMessage(f"state must be bytes, got {type(self.state).__name__}")


# --- replication: follower -> leader ------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeartbeatResponse:
    """Also the generic answer to a message from a stale term: `term` tells the
    stale leader to step down. `durable_index` = min(durable, matched)."""

    term: int
    durable_index: int

    def __post_init__(self) -> None:
        _check_int("term", self.term)
        _check_int("durable_index", self.durable_index)


@dataclass(frozen=True, slots=True)
class CompareResponse:
    """Answer to Compare(index). On a mismatch the hint lets the leader skip
    back fast: `hint_index` is the last index <= min(index, last_index) whose
    term is <= the probed term, and `hint_term` is the follower's term there
    (etcd's findConflictByTerm). The leader never skips a matching index."""

    term: int
    index: int
    matched: bool
    last_index: int
    last_term: int
    durable_index: int
    hint_index: int
    hint_term: int

    def __post_init__(self) -> None:
        _check_int("term", self.term)
        _check_int("index", self.index)
        _check_bool("matched", self.matched)
        _check_int("last_index", self.last_index)
        _check_int("last_term", self.last_term)
        _check_int("durable_index", self.durable_index)
        _check_int("hint_index", self.hint_index)
        _check_int("hint_term", self.hint_term)


@dataclass(frozen=True, slots=True)
class TruncateResponse:
    """Sent only after the truncation is durable (or at once when refused)."""

    term: int
    index: int
    success: bool
    last_index: int
    durable_index: int

    def __post_init__(self) -> None:
        _check_int("term", self.term)
        _check_int("index", self.index, minimum=1)
        _check_bool("success", self.success)
        _check_int("last_index", self.last_index)
        _check_int("durable_index", self.durable_index)


@dataclass(frozen=True, slots=True)
class AppendResponse:
    """`last_index`: the follower's verified prefix (frees pipeline slots);
    `durable_index`: the part of it that is durable (the leader's match index)."""

    term: int
    success: bool
    last_index: int
    durable_index: int

    def __post_init__(self) -> None:
        _check_int("term", self.term)
        _check_bool("success", self.success)
        _check_int("last_index", self.last_index)
        _check_int("durable_index", self.durable_index)


@dataclass(frozen=True, slots=True)
class InstallBaseResponse:
    term: int
    base_index: int
    success: bool
    durable_index: int

    def __post_init__(self) -> None:
        _check_int("term", self.term)
        _check_int("base_index", self.base_index, minimum=1)
        _check_bool("success", self.success)
        _check_int("durable_index", self.durable_index)


# --- repair: any member -> any member (read-only, never stepped into the core) -------------
# Bounds of one FetchEntriesResponse (dledger/repair.py): at most MAX_FETCH_ENTRIES entries and
# MAX_FETCH_BYTES bytes, except that a single entry larger than the byte cap is still sent alone;
# the transport's frame cap (TransportConfig.max_frame_bytes) bounds that one.
MAX_FETCH_ENTRIES = 64
MAX_FETCH_BYTES = 8 << 20
MAX_FETCH_ERROR_CHARS = 500


@dataclass(frozen=True, slots=True)
class FetchEntries:
    """Ask a peer for its raw committed entries `index`.. (at most `count`) to repair a
    corrupt copy in place. Carries no term: it changes nothing on the peer, and the shell
    hands it to the repair module, not to the core."""

    request_id: int
    index: int
    count: int

    def __post_init__(self) -> None:
        _check_int("request_id", self.request_id, minimum=1)
        _check_int("index", self.index, minimum=1)
        _check_int("count", self.count, minimum=1)
        if self.count > MAX_FETCH_ENTRIES:
            raise InvalidMessage(f"count must be <= {MAX_FETCH_ENTRIES}, got {self.count}")


@dataclass(frozen=True, slots=True)
class FetchEntriesResponse:
    """Answer to FetchEntries(request_id): `entries` holds the raw stored bytes (header +
    body) of entries index, index+1, ..., each verified by the sender first; or, when it
    cannot serve them, `entries` is empty and `error` says why."""

    request_id: int
    index: int
    entries: bytes
    error: str

    def __post_init__(self) -> None:
        _check_int("request_id", self.request_id, minimum=1)
        _check_int("index", self.index, minimum=1)
        if not isinstance(self.entries, bytes):
            raise InvalidMessage(f"entries must be bytes, got {type(self.entries).__name__}")
        if not isinstance(self.error, str) or len(self.error) > MAX_FETCH_ERROR_CHARS:
            raise InvalidMessage(f"error must be a str of at most {MAX_FETCH_ERROR_CHARS} chars")
        if bool(self.entries) == bool(self.error):
            raise InvalidMessage("exactly one of entries and error must be non-empty")


Message = Union[
    RequestVote,
    VoteResponse,
    TimeoutNow,
    Heartbeat,
    Compare,
    Truncate,
    Append,
    InstallBase,
    HeartbeatResponse,
    CompareResponse,
    TruncateResponse,
    AppendResponse,
    InstallBaseResponse,
]

# Routed by the shell to the repair module (dledger/repair.py); the core never sees them.
REPAIR_MESSAGES = (FetchEntries, FetchEntriesResponse)

# Messages only a leader of `term` sends: receiving one names the leader.
LEADER_MESSAGES = (Heartbeat, Compare, Truncate, Append, InstallBase, TimeoutNow)

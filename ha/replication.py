"""Pure cores of classic HA: no asyncio, no sockets, no clock, no files.

Time comes in as `now_ms`; offsets come in as arguments. Each machine has one
`(state, input) -> next_state` table here, and every state change goes through
`_step`, so the tables are the whole truth (tests sweep every pair).

    HAConnectionCore   master side, one per slave connection: what to push next
    HAClientCore       slave side: accept/drop a push, when to report
    HAServiceCore      master side: slaves' acks, in-sync set, SYNC_MASTER wait decision

Rules (RocketMQ store/ha, DESIGN section 4):
- a slave reports its max offset right after it connects, after each applied batch
  and at least every 5 s;
- the master pushes from the slave's reported offset; a slave reporting 0 starts at
  the base of the master's last segment; a push is at most 32 KiB and never crosses a
  segment; with nothing to send for 5 s the master sends a heartbeat (size 0);
- either side closes the link after 20 s without hearing from the other;
- a push whose offset differs from the slave's max offset breaks the stream: drop the
  link (the slave re-reports and the master restarts from there). An empty slave
  (max offset 0) accepts the first push at any offset and starts its log there.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from node.store import layout as L

MiB = 1024 * 1024
NO_LIMIT = (1 << 63) - 1      # covered_offset when no slave ack is required
CATCHUP_SAMPLE_MS = 100       # one (master max, time) sample per connection per this many ms
CATCHUP_SAMPLES = 1024        # samples kept per connection (older ones drop: only stricter)


@dataclass(frozen=True, slots=True)
class HATimings:
    """Classic HA timers and limits (RocketMQ MessageStoreConfig names in comments)."""

    heartbeat_interval_ms: int = 5_000          # haSendHeartbeatInterval: master idle -> heartbeat; slave report period
    housekeeping_ms: int = 20_000               # haHousekeepingInterval: silence before either side closes
    max_transfer_bytes: int = L.HA_MAX_TRANSFER_BYTES   # bytes per push (haTransferBatchSize)
    max_gap_not_in_sync_bytes: int = 256 * MiB  # haMaxGapNotInSync: a slave further behind is not "available"
    slave_ack_timeout_ms: int = 5_000           # syncFlushTimeout for SYNC_MASTER: then FLUSH_SLAVE_TIMEOUT
    max_time_slave_not_catchup_ms: int = 15_000  # haMaxTimeSlaveNotCatchup: behind this long -> out of the in-sync set
    max_connections: int = 64                   # haMaxConnections: slave links held at once; more are closed on accept

    def validate(self) -> None:
        for name in ("heartbeat_interval_ms", "housekeeping_ms", "max_transfer_bytes",
                     "max_gap_not_in_sync_bytes", "slave_ack_timeout_ms", "max_time_slave_not_catchup_ms",
                     "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HATimings.{name} must be > 0")
        if self.housekeeping_ms <= self.heartbeat_interval_ms:
            raise ValueError("HATimings.housekeeping_ms must exceed heartbeat_interval_ms")


def _step(table: Mapping[tuple[enum.Enum, enum.Enum], enum.Enum], state: enum.Enum, inp: enum.Enum) -> enum.Enum:
    nxt = table.get((state, inp))
    assert nxt is not None, f"no transition for {state} on {inp}"
    return nxt


# ===================================================================================
# Master side, one per slave connection
# ===================================================================================

class ConnState(enum.Enum):
    WAIT_REPORT = "WAIT_REPORT"   # connected; nothing is pushed until the slave says where it is
    TRANSFER = "TRANSFER"         # pushing from next_offset
    CLOSED = "CLOSED"


class ConnInput(enum.Enum):
    REPORT = "REPORT"             # a valid slave report
    BAD_REPORT = "BAD_REPORT"     # offset went backwards, or slave ahead of master
    SILENCE = "SILENCE"           # no report for housekeeping_ms
    CLOSE = "CLOSE"               # socket closed / shell shutting down


_C, _CI = ConnState, ConnInput
CONN_TRANSITIONS: dict[tuple[ConnState, ConnInput], ConnState] = {
    (_C.WAIT_REPORT, _CI.REPORT): _C.TRANSFER,
    (_C.WAIT_REPORT, _CI.BAD_REPORT): _C.CLOSED,
    (_C.WAIT_REPORT, _CI.SILENCE): _C.CLOSED,
    (_C.WAIT_REPORT, _CI.CLOSE): _C.CLOSED,
    (_C.TRANSFER, _CI.REPORT): _C.TRANSFER,
    (_C.TRANSFER, _CI.BAD_REPORT): _C.CLOSED,
    (_C.TRANSFER, _CI.SILENCE): _C.CLOSED,
    (_C.TRANSFER, _CI.CLOSE): _C.CLOSED,
    # Closed is absorbing: late events on a dead link change nothing.
    (_C.CLOSED, _CI.REPORT): _C.CLOSED,
    (_C.CLOSED, _CI.BAD_REPORT): _C.CLOSED,
    (_C.CLOSED, _CI.SILENCE): _C.CLOSED,
    (_C.CLOSED, _CI.CLOSE): _C.CLOSED,
}


@dataclass(frozen=True, slots=True)
class SendPush:
    """Push `size` bytes of the commitlog at `offset` (size 0 = heartbeat)."""

    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class CloseLink:
    reason: str


ConnAction = SendPush | CloseLink | None


class HAConnectionCore:
    """What the master sends to one slave, and when it gives up on it."""

    def __init__(self, segment_size: int, now_ms: int, timings: HATimings = HATimings()):
        assert segment_size > 0
        self.segment_size = segment_size
        self.t = timings
        self.state = ConnState.WAIT_REPORT
        self.close_reason = ""
        self.slave_ack_offset = -1        # last reported slave max offset; -1 before the first report
        self.next_offset = -1             # next byte to push; -1 until the first report
        self.last_report_ms = now_ms      # the silence clock starts at accept
        self.last_push_ms = now_ms

    def _input(self, inp: ConnInput, reason: str = "") -> None:
        self.state = _step(CONN_TRANSITIONS, self.state, inp)  # type: ignore[assignment]
        if self.state is ConnState.CLOSED and not self.close_reason:
            self.close_reason = reason or inp.value

    def on_report(self, max_offset: int, master_max: int, now_ms: int) -> None:
        """The slave says everything below `max_offset` is stored on it."""
        if self.state is ConnState.CLOSED:
            return
        if max_offset < self.slave_ack_offset:
            return self._input(ConnInput.BAD_REPORT, f"slave offset went back {self.slave_ack_offset} -> {max_offset}")
        if max_offset > master_max:
            # Its tail is not ours (e.g. an old master): it must truncate to the consistent point first.
            return self._input(ConnInput.BAD_REPORT, f"slave at {max_offset} is ahead of master at {master_max}")
        if self.state is ConnState.WAIT_REPORT:
            self.next_offset = self._first_offset(max_offset, master_max)
        self.slave_ack_offset = max_offset
        self.last_report_ms = now_ms
        self._input(ConnInput.REPORT)

    def _first_offset(self, reported: int, master_max: int) -> int:
        if reported != 0:
            return reported
        # An empty slave does not get the whole history: it starts at the master's last file (RocketMQ).
        return master_max - master_max % self.segment_size

    def next_action(self, now_ms: int, master_max: int, master_min: int = 0, batch_bytes: int = 0) -> ConnAction:
        """What to do now. The shell does it, then calls `pushed` once per push it wrote.

        With `batch_bytes` above the transfer cap, a SendPush may span up to that many bytes
        (still within one segment): the shell reads them at once and writes them as several
        pushes of at most max_transfer_bytes each."""
        if self.state is ConnState.CLOSED:
            return None
        if now_ms - self.last_report_ms > self.t.housekeeping_ms:
            self._input(ConnInput.SILENCE, f"no report from slave for {now_ms - self.last_report_ms} ms")
            return CloseLink(self.close_reason)
        if self.state is ConnState.WAIT_REPORT:
            return None
        if self.next_offset < master_min:
            self._input(ConnInput.CLOSE, f"slave needs {self.next_offset}, master keeps only from {master_min}")
            return CloseLink(self.close_reason)
        if self.next_offset < master_max:
            return SendPush(self.next_offset, self._push_size(master_max, batch_bytes))
        if now_ms - self.last_push_ms >= self.t.heartbeat_interval_ms:
            return SendPush(self.next_offset, 0)
        return None

    def _push_size(self, master_max: int, batch_bytes: int = 0) -> int:
        segment_end = self.next_offset - self.next_offset % self.segment_size + self.segment_size
        size = min(max(self.t.max_transfer_bytes, batch_bytes), master_max - self.next_offset,
                   segment_end - self.next_offset)
        assert size > 0
        return size

    def pushed(self, offset: int, size: int, now_ms: int) -> None:
        """The shell wrote a push of `size` bytes at `offset` to the socket."""
        assert offset == self.next_offset, "pushes must be contiguous"
        assert 0 <= size <= self.t.max_transfer_bytes
        self.next_offset += size
        self.last_push_ms = now_ms

    def close(self, reason: str) -> None:
        self._input(ConnInput.CLOSE, reason)


# ===================================================================================
# Slave side
# ===================================================================================

class ClientState(enum.Enum):
    READY = "READY"               # connected; must report before anything else
    TRANSFER = "TRANSFER"         # reported; applying pushes
    CLOSED = "CLOSED"


class ClientInput(enum.Enum):
    REPORTED = "REPORTED"
    PUSH_OK = "PUSH_OK"
    PUSH_MISMATCH = "PUSH_MISMATCH"
    SILENCE = "SILENCE"
    CLOSE = "CLOSE"


_S, _SI = ClientState, ClientInput
CLIENT_TRANSITIONS: dict[tuple[ClientState, ClientInput], ClientState] = {
    (_S.READY, _SI.REPORTED): _S.TRANSFER,
    (_S.READY, _SI.PUSH_OK): _S.TRANSFER,   # a push racing our first report is still in order
    (_S.READY, _SI.PUSH_MISMATCH): _S.CLOSED,
    (_S.READY, _SI.SILENCE): _S.CLOSED,
    (_S.READY, _SI.CLOSE): _S.CLOSED,
    (_S.TRANSFER, _SI.REPORTED): _S.TRANSFER,
    (_S.TRANSFER, _SI.PUSH_OK): _S.TRANSFER,
    (_S.TRANSFER, _SI.PUSH_MISMATCH): _S.CLOSED,
    (_S.TRANSFER, _SI.SILENCE): _S.CLOSED,
    (_S.TRANSFER, _SI.CLOSE): _S.CLOSED,
    (_S.CLOSED, _SI.REPORTED): _S.CLOSED,
    (_S.CLOSED, _SI.PUSH_OK): _S.CLOSED,
    (_S.CLOSED, _SI.PUSH_MISMATCH): _S.CLOSED,
    (_S.CLOSED, _SI.SILENCE): _S.CLOSED,
    (_S.CLOSED, _SI.CLOSE): _S.CLOSED,
}


class PushVerdict(enum.Enum):
    APPEND = "APPEND"             # append the bytes at own max offset (== push offset)
    RESET_AND_APPEND = "RESET_AND_APPEND"   # empty slave: start the log at the push offset, then append
    HEARTBEAT = "HEARTBEAT"       # in step, nothing to write
    DROP = "DROP"                 # out of step or closed: close the link


class HAClientCore:
    """When the slave reports, and whether a push fits its log."""

    def __init__(self, now_ms: int, timings: HATimings = HATimings()):
        self.t = timings
        self.state = ClientState.READY
        self.close_reason = ""
        self.last_reported = -1       # offset in our last report; -1 = none on this link yet
        self.last_report_ms = now_ms
        self.last_push_ms = now_ms    # the silence clock starts at connect

    def _input(self, inp: ClientInput, reason: str = "") -> None:
        self.state = _step(CLIENT_TRANSITIONS, self.state, inp)  # type: ignore[assignment]
        if self.state is ClientState.CLOSED and not self.close_reason:
            self.close_reason = reason or inp.value

    def on_push(self, offset: int, size: int, own_max: int, now_ms: int) -> PushVerdict:
        if self.state is ClientState.CLOSED:
            return PushVerdict.DROP
        if own_max != 0 and offset != own_max:
            self._input(ClientInput.PUSH_MISMATCH, f"push at {offset} but slave max offset is {own_max}")
            return PushVerdict.DROP
        self.last_push_ms = now_ms
        self._input(ClientInput.PUSH_OK)
        if size == 0:
            return PushVerdict.HEARTBEAT
        if own_max == 0 and offset != 0:
            return PushVerdict.RESET_AND_APPEND
        return PushVerdict.APPEND

    def report_due(self, own_max: int, now_ms: int) -> int | None:
        """The offset to report now, or None. Call after each batch and on every tick."""
        if self.state is ClientState.CLOSED:
            return None
        if own_max != self.last_reported or now_ms - self.last_report_ms >= self.t.heartbeat_interval_ms:
            return own_max
        return None

    def reported(self, offset: int, now_ms: int) -> None:
        self.last_reported = offset
        self.last_report_ms = now_ms
        self._input(ClientInput.REPORTED)

    def check_silence(self, now_ms: int) -> bool:
        """True if the link must close now: nothing from the master (heartbeats included) for 20 s."""
        if self.state is ClientState.CLOSED:
            return True
        if now_ms - self.last_push_ms > self.t.housekeeping_ms:
            self._input(ClientInput.SILENCE, f"no push from master for {now_ms - self.last_push_ms} ms")
            return True
        return False

    def close(self, reason: str) -> None:
        self._input(ClientInput.CLOSE, reason)


# ===================================================================================
# Master side: all slaves together, and the SYNC_MASTER wait
# ===================================================================================

class WaitState(enum.Enum):
    WAITING = "WAITING"
    ACKED = "ACKED"
    FLUSH_SLAVE_TIMEOUT = "FLUSH_SLAVE_TIMEOUT"
    SLAVE_NOT_AVAILABLE = "SLAVE_NOT_AVAILABLE"


class WaitInput(enum.Enum):
    ACK = "ACK"                   # the required slaves have acked past the end offset
    NO_SLAVE = "NO_SLAVE"         # no slave within the in-sync gap (checked once, at the start)
    TIMEOUT = "TIMEOUT"           # slave_ack_timeout_ms elapsed
    PENDING = "PENDING"           # none of the above yet


_W, _WI = WaitState, WaitInput
WAIT_TRANSITIONS: dict[tuple[WaitState, WaitInput], WaitState] = {
    (_W.WAITING, _WI.ACK): _W.ACKED,
    (_W.WAITING, _WI.NO_SLAVE): _W.SLAVE_NOT_AVAILABLE,
    (_W.WAITING, _WI.TIMEOUT): _W.FLUSH_SLAVE_TIMEOUT,
    (_W.WAITING, _WI.PENDING): _W.WAITING,
}
# Terminal states absorb every input: a producer gets exactly one answer.
for _term in (_W.ACKED, _W.FLUSH_SLAVE_TIMEOUT, _W.SLAVE_NOT_AVAILABLE):
    for _inp in WaitInput:
        WAIT_TRANSITIONS[(_term, _inp)] = _term


@dataclass(slots=True)
class SlaveProgress:
    broker_id: int | None         # known when the slave announced it (controller mode), else None
    ack_offset: int               # the slave's last reported max offset
    last_report_ms: int


@dataclass(slots=True)
class WaitTicket:
    """One SYNC_MASTER append waiting for slave acks."""

    end_offset: int               # first byte after the batch; a slave ack >= this covers it
    started_ms: int
    state: WaitState = WaitState.WAITING


@dataclass
class HAServiceCore:
    """Slave acks and the SYNC_MASTER decision. The shell feeds reports and asks `check`."""

    master_id: int = 0
    timings: HATimings = field(default_factory=HATimings)
    all_ack_in_sync_state_set: bool = False     # allAckInSyncStateSet: every SSS member must ack
    min_in_sync_replicas: int = 1               # minInSyncReplicas, only with all_ack_in_sync_state_set
    # SyncStateSet from the controller (broker ids, master included); None = no controller.
    sync_state_set: frozenset[int] | None = None
    slaves: dict[int, SlaveProgress] = field(default_factory=dict)   # by connection id
    # Highest end offset a SYNC_MASTER producer was told is replicated. A slave joins the
    # in-sync set only once it holds all of it, so with all_ack_in_sync_state_set every
    # SyncStateSet member (hence any master elected from it) has every acked message.
    confirm_offset: int = 0
    # Slaves this master counts as in sync (RocketMQ's locally expanded SyncStateSet). A slave
    # joins on the report that reaches the confirm offset, and from that moment its ack is
    # required (with all_ack_in_sync_state_set), before the controller has even heard of it:
    # acks can then never run ahead of a slave the controller may elect. It stays until it
    # disconnects, falls past the gap or goes silent; membership is not re-sampled against a
    # confirm offset that moves on every write.
    in_sync: set[int] = field(default_factory=set)
    # haMaxTimeSlaveNotCatchup (RocketMQ's lastCaughtUpTimeMs): per broker id, the latest time T
    # such that the slave has acked everything the master held at T. Pushes leave samples
    # (master max, time) per connection; a report that reaches a sample's offset moves T to it.
    caught_up_ms: dict[int, int] = field(default_factory=dict)
    _samples: dict[int, deque] = field(default_factory=dict)   # by connection id, oldest first
    # The controller can widen its SyncStateSet from any in-sync report this master sent that
    # the set does not reflect yet (ha.controller.alter_sync_state_set), however old: such a
    # broker must ack from now on. `session` numbers this promotion; `reported` holds, per
    # distinct in-sync set reported, the last heartbeat (seq) that said it; `reflected` is the
    # report, (session, seq), the held view of the set reflects: (0, 0) for none yet at a new
    # epoch, None when a report of an earlier promotion or process at this epoch may still
    # apply (its content unknown: every broker of the group, `group_brokers`, must then ack).
    session: int = 0
    reported: dict[int, frozenset[int]] = field(default_factory=dict)
    reflected: tuple[int, int] | None = None
    group_brokers: frozenset[int] = frozenset()

    def on_push(self, conn_id: int, master_max: int, now_ms: int) -> None:
        """The master pushed to `conn_id` while holding `master_max` bytes (one sample per
        CATCHUP_SAMPLE_MS; a newer offset within that window raises the last sample's offset,
        which only ever asks more of the slave)."""
        q = self._samples.setdefault(conn_id, deque(maxlen=CATCHUP_SAMPLES))
        if q and now_ms - q[-1][1] < CATCHUP_SAMPLE_MS:
            if master_max > q[-1][0]:
                q[-1] = (master_max, q[-1][1])
        elif not q or master_max > q[-1][0]:
            q.append((master_max, now_ms))

    def on_report(self, conn_id: int, broker_id: int | None, offset: int, now_ms: int,
                  master_max: int | None = None) -> None:
        """A slave's ack. `master_max`, the master's max offset now, lets an ack of everything
        count as caught up at once (an idle master pushes nothing to sample)."""
        prev = self.slaves.get(conn_id)
        if prev is not None:
            assert offset >= prev.ack_offset, "HAConnectionCore rejects reports that go back"
        self.slaves[conn_id] = SlaveProgress(broker_id, offset, now_ms)
        if broker_id is None or broker_id == self.master_id:
            return
        caught = now_ms if master_max is not None and offset >= master_max else None
        q = self._samples.get(conn_id)
        while q and q[0][0] <= offset:
            t = q.popleft()[1]
            caught = t if caught is None else max(caught, t)
        if caught is not None and caught > self.caught_up_ms.get(broker_id, -1):
            self.caught_up_ms[broker_id] = caught
        if offset >= self.confirm_offset and self._caught_up_recently(broker_id, now_ms):
            self.in_sync.add(broker_id)

    def _caught_up_recently(self, broker_id: int, now_ms: int) -> bool:
        last = self.caught_up_ms.get(broker_id)
        return last is not None and now_ms - last <= self.timings.max_time_slave_not_catchup_ms

    def remove(self, conn_id: int) -> None:
        self._samples.pop(conn_id, None)
        gone = self.slaves.pop(conn_id, None)
        if gone is not None and gone.broker_id is not None and not any(
                s.broker_id == gone.broker_id for s in self.slaves.values()):
            self.in_sync.discard(gone.broker_id)
            self.caught_up_ms.pop(gone.broker_id, None)

    def become_master(self, master_max: int, session: int = 0, new_epoch: bool = True) -> None:
        """A new term as master. Its SyncStateSet starts as itself, so the confirm offset is its
        whole log (RocketMQ: the minimum over the SyncStateSet's offsets): a slave joins the
        in-sync set only once it holds everything this master held at promotion, which covers
        every message any earlier master acked. `session` numbers this promotion (newer than
        any earlier one of this broker); at a new epoch no earlier report can alter the set
        (an alter needs a heartbeat of the current epoch), within its epoch one may."""
        self.confirm_offset = max(self.confirm_offset, master_max)
        self.in_sync.clear()
        self.caught_up_ms.clear()
        self._samples.clear()
        self.session = session
        self.reported.clear()
        self.reflected = (0, 0) if new_epoch else None

    def report(self, seq: int, in_sync: frozenset[int]) -> bool:
        """Remember what heartbeat `seq` of this session tells the controller. True (`pending`:
        the heartbeat asks for the set to be brought up to it) while the view is unconfirmed or
        members reported since it stay required only because of those reports."""
        last = max(self.reported, default=None)
        if last is not None and self.reported[last] == in_sync:
            del self.reported[last]        # the same set again: only its latest seq matters
        self.reported[seq] = in_sync
        return self.reflected is None or bool(self._unreflected() - self.in_sync - (self.sync_state_set or set()))

    def on_controller_view(self, sss: frozenset[int], session: int, seq: int, brokers: frozenset[int]) -> bool:
        """The controller's SyncStateSet and the report it reflects, (session, seq), taken as a
        pair. A view older than the one held (a lagging controller's) is ignored: its set could
        lack a member the newer one has. False when ignored."""
        self.group_brokers = self.group_brokers | brokers
        view = (session, seq)
        if self.reflected is not None and view < self.reflected:
            return False
        self.sync_state_set = sss
        if self.reflected is not None or session == self.session:
            self.reflected = view
            for s in [s for s in self.reported if session == self.session and s <= seq]:
                del self.reported[s]
        return True

    def _unreflected(self) -> set[int]:
        """Members of this session's reports the held view does not reflect."""
        after = self.reflected[1] if self.reflected is not None and self.reflected[0] == self.session else 0
        out: set[int] = set()
        for s, members in self.reported.items():
            if s > after:
                out |= members
        return out

    def best_ack(self) -> int:
        """push2SlaveMaxOffset: the furthest any connected slave has acked (-1 with none)."""
        return max((s.ack_offset for s in self.slaves.values()), default=-1)

    def slave_available(self, end_offset: int) -> bool:
        """isSlaveOK: some slave is connected and within the in-sync gap of `end_offset`."""
        best = self.best_ack()
        return best >= 0 and end_offset - best < self.timings.max_gap_not_in_sync_bytes

    def in_sync_broker_ids(self, master_max: int, now_ms: int) -> frozenset[int]:
        """Slaves (by broker id) that hold every acked message, are within the gap and were heard
        from recently: what the master reports to the controller for the SyncStateSet."""
        gap, silence = self.timings.max_gap_not_in_sync_bytes, self.timings.housekeeping_ms
        acks = self.acked_by_broker()
        last = {}
        for s in self.slaves.values():
            if s.broker_id is not None:
                last[s.broker_id] = max(last.get(s.broker_id, s.last_report_ms), s.last_report_ms)
        for b in list(self.in_sync):
            if (b not in acks or master_max - acks[b] > gap or now_ms - last[b] > silence
                    or not self._caught_up_recently(b, now_ms)):
                self.in_sync.discard(b)   # shrink: it rejoins only by reaching the confirm offset again
        return frozenset(self.in_sync)

    def acked_by_broker(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for s in self.slaves.values():
            if s.broker_id is not None:
                out[s.broker_id] = max(out.get(s.broker_id, -1), s.ack_offset)
        return out

    def _required_slaves(self) -> frozenset[int]:
        """The controller's SyncStateSet plus the slaves this master already counts in sync
        (an expansion the controller has not confirmed yet); a slave the master dropped stays
        required until the controller's SyncStateSet drops it too. With a controller, also
        every broker this master reported in sync since the report the set reflects, and
        every broker of the group while a report of unknown content may still apply."""
        if self.sync_state_set is None:
            return frozenset(self.in_sync) - {self.master_id}
        out = self.sync_state_set | self.in_sync | self._unreflected()
        if self.reflected is None:
            out |= self.group_brokers
        return frozenset(out) - {self.master_id}

    def covered_offset(self) -> int:
        """Every SYNC_MASTER append ending at or below this offset has the acks it needs: the
        best slave ack, or with all_ack_in_sync_state_set the lowest ack of the required slaves
        (no slave required: everything is covered). Waiters sorted by end offset are released
        up to here, so a report costs O(waiters released)."""
        if not self.all_ack_in_sync_state_set:
            return self.best_ack()
        required = self._required_slaves()
        if not required:
            return NO_LIMIT
        acks = self.acked_by_broker()
        return min(acks.get(b, -1) for b in required)

    def _covered(self, end_offset: int) -> bool:
        return self.covered_offset() >= end_offset

    def _unavailable(self, end_offset: int) -> bool:
        if not self.all_ack_in_sync_state_set:
            return not self.slave_available(end_offset)
        sss = self.sync_state_set if self.sync_state_set is not None else frozenset({self.master_id})
        return len(sss) < self.min_in_sync_replicas

    def begin(self, end_offset: int, now_ms: int) -> WaitTicket:
        """Start waiting for an append ending at `end_offset`; the availability check is made once, here."""
        ticket = WaitTicket(end_offset, now_ms)
        if self._unavailable(end_offset):
            ticket.state = _step(WAIT_TRANSITIONS, ticket.state, WaitInput.NO_SLAVE)  # type: ignore[assignment]
        return self.check(ticket, now_ms)

    def check(self, ticket: WaitTicket, now_ms: int) -> WaitTicket:
        """Advance the ticket: ACKED if covered, FLUSH_SLAVE_TIMEOUT past the timeout, else WAITING."""
        if self._covered(ticket.end_offset):
            inp = WaitInput.ACK
        elif now_ms - ticket.started_ms >= self.timings.slave_ack_timeout_ms:
            inp = WaitInput.TIMEOUT
        else:
            inp = WaitInput.PENDING
        ticket.state = _step(WAIT_TRANSITIONS, ticket.state, inp)  # type: ignore[assignment]
        if ticket.state is WaitState.ACKED:
            self.confirm_offset = max(self.confirm_offset, ticket.end_offset)
        return ticket

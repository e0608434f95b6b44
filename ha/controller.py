"""The controller: topics, routes and classic-group mastership, replicated with pysyncobj.

Two halves:

1. Pure (no IO, no clock, no Raft): `elect`, `alter_sync_state_set`, `apply_op`,
   `merge_states`, `route_of`. Time is `now_ms`; the deterministic simulator and the
   unit tests drive these directly.
2. `ControllerStateMachine(SyncObj)`: one `@replicated` method, `apply(op)`, that runs
   `apply_op` under a lock and then persists the whole state with fsync (pysyncobj's
   journal is mmap-backed and never fsynced, DESIGN section 4).

What is replicated: decisions only (topic created, broker registered, new master,
SyncStateSet altered, DLedger leader seen). What is not: heartbeats. Every controller
keeps its own liveness table from the brokers' heartbeats (brokers beat all
controllers), and only the Raft leader turns liveness into decisions.

Every op is idempotent and guarded by a monotonic version (master epoch, SyncStateSet
epoch, topic version, DLedger term), so a journal replayed on top of the fsynced state
file, or a pysyncobj snapshot older than that file, can never move state backwards;
`merge_states` takes the newer of each part.

Election (RocketMQ DefaultElectPolicy, DESIGN section 4): candidates are the alive
members of the SyncStateSet (all alive brokers with `unclean`, or before a group's first
master); the best has the highest epoch, then the highest max offset, then the lowest
election priority, then the lowest broker id. The new epoch is one above both the
controller's epoch and the highest epoch any broker of the group ever reported, so a
controller that lost its state cannot elect backwards.
"""

from __future__ import annotations

import copy
import enum
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

from node.store.fileio import FileSystem
from node.store.reserve import DiskReserve

log = logging.getLogger(__name__)

STATE_FILE = "controller-state.json"
JOURNAL_FILE = "raft.journal"
JOURNAL_RESERVE_BYTES = 16 * 1024 * 1024   # blocks allocated ahead for pysyncobj's mmap'd journal
STATE_RESERVE_BYTES = 4 * 1024 * 1024      # <data dir>/reserve, given up for a state write on a full disk


# ===================================================================================
# Inputs: heartbeats (local to each controller, never replicated)
# ===================================================================================

@dataclass(frozen=True, slots=True)
class BrokerHeartbeat:
    group: str
    broker_id: int
    addr: str                    # broker API address host:port (what clients use)
    ha_addr: str = ""            # classic: the broker's HA listen address host:port
    epoch: int = 0               # classic: newest epoch in the broker's epoch file
    max_offset: int = 0          # classic: commitlog max offset
    priority: int = 0            # electionPriority: lower is preferred (RocketMQ)
    mode: str = "classic"        # "classic" | "dledger"
    in_sync: tuple[int, ...] = ()   # classic master only: slaves within haMaxGapNotInSync
    # Classic master only: which report this is, (session, seq), ordered. A session is one
    # promotion of one master process (a re-promotion or a restart starts a newer one); seq
    # counts its heartbeats. `pending`: the master still counts members from reports the
    # SyncStateSet does not reflect yet, and asks for it to be brought up to this report.
    session: int = 0
    seq: int = 0
    pending: bool = False
    term: int = 0                # dledger: current Raft term
    is_leader: bool = False      # dledger: this node leads its group
    last_seen_ms: int = 0        # stamped by the controller on receipt


@dataclass(frozen=True, slots=True)
class ElectOptions:
    heartbeat_timeout_ms: int = 3_000    # master missing beats this long is lost (1 s beats)
    unclean: bool = False                # allow electing outside the SyncStateSet (may lose acked data)

    def validate(self) -> None:
        if self.heartbeat_timeout_ms <= 0:
            raise ValueError("ElectOptions.heartbeat_timeout_ms must be > 0")


def alive(heartbeats: Mapping[int, BrokerHeartbeat], now_ms: int, opts: ElectOptions) -> dict[int, BrokerHeartbeat]:
    return {b: hb for b, hb in heartbeats.items() if now_ms - hb.last_seen_ms <= opts.heartbeat_timeout_ms}


# ===================================================================================
# The broker's role as the controller sees it: one table
# ===================================================================================

class BrokerRole(enum.Enum):
    UNKNOWN = "UNKNOWN"          # not registered
    MASTER = "MASTER"
    IN_SYNC_SLAVE = "IN_SYNC_SLAVE"   # slave in the SyncStateSet: may be elected
    SLAVE = "SLAVE"              # slave outside the SyncStateSet


class RoleInput(enum.Enum):
    REGISTER = "REGISTER"
    ELECTED = "ELECTED"
    OTHER_ELECTED = "OTHER_ELECTED"   # another broker became master: everyone else is a plain slave
    JOIN_SSS = "JOIN_SSS"
    LEAVE_SSS = "LEAVE_SSS"


_R, _RI = BrokerRole, RoleInput
ROLE_TRANSITIONS: dict[tuple[BrokerRole, RoleInput], BrokerRole] = {
    (_R.UNKNOWN, _RI.REGISTER): _R.SLAVE,
    (_R.UNKNOWN, _RI.ELECTED): _R.MASTER,            # first master of a new group registers and wins at once
    (_R.UNKNOWN, _RI.OTHER_ELECTED): _R.UNKNOWN,
    (_R.UNKNOWN, _RI.JOIN_SSS): _R.UNKNOWN,          # impossible in practice; ignored
    (_R.UNKNOWN, _RI.LEAVE_SSS): _R.UNKNOWN,
    (_R.SLAVE, _RI.REGISTER): _R.SLAVE,
    (_R.SLAVE, _RI.ELECTED): _R.MASTER,              # only via unclean election or a group's first
    (_R.SLAVE, _RI.OTHER_ELECTED): _R.SLAVE,
    (_R.SLAVE, _RI.JOIN_SSS): _R.IN_SYNC_SLAVE,
    (_R.SLAVE, _RI.LEAVE_SSS): _R.SLAVE,
    (_R.IN_SYNC_SLAVE, _RI.REGISTER): _R.IN_SYNC_SLAVE,
    (_R.IN_SYNC_SLAVE, _RI.ELECTED): _R.MASTER,
    (_R.IN_SYNC_SLAVE, _RI.OTHER_ELECTED): _R.SLAVE,   # a new SSS holds only the new master
    (_R.IN_SYNC_SLAVE, _RI.JOIN_SSS): _R.IN_SYNC_SLAVE,
    (_R.IN_SYNC_SLAVE, _RI.LEAVE_SSS): _R.SLAVE,
    (_R.MASTER, _RI.REGISTER): _R.MASTER,
    (_R.MASTER, _RI.ELECTED): _R.MASTER,              # manual re-election of the same broker
    (_R.MASTER, _RI.OTHER_ELECTED): _R.SLAVE,          # demoted: truncate to the consistent point
    (_R.MASTER, _RI.JOIN_SSS): _R.MASTER,
    (_R.MASTER, _RI.LEAVE_SSS): _R.MASTER,            # the master is always in its own SSS
}


def role_of(group: Mapping[str, Any] | None, broker_id: int) -> BrokerRole:
    """The role the replicated state gives `broker_id` (what the table's edges lead to)."""
    if group is None or str(broker_id) not in group["brokers"]:
        return BrokerRole.UNKNOWN
    if group.get("master_id") == broker_id:
        return BrokerRole.MASTER
    return BrokerRole.IN_SYNC_SLAVE if broker_id in group.get("sss", []) else BrokerRole.SLAVE


# ===================================================================================
# Pure decisions
# ===================================================================================

class DecisionKind(enum.Enum):
    NO_CHANGE = "NO_CHANGE"
    NEW_MASTER = "NEW_MASTER"
    NO_CANDIDATE = "NO_CANDIDATE"     # master lost and nobody eligible (unclean off): wait


@dataclass(frozen=True, slots=True)
class Decision:
    kind: DecisionKind
    group: str
    master_id: int | None = None
    master_addr: str | None = None
    master_ha_addr: str | None = None
    epoch: int = 0
    sync_state_set: frozenset[int] = frozenset()
    sss_epoch: int = 0
    reason: str = ""

    def to_op(self) -> dict:
        assert self.kind is DecisionKind.NEW_MASTER
        return {"op": "set_master", "group": self.group, "master_id": self.master_id,
                "master_addr": self.master_addr, "master_ha_addr": self.master_ha_addr, "epoch": self.epoch,
                "sss": sorted(self.sync_state_set), "sss_epoch": self.sss_epoch}


def election_key(hb: BrokerHeartbeat) -> tuple[int, int, int, int]:
    """Smaller is better: newest epoch, then most data, then lowest priority value, then lowest id.

    Python ints never overflow, so negation is exact for any offset or epoch.
    """
    return (-hb.epoch, -hb.max_offset, hb.priority, hb.broker_id)


def next_epoch(group: Mapping[str, Any], heartbeats: Mapping[int, BrokerHeartbeat]) -> int:
    """One above everything anyone has seen: the controller's epoch and every broker's report."""
    reported = max((hb.epoch for hb in heartbeats.values()), default=0)
    return max(int(group.get("master_epoch", 0)), int(group.get("max_reported_epoch", 0)), reported) + 1


def _candidates(group: Mapping[str, Any], live: Mapping[int, BrokerHeartbeat], opts: ElectOptions) -> dict[int, BrokerHeartbeat]:
    if opts.unclean or int(group.get("master_epoch", 0)) == 0:
        # Before a group's first master no message was ever acked, so any replica is clean.
        return dict(live)
    sss = set(group.get("sss", []))
    return {b: hb for b, hb in live.items() if b in sss}


def elect(group: Mapping[str, Any], heartbeats: Mapping[int, BrokerHeartbeat], now_ms: int,
          opts: ElectOptions, *, force_broker: int | None = None) -> Decision:
    """Decide whether `group` needs a new master, and who. Pure.

    `force_broker` is the manual electMaster: that broker, if it is alive and eligible,
    becomes master even when the current one is healthy.
    """
    name = group["name"]
    live = alive(heartbeats, now_ms, opts)
    master = group.get("master_id")
    if force_broker is None and master is not None and master in live:
        return Decision(DecisionKind.NO_CHANGE, name, reason="master alive")
    cands = _candidates(group, live, opts)
    if force_broker is not None:
        cands = {b: hb for b, hb in cands.items() if b == force_broker}
    if not cands:
        why = "no alive broker in the SyncStateSet" + ("" if opts.unclean else " (unclean election is off)")
        return Decision(DecisionKind.NO_CANDIDATE, name, reason=why)
    best = min(cands.values(), key=election_key)
    return Decision(DecisionKind.NEW_MASTER, name, best.broker_id, best.addr, best.ha_addr,
                    epoch=next_epoch(group, heartbeats), sync_state_set=frozenset({best.broker_id}),
                    sss_epoch=int(group.get("sss_epoch", 0)) + 1,
                    reason=f"elected {best.broker_id} (epoch {best.epoch}, offset {best.max_offset})")


def alter_sync_state_set(group: Mapping[str, Any], heartbeats: Mapping[int, BrokerHeartbeat], now_ms: int,
                         opts: ElectOptions) -> dict | None:
    """The master's report of in-sync slaves as an op, if it changes the SyncStateSet, or if
    the master asks for its SyncStateSet to be brought up to this report (`pending`). Pure.

    Only a master beating at the current epoch may alter it, and only alive, registered
    brokers may join: a stale master must not re-admit slaves after being replaced. The op
    carries the report it comes from, (session, seq); `apply_op` refuses one older than the
    report the SyncStateSet already reflects, so a heartbeat a master sent before it stepped
    down, restarted or dropped a slave can never widen the set after a newer report.
    """
    master = group.get("master_id")
    live = alive(heartbeats, now_ms, opts)
    hb = live.get(master) if master is not None else None
    if hb is None or hb.epoch != group.get("master_epoch"):
        return None
    members = {master} | {b for b in hb.in_sync if b in live and str(b) in group["brokers"]}
    report = (hb.session, hb.seq)
    if _stale(report, sss_report(group)):
        return None
    if members == set(group.get("sss", [])) and not hb.pending:
        return None
    return {"op": "alter_sss", "group": group["name"], "epoch": group["master_epoch"],
            "sss": sorted(members), "sss_epoch": int(group.get("sss_epoch", 0)) + 1,
            "session": hb.session, "seq": hb.seq}


def sss_report(group: Mapping[str, Any]) -> tuple[int, int]:
    """The master's report the SyncStateSet reflects, (session, seq); (0, 0) after an election."""
    return (int(group.get("sss_session", 0)), int(group.get("sss_seq", 0)))


def _stale(report: tuple[int, int], reflected: tuple[int, int]) -> bool:
    """A report no newer than the one the set reflects. (0, 0) is a master that numbers no
    reports (an older broker): its alters apply as before, until a numbered one has."""
    return report <= reflected and report != (0, 0) or report < reflected


# ===================================================================================
# Replicated state and its ops (pure, idempotent, guarded)
# ===================================================================================

def empty_state() -> dict:
    return {"topics": {}, "groups": {}}


def _new_group(name: str, mode: str) -> dict:
    return {"name": name, "mode": mode, "master_id": None, "master_addr": None, "master_ha_addr": None,
            "master_epoch": 0, "max_reported_epoch": 0, "sss": [], "sss_epoch": 0, "brokers": {},
            "leader_term": 0, "sss_session": 0, "sss_seq": 0}


def _op_register(state: dict, op: dict) -> bool:
    g = state["groups"].setdefault(op["group"], _new_group(op["group"], op.get("mode", "classic")))
    info = {"addr": op["addr"], "ha_addr": op.get("ha_addr", "")}
    changed = g["brokers"].get(str(op["broker_id"])) != info
    g["brokers"][str(op["broker_id"])] = info
    if op.get("epoch", 0) > g["max_reported_epoch"]:
        g["max_reported_epoch"] = op["epoch"]
        changed = True
    return changed


def _op_set_master(state: dict, op: dict) -> bool:
    g = state["groups"].setdefault(op["group"], _new_group(op["group"], "classic"))
    if op["epoch"] <= g["master_epoch"]:
        return False   # replayed or stale: epochs only rise
    g.update(master_id=op["master_id"], master_addr=op["master_addr"], master_ha_addr=op["master_ha_addr"],
             master_epoch=op["epoch"], sss=list(op["sss"]), sss_epoch=max(op["sss_epoch"], g["sss_epoch"] + 1),
             sss_session=0, sss_seq=0)   # the new master's reports start over
    g["max_reported_epoch"] = max(g["max_reported_epoch"], op["epoch"])
    return True


def _op_alter_sss(state: dict, op: dict) -> bool:
    g = state["groups"].get(op["group"])
    if g is None or op["epoch"] != g["master_epoch"] or op["sss_epoch"] <= g["sss_epoch"]:
        return False
    report = (int(op.get("session", 0)), int(op.get("seq", 0)))
    if _stale(report, sss_report(g)):
        return False   # from a report older than the one the set reflects
    assert g["master_id"] in op["sss"], "the master is always in its SyncStateSet"
    g.update(sss=list(op["sss"]), sss_epoch=op["sss_epoch"], sss_session=report[0], sss_seq=report[1])
    return True


def _op_dledger_leader(state: dict, op: dict) -> bool:
    g = state["groups"].setdefault(op["group"], _new_group(op["group"], "dledger"))
    if op["term"] < g["leader_term"] or (op["term"] == g["leader_term"] and g["master_id"] == op["broker_id"]):
        return False
    g.update(mode="dledger", master_id=op["broker_id"], master_addr=op["addr"], leader_term=op["term"])
    return True


def _op_create_topic(state: dict, op: dict) -> bool:
    cur = state["topics"].get(op["topic"])
    if cur is not None and cur["version"] >= op["version"]:
        return False
    state["topics"][op["topic"]] = {"queues": op["queues"], "perm": op.get("perm", 6),
                                   "assign": op["assign"], "version": op["version"]}
    return True


_OPS = {"register": _op_register, "set_master": _op_set_master, "alter_sss": _op_alter_sss,
        "dledger_leader": _op_dledger_leader, "create_topic": _op_create_topic}


def apply_op(state: dict, op: dict) -> bool:
    """Apply one replicated op in place; True if it changed anything."""
    fn = _OPS.get(op.get("op", ""))
    if fn is None:
        log.error("controller: unknown op %r ignored", op.get("op"))
        return False
    return fn(state, op)


def assign_queues(queues: int, groups: list[str]) -> dict[str, list[int]]:
    """Global queue ids spread round-robin over the groups (sorted for determinism)."""
    assert queues > 0 and groups
    ordered = sorted(groups)
    out: dict[str, list[int]] = {g: [] for g in ordered}
    for q in range(queues):
        out[ordered[q % len(ordered)]].append(q)
    return {g: qs for g, qs in out.items() if qs}


def _group_version(g: Mapping[str, Any]) -> tuple[int, int, int]:
    return (int(g.get("master_epoch", 0)), int(g.get("sss_epoch", 0)), int(g.get("leader_term", 0)))


def merge_states(a: dict, b: dict) -> dict:
    """The newer of each group and topic (by their monotonic versions); brokers unioned."""
    out = copy.deepcopy(a)
    for name, g in b.get("groups", {}).items():
        mine = out["groups"].get(name)
        if mine is None or _group_version(g) > _group_version(mine):
            brokers = {**(mine or {}).get("brokers", {}), **g["brokers"]}
            out["groups"][name] = {**copy.deepcopy(g), "brokers": brokers}
        else:
            mine["brokers"] = {**g["brokers"], **mine["brokers"]}
        out["groups"][name]["max_reported_epoch"] = max(int(g.get("max_reported_epoch", 0)),
                                                         int((mine or {}).get("max_reported_epoch", 0)))
    for name, t in b.get("topics", {}).items():
        if name not in out["topics"] or t["version"] > out["topics"][name]["version"]:
            out["topics"][name] = copy.deepcopy(t)
    return out


def route_of(state: Mapping[str, Any], topic: str) -> dict | None:
    """TopicRouteData: queue_datas (per group) and broker_datas (addresses, master), plus a flat list."""
    t = state["topics"].get(topic)
    if t is None:
        return None
    queue_datas, broker_datas, queues = [], [], []
    for gname, qids in sorted(t["assign"].items()):
        g = state["groups"].get(gname) or _new_group(gname, "classic")
        queue_datas.append({"broker_name": gname, "queue_ids": qids, "perm": t["perm"]})
        broker_datas.append(group_view(g))
        queues += [{"queue_id": q, "broker_name": gname, "addr": g["master_addr"]} for q in qids]
    return {"topic": topic, "queue_datas": queue_datas, "broker_datas": broker_datas,
            "queues": sorted(queues, key=lambda q: q["queue_id"])}


def broker_addrs(g: Mapping[str, Any]) -> dict[str, str]:
    """brokerId (as a string) -> API address of every broker the group has registered."""
    return {b: i["addr"] for b, i in sorted(g["brokers"].items(), key=lambda kv: int(kv[0]))}


def group_view(g: Mapping[str, Any]) -> dict:
    return {"broker_name": g["name"], "mode": g["mode"], "master_id": g["master_id"],
            "master_addr": g["master_addr"], "master_ha_addr": g.get("master_ha_addr"),
            "master_epoch": g["master_epoch"], "sync_state_set": list(g["sss"]), "sss_epoch": g["sss_epoch"],
            "leader_term": g.get("leader_term", 0), "broker_addrs": broker_addrs(g)}


# ===================================================================================
# Liveness (per controller process, not replicated)
# ===================================================================================

@dataclass
class Liveness:
    """Heartbeats seen by this controller, bounded by the number of registered brokers."""

    max_brokers: int = 10_000
    beats: dict[str, dict[int, BrokerHeartbeat]] = field(default_factory=dict)

    def record(self, hb: BrokerHeartbeat) -> bool:
        group = self.beats.setdefault(hb.group, {})
        if hb.broker_id not in group and sum(len(g) for g in self.beats.values()) >= self.max_brokers:
            return False
        group[hb.broker_id] = hb
        return True

    def of(self, group: str) -> dict[int, BrokerHeartbeat]:
        return self.beats.get(group, {})


def plan_ops(state: Mapping[str, Any], live: Liveness, now_ms: int, opts: ElectOptions) -> list[dict]:
    """Everything the leader controller should propose now. Pure."""
    ops: list[dict] = []
    for name, g in sorted(state["groups"].items()):
        if g["mode"] != "classic":
            continue
        beats = live.of(name)
        d = elect(g, beats, now_ms, opts)
        if d.kind is DecisionKind.NEW_MASTER:
            log.warning("controller: group %s: %s", name, d.reason)
            ops.append(d.to_op())
            continue
        alter = alter_sync_state_set(g, beats, now_ms, opts)
        if alter is not None:
            log.info("controller: group %s: SyncStateSet %s -> %s", name, sorted(g.get("sss", [])), alter["sss"])
            ops.append(alter)
    return ops


def ops_for_heartbeat(state: Mapping[str, Any], hb: BrokerHeartbeat) -> list[dict]:
    """Registration and DLedger leadership changes a heartbeat implies (only when they change)."""
    g = state["groups"].get(hb.group)
    ops = []
    info = (g or {}).get("brokers", {}).get(str(hb.broker_id))
    if (info is None or info["addr"] != hb.addr or info["ha_addr"] != hb.ha_addr
            or hb.epoch > (g or {}).get("max_reported_epoch", 0)):
        ops.append({"op": "register", "group": hb.group, "broker_id": hb.broker_id, "addr": hb.addr,
                    "ha_addr": hb.ha_addr, "mode": hb.mode, "epoch": hb.epoch})
    if hb.mode == "dledger" and hb.is_leader:
        if g is None or g.get("master_id") != hb.broker_id or hb.term > g.get("leader_term", 0):
            ops.append({"op": "dledger_leader", "group": hb.group, "broker_id": hb.broker_id,
                        "addr": hb.addr, "term": hb.term})
    return ops


def heartbeat_reply(state: Mapping[str, Any], group: str, broker_id: int) -> dict:
    """What a broker learns from a heartbeat: its role, the master, the epoch, the SSS, its topics."""
    g = state["groups"].get(group)
    topics = {t: v["assign"].get(group, []) for t, v in state["topics"].items() if group in v["assign"]}
    if g is None:
        return {"role": BrokerRole.UNKNOWN.value, "master_id": None, "master_addr": None,
                "master_ha_addr": None, "epoch": 0, "sync_state_set": [], "topics": topics}
    session, seq = sss_report(g)
    return {"role": role_of(g, broker_id).value, "master_id": g["master_id"], "master_addr": g["master_addr"],
            "master_ha_addr": g.get("master_ha_addr"), "epoch": g["master_epoch"],
            "sync_state_set": list(g["sss"]), "sss_session": session, "sss_seq": seq,
            "brokers": sorted(int(b) for b in g["brokers"]), "broker_addrs": broker_addrs(g), "topics": topics}


# ===================================================================================
# Durable state file
# ===================================================================================

def load_state(fs: FileSystem, directory: str) -> dict:
    path = os.path.join(directory, STATE_FILE)
    if not fs.exists(path):
        return empty_state()
    state = json.loads(fs.read_file(path).decode("utf-8"))
    assert "topics" in state and "groups" in state
    return state


def save_state(fs: FileSystem, directory: str, state: Mapping[str, Any]) -> None:
    fs.write_atomic(os.path.join(directory, STATE_FILE),
                    json.dumps(state, sort_keys=True, separators=(",", ":")).encode("utf-8"))


# ===================================================================================
# The replicated state machine (pysyncobj)
# ===================================================================================

from pysyncobj import SyncObj, SyncObjConf, replicated  # noqa: E402  (kept next to its only user)


class ControllerStateMachine(SyncObj):
    """pysyncobj node holding the controller state; decisions go through `apply`.

    `_durable` (set before SyncObj.__init__, so pysyncobj never serializes it) is the
    state last fsynced to our file; every apply merges it back in, so a pysyncobj
    snapshot or journal older than our file cannot roll decisions back.
    """

    def __init__(self, self_raft_addr: str, peer_raft_addrs: list[str], data_dir: str,
                 fs: FileSystem | None = None, reserve_bytes: int = STATE_RESERVE_BYTES, **conf_overrides: Any):
        self._fs = fs or FileSystem()
        self._dir = self.data_dir = data_dir
        self._fs.makedirs(data_dir)
        self._lock = threading.Lock()
        self._durable = load_state(self._fs, data_dir)
        # Set when the state could not be persisted (a full disk past the reserve): the state
        # machine applies nothing more and the server stops the process (controller_server._watch_fatal).
        self.fatal: OSError | None = None
        self.reserve = DiskReserve(self._fs, data_dir, reserve_bytes)
        self.reserve.ensure()
        journal = os.path.join(data_dir, JOURNAL_FILE)
        conf = SyncObjConf(
            journalFile=journal,
            # Without a dump file pysyncobj keeps its compaction snapshot in memory only: after a
            # restart of every controller the journal starts past the commit index and the state
            # machine never becomes ready (no election ever again).
            fullDumpFile=os.path.join(data_dir, "raft.dump"),
            # appendEntriesUseBatch stays at its default (True): with False pysyncobj 0.3.17
            # logged "state machine may have diverged" under pipelined load (DESIGN section 4).
            dynamicMembershipChange=False,
            **conf_overrides)
        super().__init__(self_raft_addr, peer_raft_addrs, conf)
        self.state = copy.deepcopy(self._durable)
        # pysyncobj's journal is an mmap grown with ftruncate: on a full disk a write into a
        # grown page kills the process (SIGBUS). Its blocks are allocated ahead instead, so
        # the journal never needs a new block below this size (compaction keeps it far below).
        try:
            self._fs.reserve_blocks(journal, JOURNAL_RESERVE_BYTES)
        except OSError as e:
            log.warning("cannot allocate %d bytes ahead for the Raft journal %s (%s): a full disk may then "
                        "stop this controller with SIGBUS", JOURNAL_RESERVE_BYTES, journal, e)
        self._store_term_on_reserve()

    def _store_term_on_reserve(self) -> None:
        """pysyncobj stores term and vote as a temp file renamed over `raft.journal.meta`
        (journal.MetaStorer), which needs a free block. On a disk full to the last block a
        follower whose election timer fired set its term in memory, failed to store it, and
        could store no later term either: it stayed out of the group until space came back (a CI
        run: the full follower never applied another decision). The write now gives up the
        reserve on ENOSPC, as the state file's does; the rename frees the old file's block, so
        later writes fit in the room the reserve left."""
        storer = getattr(getattr(self, "_SyncObj__raftLog", None), "_FileJournal__metaStorer", None)
        store = getattr(storer, "storeMeta", None)
        if store is None:
            log.warning("controller: pysyncobj's journal has no meta storer where expected; a term write on a "
                        "full disk will not use the reserve")
            return
        storer.storeMeta = lambda meta: self.reserve.using(lambda: store(meta), "the Raft term and vote "
                                                                                "(raft.journal.meta)")

    @replicated
    def apply(self, op: dict) -> bool:
        with self._lock:
            if self.fatal is not None:
                raise self.fatal     # stopping: applied nothing (pysyncobj retries it; nobody sees it)
            self.state = merge_states(self.state, self._durable)
            changed = apply_op(self.state, op)
            if changed:
                # Persist before anyone can observe the decision through our API. A full disk
                # gives up the reserve for it; past that the decision is not applied here (the
                # state in memory goes back to the file's) and the process stops: a restart
                # with room replays it from the journal or the other controllers.
                try:
                    self.reserve.using(lambda: save_state(self._fs, self._dir, self.state), STATE_FILE)
                except OSError as e:
                    self.state = copy.deepcopy(self._durable)
                    self.fatal = e
                    log.critical("controller: cannot persist %s (%s); applying nothing more, stopping",
                                 STATE_FILE, e)
                    raise
                self._durable = copy.deepcopy(self.state)
            return changed

    def snapshot(self) -> dict:
        """A consistent copy of the state for readers on other threads."""
        with self._lock:
            return copy.deepcopy(merge_states(self.state, self._durable))

    def is_leader(self) -> bool:
        return self._isLeader()

    def leader_raft_addr(self) -> str | None:
        node = self._getLeader()
        return None if node is None else node.address if hasattr(node, "address") else str(node)

    def raft_status(self) -> dict:
        st = self.getStatus()
        return {"raft_term": st.get("raft_term"), "leader": str(st.get("leader")),
                "state": st.get("state"), "commit_idx": st.get("commit_idx"),
                "last_applied": st.get("last_applied"), "log_len": st.get("log_len")}

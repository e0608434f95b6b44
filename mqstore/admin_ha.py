"""HA and controller admin verbs, with mqadmin's layouts (`--json` prints the API document).

    mqstore haStatus -n BROKER_API                  master: slaves, ack offsets, diff, in-sync
                                                    slave: master address, max offset
    mqstore getSyncStateSet -a CONTROLLER -b broker-b
    mqstore electMaster -a CONTROLLER -b broker-b -i BROKER_ID
    mqstore getControllerMetaData -a CONTROLLER

`-a` defaults to $MQSTORE_CONTROLLER or 127.0.0.1:9876 and may list several controllers
separated by `;` (the first one answering is used; electMaster follows the leader hint).
Formatting functions are pure so the golden tests can pin them.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from mqstore.cli import CliError, call, human_ms, q

DEFAULT_CONTROLLER = "127.0.0.1:9876"


# --- formatting (pure) ---------------------------------------------------------------------------
def ha_status_text(runtime: dict) -> str:
    """mqadmin HAStatusSubCommand.printStatus."""
    if runtime.get("master"):
        conns = runtime.get("ha_connection_info", [])
        out = ("\n#MasterAddr\t%s\n#MasterCommitLogMaxOffset\t%d\n#SlaveNum\t%d\n#InSyncSlaveNum\t%d\n"
               % (runtime["master_addr"], runtime["master_commit_log_max_offset"], runtime["slave_num"],
                  runtime["in_sync_slave_num"]))
        out += "%-32s  %-16s %16s %16s %16s %16s\n" % ("#SlaveAddr", "#SlaveAckOffset", "#Diff",
                                                      "#TransferSpeed(KB/s)", "#Status", "#TransferFromWhere")
        for c in conns:
            out += "%-32s  %-16d %16d %16.2f %16s %16d\n" % (
                c["addr"], c["slave_ack_offset"], c["diff"], c["transferred_bytes_per_s"] / 1024.0,
                "OK" if c["in_sync"] else "Fall Behind", c["transfer_from_where"])
        return out
    return ("\n#MasterAddr\t%s\n#CommitLogMaxOffset\t%d\n#TransferSpeed(KB/s)\t%.2f\n#LastReadTime\t%s\n"
            "#LastWriteTime\t%s\n#MasterFlushOffset\t%s\n"
            % (runtime.get("master_addr") or "", runtime["max_offset"], runtime["transferred_bytes_per_s"] / 1024.0,
               _time(runtime.get("last_read_ms", 0)), _time(runtime.get("last_write_ms", 0)),
               runtime.get("master_offset_seen", -1)))


def _time(ms: int) -> str:
    return human_ms(ms) if ms > 0 else ""


def _replica(name: str, broker_id: int, addr: str) -> str:
    return f"ReplicaIdentity{{brokerName='{name}', brokerId={broker_id}, brokerAddress='{addr}'}}"


def sync_state_set_text(view: dict, online: set[int] | None = None) -> str:
    """mqadmin GetSyncStateSetSubCommand.printData for one group (a group_view document)."""
    name, sss = view["broker_name"], [int(b) for b in view["sync_state_set"]]
    addrs = {int(b): a for b, a in view.get("broker_addrs", {}).items()}
    online = set(addrs) if online is None else online
    out = ("\n#brokerName\t%s\n#MasterAddr\t%s\n#MasterEpoch\t%d\n#SyncStateSetEpoch\t%d\n#SyncStateSetNums\t%d\n"
           % (name, view.get("master_addr") or "", view["master_epoch"], view["sss_epoch"], len(sss)))
    for b in sss:
        out += "\n InSyncReplica:\t%s\t%s\n" % (_replica(name, b, addrs.get(b, "")),
                                                "online" if b in online else "offline")
    for b in sorted(set(addrs) - set(sss)):
        out += "\n NotInSyncReplica:\t%s\t%s\n" % (_replica(name, b, addrs[b]), "online" if b in online else "offline")
    return out


def elect_master_text(cluster: str, doc: dict, broker_addrs: dict) -> str:
    """mqadmin ReElectMasterSubCommand."""
    out = ("\n#ClusterName\t%s\n#BrokerName\t%s\n#BrokerMasterAddr\t%s\n#MasterEpoch\t%s\n#SyncStateSetEpoch\t%s\n"
           % (cluster, doc["broker_name"], doc.get("master_addr") or "", doc["master_epoch"],
              doc.get("sss_epoch", "")))
    for b, addr in sorted(broker_addrs.items(), key=lambda kv: int(kv[0])):
        out += "\t#Broker\t%d\t%s\n" % (int(b), addr)
    return out


def controller_metadata_text(group: str, leader_id: str, leader_addr: str, peers: list[str]) -> str:
    """mqadmin GetControllerMetaDataSubCommand."""
    out = "\n#ControllerGroup\t%s\n#ControllerLeaderId\t%s\n#ControllerLeaderAddress\t%s" % (
        group, leader_id, leader_addr)
    out += "".join("\n#Peer:\t%s" % p for p in peers)
    return out + "\n"


# --- verbs ---------------------------------------------------------------------------------------
def _controllers(a) -> list[str]:
    addrs = [x.strip() for x in a.controller.replace(",", ";").split(";") if x.strip()]
    if not addrs:
        raise CliError("no controller address: pass -a host:port")
    return addrs


def _first_answer(a, method: str, path: str, doc: dict | None = None) -> tuple[str, Any]:
    errors = []
    for addr in _controllers(a):
        try:
            return addr, call(addr, method, path, doc)
        except CliError as e:
            errors.append(str(e))
    raise CliError("; ".join(errors))


def cmd_ha_status(a) -> tuple[Any, str]:
    doc = call(a.endpoint, "GET", "/cluster")
    runtime = doc.get("log", {}).get("ha_runtime")
    if runtime is None:
        raise CliError(f"the node at {a.endpoint} is in {doc.get('mode')} mode: haStatus needs classic HA")
    return runtime, ha_status_text(runtime)


def cmd_get_sync_state_set(a) -> tuple[Any, str]:
    _, doc = _first_answer(a, "GET", "/groups")
    views = {g["broker_name"]: g for g in doc.get("groups", [])}
    if a.broker_name not in views:
        raise CliError(f"the controller knows no broker group {a.broker_name!r} (known: {sorted(views)})")
    view = views[a.broker_name]
    online = set(int(b) for b in view["online"]) if "online" in view else None
    return view, sync_state_set_text(view, online)


def cmd_elect_master(a) -> tuple[Any, str]:
    addr, meta = _first_answer(a, "GET", "/health")
    leader = meta.get("leader") or addr
    doc = call(leader, "POST", f"/groups/{q(a.broker_name)}/elect-master", {"broker_id": a.broker_id})
    groups = call(leader, "GET", "/groups").get("groups", [])
    view = next((g for g in groups if g["broker_name"] == a.broker_name), {})
    doc = {**doc, "sss_epoch": view.get("sss_epoch", "")}
    return doc, elect_master_text(a.cluster, doc, view.get("broker_addrs", {}))


def cmd_get_controller_metadata(a) -> tuple[Any, str]:
    addr, meta = _first_answer(a, "GET", "/metadata")
    peers = meta.get("peers") or _controllers(a)
    leader = meta.get("leader") or ""
    raft_leader = (meta.get("raft") or {}).get("leader") or ""
    doc = {"group": meta.get("group", "mqstore-controller"), "controller_leader_id": raft_leader,
           "controller_leader_address": leader, "peers": peers, "asked": addr}
    return doc, controller_metadata_text(doc["group"], raft_leader, leader, peers)


# --- parser --------------------------------------------------------------------------------------
def _controller_arg(p) -> None:
    p.add_argument("-a", "--controller", default=os.environ.get("MQSTORE_CONTROLLER", DEFAULT_CONTROLLER),
                   help="controller API host:port, several separated by ';' (default %(default)s)")


def register(sub, admin: Callable) -> None:
    """Add the verbs; `admin` is mqstore.cli._admin (adds -n and --json, verbs return (doc, text))."""
    admin(sub, "haStatus", cmd_ha_status, "classic HA status of a broker (mqadmin haStatus)")
    p = admin(sub, "getSyncStateSet", cmd_get_sync_state_set, "master, epoch and SyncStateSet of a group")
    _controller_arg(p)
    p.add_argument("-b", "--broker-name", required=True, help="broker group (brokerName)")
    p = admin(sub, "electMaster", cmd_elect_master, "make a broker the master of its group")
    _controller_arg(p)
    p.add_argument("-b", "--broker-name", required=True, help="broker group (brokerName)")
    p.add_argument("-i", "--broker-id", type=int, required=True, help="brokerId to elect")
    p.add_argument("-c", "--cluster", default="DefaultCluster", help="cluster name (printed only)")
    p = admin(sub, "getControllerMetaData", cmd_get_controller_metadata, "controller peers and leader")
    _controller_arg(p)

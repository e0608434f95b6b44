"""`mqstore cluster up/down`: a local cluster on loopback as plain processes.

Each node gets its own store directory, a generated `broker.conf` and a log
file under the cluster directory; `cluster.json` there records the PIDs this
command started, so `cluster down` ends exactly those.

Modes: `dledger` (default: one Raft group of 3 nodes), `standalone` (one node), `classic`
(`--controllers` controllers, default 3, RocketMQ 5's controller mode, and a broker group of
`--nodes` brokers, default 2: the controllers elect the master, the others are its slaves;
`--broker-role` SYNC_MASTER, the default, or ASYNC_MASTER is the role a master takes).

Ports from `--base-port` B (default 10911, RocketMQ's): node i serves its API on B + 10 i,
its produce stream on that - 2 and (classic) its HA port on that + 1; DLedger Raft on
40911 + i + (B - 10911); controller j (classic) its API on 9876 + 10 j + (B - 10911), its
pysyncobj port on that + 2.

`--secure` (docs/security.md) writes `acl.json` (one admin account, random secret key) and
`cluster.secret` (random) into the cluster directory, both mode 600, and starts the nodes
with `aclEnable=true` and `clusterSecretFile`: every API request but /health and /metrics is
signed, and the Raft and HA peers prove the secret before any frame; classic controllers get
`--cluster-secret-file`. The keys are printed.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
from dataclasses import dataclass

from mqstore import localcluster as lc

STATE_FILE = "cluster.json"
HEALTH_TIMEOUT_S = 30.0
ACL_FILE = "acl.json"
SECRET_FILE = "cluster.secret"
ADMIN_ACCESS_KEY = "local-admin"
MODES = ("dledger", "standalone", "classic")
CONTROLLERS = 3                 # classic: controllers by default (--controllers: 1, 3 or 5)
BROKER_ROLES = ("SYNC_MASTER", "ASYNC_MASTER")
CONTROLLER_BASE_PORT = 9876     # RocketMQ's name-server port: the controllers hold the routes here


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    api_port: int
    raft_port: int
    config_path: str
    store_dir: str
    log_path: str

    @property
    def api(self) -> str:
        return f"127.0.0.1:{self.api_port}"

    @property
    def stream_port(self) -> int:
        """The produce stream, at RocketMQ's fast-channel port (listenPort - 2)."""
        return self.api_port - 2

    @property
    def ha_port(self) -> int:
        """Classic HA, at RocketMQ's haListenPort (listenPort + 1)."""
        return self.api_port + 1


@dataclass(frozen=True)
class ControllerSpec:
    ctl_id: str
    api_port: int
    raft_port: int
    data_dir: str
    log_path: str

    @property
    def api(self) -> str:
        return f"127.0.0.1:{self.api_port}"


def check_classic(mode: str, broker_role: str, controllers: int) -> None:
    """The classic options, with words a user can act on (SystemExit)."""
    if broker_role not in BROKER_ROLES:
        raise SystemExit(f"--broker-role must be one of {', '.join(BROKER_ROLES)}, not {broker_role!r}")
    if controllers not in (1, 3, 5):
        raise SystemExit(f"--controllers must be 1, 3 or 5 (a majority must survive a failure), not {controllers}")
    if mode != "classic" and (broker_role != BROKER_ROLES[0] or controllers != CONTROLLERS):
        raise SystemExit("--broker-role and --controllers apply to --mode classic only")


def plan_controllers(directory: str, base_port: int, count: int = CONTROLLERS) -> list[ControllerSpec]:
    first = CONTROLLER_BASE_PORT + base_port - 10911
    return [ControllerSpec(f"c{j}", first + 10 * j, first + 10 * j + 2, os.path.join(directory, f"c{j}", "data"),
                           os.path.join(directory, f"c{j}", "controller.log")) for j in range(count)]


def controller_argvs(ctls: list[ControllerSpec]) -> list[list[str]]:
    return [lc.controller_argv(c.api_port, c.raft_port, c.data_dir,
                               [f"127.0.0.1:{o.raft_port}" for o in ctls if o is not c],
                               [o.api for o in ctls if o is not c]) for c in ctls]


def write_security(directory: str) -> tuple[str, str]:
    """acl.json (one admin account) and cluster.secret with fresh random secrets in `directory`;
    returns the admin's (access key, secret key). Both files are checked as the nodes will."""
    from node.acl import parse_acl
    from node.peer_auth import generate_secret, load_secret, write_private
    os.makedirs(directory, exist_ok=True)
    secret_key = secrets.token_urlsafe(32)
    doc = {"accounts": [{"accessKey": ADMIN_ACCESS_KEY, "secretKey": secret_key, "admin": True}]}
    parse_acl(json.dumps(doc))
    write_private(os.path.join(directory, ACL_FILE), json.dumps(doc, indent=2) + "\n")
    write_private(os.path.join(directory, SECRET_FILE), generate_secret() + "\n")
    load_secret(secret_file=os.path.join(directory, SECRET_FILE))
    return ADMIN_ACCESS_KEY, secret_key


def security_lines(directory: str) -> list[str]:
    return ["aclEnable=true", f"aclFile={os.path.join(directory, ACL_FILE)}",
            f"clusterSecretFile={os.path.join(directory, SECRET_FILE)}"]


def plan(directory: str, mode: str, nodes: int, base_port: int, group: str = "broker-a",
         secure: bool = False, broker_role: str = BROKER_ROLES[0], controllers: int = CONTROLLERS) -> list[NodeSpec]:
    """Node specs and their broker.conf files (written) for a local cluster; with `secure`, the
    files of write_security must be in `directory` already."""
    if mode not in MODES:
        raise SystemExit(f"--mode must be one of {', '.join(MODES)}")
    check_classic(mode, broker_role, controllers)
    if mode == "standalone":
        nodes = 1
    if mode == "classic" and nodes < 2:
        raise SystemExit("--mode classic needs --nodes 2 or more (a master and its slaves)")
    specs = [NodeSpec(f"n{i}", base_port + 10 * i, 40911 + i + (base_port - 10911),
                      os.path.join(directory, f"n{i}", "broker.conf"), os.path.join(directory, f"n{i}", "store"),
                      os.path.join(directory, f"n{i}", "node.log")) for i in range(nodes)]
    raft = {s.node_id: s.raft_port for s in specs}
    api = {s.node_id: s.api_port for s in specs}
    ctl = ";".join(c.api for c in plan_controllers(directory, base_port, controllers))
    for broker_id, s in enumerate(specs):
        lines = [
            "brokerClusterName=DefaultCluster",
            f"brokerName={group}",
            "brokerIP1=127.0.0.1",
            f"listenPort={s.api_port}",
            f"streamListenPort={s.stream_port}",
            f"storePathRootDir={s.store_dir}",
            "flushDiskType=ASYNC_FLUSH",
            "mappedFileSizeCommitLog=67108864",
            "autoCreateTopicEnable=true",
        ]
        if mode == "dledger":
            lines += ["brokerId=0", *lc.dledger_lines(s.node_id, group, raft, api)]
        elif mode == "classic":    # the role a broker takes when the controllers elect it master
            lines += lc.classic_lines(broker_id, broker_role, s.ha_port, ctl)
        else:
            lines.append("brokerId=0")
        if secure:
            lines += security_lines(directory)
        lc.write_conf(s.config_path, lines)
    return specs


def planned_ports(mode: str, specs: list[NodeSpec], ctls: list[ControllerSpec]) -> list[int]:
    """Every port the cluster's processes will listen on, on 127.0.0.1."""
    ports = [p for s in specs for p in (s.api_port, s.stream_port)]
    ports += [s.raft_port for s in specs] if mode == "dledger" else []
    ports += [s.ha_port for s in specs] if mode == "classic" else []
    return ports + [p for c in ctls for p in (c.api_port, c.raft_port)]


def start(directory: str, mode: str = "dledger", nodes: int = 3, base_port: int = 10911,
          secure: bool = False, broker_role: str = BROKER_ROLES[0], controllers: int = CONTROLLERS) -> list[NodeSpec]:
    directory = os.path.abspath(directory)
    if os.path.exists(os.path.join(directory, STATE_FILE)):
        raise SystemExit(f"a cluster is already recorded in {directory}; run `mqstore cluster down --dir {directory}`")
    specs = plan(directory, mode, nodes, base_port, secure=secure, broker_role=broker_role, controllers=controllers)
    ctls = plan_controllers(directory, base_port, controllers) if mode == "classic" else []
    busy = lc.ports_in_use(planned_ports(mode, specs, ctls))   # the DLedger ports lie in the ephemeral range
    if busy:
        raise SystemExit(f"port(s) {', '.join(map(str, busy))} on 127.0.0.1 are in use; end what holds them, or "
                         f"move the whole cluster with --base-port (e.g. --base-port {base_port + 1000})")
    record: dict = {"mode": mode, "pids": [], "apis": [s.api for s in specs], "controllers": [c.api for c in ctls]}
    deadline = time.monotonic() + HEALTH_TIMEOUT_S

    def launch(argv: list[str], log_path: str, name: str) -> None:
        record["pids"].append(lc.Proc(argv, log_path, name, new_session=True).start().pid)
        with open(os.path.join(directory, STATE_FILE), "w") as f:      # `cluster down` ends what is recorded
            json.dump(record, f)

    def healthy(s: NodeSpec | ControllerSpec, roles: tuple[str, ...] = ()) -> None:
        try:
            lc.wait_for(lambda: (lambda h: h is not None and (not roles or h.get("role") in roles))(lc.health(s.api)),
                        max(0.0, deadline - time.monotonic()), s.api, interval=0.2)
        except lc.ClusterError:
            stop(directory)
            name = s.ctl_id if isinstance(s, ControllerSpec) else s.node_id
            raise SystemExit(f"{name} did not become healthy{' as ' + roles[0] if roles else ''} in "
                             f"{HEALTH_TIMEOUT_S:.0f} s; see {s.log_path}") from None

    for c, argv in zip(ctls, controller_argvs(ctls)):
        launch(argv + (["--cluster-secret-file", os.path.join(directory, SECRET_FILE)] if secure else []),
               c.log_path, c.ctl_id)
    for c in ctls:
        healthy(c)
    for i, s in enumerate(specs):
        launch(lc.node_argv(s.config_path), s.log_path, s.node_id)
        if ctls and i == 0:
            # Classic: n0 alone first, so the controllers elect it (the first broker to register)
            # and the master is at the base port, as in RocketMQ's default layout.
            healthy(s, ("MASTER",))
    for s in specs:
        healthy(s)
    return specs


def wait_for_leader(specs: list[NodeSpec], timeout_s: float = 15.0) -> str | None:
    return lc.find_leader([s.api for s in specs], timeout_s, interval=0.2)


def wait_in_sync(directory: str, base_port: int, brokers: int, group: str = "broker-a",
                 timeout_s: float = HEALTH_TIMEOUT_S, secret_file: str | None = None,
                 controllers: int = CONTROLLERS) -> bool:
    """Classic: until the controllers' SyncStateSet holds every broker (a send then answers
    SEND_OK, not SLAVE_NOT_AVAILABLE while a slave is still connecting). With `secret_file`,
    each request is signed with the cluster secret, as the admin CLI's controller verbs are."""
    from node.peer_auth import load_secret, sign_request
    secret = load_secret(secret_file=secret_file) if secret_file else None
    path = f"/groups/{group}/sync-state-set"

    def in_sync() -> bool:
        for c in plan_controllers(directory, base_port, controllers):
            signed = sign_request(secret, "mqstore-cluster", "GET", path) if secret is not None else None
            doc = lc.get_ok(c.api, path, headers=signed)
            if doc is not None:
                return sorted(doc.get("sync_state_set", [])) == list(range(brokers))
        return False
    try:
        lc.wait_for(in_sync, timeout_s, "every broker in the SyncStateSet", interval=0.2)
        return True
    except lc.ClusterError:
        return False


def stop(directory: str) -> list[int]:
    """End the processes this cluster started (SIGTERM, then SIGKILL after 10 s)."""
    path = os.path.join(os.path.abspath(directory), STATE_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        pids = json.load(f)["pids"]
    lc.stop_pids(pids, 10.0)
    os.remove(path)
    return pids


def secure_usage_text(specs: list[NodeSpec], leader: str | None, directory: str, keys: tuple[str, str]) -> str:
    ep = leader or specs[0].api
    nodes = "\n".join(f"  {s.node_id}  http://{s.api}   (store {s.store_dir}, log {s.log_path})" for s in specs)
    return f"""mqstore cluster is up ({len(specs)} node{'s' if len(specs) > 1 else ''}, secure); leader: {leader or 'electing'}
{nodes}
Produce streams (the SDK's pipelined send channel): {", ".join(f"127.0.0.1:{s.stream_port}" for s in specs)}

ACL is on: every request but /health and /metrics is signed (an unsigned curl gets 401), and the
Raft peers prove the cluster secret before any frame ({os.path.join(directory, SECRET_FILE)}).
Admin account (also in {os.path.join(directory, ACL_FILE)}; add accounts there, nodes reload it):
  export MQSTORE_ACCESS_KEY={keys[0]} MQSTORE_SECRET_KEY={keys[1]}

Try it (against the leader):
  .venv/bin/mqstore updateTopic -n {ep} -t TopicTest -w 4
  .venv/bin/mqstore send -n {ep} -t TopicTest -b hello --tags TagA --keys order-1
  .venv/bin/mqstore pull -n {ep} -t TopicTest -q 0 -o 0
  .venv/bin/mqstore clusterList -n {ep}

Dashboard: http://{ep}/dashboard   (sign in with the keys above; metrics: http://{ep}/metrics)

Stop with Ctrl-C (or `mqstore cluster down --dir {directory}` when started with --detach).
"""


def usage_text(specs: list[NodeSpec], leader: str | None, directory: str) -> str:
    ep = leader or specs[0].api
    nodes = "\n".join(f"  {s.node_id}  http://{s.api}   (store {s.store_dir}, log {s.log_path})" for s in specs)
    return f"""mqstore cluster is up ({len(specs)} node{'s' if len(specs) > 1 else ''}); leader: {leader or 'electing'}
{nodes}
Produce streams (the SDK's pipelined send channel): {", ".join(f"127.0.0.1:{s.stream_port}" for s in specs)}

Try it (against the leader):
  curl -s -XPOST {ep}/topics -d '{{"topic":"TopicTest","queues":4}}'
  curl -s -XPOST {ep}/topics/TopicTest/messages -d '{{"messages":[{{"body":"hello","tags":"TagA","keys":"order-1","queue_id":0}}]}}'
  curl -s '{ep}/topics/TopicTest/queues/0/messages?offset=0&max=32'
  .venv/bin/mqstore send -n {ep} -t TopicTest -b hello --tags TagA --keys order-1
  .venv/bin/mqstore pull -n {ep} -t TopicTest -q 0 -o 0
  .venv/bin/mqstore topicStatus -n {ep} -t TopicTest
  curl -s {ep}/cluster

Dashboard: http://{ep}/dashboard   (metrics: http://{ep}/metrics)

Stop with Ctrl-C (or `mqstore cluster down --dir {directory}` when started with --detach).
"""


def classic_usage_text(specs: list[NodeSpec], master: str | None, directory: str, base_port: int,
                       keys: tuple[str, str] | None = None, group: str = "broker-a",
                       broker_role: str = BROKER_ROLES[0], controllers: int = CONTROLLERS) -> str:
    ep = master or specs[0].api
    secure = "" if keys is None else f"""
Secure: brokers check the ACL (every request but /health and /metrics is signed), and brokers,
controllers and the admin CLI's controller verbs prove the cluster secret. For the commands below:
  export MQSTORE_ACCESS_KEY={keys[0]} MQSTORE_SECRET_KEY={keys[1]}
  export MQSTORE_CLUSTER_SECRET_FILE={os.path.join(directory, SECRET_FILE)}
"""
    ctls = plan_controllers(directory, base_port, controllers)
    brokers = "\n".join(f"  {s.node_id}  http://{s.api}   brokerId={i}, HA port {s.ha_port}"
                         f"{'   MASTER' if s.api == master else ''}   (log {s.log_path})"
                         for i, s in enumerate(specs))
    controllers = "\n".join(f"  {c.ctl_id}  http://{c.api}   (log {c.log_path})" for c in ctls)
    ctl = ";".join(c.api for c in ctls)
    role = ("SYNC_MASTER: a send is acked once a slave has it" if broker_role == "SYNC_MASTER" else
            "ASYNC_MASTER: a send is acked once the master has it; slaves follow")
    return f"""mqstore classic cluster is up: group {group} of {len(specs)} brokers ({role}), {len(ctls)} controller(s); master: {master or 'electing'}
{brokers}
Controllers (routes, and the master, epoch and SyncStateSet of the group):
{controllers}
{secure}
Try it:
  .venv/bin/mqstore updateTopic -n {ep} -t TopicTest -w 4
  .venv/bin/mqstore send -n {ep} -t TopicTest -b hello --tags TagA --keys order-1
  .venv/bin/mqstore pull -n {ep} -t TopicTest -q 0 -o 0
  .venv/bin/mqstore haStatus -n {ep}
  .venv/bin/mqstore getSyncStateSet -a '{ctl}' -b {group}
  .venv/bin/mqstore getControllerMetaData -a '{ctl}'
  .venv/bin/mqstore electMaster -a '{ctl}' -b {group} -i 1
Failover: kill -9 the master (PIDs in {os.path.join(directory, STATE_FILE)}); the controllers elect a
slave from the SyncStateSet within a few seconds, and the old master rejoins as a slave when restarted.

Dashboard: http://{ep}/dashboard and http://{ctls[0].api}/dashboard

Stop with Ctrl-C (or `mqstore cluster down --dir {directory}` when started with --detach).
"""


def up_main(directory: str, mode: str, nodes: int, base_port: int, detach: bool, secure: bool = False,
            broker_role: str = BROKER_ROLES[0], controllers: int = CONTROLLERS) -> int:
    keys = None
    directory = os.path.abspath(directory)
    check_classic(mode, broker_role, controllers)
    if secure:
        if os.path.exists(os.path.join(directory, STATE_FILE)):
            raise SystemExit(f"a cluster is already recorded in {directory}; run `mqstore cluster down --dir {directory}`")
        keys = write_security(directory)
    specs = start(directory, mode, nodes, base_port, secure=secure, broker_role=broker_role, controllers=controllers)
    leader = wait_for_leader(specs)
    if mode == "classic":
        text = classic_usage_text(specs, leader, directory, base_port, keys, broker_role=broker_role,
                                  controllers=controllers)
        if not wait_in_sync(directory, base_port, len(specs), secret_file=os.path.join(directory, SECRET_FILE)
                            if secure else None, controllers=controllers):
            text += ("\nNot every slave is in the SyncStateSet yet: until it is, sends answer "
                     "SLAVE_NOT_AVAILABLE (stored on the master only).\n")
    elif keys:
        text = secure_usage_text(specs, leader, directory, keys)
    else:
        text = usage_text(specs, leader, directory)
    print(text, flush=True)
    if detach:
        return 0
    stopping = {"now": False}

    def _on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
        stopping["now"] = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        while not stopping["now"]:
            time.sleep(0.5)
    finally:
        stop(directory)
        print("mqstore cluster stopped", flush=True)
    return 0

"""`mqstore controller`: the controller process, and the broker-side `ControllerClient`.

Process: aiohttp HTTP API (default 9876) in front of a `ControllerStateMachine`
(pysyncobj, default Raft port 9878). pysyncobj runs its own ticker thread; the HTTP
handlers read snapshots under the state machine's lock and propose ops through
pysyncobj's callback, bridged back into the event loop.

    GET  /health                       {status, mode: "controller", role, raft, leader_api}
    GET  /metadata                     the whole replicated state + raft status
    GET  /groups                       every group's master, epoch, SyncStateSet, brokers
    GET  /groups/{group}/sync-state-set
    POST /groups/{group}/elect-master  {broker_id}          manual electMaster (leader only)
    POST /topics                       {topic, queues, perm?, groups?}
    GET  /routes/{topic}               TopicRouteData
    POST /brokers/heartbeat            BrokerHeartbeat fields -> role/master/epoch/SSS/topics

Security (docs/security.md): with a cluster secret (`--cluster-secret-file` or the
environment's MQSTORE_clusterSecret, the broker's key) every request but GET /health,
/metrics, /routes/{topic} and the dashboard page must be signed with it (node.peer_auth.sign_request) or is
answered 401 before any handler runs, and controller-to-controller Raft traffic is
encrypted and authenticated with it (pysyncobj's `password`). `--tls-cert/--tls-key/--tls-ca`
serve the API over TLS (server auth; client certificates optional).

Heartbeats are not replicated: every controller records them locally (brokers beat all
controllers), and only the Raft leader, after holding leadership for one heartbeat
timeout (so its liveness table is warm), turns them into decisions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from dataclasses import fields
from typing import Any, Awaitable, Callable

import aiohttp
import msgpack
from aiohttp import web

from node import peer_auth, tls
from node.broker import MAX_QUEUES_PER_TOPIC, PERM_DEFAULT, check_user_topic
from node.log_throttle import LogThrottle
from node.store.disk_guard import DiskGuard
from node.store.errors import StoreError
from node.store.fileio import FileSystem
from node import dashboard
from node.metrics import controller_registry
from prometheus_client import generate_latest
from ha.controller import (BrokerHeartbeat, ControllerStateMachine, DecisionKind, ElectOptions, Liveness,
                           alive, assign_queues, elect, group_view, heartbeat_reply, ops_for_heartbeat, plan_ops,
                           route_of)

log = logging.getLogger(__name__)

MSGPACK = "application/x-msgpack"
APPLY_TIMEOUT_S = 5.0
TICK_S = 0.2
MAX_BODY_BYTES = 1 << 20
MAX_TOPICS_PER_REPLY = 4096   # a broker applies at most this many controller topics per heartbeat
DISK_FULL_PCT = 95            # the data directory's volume this full: API decisions refused (507)
RESERVE_CHECK_MS = 5000       # how often a reserve given up on a full disk is put back if there is room
TICK_FAILURE_LOG_S = 30.0     # pysyncobj's failed-tick tracebacks: at most one per this


def _mono_ms() -> int:
    return int(time.monotonic() * 1000)


async def _body(request: web.Request) -> dict:
    raw = await request.read()
    if not raw:
        return {}
    obj = msgpack.unpackb(raw, raw=False) if request.content_type == MSGPACK else json.loads(raw)
    if not isinstance(obj, dict):
        raise web.HTTPBadRequest(text="body must be an object")
    return obj


def _reply(request: web.Request, obj: Any, status: int = 200) -> web.Response:
    if MSGPACK in request.headers.get("Accept", ""):
        return web.Response(body=msgpack.packb(obj, use_bin_type=True), status=status, content_type=MSGPACK)
    return web.json_response(obj, status=status)


def _error(request: web.Request, status: int, code: str, message: str, retriable: bool = False,
           leader: str | None = None) -> web.Response:
    return _reply(request, {"error": code, "message": message, "retriable": retriable, "leader": leader}, status)


class Controller:
    """One controller process: state machine + liveness + the leader's decision loop."""

    def __init__(self, sm: ControllerStateMachine, opts: ElectOptions, api_of_raft: dict[str, str],
                 secret: bytes | None = None):
        self.sm = sm
        self.verifier = peer_auth.RequestVerifier(secret) if secret is not None else None
        self.opts = opts
        self.api_of_raft = api_of_raft     # Raft address -> API address, for leader hints
        self.live = Liveness()
        # Decisions asked for through the API are refused (507) on a disk this full; the
        # leader's own decisions (elections) still go ahead, on the reserve if need be.
        self.disk = DiskGuard(FileSystem(), sm.data_dir, DISK_FULL_PCT)
        self._reserve_checked_ms = 0
        self._leader_since_ms: int | None = None
        self._inflight: set[str] = set()   # ops proposed and not yet answered (no duplicate proposals)
        self._tick_task: asyncio.Task | None = None

    # --- proposing through pysyncobj ----------------------------------------------------------
    async def propose(self, op: dict) -> bool:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def done(result, error):   # pysyncobj's thread
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result((result, error)))

        self.sm.apply(op, callback=done)
        async with asyncio.timeout(APPLY_TIMEOUT_S):   # not wait_for: it can lose a cancel (3.11)
            result, error = await fut
        if error != 0:
            raise RuntimeError(f"controller op {op['op']} failed (pysyncobj error {error})")
        return bool(result)

    def propose_once(self, op: dict) -> None:
        """Fire-and-forget proposal, deduplicated while in flight (heartbeat-driven registration)."""
        key = repr(sorted(op.items()))
        if key in self._inflight or len(self._inflight) >= 1000:
            return
        self._inflight.add(key)

        async def run() -> None:
            try:
                await self.propose(op)
            except (RuntimeError, asyncio.TimeoutError) as e:
                log.info("controller: proposal %s not applied: %s", op["op"], e)
            finally:
                self._inflight.discard(key)
        asyncio.get_running_loop().create_task(run())

    def leader_api(self) -> str | None:
        raft = self.sm.leader_raft_addr()
        return self.api_of_raft.get(raft) if raft else None

    # --- the leader's loop --------------------------------------------------------------------
    async def run_ticks(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = _mono_ms()
            if now - self._reserve_checked_ms >= RESERVE_CHECK_MS:
                self._reserve_checked_ms = now
                self.sm.reserve.restore_if_room()   # a reserve given up on a full disk, once there is room
            if not self.sm.is_leader() or not self.sm.isReady():
                self._leader_since_ms = None
                continue
            if self._leader_since_ms is None:
                self._leader_since_ms = now
                log.info("controller: became Raft leader; deciding after %d ms", self.opts.heartbeat_timeout_ms)
            if now - self._leader_since_ms < self.opts.heartbeat_timeout_ms:
                continue   # let brokers' beats reach us before judging anyone dead
            for op in plan_ops(self.sm.snapshot(), self.live, now, self.opts):
                self.propose_once(op)

    # --- HTTP ---------------------------------------------------------------------------------
    @web.middleware
    async def _authenticate(self, request: web.Request, handler):
        """Cluster-secret signature on every request but the open probes (before any handler)."""
        # Open: probes, the dashboard page, and route lookups (clients need them, as they need a
        # RocketMQ name server; they hold no cluster secret).
        open_path = request.method == "GET" and (request.path in ("/health", "/metrics")
                                                 or request.path.startswith(("/dashboard", "/routes/")))
        if self.verifier is not None and not open_path:
            body = await request.read()
            try:
                self.verifier.verify(request.method, request.raw_path, request.headers, body)
            except peer_auth.PeerAuthError as e:
                peer_auth.FAILURES.record("controller", request.remote, str(e))
                return _error(request, 401, "UNAUTHENTICATED", "sign requests with the cluster secret: " + str(e))
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._authenticate])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metadata", self.metadata)
        app.router.add_get("/groups", self.groups)
        app.router.add_get("/groups/{group}/sync-state-set", self.sync_state_set)
        app.router.add_post("/groups/{group}/elect-master", self.elect_master)
        app.router.add_post("/topics", self.create_topic)
        app.router.add_get("/routes/{topic}", self.route)
        app.router.add_post("/brokers/heartbeat", self.heartbeat)
        registry = controller_registry(self.sm)
        registry.register(peer_auth.PeerAuthCollector())
        app.router.add_get("/metrics", lambda request: web.Response(
            body=generate_latest(registry), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}))
        dashboard.add_routes(app)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return _reply(request, {"status": "ok", "mode": "controller",
                                "role": "LEADER" if self.sm.is_leader() else "FOLLOWER",
                                "ready": self.sm.isReady(), "leader": self.leader_api(), "raft": self.sm.raft_status()})

    async def metadata(self, request: web.Request) -> web.Response:
        return _reply(request, {"state": self.sm.snapshot(), "raft": self.sm.raft_status(),
                                "leader": self.leader_api(), "group": "mqstore-controller",
                                "peers": sorted(self.api_of_raft.values())})

    async def groups(self, request: web.Request) -> web.Response:
        st = self.sm.snapshot()
        now = _mono_ms()
        views = []
        for name, g in sorted(st["groups"].items()):
            online = sorted(alive(self.live.of(name), now, self.opts))
            views.append({**group_view(g), "online": online})
        return _reply(request, {"groups": views})

    async def sync_state_set(self, request: web.Request) -> web.Response:
        g = self.sm.snapshot()["groups"].get(request.match_info["group"])
        if g is None:
            return _error(request, 404, "GROUP_NOT_FOUND", f"no group {request.match_info['group']}")
        return _reply(request, {"broker_name": g["name"], "master_id": g["master_id"],
                                "master_epoch": g["master_epoch"], "sync_state_set": g["sss"],
                                "sss_epoch": g["sss_epoch"]})

    def _disk_full(self, request: web.Request) -> web.Response | None:
        """507 when this controller's disk is too full to take a decision asked for by hand
        (looked at afresh: such decisions are rare, a statfs each is nothing)."""
        self.disk.recheck()
        if not self.disk.full():
            return None
        return _error(request, 507, "SERVICE_NOT_AVAILABLE",
                      f"controller {self.disk.reason()}: decisions through the API refused until space returns", True)

    async def elect_master(self, request: web.Request) -> web.Response:
        if not self.sm.is_leader():
            return _error(request, 421, "NOT_LEADER", "electMaster runs on the leader controller", True,
                          self.leader_api())
        if (refused := self._disk_full(request)) is not None:
            return refused
        name = request.match_info["group"]
        body = await _body(request)
        g = self.sm.snapshot()["groups"].get(name)
        if g is None:
            return _error(request, 404, "GROUP_NOT_FOUND", f"no group {name}")
        broker = body.get("broker_id")
        d = elect(g, self.live.of(name), _mono_ms(), self.opts,
                  force_broker=int(broker) if broker is not None else None)
        if d.kind is not DecisionKind.NEW_MASTER:
            return _error(request, 409, "ELECT_MASTER_FAILED", d.reason or d.kind.value)
        await self.propose(d.to_op())
        return _reply(request, {"broker_name": name, "master_id": d.master_id, "master_addr": d.master_addr,
                                "master_epoch": d.epoch, "sync_state_set": sorted(d.sync_state_set)})

    async def create_topic(self, request: web.Request) -> web.Response:
        body = await _body(request)
        topic, queues, perm = body.get("topic"), body.get("queues", 8), body.get("perm", 6)
        if not isinstance(topic, str) or not topic or not isinstance(queues, int) or queues <= 0:
            return _error(request, 400, "INVALID_TOPIC", "need {topic: str, queues: int > 0}")
        try:
            check_user_topic(topic)   # brokers reject anything else, so the topic could never reach them
        except StoreError as e:
            return _error(request, 400, "INVALID_TOPIC", str(e))
        if queues > MAX_QUEUES_PER_TOPIC:
            return _error(request, 400, "INVALID_TOPIC", f"queues must be at most {MAX_QUEUES_PER_TOPIC}")
        if not isinstance(perm, int) or isinstance(perm, bool) or perm & ~PERM_DEFAULT or perm < 0:
            return _error(request, 400, "INVALID_TOPIC", "perm must combine read (4) and write (2)")
        st = self.sm.snapshot()
        groups = body.get("groups") or sorted(st["groups"])
        if not isinstance(groups, list) or not all(isinstance(g, str) and g for g in groups):
            return _error(request, 400, "INVALID_TOPIC", "groups must be a list of group names")
        if not groups:
            return _error(request, 409, "NO_BROKER_GROUP", "no broker group has registered yet", True)
        if (refused := self._disk_full(request)) is not None:
            return refused
        version = st["topics"].get(topic, {}).get("version", 0) + 1
        op = {"op": "create_topic", "topic": topic, "queues": queues, "perm": perm,
              "assign": assign_queues(queues, list(groups)), "version": version}
        await self.propose(op)
        return _reply(request, route_of(self.sm.snapshot(), topic), 201)

    async def route(self, request: web.Request) -> web.Response:
        r = route_of(self.sm.snapshot(), request.match_info["topic"])
        if r is None:
            return _error(request, 404, "TOPIC_NOT_EXIST", f"no route for topic {request.match_info['topic']}")
        return _reply(request, r)

    async def heartbeat(self, request: web.Request) -> web.Response:
        body = await _body(request)
        names = {f.name for f in fields(BrokerHeartbeat)} - {"last_seen_ms"}
        try:
            kw = {k: v for k, v in body.items() if k in names}
            kw["in_sync"] = tuple(int(b) for b in kw.get("in_sync", ()))
            for k in ("session", "seq"):
                kw[k] = int(kw.get(k, 0))
            kw["pending"] = bool(kw.get("pending", False))
            hb = BrokerHeartbeat(**kw, last_seen_ms=_mono_ms())
        except (TypeError, ValueError) as e:
            return _error(request, 400, "BAD_HEARTBEAT", str(e))
        if not self.live.record(hb):
            return _error(request, 503, "TOO_MANY_BROKERS", "liveness table full", True)
        st = self.sm.snapshot()
        for op in ops_for_heartbeat(st, hb):
            self.propose_once(op)
        reply = heartbeat_reply(st, hb.group, hb.broker_id)
        reply.update(controller_leader=self.sm.is_leader(), leader=self.leader_api(),
                     heartbeat_timeout_ms=self.opts.heartbeat_timeout_ms,
                     topic_perms={t: st["topics"][t].get("perm", 6) for t in reply["topics"]})
        return _reply(request, reply)


# ===================================================================================
# Process entry point
# ===================================================================================

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mqstore controller", description="mqstore controller (pysyncobj)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind and advertise")
    p.add_argument("--port", type=int, default=9876, help="HTTP API port")
    p.add_argument("--raft-port", type=int, default=9878, help="pysyncobj port")
    p.add_argument("--peers", default="", help="other controllers' Raft addresses host:port, comma-separated")
    p.add_argument("--peer-apis", default="", help="their API addresses, same order (for leader hints)")
    p.add_argument("--data-dir", required=True, help="journal and the fsynced controller-state.json")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=3000, help="master lost after this silence")
    p.add_argument("--unclean-election", action="store_true", help="elect outside the SyncStateSet (may lose data)")
    p.add_argument("--cluster-secret-file", default="",
                   help="file holding the cluster secret (default: env MQSTORE_clusterSecret; none = open API)")
    p.add_argument("--tls-cert", default="", help="PEM certificate: serve the API over TLS")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default="", help="PEM CA for client certificates (optional)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def controller_security(args: argparse.Namespace, environ=None):
    """(secret or None, server SSLContext or None) from the command line; ValueError if bad."""
    import os
    from node.config import ConfigError
    env = os.environ if environ is None else environ
    secret = peer_auth.load_secret("" if args.cluster_secret_file else env.get("MQSTORE_clusterSecret", ""),
                                   args.cluster_secret_file)
    ctx = None
    if args.tls_cert or args.tls_key:
        try:
            ctx = tls.server_context(args.tls_cert, args.tls_key, args.tls_ca, require_client_cert=False)
        except ConfigError as e:
            raise ValueError(str(e)) from None
    if secret is None and not peer_auth.is_loopback(args.host):
        log.warning("controller listens on %s without a cluster secret: anyone who reaches it can change "
                    "roles and routes; use --cluster-secret-file (docs/security.md)", args.host)
    return secret, ctx


async def serve(args: argparse.Namespace, stop: asyncio.Event | None = None) -> int:
    peers = [x for x in args.peers.split(",") if x]
    apis = [x for x in args.peer_apis.split(",") if x]
    self_raft = f"{args.host}:{args.raft_port}"
    api_of_raft = dict(zip(peers, apis))
    api_of_raft[self_raft] = f"{args.host}:{args.port}"
    opts = ElectOptions(heartbeat_timeout_ms=args.heartbeat_timeout_ms, unclean=args.unclean_election)
    opts.validate()
    secret, ssl_ctx = controller_security(args)
    # pysyncobj's password encrypts and authenticates controller-to-controller traffic.
    sm = ControllerStateMachine(self_raft, peers, args.data_dir,
                                **({"password": secret} if secret is not None else {}))
    ctl = Controller(sm, opts, api_of_raft, secret)
    runner = web.AppRunner(ctl.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port, reuse_address=True,
                      ssl_context=tls.count_failures(ssl_ctx, "controller")).start()
    log.info("controller serving API %s:%d, raft %s, peers %s", args.host, args.port, self_raft, peers)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ticks = loop.create_task(ctl.run_ticks())
    watcher = loop.create_task(_watch_fatal(sm, stop))
    await stop.wait()
    ticks.cancel()
    watcher.cancel()
    await runner.cleanup()
    sm.destroy()
    return 1 if sm.fatal is not None else 0


async def _watch_fatal(sm: ControllerStateMachine, stop: asyncio.Event) -> None:
    """A state that cannot be persisted stops the process: recovery is a restart with room."""
    while not stop.is_set():
        await asyncio.sleep(0.5)
        if sm.fatal is not None:
            log.error("controller: fatal: cannot persist its state (%s); stopping", sm.fatal)
            stop.set()


class _ThrottleTickFailures(logging.Filter):
    """pysyncobj logs a traceback for every failed tick (on a full disk, each second it cannot
    store its meta file): at most one per TICK_FAILURE_LOG_S, with the count held back."""

    def __init__(self) -> None:
        super().__init__()
        self._throttle = LogThrottle(TICK_FAILURE_LOG_S)

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("failed _onTick"):
            return True
        held = self._throttle.due(time.monotonic())
        if held is None:
            return False
        if held:
            record.msg = f"{record.msg} ({held} more since the last such line)"
        return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pysyncobj.syncobj").addFilter(_ThrottleTickFailures())
    try:
        controller_security(args)
    except ValueError as e:
        print(f"mqstore controller: {e}", file=sys.stderr)
        return 2
    return asyncio.run(serve(args))


# ===================================================================================
# Broker side
# ===================================================================================

def topics_of_reply(reply: dict) -> dict[str, tuple[int, int]]:
    """`{topic: (queues, perm)}` a heartbeat reply holds for this broker's group. The reply names
    the global queue ids the group serves, so the broker needs ids 0..max; malformed entries are
    dropped, and at most MAX_TOPICS_PER_REPLY are kept."""
    topics, perms = reply.get("topics"), reply.get("topic_perms")
    if not isinstance(topics, dict):
        return {}
    perms = perms if isinstance(perms, dict) else {}
    out: dict[str, tuple[int, int]] = {}
    for name, qids in topics.items():
        if len(out) >= MAX_TOPICS_PER_REPLY:
            log.warning("controller client: reply holds %d topics; applying the first %d",
                        len(topics), MAX_TOPICS_PER_REPLY)
            break
        if not (isinstance(name, str) and isinstance(qids, list) and qids
                and all(isinstance(q, int) and not isinstance(q, bool) and q >= 0 for q in qids)):
            continue
        perm = perms.get(name, PERM_DEFAULT)
        out[name] = (max(qids) + 1, perm if isinstance(perm, int) and not perm & ~PERM_DEFAULT else PERM_DEFAULT)
    return out


class ControllerClient:
    """Heartbeats every controller about once a second and acts on the freshest answer.

    `beat()` builds the heartbeat body; `on_reply(reply)` applies it (HALog.on_controller_reply).
    Replies are ranked by epoch, the leader's first, so a lagging follower controller cannot move
    the broker backwards. When `topic_sink` is set (the broker's apply_controller_topics), the
    reply's topics go to it in a background task, one at a time, so creating topics never delays
    the heartbeats.
    """

    def __init__(self, controller_addrs: list[str], beat: Callable[[], dict],
                 on_reply: Callable[[dict], Awaitable[None]], interval_s: float = 1.0, timeout_s: float = 0.8,
                 security: Any = None):
        assert controller_addrs
        self.security = security or peer_auth.NO_SECURITY
        self.scheme = "https" if self.security.client_ssl is not None else "http"
        self.addrs = controller_addrs
        self.beat = beat
        self.on_reply = on_reply
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.last_reply: dict | None = None
        self.failures = 0
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self.topic_sink: Callable[[dict[str, tuple[int, int]]], Awaitable[Any]] | None = None
        self._topic_task: asyncio.Task | None = None

    def start(self) -> None:
        connector = aiohttp.TCPConnector(ssl=self.security.client_ssl) if self.security.client_ssl else None
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                              connector=connector)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="controller-heartbeat")

    async def stop(self) -> None:
        for task in (self._task, self._topic_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _post(self, addr: str, body: dict) -> dict | None:
        assert self._session is not None
        try:
            data = json.dumps(body, separators=(",", ":")).encode()
            headers = {"Content-Type": "application/json"}
            if self.security.secret is not None:
                headers.update(peer_auth.sign_request(self.security.secret, str(body.get("group", "broker")),
                                                      "POST", "/brokers/heartbeat", data))
            async with self._session.post(f"{self.scheme}://{addr}/brokers/heartbeat", data=data,
                                          headers=headers) as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def beat_once(self) -> dict | None:
        body = self.beat()
        replies = [r for r in await asyncio.gather(*(self._post(a, body) for a in self.addrs)) if r]
        if not replies:
            self.failures += 1
            return None
        best = max(replies, key=lambda r: (int(r.get("epoch") or 0), bool(r.get("controller_leader"))))
        self.last_reply = best
        await self.on_reply(best)
        self._sync_topics(best)
        return best

    def _sync_topics(self, reply: dict) -> None:
        """Hand the reply's topics to `topic_sink`, unless the previous batch is still being applied
        (the next heartbeat brings them again)."""
        if self.topic_sink is None or (self._topic_task is not None and not self._topic_task.done()):
            return
        wanted = topics_of_reply(reply)
        if wanted:
            self._topic_task = asyncio.get_running_loop().create_task(self._apply_topics(wanted),
                                                                      name="controller-topics")

    async def _apply_topics(self, wanted: dict[str, tuple[int, int]]) -> None:
        assert self.topic_sink is not None
        try:
            await self.topic_sink(wanted)
        except (StoreError, OSError, RuntimeError, asyncio.TimeoutError) as e:   # retried on the next beat
            log.warning("controller client: applying topics failed: %r", e)

    async def _run(self) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await self.beat_once()
            except (RuntimeError, OSError, StoreError) as e:   # a failed role change is retried on the next beat
                log.warning("controller client: heartbeat handling failed: %r", e)
            except Exception as e:   # noqa: BLE001 - a bug must not end the heartbeats (and role changes) silently
                log.error("controller client: heartbeat handling failed unexpectedly: %r (retrying)", e,
                          exc_info=True)
            # Small jitter so a group's brokers do not beat in lockstep.
            await asyncio.sleep(max(0.05, self.interval_s - (time.monotonic() - t0)) * random.uniform(0.9, 1.1))


if __name__ == "__main__":
    sys.exit(main())

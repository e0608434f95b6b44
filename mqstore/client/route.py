"""Where a topic's queues live: a static list of broker groups, or the controller's routes.

Static: `brokers="host:port"`, `["h:p", "h:p", "h:p"]` (the nodes of ONE group, e.g. a
DLedger group) or `{"broker-a": [...], "broker-b": [...]}` (several groups). Each group's
`GET /topics/{topic}` gives its read/write queue counts.
Controller: `controller="h:p"` (or a list); `GET /routes/{topic}` gives the queue ids per
group and the groups' node addresses (ha/controller_server.py, TopicRouteData).
Routes are cached for `ttl_s` and dropped on a send failure.

A bare address list names no group: it is called DEFAULT_GROUP until one of its nodes has told
its brokerName (`GET /health`, asked on start and before a route lookup while unknown); then
the group takes that name, so send results, queues and messages carry it as RocketMQ's do, and
DEFAULT_GROUP stays an alias of it (a MessageQueue built with it still resolves).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mqstore.client.errors import MQBrokerError, MQClientError, MQConfigError, MQConnectError
from mqstore.client.message import MessageQueue
from mqstore.client.transport import BrokerGroup, Transport

DEFAULT_GROUP = "broker"      # a bare address list's group until its nodes give its name
NAME_LOOKUP_TIMEOUT_S = 1.0   # GET /health for the name: a group that is down delays start by this at most
NAME_RETRY_S = 5.0            # while unnamed, a route lookup asks again at most this often
MAX_CACHED_ROUTES = 1024


@dataclass(frozen=True, slots=True)
class TopicRoute:
    write_queues: tuple[MessageQueue, ...]
    read_queues: tuple[MessageQueue, ...]
    fetched_at: float


def parse_brokers(brokers: Any) -> dict[str, BrokerGroup]:
    if isinstance(brokers, str):
        brokers = [b.strip() for b in brokers.replace(";", ",").split(",") if b.strip()]
    if isinstance(brokers, (list, tuple)):
        return {DEFAULT_GROUP: BrokerGroup(DEFAULT_GROUP, list(brokers))}
    if isinstance(brokers, dict) and brokers:
        return {name: BrokerGroup(name, [addrs] if isinstance(addrs, str) else list(addrs))
                for name, addrs in brokers.items()}
    raise MQConfigError("brokers must be 'host:port', a list of one group's node addresses, "
                        "or {group_name: [addresses]}")


class RouteTable:
    def __init__(self, transport: Transport, brokers: Any = None, controller: Any = None, ttl_s: float = 30.0):
        if (brokers is None) == (controller is None):
            raise MQConfigError("give exactly one of brokers (static list) and controller (route lookup)")
        self.transport = transport
        self.ttl_s = ttl_s
        self.groups: dict[str, BrokerGroup] = parse_brokers(brokers) if brokers is not None else {}
        self.aliases: dict[str, str] = {}   # a name the group had before its nodes named it -> its name
        self._unnamed = isinstance(brokers, (str, list, tuple))
        self._name_asked_at = -NAME_RETRY_S
        self.controller = None
        if controller is not None:
            addrs = [controller] if isinstance(controller, str) else list(controller)
            self.controller = BrokerGroup("controller", addrs)
        self._routes: dict[str, TopicRoute] = {}

    def group(self, name: str) -> BrokerGroup:
        g = self.groups.get(name)
        if g is None and name in self.aliases:
            g = self.groups.get(self.aliases[name])
        if g is None:
            raise MQConfigError(f"unknown broker group {name!r}; known: {sorted(self.groups)}")
        return g

    def invalidate(self, topic: str) -> None:
        self._routes.pop(topic, None)

    async def learn_name(self) -> None:
        """Name a bare address list's group as its nodes do (best effort: unreachable nodes leave
        DEFAULT_GROUP, and a route lookup asks again, at most every NAME_RETRY_S)."""
        if not self._unnamed:
            return
        self._name_asked_at = time.monotonic()
        g = self.groups[DEFAULT_GROUP]
        try:
            doc = await self.transport.call(g, "GET", "/health", timeout_s=NAME_LOOKUP_TIMEOUT_S)
        except MQClientError:
            return
        if not self._unnamed:     # named by another lookup while this one waited
            return
        self._unnamed = False
        name = doc.get("group")
        if isinstance(name, str) and name and name != DEFAULT_GROUP:
            del self.groups[DEFAULT_GROUP]
            g.name = self.aliases[DEFAULT_GROUP] = name
            self.groups[name] = g

    async def route(self, topic: str, refresh: bool = False) -> TopicRoute:
        if self._unnamed and time.monotonic() - self._name_asked_at >= NAME_RETRY_S:
            await self.learn_name()
        r = self._routes.get(topic)
        if r is not None and not refresh and time.monotonic() - r.fetched_at < self.ttl_s:
            return r
        r = await (self._from_controller(topic) if self.controller is not None else self._from_brokers(topic))
        if len(self._routes) >= MAX_CACHED_ROUTES:
            self._routes.clear()
        self._routes[topic] = r
        return r

    async def _from_brokers(self, topic: str) -> TopicRoute:
        write, read, errors = [], [], []
        for name, g in sorted(self.groups.items()):
            try:
                doc = await self._topic_doc(g, topic)
            except MQBrokerError as e:
                if e.code == "TOPIC_NOT_EXIST":
                    continue
                raise
            except MQConnectError as e:
                errors.append(e)     # a group that is down: route over the others
                continue
            perm = int(doc.get("perm", 6))
            if perm & 2:
                write += [MessageQueue(topic, name, q) for q in range(int(doc["write_queue_nums"]))]
            if perm & 4:
                read += [MessageQueue(topic, name, q) for q in range(int(doc["read_queue_nums"]))]
        if not write and not read:
            if errors and len(errors) == len(self.groups):
                raise errors[0]
            # Unknown topic: let a broker choose the queue (and auto-create the topic if it may).
            write = [MessageQueue(topic, name, -1) for name in sorted(self.groups)]
        return TopicRoute(tuple(write), tuple(read), time.monotonic())

    async def _topic_doc(self, g: Any, topic: str) -> dict:
        """The topic as the group's leader knows it. A follower may not have applied a new topic yet
        and answers TOPIC_NOT_EXIST with a leader hint: then the leader is asked (once)."""
        try:
            return await self.transport.call(g, "GET", f"/topics/{topic}")
        except MQBrokerError as e:
            if e.code != "TOPIC_NOT_EXIST" or not e.leader or e.leader == e.addr:
                raise
            g.redirect(e.leader)
        return await self.transport.call(g, "GET", f"/topics/{topic}")

    async def _from_controller(self, topic: str) -> TopicRoute:
        assert self.controller is not None
        doc = await self.transport.call(self.controller, "GET", f"/routes/{topic}")
        for bd in doc.get("broker_datas", []):
            name = bd["broker_name"]
            addrs = [a for a in (bd.get("broker_addrs") or {}).values() if a]
            master = bd.get("master_addr")
            if master and master not in addrs:
                addrs.insert(0, master)
            if not addrs:
                continue
            g = self.groups.get(name)
            if g is None:
                g = self.groups[name] = BrokerGroup(name, addrs)
            else:
                g.addrs = addrs
            if master:
                g.leader = master
        write, read = [], []
        for qd in doc.get("queue_datas", []):
            name, perm = qd["broker_name"], int(qd.get("perm", 6))
            if name not in self.groups:
                continue
            qs = [MessageQueue(topic, name, int(q)) for q in qd.get("queue_ids", [])]
            if perm & 2:
                write += qs
            if perm & 4:
                read += qs
        return TopicRoute(tuple(sorted(write)), tuple(sorted(read)), time.monotonic())

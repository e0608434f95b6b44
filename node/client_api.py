"""Broker features the client SDK needs: delay, transactions, group members, send-back.

`ClientServices` holds the services a Broker owns for them (built by Broker.__init__);
`route_special` is the send-path hook that stores delayed messages in the schedule topic
and transactional messages in the half topic; `CLIENT_ROUTES` are their REST handlers
(added to the node's app by node/api.py):

  POST   /groups/{group}/heartbeat            {client_id, topics, ttl_ms?, subscriptions?, consume_type?,
                                               message_model?, consume_from_where?, language?, version?}
                                               -> {group, members: {topic: [ids]}}
  GET    /groups/{group}/members               -> {group, members: [{client_id, topics, expires_in_ms, addr,
                                               language, version, subscriptions, consume_type, ...}]}
  DELETE /groups/{group}/members/{client_id}   -> {group, client_id, removed}
  POST   /groups/{group}/lock                 {client_id, queues: [{topic, queue_id}]}
                                               -> {group, locked: [...], expires_in_ms, retry_after_ms}
  POST   /groups/{group}/unlock               {client_id, queues: [...]} -> {group, unlocked: [...]}
  GET    /groups/{group}/locks                 -> {group, locks: [{topic, queue_id, client_id, expires_in_ms}]}
  POST   /groups/{group}/retry                 {offset_msg_id, delay_level?, max_reconsume_times?}
  POST   /transactions/end                     {producer_group, offset_msg_id, action: COMMIT|ROLLBACK}
  GET    /transactions/pending?producer_group=&older_than_ms=&max=   -> {messages: [...]}
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from node.config import parse_delay_levels
import time

from node.consumer_groups import ConsumerGroups, QueueLocks, send_back
from node.fence import LeaderFence
from node.schedule import ScheduleService, clamp_level, parse_level, to_schedule
from node.store import message as M
from node.store.errors import NotLeader
from node.transaction import TransactionService, to_half


class ClientServices:
    def __init__(self, broker: Any):
        self.broker = broker
        self.levels_ms = parse_delay_levels(broker.config.message_delay_level)
        self.fence = LeaderFence(broker)
        self.schedule = ScheduleService(broker, self.fence, self.levels_ms)
        self.transactions = TransactionService(broker, self.fence)
        self.groups = ConsumerGroups(admit=broker.admit_group)   # maxConsumerGroups
        self.created = time.monotonic()
        self._locks = QueueLocks(broker.config.rebalance_lock_max_live_time_ms)

    def locks(self) -> QueueLocks:
        """The lock table of the current leadership; a new one (refusing grants for a while) after a change.

        A standalone node counts its quiet time from its start (a lock granted by its previous run was
        granted before that); a node that becomes leader or master counts it from when it noticed.
        """
        key = self.fence.key()
        if key != self._locks.epoch:
            since = self.created if key[0] == "STANDALONE" else time.monotonic()
            self._locks.reset(key, since)
        return self._locks

    def route_special(self, topic: str, queue_id: int, props: dict[str, str], where: str
                      ) -> tuple[str, int, dict[str, str]]:
        """Where a user message is stored: its topic, the schedule topic (DELAY) or the half topic (TRAN_MSG)."""
        from node.store.errors import BadRequest
        tx = props.get(M.PROPERTY_TRANSACTION_PREPARED, "").lower() == "true"
        level = parse_level(props.get(M.PROPERTY_DELAY_TIME_LEVEL))
        if level < 0:
            raise BadRequest(f"{where}: property {M.PROPERTY_DELAY_TIME_LEVEL} must be an integer level")
        if tx:
            if level > 0:
                raise BadRequest(f"{where}: a transactional message cannot be delayed")
            if not props.get(M.PROPERTY_PRODUCER_GROUP):
                raise BadRequest(f"{where}: a transactional message needs property {M.PROPERTY_PRODUCER_GROUP}")
            return to_half(topic, queue_id, props)
        if level > 0:
            return to_schedule(topic, queue_id, props, clamp_level(level, len(self.levels_ms)))
        props.pop(M.PROPERTY_DELAY_TIME_LEVEL, None)
        return topic, queue_id, props


def _services(request: web.Request) -> ClientServices:
    from node.api import broker_of
    return broker_of(request).services


def _writable(request: web.Request) -> None:
    """Member tables live on the node that accepts writes; others point at it."""
    s = _services(request)
    if not s.fence.writable():
        raise NotLeader(leader=s.broker.log.leader())


async def heartbeat(request: web.Request) -> web.Response:
    from node.api import read_doc, reply
    from node.broker import check_group
    _writable(request)
    doc = await read_doc(request)
    group = check_group(request.match_info["group"])
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    addr = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else ""
    members = _services(request).groups.heartbeat(group, doc.get("client_id"), doc.get("topics"), doc.get("ttl_ms"),
                                                  doc, addr)
    return reply(request, {"group": group, "members": members})


async def members(request: web.Request) -> web.Response:
    from node.api import reply
    from node.broker import check_group
    _writable(request)
    group = check_group(request.match_info["group"])
    return reply(request, {"group": group, "members": _services(request).groups.describe(group)})


async def unregister(request: web.Request) -> web.Response:
    from node.api import reply
    from node.broker import check_group
    _writable(request)
    group = check_group(request.match_info["group"])
    cid = request.match_info["client_id"]
    removed = _services(request).groups.unregister(group, cid)
    return reply(request, {"group": group, "client_id": cid, "removed": removed})


async def lock(request: web.Request) -> web.Response:
    from node.api import read_doc, reply
    from node.broker import check_group
    _writable(request)
    doc = await read_doc(request)
    group = check_group(request.match_info["group"])
    out = _services(request).locks().lock(group, doc.get("client_id"), doc.get("queues"))
    return reply(request, {"group": group, **out})


async def unlock(request: web.Request) -> web.Response:
    from node.api import read_doc, reply
    from node.broker import check_group
    _writable(request)
    doc = await read_doc(request)
    group = check_group(request.match_info["group"])
    released = _services(request).locks().unlock(group, doc.get("client_id"), doc.get("queues"))
    return reply(request, {"group": group, "unlocked": released})


async def locks(request: web.Request) -> web.Response:
    from node.api import reply
    from node.broker import check_group
    _writable(request)
    group = check_group(request.match_info["group"])
    return reply(request, {"group": group, "locks": _services(request).locks().describe(group)})


async def retry(request: web.Request) -> web.Response:
    from node.api import read_doc, reply
    doc = await read_doc(request)
    s = _services(request)
    out = await send_back(s.broker, len(s.levels_ms), request.match_info["group"], doc.get("offset_msg_id"),
                          doc.get("delay_level"), doc.get("max_reconsume_times"))
    return reply(request, out)


async def end_transaction(request: web.Request) -> web.Response:
    from node.api import read_doc, reply
    doc = await read_doc(request)
    out = await _services(request).transactions.end(doc.get("producer_group"), doc.get("offset_msg_id"),
                                                     doc.get("action"))
    return reply(request, out)


async def pending_transactions(request: web.Request) -> web.Response:
    from node.api import query_int, render_message, reply, wants_msgpack
    found = await _services(request).transactions.pending(request.query.get("producer_group"),
                                                          query_int(request, "older_than_ms", 0),
                                                          query_int(request, "max", 32))
    return reply(request, {"messages": [render_message(m, wants_msgpack(request)) for m in found]})


CLIENT_ROUTES = [
    ("POST", "/groups/{group}/heartbeat", heartbeat),
    ("GET", "/groups/{group}/members", members),
    ("DELETE", "/groups/{group}/members/{client_id}", unregister),
    ("POST", "/groups/{group}/lock", lock),
    ("POST", "/groups/{group}/unlock", unlock),
    ("GET", "/groups/{group}/locks", locks),
    ("POST", "/groups/{group}/retry", retry),
    ("POST", "/transactions/end", end_transaction),
    ("GET", "/transactions/pending", pending_transactions),
]

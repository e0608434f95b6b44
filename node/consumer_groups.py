"""Consumer groups on the broker: member heartbeats (for rebalancing) and send-back (retry, DLQ).

Members: each consumer of a clustering group heartbeats `{client_id, topics, ttl_ms}`; the
broker answers with the live members per topic, and clients allocate queues among the sorted
members themselves (AllocateMessageQueueAveragely), as RocketMQ clients do. Membership is
soft state on the node that accepts writes: after a failover clients heartbeat to the new
leader and the table refills within one heartbeat interval.

Send-back (RocketMQ's SendMessageProcessor.consumerSendMsgBack): a message whose
consumption failed is re-stored with reconsume_times + 1 — into `%RETRY%<group>` through
the delay level 3 + reconsume_times (or the level the client asks for), or, once
reconsume_times passes max_reconsume_times (16) or the client asks for level -1, into
`%DLQ%<group>`. The message keeps its UNIQ_KEY (msg_id), and RETRY_TOPIC names the topic
it was first sent to.
Queue locks (RocketMQ's lockBatchMQ / unlockBatchMQ, for ordered consumption): a member of a
group holds a queue while it renews the lock within `rebalanceLockMaxLiveTimeMs`; another
member asking for a held queue is refused. Locks are soft state on the leader, not in the
log: a node that has just started to accept writes grants no lock for one lock lifetime
(`QueueLocks.reset`), so a lock granted by the previous leader has expired on its holder
before anyone else can get the queue.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from node.schedule import clamp_level, to_schedule
from node.store import message as M
from node.store.cold_reads import read_without_stalling
from node.store.message import MessageDraft

RETRY_PREFIX = "%RETRY%"
DLQ_PREFIX = "%DLQ%"
MAX_RECONSUME_TIMES_DEFAULT = 16
MAX_RECONSUME_TIMES_LIMIT = 64
MAX_GROUPS = 10_000
MAX_MEMBERS_PER_GROUP = 1_000
MAX_TOPICS_PER_MEMBER = 64
MAX_CLIENT_ID_CHARS = 256
TTL_MS_DEFAULT = 30_000
TTL_MS_RANGE = (1_000, 300_000)
MAX_LOCKS_PER_REQUEST = 1_024
MAX_LOCKS = 1_000_000


def retry_topic(group: str) -> str:
    return RETRY_PREFIX + group


def dlq_topic(group: str) -> str:
    return DLQ_PREFIX + group


CONSUME_TYPES = ("CONSUME_PASSIVELY", "CONSUME_ACTIVELY")
MESSAGE_MODELS = ("CLUSTERING", "BROADCASTING")
CONSUME_FROM = ("CONSUME_FROM_LAST_OFFSET", "CONSUME_FROM_FIRST_OFFSET", "CONSUME_FROM_TIMESTAMP")
MAX_EXPRESSION_CHARS = 4096     # a subscription's expression (`TagA || TagB`)
MAX_LABEL_CHARS = 32            # language, version


@dataclass(frozen=True, slots=True)
class ClientInfo:
    """What a member's heartbeat says of itself, for consumerConnection (RocketMQ's
    HeartbeatData's ConsumerData and the connection's language and version). All optional:
    a beat without them says nothing of them."""

    subscriptions: tuple[tuple[str, str], ...] = ()     # (topic, expression), sorted
    consume_type: str = ""
    message_model: str = ""
    consume_from_where: str = ""
    language: str = ""
    version: str = ""
    addr: str = ""              # the beat's source address, as the node saw it

    @classmethod
    def parse(cls, doc: dict, topics: frozenset[str], addr: str) -> "ClientInfo":
        from node.store.errors import BadRequest
        subs = doc.get("subscriptions") or {}
        if not isinstance(subs, dict) or not all(
                isinstance(t, str) and t in topics and isinstance(e, str) and len(e) <= MAX_EXPRESSION_CHARS
                for t, e in subs.items()):
            raise BadRequest(f"subscriptions must map topics of `topics` to expressions of at most "
                             f"{MAX_EXPRESSION_CHARS} chars")

        def one_of(name: str, allowed: tuple[str, ...]) -> str:
            value = doc.get(name) or ""
            if value and value not in allowed:
                raise BadRequest(f"{name} must be one of {', '.join(allowed)}")
            return value

        def label(name: str) -> str:
            value = doc.get(name) or ""
            if not isinstance(value, str) or len(value) > MAX_LABEL_CHARS or not value.isprintable():
                raise BadRequest(f"{name} must be printable, at most {MAX_LABEL_CHARS} chars")
            return value
        return cls(tuple(sorted(subs.items())), one_of("consume_type", CONSUME_TYPES),
                   one_of("message_model", MESSAGE_MODELS), one_of("consume_from_where", CONSUME_FROM),
                   label("language"), label("version"), addr)


@dataclass(slots=True)
class Member:
    client_id: str
    topics: frozenset[str]
    expires_at: float           # monotonic seconds
    info: ClientInfo = ClientInfo()


class ConsumerGroups:
    """Live members per group, expiring when their heartbeats stop. Bounded in groups and members."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, admit: Callable[[str], None] | None = None):
        self.clock = clock
        self.groups: dict[str, dict[str, Member]] = {}
        # Called for a group with no live members before it is added; raises to refuse it (the
        # broker's maxConsumerGroups, node/limits.py). Without it, MAX_GROUPS bounds the table.
        self.admit = admit

    def _expire(self, group: str) -> dict[str, Member]:
        now = self.clock()
        members = self.groups.get(group, {})
        for cid in [c for c, m in members.items() if m.expires_at <= now]:
            del members[cid]
        if not members:
            self.groups.pop(group, None)
        return members

    def heartbeat(self, group: str, client_id: Any, topics: Any, ttl_ms: Any, client: dict | None = None,
                  addr: str = "") -> dict[str, list[str]]:
        """A member's beat. `client`: the rest of its heartbeat document (ClientInfo's fields);
        `addr`: where it came from."""
        from node.broker import check_int, check_user_topic
        from node.store.errors import BadRequest
        if not isinstance(client_id, str) or not client_id or len(client_id) > MAX_CLIENT_ID_CHARS:
            raise BadRequest(f"client_id must be a string of 1..{MAX_CLIENT_ID_CHARS} chars")
        if not isinstance(topics, list) or len(topics) > MAX_TOPICS_PER_MEMBER:
            raise BadRequest(f"topics must be a list of at most {MAX_TOPICS_PER_MEMBER} topic names")
        names = frozenset(check_user_topic(t) for t in topics)
        ttl = check_int("ttl_ms", TTL_MS_DEFAULT if ttl_ms is None else ttl_ms, *TTL_MS_RANGE)
        info = ClientInfo.parse(client or {}, names, addr)
        members = self._expire(group)
        if group not in self.groups:
            if self.admit is not None:
                self.admit(group)
            elif len(self.groups) >= MAX_GROUPS:
                raise BadRequest(f"too many consumer groups (limit {MAX_GROUPS})")
        if client_id not in members and len(members) >= MAX_MEMBERS_PER_GROUP:
            raise BadRequest(f"group {group!r} has {MAX_MEMBERS_PER_GROUP} members; the limit is reached")
        members[client_id] = Member(client_id, names, self.clock() + ttl / 1000.0, info)
        self.groups[group] = members
        return {t: self.members_of(group, t) for t in sorted(names)}

    def members_of(self, group: str, topic: str) -> list[str]:
        members = self._expire(group)
        return sorted(c for c, m in members.items() if topic in m.topics)

    def unregister(self, group: str, client_id: str) -> bool:
        members = self._expire(group)
        found = members.pop(client_id, None) is not None
        if not members:
            self.groups.pop(group, None)
        return found

    def describe(self, group: str) -> list[dict[str, Any]]:
        now = self.clock()
        return [{"client_id": m.client_id, "topics": sorted(m.topics),
                 "expires_in_ms": int((m.expires_at - now) * 1000), "addr": m.info.addr,
                 "language": m.info.language, "version": m.info.version,
                 "subscriptions": dict(m.info.subscriptions), "consume_type": m.info.consume_type,
                 "message_model": m.info.message_model, "consume_from_where": m.info.consume_from_where}
                for m in sorted(self._expire(group).values(), key=lambda m: m.client_id)]


@dataclass(slots=True)
class Lock:
    client_id: str
    expires_at: float           # monotonic seconds


class QueueLocks:
    """group -> (topic, queue_id) -> holder. Bounded in locks; expired locks are free."""

    def __init__(self, max_live_ms: int, clock: Callable[[], float] = time.monotonic):
        self.max_live_s = max_live_ms / 1000.0
        self.clock = clock
        self.locks: dict[str, dict[tuple[str, int], Lock]] = {}
        self.count = 0
        self.grant_from = clock()
        self.epoch: Any = None

    def reset(self, epoch: Any, since: float) -> None:
        """A new leadership (epoch) began at `since`: forget every lock and grant none for one lock lifetime."""
        self.locks.clear()
        self.count = 0
        self.epoch = epoch
        self.grant_from = since + self.max_live_s

    def _queues(self, queues: Any) -> list[tuple[str, int]]:
        from node.broker import check_user_topic
        from node.store.errors import BadRequest
        if not isinstance(queues, list) or len(queues) > MAX_LOCKS_PER_REQUEST:
            raise BadRequest(f"queues must be a list of at most {MAX_LOCKS_PER_REQUEST} {{topic, queue_id}}")
        out = []
        for q in queues:
            if not isinstance(q, dict) or isinstance(q.get("queue_id"), bool) or not isinstance(q.get("queue_id"), int) \
                    or not 0 <= q["queue_id"] < 65536:
                raise BadRequest("each queue must be {topic: str, queue_id: int 0..65535}")
            topic = q.get("topic")
            if not (isinstance(topic, str) and topic.startswith(RETRY_PREFIX)):
                topic = check_user_topic(topic)
            out.append((topic, q["queue_id"]))
        return out

    def lock(self, group: str, client_id: Any, queues: Any) -> dict[str, Any]:
        """Grant or renew what is free or already ours; the rest stays with its holder."""
        from node.store.errors import BadRequest
        if not isinstance(client_id, str) or not client_id or len(client_id) > MAX_CLIENT_ID_CHARS:
            raise BadRequest(f"client_id must be a string of 1..{MAX_CLIENT_ID_CHARS} chars")
        wanted = self._queues(queues)
        now = self.clock()
        if now < self.grant_from:
            return {"locked": [], "expires_in_ms": 0, "retry_after_ms": int((self.grant_from - now) * 1000) + 1}
        table = self.locks.setdefault(group, {})
        granted = []
        for key in wanted:
            held = table.get(key)
            if held is not None and held.client_id != client_id and held.expires_at > now:
                continue
            if held is None:
                if self.count >= MAX_LOCKS:
                    raise BadRequest(f"too many queue locks held (limit {MAX_LOCKS})")
                self.count += 1
            table[key] = Lock(client_id, now + self.max_live_s)
            granted.append({"topic": key[0], "queue_id": key[1]})
        if not table:
            self.locks.pop(group, None)
        return {"locked": granted, "expires_in_ms": int(self.max_live_s * 1000), "retry_after_ms": 0}

    def unlock(self, group: str, client_id: Any, queues: Any) -> list[dict[str, Any]]:
        wanted = self._queues(queues)
        table = self.locks.get(group, {})
        released = []
        for key in wanted:
            held = table.get(key)
            if held is not None and held.client_id == client_id:
                del table[key]
                self.count -= 1
                released.append({"topic": key[0], "queue_id": key[1]})
        if not table:
            self.locks.pop(group, None)
        return released

    def describe(self, group: str) -> list[dict[str, Any]]:
        now = self.clock()
        return [{"topic": t, "queue_id": q, "client_id": h.client_id, "expires_in_ms": int((h.expires_at - now) * 1000)}
                for (t, q), h in sorted(self.locks.get(group, {}).items()) if h.expires_at > now]


async def send_back(broker: Any, levels: int, group: Any, offset_msg_id: Any, delay_level: Any = 0,
                    max_reconsume_times: Any = None) -> dict[str, Any]:
    """Re-store a message whose consumption failed: to %RETRY%<group> with a delay, or to %DLQ%<group>."""
    from node.broker import check_group, check_int
    group = check_group(group)
    level = check_int("delay_level", 0 if delay_level is None else delay_level, -1, 1 << 16)
    max_rc = check_int("max_reconsume_times",
                       MAX_RECONSUME_TIMES_DEFAULT if max_reconsume_times is None else max_reconsume_times,
                       0, MAX_RECONSUME_TIMES_LIMIT)
    msg = await read_without_stalling(broker.query_by_id, offset_msg_id)
    reconsume = msg.reconsume_times + 1
    props = {k: v for k, v in msg.properties.items()
             if k not in (M.PROPERTY_DELAY_TIME_LEVEL, M.PROPERTY_REAL_TOPIC, M.PROPERTY_REAL_QUEUE_ID)}
    if not msg.topic.startswith(RETRY_PREFIX):
        props[M.PROPERTY_RETRY_TOPIC] = msg.topic
    props.setdefault(M.PROPERTY_ORIGIN_MESSAGE_ID, msg.msg_id)
    props.setdefault(M.PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX, msg.msg_id)
    if reconsume > max_rc or level < 0:
        target = dlq_topic(group)
        await _ensure_topic(broker, target)
        topic, qid, level = target, 0, 0
    else:
        target = retry_topic(group)
        await _ensure_topic(broker, target)
        level = clamp_level(level if level > 0 else 3 + msg.reconsume_times, levels)
        topic, qid, props = to_schedule(target, 0, props, level)
    draft = MessageDraft(topic=topic, queue_id=qid, body=msg.body, properties=props, flag=msg.flag,
                         born_timestamp=msg.born_timestamp, reconsume_times=reconsume
                         ).seal(broker.config.max_message_size)
    (r,) = await broker.log.append([draft])
    return {"status": r.status.value, "topic": target, "reconsume_times": reconsume, "delay_level": level,
            "msg_id": msg.msg_id}


async def _ensure_topic(broker: Any, topic: str) -> None:
    """Retry and DLQ topics have one queue (RocketMQ's retryQueueNums / DLQ defaults)."""
    if topic not in broker.topics:
        await broker.create_topic(topic, 1)

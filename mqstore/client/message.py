"""Values the client exchanges: messages, queues, results, statuses, and the UNIQ_KEY id."""

from __future__ import annotations

import enum
import itertools
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mqstore.client.errors import MQConfigError

# MessageConst property names the client sets or reads.
PROPERTY_KEYS = "KEYS"
PROPERTY_TAGS = "TAGS"
PROPERTY_DELAY_TIME_LEVEL = "DELAY"
PROPERTY_UNIQ_KEY = "UNIQ_KEY"
PROPERTY_RETRY_TOPIC = "RETRY_TOPIC"
PROPERTY_TRANSACTION_PREPARED = "TRAN_MSG"
PROPERTY_PRODUCER_GROUP = "PGROUP"
PROPERTY_ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
RETRY_PREFIX = "%RETRY%"
DLQ_PREFIX = "%DLQ%"


class SendStatus(str, enum.Enum):
    SEND_OK = "SEND_OK"
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"
    FLUSH_SLAVE_TIMEOUT = "FLUSH_SLAVE_TIMEOUT"
    SLAVE_NOT_AVAILABLE = "SLAVE_NOT_AVAILABLE"


_SEND_STATUS = {s.value: s for s in SendStatus}       # a dict lookup is cheaper than SendStatus(value)


class PullStatus(str, enum.Enum):
    FOUND = "FOUND"
    NO_NEW_MSG = "NO_NEW_MSG"
    NO_MATCHED_MSG = "NO_MATCHED_MSG"
    OFFSET_ILLEGAL = "OFFSET_ILLEGAL"


class ConsumeStatus(str, enum.Enum):
    """What a push consumer's listener returns (ConsumeConcurrentlyStatus)."""

    CONSUME_SUCCESS = "CONSUME_SUCCESS"
    RECONSUME_LATER = "RECONSUME_LATER"


class LocalTransactionState(str, enum.Enum):
    COMMIT_MESSAGE = "COMMIT_MESSAGE"
    ROLLBACK_MESSAGE = "ROLLBACK_MESSAGE"
    UNKNOW = "UNKNOW"           # RocketMQ's spelling


class MessageModel(str, enum.Enum):
    CLUSTERING = "CLUSTERING"
    BROADCASTING = "BROADCASTING"


class ConsumeFromWhere(str, enum.Enum):
    CONSUME_FROM_LAST_OFFSET = "CONSUME_FROM_LAST_OFFSET"
    CONSUME_FROM_FIRST_OFFSET = "CONSUME_FROM_FIRST_OFFSET"


@dataclass(slots=True)
class Message:
    """A message to send. `delay_level` > 0 delays delivery by that messageDelayLevel level."""

    topic: str
    body: bytes
    tags: str | None = None
    keys: list[str] = field(default_factory=list)
    properties: dict[str, str] = field(default_factory=dict)
    delay_level: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.body, str):
            self.body = self.body.encode("utf-8")
        if isinstance(self.keys, str):
            self.keys = self.keys.split()
        if not isinstance(self.body, (bytes, bytearray)) or not self.body:
            raise MQConfigError("Message.body must be non-empty bytes (or str)")
        if not isinstance(self.topic, str) or not self.topic:
            raise MQConfigError("Message.topic must be a non-empty string")
        if isinstance(self.delay_level, bool) or not isinstance(self.delay_level, int) or self.delay_level < 0:
            raise MQConfigError("Message.delay_level must be an integer >= 0")

    def to_wire(self, queue_id: int | None) -> dict[str, Any]:
        props = dict(self.properties)
        if self.delay_level > 0:
            props[PROPERTY_DELAY_TIME_LEVEL] = str(self.delay_level)
        doc: dict[str, Any] = {"body": bytes(self.body), "properties": props}
        if self.tags:
            doc["tags"] = self.tags
        if self.keys:
            doc["keys"] = list(self.keys)
        if queue_id is not None and queue_id >= 0:
            doc["queue_id"] = queue_id
        return doc


@dataclass(slots=True)
class MessageExt:
    """A received message (RocketMQ MessageExt)."""

    topic: str
    body: bytes
    tags: str | None
    keys: list[str]
    properties: dict[str, str]
    msg_id: str
    offset_msg_id: str
    queue_id: int
    queue_offset: int
    commitlog_offset: int
    born_timestamp: int
    store_timestamp: int
    reconsume_times: int
    broker_name: str = ""

    @classmethod
    def from_wire(cls, doc: dict[str, Any], broker_name: str = "") -> "MessageExt":
        body = doc.get("body", b"")
        if isinstance(body, str):
            body = body.encode("utf-8")
        return cls(topic=doc["topic"], body=body, tags=doc.get("tags"), keys=list(doc.get("keys") or []),
                   properties=dict(doc.get("properties") or {}), msg_id=doc["msg_id"],
                   offset_msg_id=doc["offset_msg_id"], queue_id=int(doc["queue_id"]),
                   queue_offset=int(doc["queue_offset"]), commitlog_offset=int(doc["commitlog_offset"]),
                   born_timestamp=int(doc.get("born_timestamp", 0)), store_timestamp=int(doc.get("store_timestamp", 0)),
                   reconsume_times=int(doc.get("reconsume_times", 0)), broker_name=broker_name)

    @property
    def body_size(self) -> int:
        return len(self.body)


@dataclass(frozen=True, slots=True, order=True)
class MessageQueue:
    """A queue of a topic on one broker group. queue_id -1: the broker picks (topic not yet routed)."""

    topic: str
    broker_name: str
    queue_id: int


@dataclass(frozen=True, slots=True)
class SendResult:
    status: SendStatus
    msg_id: str
    offset_msg_id: str
    queue_id: int
    queue_offset: int
    broker_name: str = ""

    @classmethod
    def from_wire(cls, doc: dict[str, Any], broker_name: str) -> "SendResult":
        status = doc["status"]
        return cls(_SEND_STATUS.get(status) or SendStatus(status), doc["msg_id"], doc["offset_msg_id"], int(doc["queue_id"]),
                   int(doc["queue_offset"]), broker_name)


@dataclass(frozen=True, slots=True)
class PullResult:
    status: PullStatus
    next_offset: int
    min_offset: int
    max_offset: int
    messages: list[MessageExt]


@dataclass(frozen=True, slots=True)
class TransactionSendResult:
    send_result: SendResult
    local_state: LocalTransactionState


# --- UNIQ_KEY: RocketMQ's MessageClientIDSetter format ---------------------------------------
# 16 bytes as 32 upper-case hex chars: ip 4 · pid 2 · client hash 4 · ms since the start of
# the month 4 · counter 2. Unique per process and sortable by time within a month.


def _local_ip() -> bytes:
    try:
        return socket.inet_aton(socket.gethostbyname(socket.gethostname()))
    except OSError:
        return b"\x7f\x00\x00\x01"


def _month_start_ms(now_ms: int) -> int:
    t = time.localtime(now_ms / 1000)
    return int(time.mktime((t.tm_year, t.tm_mon, 1, 0, 0, 0, 0, 0, -1)) * 1000)


class UniqIdGenerator:
    def __init__(self) -> None:
        fix = _local_ip() + struct.pack(">H", os.getpid() & 0xFFFF) + struct.pack(">I", id(self) & 0xFFFFFFFF)
        self._prefix = fix.hex().upper()
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._month_start = 0
        self._next_month = 0

    def next(self) -> str:
        return self.next_many(1)[0]

    def next_many(self, count: int) -> list[str]:
        """`count` ids under one clock read and one lock (a batch send asks for many at once)."""
        now = int(time.time() * 1000)
        with self._lock:
            if now >= self._next_month or now < self._month_start:
                self._month_start = _month_start_ms(now)
                self._next_month = _month_start_ms(self._month_start + 32 * 86_400_000)
            first = next(self._counter)
            if count > 1:
                self._counter = itertools.count(first + count)
        head = f"{self._prefix}{(now - self._month_start) & 0xFFFFFFFF:08X}"
        return [f"{head}{(first + i) & 0xFFFF:04X}" for i in range(count)]


UNIQ_IDS = UniqIdGenerator()

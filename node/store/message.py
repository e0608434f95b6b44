"""Commitlog message records: encode, decode, validate (pure, no IO).

A producer's message becomes a `MessageDraft` once, at the edge: its body CRC,
tag hash and the record's tail (body, topic, properties) are computed there.
At append time only the 88-byte header is packed, with the queue offset,
physical offset and store timestamp the log assigns under its lock.
"""

from __future__ import annotations

import functools
import re
import socket
from dataclasses import dataclass, field

from node.store.crc import crc32 as _crc32
from node.store import layout as L
from node.store.errors import CorruptRecord, InvalidMessage

TOPIC_RE = re.compile(r"^[%|a-zA-Z0-9_-]+$")

# Well-known property names (MessageConst).
PROPERTY_KEYS = "KEYS"
PROPERTY_TAGS = "TAGS"
PROPERTY_WAIT_STORE_MSG_OK = "WAIT"
PROPERTY_DELAY_TIME_LEVEL = "DELAY"
PROPERTY_RETRY_TOPIC = "RETRY_TOPIC"
PROPERTY_REAL_TOPIC = "REAL_TOPIC"
PROPERTY_REAL_QUEUE_ID = "REAL_QID"
PROPERTY_TRANSACTION_PREPARED = "TRAN_MSG"
PROPERTY_PRODUCER_GROUP = "PGROUP"
PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX = "UNIQ_KEY"
PROPERTY_RECONSUME_TIME = "RECONSUME_TIME"
PROPERTY_ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
PROPERTY_TRANSACTION_CHECK_TIMES = "TRANSACTION_CHECK_TIMES"
PROPERTY_TRAN_PREPARED_QUEUE_OFFSET = "TRAN_PREPARED_QUEUE_OFFSET"
KEY_SEPARATOR = " "


def java_string_hash(s: str) -> int:
    """Java's String.hashCode (signed 32-bit) over UTF-16 code units."""
    h = 0
    data = s.encode("utf-16-be")
    for i in range(0, len(data), 2):
        h = (31 * h + ((data[i] << 8) | data[i + 1])) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


@functools.lru_cache(maxsize=4096)
def _tags_hash(tags: str) -> int:
    return java_string_hash(tags)


def tags_code(tags: str | None) -> int:
    """ConsumeQueue tag hash: String.hashCode, 0 when there are no tags (cached: few distinct tags)."""
    return _tags_hash(tags) if tags else 0


_VALID_TOPICS: set[str] = set()     # topics that passed validate_topic (bounded below)
_VALID_TOPICS_MAX = 4096


def validate_topic(topic: str) -> None:
    if type(topic) is str and topic in _VALID_TOPICS:
        return
    _validate_topic(topic)
    if len(_VALID_TOPICS) >= _VALID_TOPICS_MAX:
        _VALID_TOPICS.clear()
    _VALID_TOPICS.add(topic)


@functools.lru_cache(maxsize=4096)
def _topic_field(topic: str) -> bytes:
    """TOPICLEN + TOPIC of a record, for a topic that passes validate_topic (raises otherwise)."""
    validate_topic(topic)
    raw = topic.encode("ascii")
    return L.TOPIC_LEN.pack(len(raw)) + raw


_HEADER_SIZE = L.MESSAGE_HEADER.size


def _validate_topic(topic: str) -> None:
    if not isinstance(topic, str) or not topic:
        raise InvalidMessage("topic must be a non-empty string")
    if len(topic) > L.MAX_TOPIC_CHARS:
        raise InvalidMessage(f"topic is {len(topic)} chars; the limit is {L.MAX_TOPIC_CHARS}")
    if not TOPIC_RE.match(topic):
        raise InvalidMessage(f"topic {topic!r} has characters outside [%|a-zA-Z0-9_-]")


def encode_properties(props: dict[str, str]) -> bytes:
    if not props:
        return b""
    nv, ps = L.NAME_VALUE_SEPARATOR, L.PROPERTY_SEPARATOR
    text = "".join([f"{k}{nv}{v}{ps}" for k, v in props.items()])
    # Exactly one separator of each kind per pair, or a name or value holds a reserved one.
    if text.count(L.NAME_VALUE_SEPARATOR) != len(props) or text.count(L.PROPERTY_SEPARATOR) != len(props):
        for k, v in props.items():
            for part in (k, v):
                if L.NAME_VALUE_SEPARATOR in part or L.PROPERTY_SEPARATOR in part:
                    raise InvalidMessage(f"property {k!r} contains a reserved separator character")
    return text.encode("utf-8")


def decode_properties(raw: bytes) -> dict[str, str]:
    if not raw:
        return {}
    text = raw.decode("utf-8", "replace")
    nv = L.NAME_VALUE_SEPARATOR
    try:   # the common case, every pair well formed: dict() does the loop in C
        return dict([pair.split(nv, 1) for pair in text.split(L.PROPERTY_SEPARATOR) if pair])
    except ValueError:
        pass   # a pair without a name/value separator: skip it, as below
    props: dict[str, str] = {}
    for pair in text.split(L.PROPERTY_SEPARATOR):
        if not pair:
            continue
        name, sep, value = pair.partition(L.NAME_VALUE_SEPARATOR)
        if sep:
            props[name] = value
    return props


def host_bytes(host: str) -> bytes:
    """IPv4 dotted quad -> 4 bytes (a hostname resolves to 0.0.0.0 rather than blocking)."""
    try:
        return socket.inet_aton(host)
    except OSError:
        return b"\x00\x00\x00\x00"


@dataclass(slots=True)
class MessageDraft:
    """A message ready to append: everything but queue offset, physical offset and store time."""

    topic: str
    queue_id: int
    body: bytes
    properties: dict[str, str]
    flag: int = 0
    sys_flag: int = 0
    born_timestamp: int = 0
    born_ip: bytes = b"\x7f\x00\x00\x01"
    born_port: int = 0
    reconsume_times: int = 0
    prepared_tx_offset: int = 0
    # Derived once by `seal` (the append path only packs the header).
    tail: bytes = b""
    body_crc: int = 0
    total_size: int = 0
    tags_code: int = 0

    def seal(self, max_body_bytes: int = L.MAX_BODY_BYTES_DEFAULT) -> "MessageDraft":
        body = self.body
        if len(body) > max_body_bytes:
            raise InvalidMessage(f"body is {len(body)} bytes; the limit is {max_body_bytes}")
        if self.queue_id < 0:
            raise InvalidMessage("queue_id must be >= 0")
        topic_field = _topic_field(self.topic) if type(self.topic) is str else validate_topic(self.topic)
        properties = self.properties
        props = encode_properties(properties)
        if len(props) > L.MAX_PROPERTIES_BYTES:
            raise InvalidMessage(f"properties are {len(props)} bytes; the limit is {L.MAX_PROPERTIES_BYTES}")
        tail = b"".join((body, topic_field, L.PROPERTIES_LEN.pack(len(props)), props))
        self.tail = tail
        self.body_crc = _crc32(body)
        self.total_size = _HEADER_SIZE + len(tail)
        tags = properties.get(PROPERTY_TAGS)
        self.tags_code = _tags_hash(tags) if tags else 0
        return self

    @classmethod
    def sealed_plain(cls, topic: str, queue_id: int, body: bytes, tags: str | None,
                     born_timestamp: int) -> "MessageDraft":
        """`MessageDraft(topic, queue_id, body, {TAGS: tags} or {}, born_timestamp=...).seal()`
        for a message whose only property is its tag: the record's suffix (topic, properties)
        and the tag hash come from a bounded cache, so per message only the body's CRC and
        one concatenation are computed. The caller has checked the body size and queue id;
        the topic and the tag are checked here (on a cache miss) exactly as `seal` checks them."""
        suffix, code = _plain_suffix(topic, tags)
        return cls(topic, queue_id, body, {PROPERTY_TAGS: tags} if tags else {}, 0, 0, born_timestamp,
                   _LOOPBACK, 0, 0, 0, body + suffix, _crc32(body), _HEADER_SIZE + len(body) + len(suffix),
                   code)

    @property
    def is_dispatched(self) -> bool:
        """Prepared and rolled-back transaction messages take no queue offset (RocketMQ)."""
        tx = self.sys_flag & L.SYSFLAG_TRANSACTION_MASK
        return tx not in (L.SYSFLAG_TRANSACTION_PREPARED_TYPE, L.SYSFLAG_TRANSACTION_ROLLBACK_TYPE)


_LOOPBACK = b"\x7f\x00\x00\x01"           # MessageDraft.born_ip default
_PLAIN_SUFFIXES: dict[tuple[str, str | None], tuple[bytes, int]] = {}
_PLAIN_SUFFIXES_MAX = 4096                 # entries; the cache is cleared when full
_PLAIN_SUFFIX_CACHED_TAG_CHARS = 256       # longer tags are encoded every time, not cached


def _plain_suffix(topic: str, tags: str | None) -> tuple[bytes, int]:
    """(TOPICLEN+TOPIC+PROPERTIESLEN+PROPERTIES, tags code) of a record whose only property is
    TAGS (none when `tags` is empty). Raises InvalidMessage like `MessageDraft.seal`."""
    if type(topic) is not str:
        validate_topic(topic)     # raises InvalidMessage (and the key below must be hashable)
    key = (topic, tags)
    hit = _PLAIN_SUFFIXES.get(key)
    if hit is not None:
        return hit
    topic_field = _topic_field(topic)
    props = encode_properties({PROPERTY_TAGS: tags} if tags else {})
    if len(props) > L.MAX_PROPERTIES_BYTES:
        raise InvalidMessage(f"properties are {len(props)} bytes; the limit is {L.MAX_PROPERTIES_BYTES}")
    out = (b"".join((topic_field, L.PROPERTIES_LEN.pack(len(props)), props)), _tags_hash(tags) if tags else 0)
    if tags is None or len(tags) <= _PLAIN_SUFFIX_CACHED_TAG_CHARS:
        if len(_PLAIN_SUFFIXES) >= _PLAIN_SUFFIXES_MAX:
            _PLAIN_SUFFIXES.clear()
        _PLAIN_SUFFIXES[key] = out
    return out


def encode_record(d: MessageDraft, queue_offset: int, physical_offset: int, store_timestamp: int,
                  store_ip: bytes, store_port: int) -> bytes:
    """The complete commitlog record for a sealed draft."""
    assert d.total_size > 0, "draft not sealed"
    header = L.MESSAGE_HEADER.pack(
        d.total_size, L.MESSAGE_MAGIC, d.body_crc, d.queue_id, d.flag, queue_offset, physical_offset,
        d.sys_flag, d.born_timestamp, d.born_ip, d.born_port, store_timestamp, store_ip, store_port,
        d.reconsume_times, d.prepared_tx_offset, len(d.body))
    return header + d.tail


@dataclass(slots=True)
class StoredMessage:
    """A decoded commitlog record."""

    total_size: int
    body_crc: int
    queue_id: int
    flag: int
    queue_offset: int
    physical_offset: int
    sys_flag: int
    born_timestamp: int
    born_host: str
    store_timestamp: int
    store_host: str
    reconsume_times: int
    prepared_tx_offset: int
    body: bytes
    topic: str
    properties: dict[str, str] = field(default_factory=dict)

    @property
    def tags(self) -> str | None:
        return self.properties.get(PROPERTY_TAGS)

    @property
    def keys(self) -> list[str]:
        raw = self.properties.get(PROPERTY_KEYS, "")
        return [k for k in raw.split(KEY_SEPARATOR) if k]

    @property
    def msg_id(self) -> str:
        """Client-side unique id (UNIQ_KEY) when the producer set one, else the offsetMsgId."""
        return self.properties.get(PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX) or self.offset_msg_id

    @property
    def offset_msg_id(self) -> str:
        ip, _, port = self.store_host.rpartition(":")
        return encode_offset_msg_id(host_bytes(ip), int(port), self.physical_offset)


@functools.lru_cache(maxsize=1024)
def _host(ip: bytes, port: int) -> str:
    """`ip:port` text (cached: a store holds few distinct hosts, and a pull decodes two per message)."""
    return f"{socket.inet_ntoa(ip)}:{port}"


def record_size_at(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """(total_size, magic) of the record or blank at `pos`; raises CorruptRecord if unreadable."""
    if pos + L.BLANK.size > len(buf):
        raise CorruptRecord(pos, "truncated record prefix")
    size, magic = L.BLANK.unpack_from(buf, pos)
    return size, magic


def decode_record(buf: bytes | memoryview, pos: int = 0, *, check_crc: bool = True,
                  with_body: bool = True) -> StoredMessage:
    """Decode the message record at `pos`; raise CorruptRecord on any inconsistency."""
    if pos + L.MESSAGE_HEADER.size > len(buf):
        raise CorruptRecord(pos, "truncated header")
    (total, magic, body_crc, queue_id, flag, queue_offset, physical_offset, sys_flag, born_ts, born_ip,
     born_port, store_ts, store_ip, store_port, reconsume, prepared, body_len) = L.MESSAGE_HEADER.unpack_from(buf, pos)
    if magic != L.MESSAGE_MAGIC:
        raise CorruptRecord(pos, f"bad magic {magic:#x}")
    if total < L.MESSAGE_OVERHEAD or pos + total > len(buf):
        raise CorruptRecord(pos, f"bad total size {total}")
    if body_len < 0 or L.MESSAGE_OVERHEAD + body_len > total:
        raise CorruptRecord(pos, f"bad body length {body_len}")
    p = pos + L.MESSAGE_HEADER.size
    body = bytes(buf[p:p + body_len])
    if check_crc and _crc32(body) != body_crc:
        raise CorruptRecord(pos, "body crc mismatch")
    p += body_len
    topic_len = buf[p]
    p += 1
    topic = bytes(buf[p:p + topic_len]).decode("ascii", "replace")
    p += topic_len
    if p + 2 > pos + total:
        raise CorruptRecord(pos, "properties length past record end")
    (props_len,) = L.PROPERTIES_LEN.unpack_from(buf, p)
    p += 2
    if p + props_len != pos + total:
        raise CorruptRecord(pos, "record size does not match its fields")
    props = decode_properties(bytes(buf[p:p + props_len]))
    return StoredMessage(total, body_crc, queue_id, flag, queue_offset, physical_offset, sys_flag, born_ts,
                         _host(born_ip, born_port), store_ts, _host(store_ip, store_port), reconsume,
                         prepared, body if with_body else b"", topic, props)


def encode_offset_msg_id(ip: bytes, port: int, offset: int) -> str:
    return L.MSG_ID.pack(ip, port, offset).hex().upper()


def decode_offset_msg_id(msg_id: str) -> tuple[str, int, int]:
    """offsetMsgId -> (ip, port, commitlog offset); raises InvalidMessage if malformed."""
    try:
        raw = bytes.fromhex(msg_id)
    except ValueError:
        raise InvalidMessage(f"offsetMsgId {msg_id!r} is not hex") from None
    if len(raw) != L.MSG_ID.size:
        raise InvalidMessage(f"offsetMsgId must be {L.MSG_ID.size * 2} hex chars")
    ip, port, offset = L.MSG_ID.unpack(raw)
    return socket.inet_ntoa(ip), port, offset

"""The produce and pull hot paths keep every check they replaced.

Method: the fast paths (inline type tests in parse_message, count-based separator check
in encode_properties, C-level decode_properties, cached topic and host encodings,
framing-only scans for the dispatcher, offsetMsgId from a cached host prefix) are fed
the inputs the slow paths rejected or produced, and must reject or produce the same.
"""

from __future__ import annotations

import os

import pytest

from node.api import offset_msg_id_of, parse_message, render_message
from node.store.errors import BadRequest
from node.store import layout as L
from node.store.commitlog import CommitLog
from node.store.errors import CorruptRecord, InvalidMessage
from node.store.fileio import FileSystem
from node.store.message import (MessageDraft, decode_properties, decode_record, encode_properties, encode_record,
                                tags_code, java_string_hash, validate_topic)
from node.store.queue_offsets import QueueOffsetTable

IP = b"\x0a\x00\x00\x07"
PORT = 10911


# --- parse_message --------------------------------------------------------------------------------
def test_parse_message_accepts_the_common_shapes():
    m = parse_message({"body": b"\x00\xff", "tags": "A", "queue_id": 3, "born_timestamp": 7}, 0)
    assert (m.body, m.tags, m.queue_id, m.born_timestamp, m.keys, m.properties) == (b"\x00\xff", "A", 3, 7, [], {})
    m = parse_message({"body": "héllo", "keys": "k1 k2", "properties": {"p": "v"}}, 0)
    assert m.body == "héllo".encode() and m.keys == ["k1", "k2"] and m.properties == {"p": "v"} and m.tags is None
    assert parse_message({"body_b64": "YWI="}, 0).body == b"ab"


@pytest.mark.parametrize("item, words", [
    ({"body": "a", "queue_id": True}, "queue_id"),          # bool is not an integer here
    ({"body": "a", "queue_id": 1.0}, "queue_id"),
    ({"body": "a", "born_timestamp": False}, "born_timestamp"),
    ({"body": "a", "born_timestamp": -1}, "born_timestamp"),
    ({"body": "a", "body_b64": "YQ=="}, "exactly one"),
    ({"body": b"a", "body_b64": "YQ=="}, "exactly one"),
    ({"body": ""}, "empty"),
    ({"body": b""}, "empty"),
    ({"body": 5}, "body must be"),
    ({}, "exactly one"),
    ({"body": "a", "tags": "x||y"}, "tags"),
    ({"body": "a", "tags": 1}, "tags"),
    ({"body": "a", "keys": [1]}, "keys"),
    ({"body": "a", "properties": {"a": 1}}, "properties"),
    ([1], "must be an object"),
])
def test_parse_message_rejects_what_it_always_rejected(item, words):
    with pytest.raises(BadRequest) as e:
        parse_message(item, 4)
    assert "messages[4]" in str(e.value) and words in str(e.value)


# --- properties -----------------------------------------------------------------------------------
def test_properties_round_trip_and_reserved_separators_are_still_refused():
    props = {"TAGS": "t", "KEYS": "a b", "x": ""}
    raw = encode_properties(props)
    assert raw == b"TAGS\x01t\x02KEYS\x01a b\x02x\x01\x02"
    assert decode_properties(raw) == props
    assert encode_properties({}) == b""
    for bad in ({"a\x01": "v"}, {"a": "v\x01"}, {"a": "v\x02"}, {"a\x02": "v"}, {"ok": "1", "b": "x\x01y\x02"}):
        with pytest.raises(InvalidMessage):
            encode_properties(bad)


def test_decode_properties_skips_a_pair_without_separator_like_before():
    assert decode_properties(b"A\x01b\x02junk\x02C\x01d\x01e\x02") == {"A": "b", "C": "d\x01e"}
    assert decode_properties(b"\x02\x02") == {}
    assert decode_properties(b"A\x01\x02A\x012\x02") == {"A": "2"}    # the last one wins


# --- topic and tag caches ---------------------------------------------------------------------------
def test_topic_validation_cache_never_admits_a_bad_topic():
    validate_topic("GoodTopic")
    validate_topic("GoodTopic")
    for bad in ("bad topic", "", "x" * (L.MAX_TOPIC_CHARS + 1), None, ["list"], 5):
        with pytest.raises(InvalidMessage):
            validate_topic(bad)                                  # unhashable ones too: no TypeError
        with pytest.raises(InvalidMessage):
            MessageDraft(bad, 0, b"x", {}).seal()


def test_sealed_record_is_the_one_encode_record_describes():
    d = MessageDraft("Topic_1", 2, b"body", {"TAGS": "tg", "KEYS": "k"}).seal()
    rec = encode_record(d, 5, 64, 99, IP, PORT)
    assert len(rec) == d.total_size
    m = decode_record(rec)
    assert (m.topic, m.queue_id, m.body, m.properties, m.queue_offset) == ("Topic_1", 2, b"body",
                                                                          {"TAGS": "tg", "KEYS": "k"}, 5)
    assert d.tags_code == tags_code("tg") == java_string_hash("tg")
    assert MessageDraft("Topic_1", 0, b"b", {}).seal().tags_code == 0


# --- pull rendering ---------------------------------------------------------------------------------
def test_offset_msg_id_from_the_cached_host_prefix_equals_the_full_encoding():
    d = MessageDraft("T", 0, b"x" * 10, {"TAGS": "a"}).seal()
    for phys in (0, 1, 4096, (1 << 40) + 12345, (1 << 62) + 3):
        m = decode_record(encode_record(d, 0, phys, 1, IP, PORT))
        assert offset_msg_id_of(m) == m.offset_msg_id
        doc = render_message(m, True)
        assert doc["offset_msg_id"] == doc["msg_id"] == m.offset_msg_id
        assert doc["tags"] == "a" and doc["keys"] == [] and doc["body"] == b"x" * 10
    uniq = MessageDraft("T", 0, b"y", {"UNIQ_KEY": "C0FFEE", "KEYS": "k1 k2"}).seal()
    doc = render_message(decode_record(encode_record(uniq, 0, 8, 1, IP, PORT)), False)
    assert doc["msg_id"] == "C0FFEE" and doc["keys"] == ["k1", "k2"] and doc["body"] == "y"


# --- framing-only scan ------------------------------------------------------------------------------
def _log_with(tmp_path, n: int) -> CommitLog:
    cl = CommitLog(FileSystem(), str(tmp_path / "commitlog"), 8192, IP, PORT)
    cl.load()
    cl.append_batch([MessageDraft("T", i % 2, os.urandom(700), {"TAGS": "t"}).seal() for i in range(n)],
                    QueueOffsetTable(), 1)
    return cl


def test_framing_only_scan_returns_exactly_the_verified_records(tmp_path):
    cl = _log_with(tmp_path, 25)       # rolls over several 8 KiB files
    pos, a, b = 0, [], []
    while pos < cl.max_offset:
        batch = cl.scan(pos, 3000)
        a.extend(batch.records)
        pos = batch.next_position
    pos = 0
    while pos < cl.max_offset:
        batch = cl.scan(pos, 3000, verify=False)
        b.extend(batch.records)
        pos = batch.next_position
    assert a == b and len(a) == 25


def test_framing_only_scan_still_refuses_bad_framing(tmp_path):
    cl = _log_with(tmp_path, 3)
    seg = cl.files.segments[0]
    first = len(cl.scan(0, 1).records[0].data)
    seg.handle.pwrite(L.BLANK.pack(5, L.MESSAGE_MAGIC), first)     # a size below the fixed overhead
    with pytest.raises(CorruptRecord) as e:
        cl.scan(0, 1 << 20, verify=False)
    assert e.value.offset == first
    seg.handle.pwrite(b"\xde\xad\xbe\xef" * 2, first)               # not a record at all
    with pytest.raises(CorruptRecord):
        cl.scan(0, 1 << 20, verify=False)
    assert len(cl.scan(0, 1, verify=False).records) == 1            # the good record before it

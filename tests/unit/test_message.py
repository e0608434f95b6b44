"""Commitlog record codec: byte layout per RocketMQ V1, validation at the edge."""

import zlib

import pytest

from node.store import layout as L
from node.store.errors import CorruptRecord, InvalidMessage
from node.store.message import (MessageDraft, decode_offset_msg_id, decode_record, encode_offset_msg_id,
                                encode_record, java_string_hash, tags_code)


def draft(body=b"hello", topic="TopicTest", props=None, **kw):
    return MessageDraft(topic=topic, queue_id=kw.pop("queue_id", 1), body=body,
                        properties=props if props is not None else {"TAGS": "TagA", "KEYS": "k1 k2"}, **kw).seal()


def test_record_overhead_is_91_bytes_plus_variable_parts():
    d = draft(body=b"x" * 10, topic="T", props={})
    rec = encode_record(d, 0, 0, 0, b"\x7f\x00\x00\x01", 10911)
    assert len(rec) == 91 + 10 + 1


def test_record_fields_sit_where_rocketmq_puts_them():
    d = draft(born_timestamp=1234)
    rec = encode_record(d, queue_offset=7, physical_offset=4096, store_timestamp=99,
                        store_ip=b"\x0a\x00\x00\x02", store_port=10911)
    assert int.from_bytes(rec[0:4], "big") == len(rec)
    assert rec[4:8] == bytes.fromhex("DAA320A7")
    assert int.from_bytes(rec[8:12], "big") == zlib.crc32(b"hello")
    assert int.from_bytes(rec[20:28], "big") == 7          # QUEUEOFFSET
    assert int.from_bytes(rec[28:36], "big") == 4096       # PHYSICALOFFSET
    assert int.from_bytes(rec[40:48], "big") == 1234       # BORNTIMESTAMP
    assert rec[64:68] == b"\x0a\x00\x00\x02"               # STOREHOST ip


def test_decode_round_trips_every_field():
    d = draft(flag=3, reconsume_times=2, born_port=5555)
    rec = encode_record(d, 7, 4096, 99, b"\x0a\x00\x00\x02", 10911)
    m = decode_record(rec)
    assert (m.topic, m.queue_id, m.queue_offset, m.physical_offset, m.body) == ("TopicTest", 1, 7, 4096, b"hello")
    assert (m.flag, m.reconsume_times, m.store_timestamp, m.store_host) == (3, 2, 99, "10.0.0.2:10911")
    assert m.tags == "TagA" and m.keys == ["k1", "k2"]
    assert decode_offset_msg_id(m.offset_msg_id) == ("10.0.0.2", 10911, 4096)


def test_a_flipped_body_bit_is_reported_at_its_offset():
    rec = bytearray(encode_record(draft(), 0, 0, 0, b"\x7f\x00\x00\x01", 1))
    rec[L.MESSAGE_HEADER.size] ^= 0x01
    with pytest.raises(CorruptRecord) as e:
        decode_record(bytes(rec))
    assert e.value.offset == 0 and "crc" in e.value.reason


@pytest.mark.parametrize("topic", ["", "a b", "x" * 128, "ü"])
def test_bad_topics_are_rejected_with_a_clear_error(topic):
    with pytest.raises(InvalidMessage):
        draft(topic=topic)


def test_oversize_body_is_rejected():
    with pytest.raises(InvalidMessage, match="limit"):
        MessageDraft("T", 0, b"x" * 11, {}).seal(max_body_bytes=10)


def test_java_hash_matches_known_values():
    assert java_string_hash("TagA") == 2598919
    assert java_string_hash("hello") == 99162322
    assert java_string_hash("polygenelubricants") == -2147483648
    assert tags_code(None) == 0


def test_offset_msg_id_is_32_upper_hex():
    mid = encode_offset_msg_id(b"\xc0\xa8\x00\x01", 10911, 123456)
    assert len(mid) == 32 and mid == mid.upper()
    with pytest.raises(InvalidMessage):
        decode_offset_msg_id("zz")

"""Every struct in node.store.layout round-trips, and so do records and properties.

Method: Hypothesis builds values from each Struct's own format codes (so a new
struct added to layout.py is covered, or this test fails naming it), packs and
unpacks them; records go through encode_record/decode_record with random fields.
"""

from __future__ import annotations

import re
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from node.store import layout as L
from node.store.commitlog import record_problem
from node.store.message import (MessageDraft, decode_offset_msg_id, decode_properties, decode_record,
                                encode_offset_msg_id, encode_properties, encode_record)

_INT = {"b": 8, "h": 16, "i": 32, "q": 64}


def _field(code: str) -> st.SearchStrategy:
    m = re.fullmatch(r"(\d*)([a-zA-Z])", code)
    assert m, code
    count, kind = int(m.group(1) or 1), m.group(2)
    if kind == "s":
        return st.binary(min_size=count, max_size=count)
    bits = _INT[kind.lower()]
    if kind.islower():
        return st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    return st.integers(0, (1 << bits) - 1)


def _codes(s: struct.Struct) -> list[str]:
    assert s.format[0] == ">", f"{s.format} is not big-endian"
    return [c for c in re.findall(r"\d*[a-zA-Z]", s.format[1:]) if not c.endswith("x")]   # pad bytes take no value


STRUCTS = {name: v for name, v in vars(L).items() if isinstance(v, struct.Struct)}


def test_every_layout_struct_is_known_here():
    # Adding a struct to layout.py adds it to STRUCTS; this pins what the docs describe.
    assert set(STRUCTS) == {"MESSAGE_HEADER", "TOPIC_LEN", "PROPERTIES_LEN", "BLANK", "ENTRY_HEADER",
                            "ENTRY_BLANK", "ENTRY_INDEX", "CQ_UNIT", "INDEX_HEADER", "INDEX_SLOT",
                            "INDEX_ENTRY", "CHECKPOINT", "MSG_ID", "HA_PUSH_HEADER", "HA_SLAVE_REPORT",
                            "FRAME_LEN", "MESSAGE_QUEUE_FIELDS", "MESSAGE_DISPATCH_FIELDS", "STREAM_FRAME_HEADER",
                            "ENTRY_BASE_STATE", "ENTRY_BASE_STATE_V1"}


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_message_queue_fields_view_reads_the_header_fields(data):
    values = tuple(data.draw(_field(c)) for c in _codes(L.MESSAGE_HEADER))
    packed = L.MESSAGE_HEADER.pack(*values)
    h = dict(zip(L.MESSAGE_FIELD_OFFSET, values))
    got = L.MESSAGE_QUEUE_FIELDS.unpack_from(packed, L.MESSAGE_FIELD_OFFSET["queue_id"])
    assert got == (h["queue_id"], h["queue_offset"], h["sys_flag"], h["body_len"])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_struct_round_trips(data):
    for name, s in STRUCTS.items():
        values = tuple(data.draw(_field(c), label=f"{name}.{c}") for c in _codes(s))
        packed = s.pack(*values)
        assert len(packed) == s.size
        assert s.unpack(packed) == values, name


_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x01\x02"), max_size=20)


@settings(max_examples=200, deadline=None)
@given(props=st.dictionaries(_TEXT.filter(bool), _TEXT, max_size=6))
def test_properties_round_trip(props):
    assert decode_properties(encode_properties(props)) == props


@settings(max_examples=200, deadline=None)
@given(topic=st.from_regex(r"[%|a-zA-Z0-9_-]{1,127}", fullmatch=True), queue_id=st.integers(0, 1 << 20),
       body=st.binary(max_size=2000), props=st.dictionaries(_TEXT.filter(bool), _TEXT, max_size=4),
       flag=st.integers(-(1 << 31), (1 << 31) - 1), qoff=st.integers(0, 1 << 62), phys=st.integers(0, 1 << 62),
       ts=st.integers(0, 1 << 50), born=st.integers(0, 1 << 50), port=st.integers(0, 65535),
       sys_flag=st.sampled_from([0, L.SYSFLAG_TRANSACTION_PREPARED_TYPE, L.SYSFLAG_TRANSACTION_COMMIT_TYPE]))
def test_record_round_trips_and_passes_the_recovery_check(topic, queue_id, body, props, flag, qoff, phys, ts,
                                                          born, port, sys_flag):
    d = MessageDraft(topic, queue_id, body, props, flag=flag, sys_flag=sys_flag, born_timestamp=born,
                     born_port=port).seal()
    rec = encode_record(d, qoff, phys, ts, b"\x0a\x01\x02\x03", port)
    assert len(rec) == d.total_size
    m = decode_record(rec)
    assert (m.topic, m.queue_id, m.body, m.properties, m.flag, m.queue_offset, m.physical_offset) == \
        (topic, queue_id, body, props, flag, qoff, phys)
    assert (m.store_timestamp, m.born_timestamp, m.sys_flag, m.store_host) == (ts, born, sys_flag, f"10.1.2.3:{port}")
    assert record_problem(rec, 0, phys, len(rec) + 8) is None
    ip, p, off = decode_offset_msg_id(m.offset_msg_id)
    assert (ip, p, off) == ("10.1.2.3", port, phys)
    assert encode_offset_msg_id(b"\x0a\x01\x02\x03", port, phys) == m.offset_msg_id

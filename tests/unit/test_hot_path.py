"""The produce and pull hot paths keep every check they replaced.

Method: the fast paths (inline type tests in parse_message, count-based separator check
in encode_properties, C-level decode_properties, cached topic and host encodings,
framing-only scans for the dispatcher, offsetMsgId from a cached host prefix) are fed
the inputs the slow paths rejected or produced, and must reject or produce the same.
"""

from __future__ import annotations

import asyncio
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


# --- batched produce: cached-suffix drafts, packed results --------------------------------------------
# The batched send seals a message whose only property is its tag from a cached record suffix
# (MessageDraft.sealed_plain, Broker._drafts) and renders results from (phys, size, qoff)
# tuples (LocalLog.append_packed, Broker.send_rows). They must give the very drafts, bytes,
# errors and results the per-message path gives.
from node.broker import Broker, OutgoingMessage, TopicConfig   # noqa: E402
from node.config import BrokerConfig   # noqa: E402
from node.store import message as M   # noqa: E402
from node.store.errors import MessageTooLarge   # noqa: E402


@pytest.mark.parametrize("topic, tags", [("T", None), ("T", ""), ("Topic_1", "TagA"), ("%RETRY%g", "héllo wörld"),
                                         ("T", "x" * 300)])
def test_sealed_plain_equals_seal(topic, tags):
    for body in (b"a", os.urandom(1024)):
        slow = MessageDraft(topic, 3, body, {"TAGS": tags} if tags else {}, born_timestamp=77).seal()
        fast = MessageDraft.sealed_plain(topic, 3, body, tags or None, 77)
        assert fast == slow
        assert encode_record(fast, 9, 4096, 5, IP, PORT) == encode_record(slow, 9, 4096, 5, IP, PORT)


@pytest.mark.parametrize("topic, tags, words", [("bad topic", "A", "characters"), ("", None, "non-empty"), (["x"], None, "non-empty"),
                                                ("T", "a\x01b", "reserved separator"),
                                                ("T", "y" * (L.MAX_PROPERTIES_BYTES + 1), "limit")])
def test_sealed_plain_refuses_what_seal_refuses(topic, tags, words):
    with pytest.raises(InvalidMessage) as slow:
        MessageDraft(topic, 0, b"b", {"TAGS": tags} if tags else {}).seal()
    for _ in range(2):                       # a refusal is never cached
        with pytest.raises(InvalidMessage) as fast:
            MessageDraft.sealed_plain(topic, 0, b"b", tags, 1)
        assert str(fast.value) == str(slow.value) and words in str(fast.value)


def test_plain_suffix_cache_is_bounded():
    for i in range(M._PLAIN_SUFFIXES_MAX + 10):
        MessageDraft.sealed_plain("T", 0, b"b", f"tag{i}", 1)
        assert len(M._PLAIN_SUFFIXES) <= M._PLAIN_SUFFIXES_MAX
    MessageDraft.sealed_plain("T", 0, b"b", "z" * (M._PLAIN_SUFFIX_CACHED_TAG_CHARS + 1), 1)
    assert ("T", "z" * (M._PLAIN_SUFFIX_CACHED_TAG_CHARS + 1)) not in M._PLAIN_SUFFIXES


class _NoLog:
    mode = "standalone"


def _bare_broker(**config) -> Broker:
    return Broker(BrokerConfig(**config), _NoLog(), None, None, None, None, None, clock_ms=lambda: 1_700_000_000_123)


def test_batched_drafts_equal_per_message_drafts():
    b = _bare_broker()
    cfg = TopicConfig("T", 4, 4)
    msgs = [OutgoingMessage(b"a"), OutgoingMessage(b"b", tags="A"), OutgoingMessage(b"c", tags="", queue_id=3),
            OutgoingMessage(b"d", queue_id=0, born_timestamp=5), OutgoingMessage(b"e", keys=["k1"]),
            OutgoingMessage(b"f", tags="A", properties={"p": "v", "UNIQ_KEY": "U1"}),
            OutgoingMessage(b"g", properties={"DELAY": "2"}), OutgoingMessage(os.urandom(1024), tags="bench")]
    fast, body_bytes = b._drafts(cfg, msgs, 1, 1_700_000_000_000)
    slow = [b._draft(cfg, m, i, 1, 1_700_000_000_000) for i, m in enumerate(msgs)]
    assert fast == slow
    assert body_bytes == sum(len(m.body) for m in msgs)
    assert [d.queue_id for d in fast[:4]] == [1, 1, 3, 0] and fast[3].born_timestamp == 5


@pytest.mark.parametrize("m, error", [
    (OutgoingMessage(b"x", queue_id=4), BadRequest),            # topic has 4 write queues
    (OutgoingMessage(b"x", queue_id=-1), BadRequest),
    (OutgoingMessage(b"x", queue_id=True), BadRequest),         # bool is not a queue id
    (OutgoingMessage(b"x" * 65, tags="A"), MessageTooLarge),
    (OutgoingMessage(b"x", tags="a\x02b"), BadRequest),
])
def test_batched_drafts_refuse_with_the_per_message_words(m, error):
    b = _bare_broker(max_message_size=64)
    cfg = TopicConfig("T", 4, 4)
    with pytest.raises(error) as slow:
        b._draft(cfg, m, 1, 0, 1)
    with pytest.raises(error) as fast:
        b._drafts(cfg, [OutgoingMessage(b"ok"), m], 0, 1)
    assert str(fast.value) == str(slow.value) and "messages[1]" in str(fast.value)


def test_send_rows_are_the_send_results():
    b = _bare_broker(broker_ip1="10.0.0.7", listen_port=10911)
    drafts = [MessageDraft.sealed_plain("T", 1, b"a", None, 1),
              MessageDraft("T", 2, b"b", {"UNIQ_KEY": "C0FFEE"}).seal(),
              MessageDraft("SCHEDULE_TOPIC_XXXX", 1, b"c", {"REAL_TOPIC": "T", "REAL_QID": "3"}).seal()]
    placed = [(0, 100, 7), ((1 << 40) + 5, 100, 8), (123456789, 100, 0)]
    rows = b._send_rows(drafts, ["SEND_OK"] * 3, placed)
    ids = [M.encode_offset_msg_id(M.host_bytes("10.0.0.7"), 10911, p) for p, _, _ in placed]
    assert rows == [("SEND_OK", ids[0], ids[0], 1, 7), ("SEND_OK", "C0FFEE", ids[1], 2, 8),
                    ("SEND_OK", ids[2], ids[2], 3, 0)]


# --- the whole batched path over a real LocalLog and Dispatcher ---------------------------------------
from node.config import from_properties   # noqa: E402
from node.server import build_broker   # noqa: E402
from node.store.dispatcher import SCHEDULE_TOPIC   # noqa: E402


def _store_broker(root: str, flush: str = "ASYNC_FLUSH") -> Broker:
    cfg, _ = from_properties({"storePathRootDir": root, "flushDiskType": flush, "brokerIP1": "10.0.0.7",
                              "mappedFileSizeCommitLog": str(1 << 20), "maxMessageSize": "65536", "maxHashSlotNum": "1000",
                              "maxIndexNum": "4000", "autoCreateTopicEnable": "false"})
    return build_broker(cfg, FileSystem())


async def _settled(b: Broker) -> None:
    for _ in range(500):
        if b.dispatcher.position >= b.log.committed_position:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("dispatcher did not catch up")


@pytest.mark.parametrize("flush", ["ASYNC_FLUSH", "SYNC_FLUSH"])
def test_batched_send_over_local_log_reads_back_what_was_sent(tmp_path, flush):
    async def go():
        b = _store_broker(str(tmp_path), flush)
        await b.start()
        try:
            await b.create_topic("T", 2)
            msgs = [OutgoingMessage(f"m{i}".encode() * 30, tags="A" if i % 3 else "B", queue_id=i % 2)
                    for i in range(300)]
            msgs[5] = OutgoingMessage(b"keyed", tags="A", keys=["order-5"], queue_id=1)
            rows = await b.send_rows("T", msgs)
            assert b.log.append_packed is not None and len(rows) == 300
            await _settled(b)
            for m, (status, msg_id, offset_id, qid, qoff) in zip(msgs, rows):
                assert status == "SEND_OK" and msg_id == offset_id and qid == m.queue_id
                got = b.query_by_id(offset_id)
                assert (got.body, got.tags, got.queue_id, got.queue_offset) == (m.body, m.tags, qid, qoff)
            # tag filtering in pulls runs on the codes the dispatcher wrote (cached per properties)
            pulled, offset = [], 0
            for _ in range(300):          # bounded: each pull moves the offset forward
                r = await b.pull("T", 0, offset, 32, tags="B")
                pulled += [m.body for m in r.messages]
                if r.next_offset == r.max_offset:
                    break
                offset = r.next_offset
            assert pulled == [m.body for m in msgs if m.queue_id == 0 and m.tags == "B"]
            assert [m.body for m in await b.query_by_key("T", "order-5")] == [b"keyed"]
        finally:
            await b.stop()
    asyncio.run(go())


def test_dispatch_codes_of_delayed_messages_follow_each_store_time(tmp_path):
    """Regression guard for the properties cache: a schedule-topic unit carries store time +
    delay, so two records with identical properties but different store times differ."""
    async def go():
        b = _store_broker(str(tmp_path))
        await b.start()
        try:
            await b.create_topic("T", 1)
            await b.send_rows("T", [OutgoingMessage(b"d1", properties={"DELAY": "1"})])
            await asyncio.sleep(0.02)
            await b.send_rows("T", [OutgoingMessage(b"d2", properties={"DELAY": "1"})])
            await _settled(b)
            units = b.cq_store.get(SCHEDULE_TOPIC, 0).get_range(0, 10)
            stored = [b._read_unit(phys, size) for phys, size, _ in units]
            assert [m.body for m in stored] == [b"d1", b"d2"]
            assert [code for _, _, code in units] == [m.store_timestamp + 1000 for m in stored]
            assert stored[0].store_timestamp != stored[1].store_timestamp
        finally:
            await b.stop()
    asyncio.run(go())


def test_dispatch_properties_cache_is_bounded(tmp_path):
    from node.store import dispatcher as D
    async def go():
        b = _store_broker(str(tmp_path))
        await b.start()
        try:
            await b.create_topic("T", 1)
            for i in range(0, 40, 20):
                await b.send_rows("T", [OutgoingMessage(b"x", tags=f"t{i + k}") for k in range(20)])
            await _settled(b)
            assert 0 < len(b.dispatcher._props) <= D.MAX_CACHED_NAMES
            keyed = await b.send_rows("T", [OutgoingMessage(b"k", keys=[f"key{i}"]) for i in range(10)])
            await _settled(b)
            assert len(b.dispatcher._props) <= 40     # keyed properties are not remembered
            assert [m.body for m in await b.query_by_key("T", "key3")] == [b"k"] and len(keyed) == 10
        finally:
            await b.stop()
    asyncio.run(go())


def test_commitlog_spans_name_the_records_scan_copies(tmp_path):
    cl = _log_with(tmp_path, 25)
    pos = 0
    while pos < cl.max_offset:
        spans, nxt = cl.scan_spans(pos, 3000, verify=False)
        batch = cl.scan(pos, 3000, verify=False)
        assert nxt == batch.next_position
        assert [(phys, buf[at:at + size]) for buf, at, phys, size in spans] == \
               [(r.physical_offset, r.data) for r in batch.records]
        pos = nxt


# --- DLedger queue-offset replay -------------------------------------------------------------------------
def test_fold_records_equals_folding_one_by_one():
    from dledger.dledger_log import _fold_record, _fold_records
    rng = __import__("random").Random(7)
    bodies = []
    for i in range(400):
        d = MessageDraft(rng.choice(["T", "U", "%RETRY%g"]), rng.randrange(4), b"b" * rng.randrange(1, 50),
                         {"TAGS": "x"}, sys_flag=rng.choice([0, 0, 0, L.SYSFLAG_TRANSACTION_PREPARED_TYPE])).seal()
        qoff = -1 if not d.is_dispatched else rng.randrange(1000)
        bodies.append(encode_record(d, qoff, 100 * i, 1, IP, PORT))
    start = {("T", 0): 500, ("U", 3): 2000}
    one, batch = QueueOffsetTable(start), QueueOffsetTable(start)
    for body in bodies:
        _fold_record(one, body)
    _fold_records(batch, bodies)
    assert one.snapshot() == batch.snapshot()
    assert batch.get("U", 3) == 2000     # folding never lowers an offset


# --- batched request parsing ------------------------------------------------------------------------------
def test_parse_messages_equals_parse_message_item_by_item():
    from node.api import parse_messages
    items = [{"body": b"a"}, {"body": "héllo", "tags": "A"}, {"body": b"b", "tags": "", "queue_id": 3},
             {"body": b"c", "born_timestamp": 9}, {"body": b"d", "tags": None, "queue_id": None},
             {"body": "k", "keys": "k1 k2"}, {"body_b64": "YWI="}, {"body": b"p", "properties": {"x": "y"}}]
    assert parse_messages(items) == [parse_message(item, i) for i, item in enumerate(items)]


@pytest.mark.parametrize("item, words", [
    ({"body": "a", "queue_id": True}, "queue_id"), ({"body": "a", "born_timestamp": -1}, "born_timestamp"),
    ({"body": "a", "born_timestamp": False}, "born_timestamp"), ({"body": b""}, "empty"),
    ({"body": 5}, "body must be"), ({"body": "a", "tags": "x||y"}, "tags"), ({"body": "a", "tags": 1}, "tags"),
    ({"body": "a", "queue_id": 1.0}, "queue_id"), ([1], "must be an object"), ({}, "exactly one"),
])
def test_parse_messages_refuses_what_parse_message_refuses(item, words):
    from node.api import parse_messages
    with pytest.raises(BadRequest) as e:
        parse_messages([{"body": b"ok"}, item])
    assert "messages[1]" in str(e.value) and words in str(e.value)


def test_fold_entries_equals_folding_one_by_one():
    """`_fold_entries` (the replay of committed entries) skips no-ops and short bodies and folds
    the rest exactly as `_fold_record` does one at a time."""
    from dledger.dledger_log import _fold_entries, _fold_record
    from dledger.messages import Entry, EntryType
    rng = __import__("random").Random(11)
    es = []
    for i in range(400):
        if i % 37 == 0:
            es.append(Entry(i + 1, 1, EntryType.NOOP, b""))
            continue
        d = MessageDraft(rng.choice(["T", "U", "%RETRY%g"]), rng.randrange(4), b"b" * rng.randrange(1, 50),
                         {"TAGS": "x"}, sys_flag=rng.choice([0, 0, 0, L.SYSFLAG_TRANSACTION_PREPARED_TYPE])).seal()
        qoff = -1 if not d.is_dispatched else rng.randrange(1000)
        es.append(Entry(i + 1, 1, EntryType.NORMAL, encode_record(d, qoff, 100 * i, 1, IP, PORT)))
    es.append(Entry(401, 1, EntryType.NORMAL, b"short"))
    start = {("T", 0): 500, ("U", 3): 2000}
    one, batch = QueueOffsetTable(start), QueueOffsetTable(start)
    for e in es:
        if e.type is EntryType.NORMAL and len(e.body) >= L.MESSAGE_OVERHEAD:
            _fold_record(one, e.body)
    _fold_entries(batch, es)
    assert one.snapshot() == batch.snapshot()


def test_dispatch_fields_view_reads_the_header_fields():
    rng = __import__("random").Random(3)
    for _ in range(50):
        raw = bytes(rng.randrange(256) for _ in range(L.MESSAGE_HEADER.size))
        h = L.MESSAGE_HEADER.unpack(raw)
        assert L.MESSAGE_DISPATCH_FIELDS.unpack(raw) == (h[0], h[1], h[3], h[5], h[6], h[7], h[11], h[16])


def test_byte_budget_fast_paths_equal_the_entry_by_entry_count():
    """All entries fit: the C-level sum returns them all; otherwise the loop decides, at least one."""
    from dledger import raft_storage as RS
    from dledger import entry_store as ES
    from dledger.messages import Entry, EntryType

    def slow(entries, max_bytes):
        out, used = [], 0
        for e in entries:
            used += 48 + len(e.body)
            if out and used > max_bytes:
                break
            out.append(e)
        return out

    rng = __import__("random").Random(5)
    for _ in range(200):
        es = [Entry(i + 1, 1, EntryType.NORMAL, b"x" * rng.randrange(0, 300)) for i in range(rng.randrange(1, 20))]
        budget = rng.randrange(0, 3000)
        assert RS._take_within_budget(es, budget) == slow(es, budget)
        assert ES._within_budget(es, budget) == slow(es, budget)


def test_dispatcher_run_packs_the_same_units_as_one_pack_per_unit():
    """A consume-queue run gathers its units' fields and packs them in one struct call: the same
    bytes as packing each 20-byte unit, for any run length (Structs are cached per length)."""
    from node.store.dispatcher import _Run
    rng = __import__("random").Random(2)
    for n in (1, 2, 7, 256, 1):
        units = [(rng.randrange(1 << 62), rng.randrange(1 << 31), rng.randrange(-(1 << 63), 1 << 63)) for _ in range(n)]
        run = _Run(None, 0, *units[0])
        for u in units[1:]:
            run.fields += u
            run.count += 1
        assert run.packed() == b"".join(L.CQ_UNIT.pack(*u) for u in units)

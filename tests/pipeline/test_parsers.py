"""Pure parser tests (no Spark).

Goal: the segment parsers return exactly what was written, stop at the end of data,
and stop at the first bad record with its absolute offset, never guessing past it.
Method: Hypothesis-generated messages go through the node's own CommitLog (real headers,
end-of-file blanks, rolls) or through DLedger entries built with dledger.entry; we parse
every segment and compare with the drafts and with node.store.message.decode_record.
Then single bytes are corrupted and the report must name the damaged record.
"""

from __future__ import annotations

import os
import random
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.store import layout as L
from node.store.commitlog import CommitLog
from node.store.fileio import FileSystem
from node.store.message import MessageDraft, decode_record
from node.store.queue_offsets import QueueOffsetTable
from pipeline import parsers as P
from tests.pipeline.storegen import (BORN_IP, STORE_IP, STORE_PORT, DLedgerWriter, Spec, make_draft,
                                     write_commitlog_store, write_dledger_store, write_entry_store)

SEG = 4096

_prop_text = st.text(alphabet=st.characters(blacklist_characters="\x01\x02", blacklist_categories=("Cs",)),
                     min_size=0, max_size=12)
_draft = st.builds(
    lambda topic, qid, body, tags, keys, extra, sys_flag, born: MessageDraft(
        topic=topic, queue_id=qid, body=body,
        properties={**({"TAGS": tags} if tags else {}), **({"KEYS": " ".join(keys)} if keys else {}), **extra},
        sys_flag=sys_flag, born_timestamp=born, born_ip=BORN_IP, born_port=4000).seal(),
    st.sampled_from(["orders", "audit", "%RETRY%g1", "t-x_1"]),
    st.integers(0, 3),
    st.binary(max_size=700),
    st.one_of(st.none(), st.text(alphabet="abcXYZ|", min_size=1, max_size=8)),
    st.lists(st.text(alphabet="k0123456789", min_size=1, max_size=6), max_size=3),
    st.dictionaries(st.text(alphabet="ABCdef", min_size=1, max_size=5).filter(lambda k: k not in ("TAGS", "KEYS")),
                    _prop_text, max_size=3),
    st.sampled_from([0, L.SYSFLAG_TRANSACTION_PREPARED_TYPE, L.SYSFLAG_TRANSACTION_COMMIT_TYPE]),
    st.integers(0, 2 ** 62),
)


def _write(root: str, batches: list[list[MessageDraft]], ts: int = 1_700_000_000_123):
    cl = CommitLog(FileSystem(), os.path.join(root, "commitlog"), SEG, STORE_IP, STORE_PORT)
    cl.load()
    table = QueueOffsetTable()
    written = []
    for b in batches:
        for d, res in zip(b, cl.append_batch(b, table, ts)):
            written.append((d, res))
    cl.flush()
    cl.close()
    return written


def _parse_all(root: str, **kw):
    rows, reports = [], []
    for s in P.list_segments(root):
        rep = P.ParseReport()
        rows += list(P.parse_commitlog_segment(s.path, s.base_offset, report=rep, **kw))
        reports.append(rep)
    return rows, reports


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(_draft, min_size=1, max_size=6), min_size=1, max_size=8))
def test_commitlog_records_round_trip_through_segments(batches):
    with tempfile.TemporaryDirectory() as root:
        written = _write(root, batches)
        rows, reports = _parse_all(root)
        assert len(rows) == len(written)
        for row, (d, (phys, size, qoff)) in zip(rows, written):
            m = P.message_as_dict(row)
            assert (m["topic"], m["queue_id"], m["queue_offset"]) == (d.topic, d.queue_id, qoff)
            assert (m["commitlog_offset"], m["size"], m["body"]) == (phys, size, d.body)
            assert m["properties"] == d.properties
            assert m["tags"] == d.properties.get("TAGS")
            assert m["keys"] == d.properties.get("KEYS")
            assert (m["sys_flag"], m["born_timestamp"]) == (d.sys_flag, d.born_timestamp)
            assert m["store_host"] == f"10.0.0.7:{STORE_PORT}"
        for rep in reports:
            assert rep.ok, rep
        # Every file but the last ends in a blank or exactly at its end; the last one in zeros.
        assert all(r.end_reason in (P.END_BLANK, P.END_EOF) for r in reports[:-1])
        assert reports[-1].end_reason in (P.END_ZERO, P.END_BLANK, P.END_EOF)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_draft, min_size=1, max_size=20))
def test_parser_agrees_with_the_reference_decoder(drafts):
    with tempfile.TemporaryDirectory() as root:
        written = _write(root, [drafts])
        segs = {s.base_offset: s.path for s in P.list_segments(root)}
        rows, _ = _parse_all(root)
        for row, (_d, (phys, _size, _qoff)) in zip(rows, written):
            base = phys - phys % SEG
            with open(segs[base], "rb") as f:
                ref = decode_record(f.read(), phys - base)
            m = P.message_as_dict(row)
            assert (m["topic"], m["queue_id"], m["queue_offset"], m["commitlog_offset"]) == \
                (ref.topic, ref.queue_id, ref.queue_offset, ref.physical_offset)
            assert (m["size"], m["body"], m["properties"]) == (ref.total_size, ref.body, ref.properties)
            assert (m["born_host"], m["store_host"], m["store_timestamp"]) == \
                (ref.born_host, ref.store_host, ref.store_timestamp)
            assert (m["reconsume_times"], m["sys_flag"], m["born_timestamp"]) == \
                (ref.reconsume_times, ref.sys_flag, ref.born_timestamp)


def test_units_scan_matches_the_full_scan(tmp_path):
    write_commitlog_store(str(tmp_path), 300, SEG * 4, spec=Spec(tx_every=7))
    for s in P.list_segments(str(tmp_path)):
        full = list(P.parse_commitlog_segment(s.path, s.base_offset, with_body=False))
        lean = list(P.parse_commitlog_units(s.path, s.base_offset))
        assert [(m[3], m[4], m[0], m[1], m[2], m[13], m[9]) for m in full] == [u[:7] for u in lean]
        assert all(m[14] is None for m in full)


@pytest.mark.parametrize("where,reason", [
    (L.MESSAGE_HEADER.size + 1, "body crc mismatch"),                 # a body byte
    (4, "bad magic"),                                                  # the magic
    (L.MESSAGE_FIELD_OFFSET["physical_offset"] + 7, "PHYSICALOFFSET"),  # a stale/moved record
])
def test_a_corrupt_byte_stops_the_scan_at_that_record(tmp_path, where, reason):
    written = write_commitlog_store(str(tmp_path), 40, 1 << 16, spec=Spec(body_min=10, body_max=50))
    phys, _size, _q = written[17]
    seg = P.list_segments(str(tmp_path))[0]
    with open(seg.path, "r+b") as f:
        f.seek(phys + where)
        b = f.read(1)
        f.seek(phys + where)
        f.write(bytes([b[0] ^ 0x5A]))
    rep = P.ParseReport()
    rows = list(P.parse_commitlog_segment(seg.path, seg.base_offset, report=rep))
    assert len(rows) == 17
    assert rep.end_reason == P.END_CORRUPT and rep.corrupt_offset == phys
    assert reason in rep.corrupt_reason
    assert rep.data_end == phys and not rep.ok


def test_a_torn_tail_is_reported_not_skipped(tmp_path):
    written = write_commitlog_store(str(tmp_path), 10, 1 << 16)
    phys, size, _ = written[-1]
    seg = P.list_segments(str(tmp_path))[0]
    with open(seg.path, "r+b") as f:        # the last record lost its second half
        f.seek(phys + size // 2)
        f.write(bytes(size - size // 2))
    rep = P.ParseReport()
    assert len(list(P.parse_commitlog_segment(seg.path, seg.base_offset, report=rep))) == 9
    assert (rep.end_reason, rep.corrupt_offset) == (P.END_CORRUPT, phys)


def test_blank_must_reach_the_end_of_the_file():
    buf = bytearray(256)
    L.BLANK.pack_into(buf, 0, 100, L.BLANK_MAGIC)         # claims 100 bytes, 256 are left
    rep = P.ParseReport()
    assert list(P.parse_commitlog_segment(bytes(buf), 0, report=rep)) == []
    assert rep.end_reason == P.END_CORRUPT and rep.corrupt_offset == 0
    L.BLANK.pack_into(buf, 0, 256, L.BLANK_MAGIC)
    rep = P.ParseReport()
    assert list(P.parse_commitlog_segment(bytes(buf), 0, report=rep)) == [] and rep.end_reason == P.END_BLANK


def test_end_offset_stops_before_later_records(tmp_path):
    written = write_commitlog_store(str(tmp_path), 20, 1 << 16)
    seg = P.list_segments(str(tmp_path))[0]
    rep = P.ParseReport()
    rows = list(P.parse_commitlog_segment(seg.path, 0, end_offset=written[5][0], report=rep))
    assert len(rows) == 5 and rep.end_reason == P.END_LIMIT


# --- DLedger -----------------------------------------------------------------------------------
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 120), term_every=st.integers(0, 17), seed=st.integers(0, 1000))
def test_dledger_entries_round_trip(n, term_every, seed):
    with tempfile.TemporaryDirectory() as root:
        w = write_dledger_store(root, "n0", n, SEG * 2, seed=seed, term_every=term_every,
                                spec=Spec(body_max=400))
        got, reports = [], []
        for s in P.list_segments(root):
            rep = P.ParseReport()
            got += list(P.parse_dledger_segment(s.path, s.base_offset, report=rep))
            reports.append(rep)
        assert [(e[0], e[1], e[2], e[3]) for e in got] == [(x.index, x.term, x.pos, x.magic) for x in w.entries]
        assert all(r.ok for r in reports)
        # Within a file every entry after the first is chain-checked and passes.
        assert all(e[7] in (True, None) for e in got)
        assert got[0][7] is None and sum(e[7] is None for e in got) == len(reports)
        for e, x in zip(got, w.entries):
            if x.magic == L.ENTRY_MAGIC_NORMAL:
                m = P.message_as_dict(e[8])
                assert m["commitlog_offset"] == x.pos + L.ENTRY_HEADER.size
                assert m["body"] == decode_record(x.body, 0).body
            else:
                assert e[8] is None


def test_dledger_body_corruption_names_the_entry(tmp_path):
    w = write_dledger_store(str(tmp_path), "n0", 30, 1 << 16, term_every=0)
    victim = w.entries[12]
    seg = P.list_segments(str(tmp_path))[0]
    with open(seg.path, "r+b") as f:
        f.seek(victim.pos + L.ENTRY_HEADER.size + 100)
        f.write(b"\xff")
    rep = P.ParseReport()
    got = list(P.parse_dledger_segment(seg.path, 0, report=rep))
    assert [e[0] for e in got] == [x.index for x in w.entries[:12]]
    assert (rep.end_reason, rep.corrupt_offset) == (P.END_CORRUPT, victim.pos)
    assert "body crc" in rep.corrupt_reason and rep.last_index == w.entries[11].index


def test_dledger_header_tamper_breaks_only_that_chain_link(tmp_path):
    w = write_dledger_store(str(tmp_path), "n0", 30, 1 << 16, term_every=0)
    victim = w.entries[9]
    seg = P.list_segments(str(tmp_path))[0]
    with open(seg.path, "r+b") as f:      # bump the term: body CRC still fine, chain is not
        f.seek(victim.pos + L.ENTRY_FIELD_OFFSET["term"])
        f.write(L.ENTRY_HEADER.pack(0, 0, 0, victim.term + 1, 0, 0, 0, 0, 0)[16:24])
    rep = P.ParseReport()
    got = list(P.parse_dledger_segment(seg.path, 0, report=rep))
    assert len(got) == len(w.entries)
    assert rep.chain_failures == [victim.index] and not rep.ok
    assert [e[0] for e in got if e[7] is False] == [victim.index]


def test_dledger_message_must_sit_at_entry_pos_plus_48(tmp_path):
    w = DLedgerWriter(str(tmp_path), "n0", 1 << 16)
    rng = random.Random(3)
    w.append_message(1, make_draft(rng, Spec(), 0), 1000)
    from node.store.message import encode_record
    d = make_draft(rng, Spec(), 1)
    bad = w.append(1, lambda pos: encode_record(d, 0, pos, 1001, STORE_IP, STORE_PORT))   # pos, not pos + 48
    seg = P.list_segments(str(tmp_path))[0]
    rep = P.ParseReport()
    assert len(list(P.parse_dledger_segment(seg.path, 0, report=rep))) == 1
    assert rep.corrupt_offset == bad.pos and "PHYSICALOFFSET" in rep.corrupt_reason


def test_max_index_limits_the_dledger_scan(tmp_path):
    write_dledger_store(str(tmp_path), "n0", 50, 1 << 16, term_every=0)
    seg = P.list_segments(str(tmp_path))[0]
    rep = P.ParseReport()
    got = list(P.parse_dledger_segment(seg.path, 0, max_index=20, report=rep))
    assert got[-1][0] == 20 and rep.end_reason == P.END_LIMIT


def test_dledger_side_files(tmp_path):
    w = write_dledger_store(str(tmp_path), "n0", 40, SEG, term_every=10)
    root = str(tmp_path)
    e = w.entries[25]
    assert P.dledger_index_entry(root, e.index) == (e.magic, e.pos, L.ENTRY_HEADER.size + len(e.body), e.index,
                                                    e.term)
    prev = w.entries[24]
    assert P.dledger_prev_chain_crc(root, e.index) == P.dledger_entry_header(root, prev.pos)[6]
    assert P.dledger_prev_chain_crc(root, 1) == 0
    end = w.entries[30].pos            # entries 1..30 end at or before entry 31's start
    assert P.dledger_last_index_within(root, end, 1, w.entries[-1].index) == w.entries[29].index


# --- Store directories ----------------------------------------------------------------------------
def test_store_kind_and_segments(tmp_path):
    cl_root, dl_root = tmp_path / "a", tmp_path / "b"
    write_commitlog_store(str(cl_root), 200, SEG)
    write_dledger_store(str(dl_root), "n1", 50, SEG)
    assert P.detect_store_kind(str(cl_root)) == P.KIND_COMMITLOG
    assert P.detect_store_kind(str(dl_root)) == P.KIND_DLEDGER
    segs = P.list_segments(str(cl_root))
    assert [s.base_offset for s in segs] == [i * SEG for i in range(len(segs))] and len(segs) > 3
    (cl_root / "commitlog" / "00000000000000000000.tmp").write_bytes(b"x")   # foreign files are ignored
    assert len(P.list_segments(str(cl_root))) == len(segs)
    with pytest.raises(ValueError, match="not an mqstore store root"):
        P.detect_store_kind(str(tmp_path))


def test_props_get_and_index_keys():
    raw = b"UNIQ_KEY\x01U1\x02KEYS\x01a b  c\x02TAGS\x01T\x02"
    assert P.props_get(raw, "KEYS") == "a b  c" and P.props_get(raw, "TAGS") == "T"
    assert P.props_get(raw, "NOPE") is None and P.props_get(b"", "KEYS") is None
    assert P.index_keys(P.decode_properties_fast(raw)) == ["U1", "a", "b", "c"]


def test_ddl_schema_lists_every_column_once():
    ddl = P.ddl_schema()
    assert all(f"`{name}`" in ddl for name in P.COLUMN_NAMES)
    assert len(set(P.COLUMN_NAMES)) == len(P.COLUMN_NAMES)


def test_reads_the_dledger_entry_store_itself(tmp_path):
    from pipeline.source import committed_bound
    positions = write_entry_store(str(tmp_path), "n0", 120, 8 * 1024, committed=77)
    got = []
    for s in P.list_segments(str(tmp_path)):
        rep = P.ParseReport()
        got += list(P.parse_dledger_segment(s.path, s.base_offset, report=rep))
        assert rep.ok, rep
    assert [e[2] for e in got] == positions and [e[0] for e in got] == list(range(1, 122))
    assert all(e[8][3] == e[2] + L.ENTRY_HEADER.size for e in got[1:])
    assert committed_bound(str(tmp_path), P.KIND_DLEDGER, None) == 77        # from the entry store's meta
    assert P.dledger_prev_chain_crc(str(tmp_path), 50) == got[48][5]

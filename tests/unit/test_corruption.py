"""Corrupt data on disk: no corrupt byte reaches a consumer, damage is found and reported.

Method: real stores in the test's tmp dir (a standalone broker built by node.server, a
DLedger EntryStore), bits flipped in their segment files with os.pwrite while they run
or while they are closed; then the read path (pull, query by id / queue offset), the
scrubber and recovery are observed from outside: errors, /health's "corrupt" list,
the metrics text, and the bytes on disk.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from dledger import entry as E
from dledger.entry_store import EntryStore
from dledger.messages import Entry, EntryType
from node.broker import OutgoingMessage
from node.config import BrokerConfig, ConfigError, from_properties
from node.metrics import NodeCollector
from node.server import build_broker
from node.store import layout as L
from node.store import message as M
from node.store.fileio import FileSystem
from node.store.scrub import CommitLogSource, CorruptData, CorruptionRegistry, CorruptRange, Scrubber
from prometheus_client import generate_latest
from prometheus_client.core import CollectorRegistry

SEG = 72 * 1024
BODY = 1000


def flip(path: str, offset: int, mask: int = 0x01) -> None:
    """XOR one byte of a file in place (what a failing disk or a cosmic ray does)."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ mask]), offset)
    finally:
        os.close(fd)


def standalone(tmp_path, **kw):
    cfg = BrokerConfig(store_path_root_dir=str(tmp_path), mapped_file_size_commit_log=SEG,
                       maped_file_size_consume_queue=20 * 1024, max_message_size=4096, **kw).validate()
    return build_broker(cfg)


def body(i: int) -> bytes:
    return (b"%06d" % i) * (BODY // 6)


async def fill(broker, n: int, topic: str = "T") -> list[int]:
    """Send n messages to queue 0; return their physical offsets."""
    await broker.create_topic(topic, 1)
    out = []
    for i in range(0, n, 50):
        rs = await broker.send(topic, [OutgoingMessage(body=body(j), queue_id=0, keys=[f"k{j}"])
                                       for j in range(i, min(n, i + 50))])
        out += [M.decode_offset_msg_id(r.offset_msg_id)[2] for r in rs]
    for _ in range(400):
        if broker.dispatcher.position >= broker.log.committed_position:
            break
        await asyncio.sleep(0.005)
    return out


def commitlog_file(root, phys: int) -> tuple[str, int]:
    base = phys - phys % SEG
    return os.path.join(str(root), "commitlog", f"{base:020d}"), phys - base


def flip_body(root, phys: int) -> None:
    path, rel = commitlog_file(root, phys)
    flip(path, rel + L.MESSAGE_HEADER.size + 10)


def metrics_text(broker) -> str:
    reg = CollectorRegistry()
    reg.register(NodeCollector(broker))
    return generate_latest(reg).decode()


# --- read path (standalone) -------------------------------------------------------------------
def test_pull_serves_the_intact_prefix_then_refuses_the_corrupt_record(tmp_path):
    async def go():
        b = standalone(tmp_path, store_scrub_rate_mb=0)
        await b.start()
        try:
            phys = await fill(b, 10)
            flip_body(tmp_path, phys[5])
            r = await b.pull("T", 0, 0, 32)
            assert [m.queue_offset for m in r.messages] == [0, 1, 2, 3, 4]
            assert r.next_offset == 5, "the pull must stop before the damage, not step past it"
            assert all(m.body == body(m.queue_offset) for m in r.messages)
            for _ in range(2):   # every retry fails the same way; the count does not grow
                with pytest.raises(CorruptData) as ei:
                    await b.pull("T", 0, 5, 32)
                assert ei.value.retriable and ei.value.code == "CORRUPT_RECORD"
            with pytest.raises(CorruptData):
                b.query_by_queue_offset("T", 0, 5)
            msg_id = M.encode_offset_msg_id(M.host_bytes("127.0.0.1"), b.config.listen_port, phys[5])
            with pytest.raises(CorruptData):
                b.query_by_id(msg_id)
            corrupt = b.health()["corrupt"]
            assert len(corrupt) == 1
            c = corrupt[0]
            assert c["start"] == phys[5] and c["found_by"] == "read" and c["reason"] == "body crc mismatch"
            assert c["path"] == commitlog_file(tmp_path, phys[5])[0]
            assert c["expected_crc"] != c["actual_crc"] and c["expected_crc"] is not None
            assert b.cluster()["corrupt"] == corrupt
            text = metrics_text(b)
            assert "rocketmq_store_corrupt_records_total 1.0" in text
            assert "rocketmq_store_corrupt_ranges 1.0" in text
            # Messages past the damage are still served to whoever asks for them directly.
            r = await b.pull("T", 0, 6, 32)
            assert [m.queue_offset for m in r.messages] == [6, 7, 8, 9]
        finally:
            await b.stop()
    asyncio.run(go())


def test_query_by_key_refuses_a_corrupt_hit(tmp_path):
    async def go():
        b = standalone(tmp_path, store_scrub_rate_mb=0)
        await b.start()
        try:
            phys = await fill(b, 4)
            assert [m.body for m in await b.query_by_key("T", "k2")] == [body(2)]
            flip_body(tmp_path, phys[2])
            with pytest.raises(CorruptData):
                await b.query_by_key("T", "k2")
            assert [m.body for m in await b.query_by_key("T", "k3")] == [body(3)]
        finally:
            await b.stop()
    asyncio.run(go())


def test_a_corrupt_record_is_logged_with_file_offset_and_crcs(tmp_path, caplog):
    async def go():
        b = standalone(tmp_path, store_scrub_rate_mb=0)
        await b.start()
        try:
            phys = await fill(b, 3)
            flip_body(tmp_path, phys[1])
            with pytest.raises(CorruptData):
                await b.pull("T", 0, 1, 1)
        finally:
            await b.stop()
        return phys
    caplog.set_level("ERROR", logger="node.store.scrub")
    phys = asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if r.name == "node.store.scrub"]
    assert len(lines) == 1
    path = commitlog_file(tmp_path, phys[1])[0]
    assert path in lines[0] and f"offset {phys[1]}" in lines[0] and "expected crc 0x" in lines[0]


# --- scrubber ---------------------------------------------------------------------------------
def test_scrubber_finds_old_flips_that_nobody_reads(tmp_path):
    async def go():
        b = standalone(tmp_path, store_scrub_rate_mb=0)
        await b.start()
        try:
            phys = await fill(b, 250)          # ~270 KB: four 72 KiB files, the first three sealed
            assert b.log.commitlog.files.segments[-1].base >= 3 * SEG
            flip_body(tmp_path, phys[3])        # a body bit in the oldest file
            magic_victim = next(p for p in phys if SEG <= p < 2 * SEG and p > SEG + 1000)
            path, rel = commitlog_file(tmp_path, magic_victim)
            flip(path, rel + 4)                 # the MAGIC of a record in the second file
            scrub = Scrubber(CommitLogSource(b.log), b.corruption, 1000, 1000)
            found = scrub.scrub_pass()
            assert [(c.start, c.reason) for c in found] == [
                (phys[3], "body crc mismatch"), (magic_victim, found[1].reason)]
            assert found[1].end == 2 * SEG and found[1].expected_crc is None   # framing lost to the file end
            assert scrub.scrub_pass() == [], "a known range is reported once"
            assert len(b.health()["corrupt"]) == 2
            # Nothing of a framing-damaged range is served either.
            victim_qoff = phys.index(magic_victim)
            with pytest.raises(CorruptData):
                await b.pull("T", 0, victim_qoff, 1)
        finally:
            await b.stop()
    asyncio.run(go())


def test_scrubber_runs_in_the_background_at_its_interval(tmp_path):
    async def go():
        b = standalone(tmp_path, store_scrub_interval_ms=50, store_scrub_rate_mb=64)
        await b.start()
        try:
            phys = await fill(b, 100)
            flip_body(tmp_path, phys[0])
            deadline = time.monotonic() + 10
            while not b.corruption and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert [c["start"] for c in b.health()["corrupt"]] == [phys[0]]
            assert b.health()["corrupt"][0]["found_by"] == "scrub"
            assert b.scrubber.bytes_checked > 0
        finally:
            await b.stop()
    asyncio.run(go())


def test_scrubber_keeps_to_its_rate(tmp_path):
    async def go():
        b = standalone(tmp_path, store_scrub_rate_mb=0)
        await b.start()
        try:
            await fill(b, 300)                      # ~320 KB committed
            size = b.log.committed_position
            scrub = Scrubber(CommitLogSource(b.log), CorruptionRegistry(), 10, 1, step_bytes=32 * 1024)
            task = asyncio.create_task(scrub.run())
            t0 = time.monotonic()
            while scrub.passes == 0 and time.monotonic() - t0 < 5:
                await asyncio.sleep(0.01)
            elapsed = time.monotonic() - t0
            task.cancel()
            assert scrub.passes >= 1
            # 1 MB/s over ~0.3 MB: at least ~0.3 s (minus one step), however fast the machine.
            assert elapsed >= size / (1 << 20) - 0.05, (elapsed, size)
        finally:
            await b.stop()
    asyncio.run(go())


def test_scrub_config_keys_are_checked():
    cfg, _ = from_properties({"storeScrubIntervalMs": "250", "storeScrubRateMb": "0"})
    cfg.validate()
    assert cfg.store_scrub_interval_ms == 250 and cfg.store_scrub_rate_mb == 0
    for key, value in (("storeScrubRateMb", "-1"), ("storeScrubIntervalMs", "0")):
        with pytest.raises(ConfigError, match=key):
            from_properties({key: value})[0].validate()


def test_registry_ranges_overlap_and_bound():
    reg = CorruptionRegistry(max_ranges=2)
    reg.report(CorruptRange("f", 100, 200, 1, 2, "read", "x"))
    assert reg.overlapping(150, 151) is not None and reg.overlapping(199, 300) is not None
    assert reg.overlapping(0, 100) is None and reg.overlapping(200, 300) is None
    reg.report(CorruptRange("f", 300, 400, 1, 2, "read", "x"))
    with pytest.raises(CorruptData, match="more than 2"):
        reg.report(CorruptRange("f", 500, 600, 1, 2, "read", "x"))
    reg.clear(100, "test")
    assert reg.overlapping(150, 151) is None and len(reg) == 1 and reg.repaired_total == 1


# --- DLedger entry store: recovery keeps body damage, repair writes it back in place ----------------
DSEG = 4096


def dledger_store(root) -> EntryStore:
    s = EntryStore(FileSystem(), str(root), "n0", data_segment_size=DSEG, index_segment_size=32 * 64)
    s.recover()
    return s


def dflip(store: EntryStore, at: int) -> None:
    base = at - at % DSEG
    flip(os.path.join(store.data.directory, f"{base:020d}"), at - base)


def entries(first: int, n: int) -> list[Entry]:
    return [Entry(i, 1, EntryType.NORMAL, bytes([i % 251]) * 300) for i in range(first, first + n)]


def committed_with_a_flipped_body(root) -> tuple[EntryStore, list[int], str, bytes]:
    """Entries 1..30 committed and closed, then a bit of entry 10's body flipped on disk:
    (the store reopened, not recovered yet; the entries' positions; the data file; its
    bytes before the flip)."""
    s = dledger_store(root)
    pos = s.append(entries(1, 30))
    s.flush()
    s.checkpoint(30)
    s.close()
    path = os.path.join(s.data.directory, f"{0:020d}")
    pristine = open(path, "rb").read()
    flip(path, pos[9] + E.HEADER_SIZE + 7)
    return (EntryStore(FileSystem(), str(root), "n0", data_segment_size=DSEG, index_segment_size=32 * 64), pos,
            path, pristine)


def test_recovery_keeps_a_committed_entry_with_a_flipped_body_and_marks_it(tmp_path):
    from dledger.repair import check_fetched, write_in_place, RepairError
    s2, pos, path, pristine = committed_with_a_flipped_body(tmp_path)
    rep = s2.recover()
    assert rep.cut_at_index is None and rep.last_index == 30 and not rep.lost_durable, "nothing committed is cut"
    assert list(s2.damaged) == [10]
    d = s2.damaged[10]
    assert d.pos == pos[9] and d.expected_crc != d.actual_crc
    with pytest.raises(Exception):
        s2.entries(10, 11, 1 << 20)         # the damaged body is never handed out
    # A peer's copy that is not our entry, or does not verify, is refused.
    rec = s2.entry_at(10)
    good = pristine[rec.pos:rec.end]
    bad_body = bytearray(good)
    bad_body[E.HEADER_SIZE + 1] ^= 1
    other = pristine[s2.entry_at(11).pos:s2.entry_at(11).end]
    for wrong in (bytes(bad_body), other, good[:100]):
        with pytest.raises(RepairError):
            check_fetched(wrong, rec)
    check_fetched(good, rec)
    write_in_place(s2, rec, good)
    assert open(path, "rb").read() == pristine, "repaired bytes are the original bytes, in place"
    assert [e.body for e in s2.entries(10, 11, 1 << 20)] == [entries(10, 1)[0].body]
    s2.close()


def test_regression_a_repair_never_waits_on_the_event_loop_for_a_flush(tmp_path):
    """Random-fault run (DLedger seed 554): the event loop stalled 2,306 ms in a repair. Its
    in-place write waited for the store's flush lock, which a flush holds across its fsync
    (slow on that disk), and then fsynced itself, both on the loop. Now a worker does both;
    the loop runs on meanwhile, and the entry is repaired once the flush is done."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from dledger import repair as R
    s2, _pos, path, pristine = committed_with_a_flipped_body(tmp_path)
    s2.recover()
    rec = s2.entry_at(10)
    repaired = []
    gate = asyncio.Lock()
    dlog = SimpleNamespace(store=s2, _leader_id="n1", on_repaired=lambda r, rec, raw, how: repaired.append(r),
                           node=SimpleNamespace(flushes_held=lambda: gate))
    repairer = R.Repairer(dlog, SimpleNamespace(ranges=lambda: []), ["n1"])

    async def answer(peer, index, count=1):
        return pristine[rec.pos:rec.end]
    repairer.fetch = answer

    async def go() -> float:
        s2.flush_lock.acquire()             # a flush in its fsync ...
        threading.Timer(1.0, s2.flush_lock.release).start()    # ... for a second
        longest, stop = 0.0, asyncio.Event()

        async def ticker():
            nonlocal longest
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                longest, last = max(longest, now - last), now
        t = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)           # the ticker runs
        assert await repairer._repair_one(SimpleNamespace(index=10))
        stop.set()
        await t
        return longest
    longest = asyncio.run(go())
    assert longest < 0.5, f"the event loop stalled {longest:.3f} s behind the flush"
    assert repaired and open(path, "rb").read() == pristine
    s2.close()


def test_a_flipped_body_above_the_durable_mark_is_still_cut_as_a_torn_tail(tmp_path):
    s = dledger_store(tmp_path)
    pos = s.append(entries(1, 30))
    s.flush()
    s.checkpoint(5)                     # only 1..5 known committed here
    s.close()
    dflip(s, pos[19] + E.HEADER_SIZE + 3)
    s2 = EntryStore(FileSystem(), str(tmp_path), "n0", data_segment_size=DSEG, index_segment_size=32 * 64)
    rep = s2.recover()
    assert rep.cut_at_index == 20 and s2.damaged == {}
    s2.close()


def test_entry_scrubber_finds_a_body_flip_and_names_the_entry(tmp_path):
    from types import SimpleNamespace
    from dledger.repair import EntryScrubSource
    s = dledger_store(tmp_path)
    pos = s.append(entries(1, 40))      # ~14 KB: four 4 KiB files with blanks at their ends
    s.flush()
    dlog = SimpleNamespace(store=s, _committed_pos=s.end_pos)
    dflip(s, pos[2] + E.HEADER_SIZE + 100)
    third = next(i for i, p in enumerate(pos) if p >= 2 * DSEG)
    dflip(s, pos[third + 1] + E.HEADER_SIZE)
    reg = CorruptionRegistry()
    found = Scrubber(EntryScrubSource(dlog), reg, 1000, 1000, step_bytes=1500).scrub_pass()
    assert [(c.index, c.start, c.reason) for c in found] == [
        (3, pos[2], "entry body crc mismatch"), (third + 2, pos[third + 1], "entry body crc mismatch")]
    assert all(c.expected_crc != c.actual_crc for c in found)
    s.close()


# --- Raft: a node with a corrupt committed range votes but does not campaign -----------------------
def test_a_node_with_corrupt_data_does_not_campaign_but_still_votes():
    from tests.unit.test_raft_core import Group
    g = Group()
    g["a"].campaign_blocked = True
    g.tick("a", 50)                         # five election timeouts: a never stands
    assert g["a"].role.name == "FOLLOWER" and g["a"].term == 0
    assert not any(type(m).__name__ == "RequestVote" for _, _, m in g.queue)
    g.tick_all(30)                           # b or c is elected, with a's vote counted like any other
    leaders = [n for n in g.ids if g[n].role.name == "LEADER"]
    assert len(leaders) == 1 and leaders[0] != "a"
    g["a"].campaign_blocked = False          # repaired: a may stand again later
    assert g["a"].leader_id == leaders[0]


def test_a_blocked_node_grants_its_vote():
    from dledger.messages import RequestVote, VoteResponse
    from tests.unit.test_raft_core import Group
    g = Group()
    g["a"].campaign_blocked = True
    g["a"].step("b", RequestVote(1, "b", 0, 0, pre_vote=False))
    g.drain("a")
    votes = [m for src, dst, m in g.queue if src == "a" and isinstance(m, VoteResponse)]
    assert votes and votes[0].granted, "a corrupt body changes no last index/term: voting stays safe"


def test_dledger_read_checks_the_entry_body_crc_not_only_the_message_body(tmp_path):
    """Regression: the DLedger read path returned the record bytes unchecked, and the broker's
    decode checks only the message BODYCRC, so a flip in the record's topic or properties (covered
    by the entry's bodyCrc alone) reached consumers."""
    from types import SimpleNamespace
    from dledger.dledger_log import DLedgerLog
    s = dledger_store(tmp_path)
    pos = s.append(entries(1, 10))
    s.flush()
    node = SimpleNamespace(store=s, raft_config=SimpleNamespace(max_batch_entries=64), listener=None,
                           node_id="n0", core=None)
    dlog = DLedgerLog(node, {"n0": "127.0.0.1:1"})
    dlog._committed_pos = s.end_pos
    size = 300
    assert dlog.read(pos[4] + E.HEADER_SIZE, size) == entries(5, 1)[0].body
    dflip(s, pos[4] + E.HEADER_SIZE + size - 1)          # the last byte: a record's properties end
    with pytest.raises(CorruptData):
        dlog.read(pos[4] + E.HEADER_SIZE, size)
    [r] = dlog.corruption.ranges()
    assert (r.index, r.start, r.end, r.found_by) == (5, pos[4], pos[4] + E.HEADER_SIZE + size, "read")
    with pytest.raises(CorruptData):
        dlog.read_record(pos[4] + E.HEADER_SIZE)          # query by id refuses it too
    assert dlog.read(pos[5] + E.HEADER_SIZE, size) == entries(6, 1)[0].body
    assert dlog.committed_position == pos[4], "dispatch is held before the damaged entry"
    s.close()


def test_internal_readers_skip_a_reported_record_and_the_node_keeps_running(tmp_path):
    """topicStatus, consumer progress and the delay/transaction services read records too: a
    corrupt one is reported there as well, but those reads do not fail the node or the request."""
    async def go():
        b = standalone(tmp_path, store_scrub_rate_mb=0)
        await b.start()
        try:
            phys = await fill(b, 3)
            flip_body(tmp_path, phys[2])                 # the newest message: topicStatus reads it
            [q] = b.topic_status("T")
            assert q["max_offset"] == 3 and q["last_updated"] == 0
            assert [c["start"] for c in b.health()["corrupt"]] == [phys[2]]
            with pytest.raises(CorruptData):
                b.query_by_queue_offset("T", 0, 2)
            assert b.fatal is None and b.health()["status"] == "UP"
        finally:
            await b.stop()
    asyncio.run(go())


# --- repair over the Raft peer channel: serving and matching (dledger/repair.py) ----------------------
def repair_pair(tmp_path, n: int = 30):
    """A DLedgerLog over a real store whose node records what the repairer sends."""
    from types import SimpleNamespace
    from dledger.dledger_log import DLedgerLog
    s = dledger_store(tmp_path)
    pos = s.append(entries(1, n))
    s.flush()
    sent: list[tuple[str, object]] = []
    node = SimpleNamespace(store=s, raft_config=SimpleNamespace(max_batch_entries=64), listener=None,
                           node_id="n0", core=None, side_handler=None,
                           send_side=lambda peer, msg: sent.append((peer, msg)))
    dlog = DLedgerLog(node, {"n0": "127.0.0.1:1", "n1": "127.0.0.1:2", "n2": "127.0.0.1:3"})
    dlog._committed_pos, dlog._commit_index = s.end_pos, n
    return s, pos, dlog, sent


def test_fetch_entries_is_answered_with_verified_committed_entries_within_bounds(tmp_path):
    from dledger import messages as RM
    s, pos, dlog, sent = repair_pair(tmp_path)
    assert dlog.node.side_handler == dlog.repairer.on_message, "the shell routes repair messages here"
    dlog.repairer.on_message("n1", RM.FetchEntries(5, 3, 4))
    [(peer, resp)] = sent
    assert peer == "n1" and (resp.request_id, resp.index, resp.error) == (5, 3, "")
    assert resp.entries == s.data.read(pos[2], pos[6] - pos[2]), "raw entries 3..6, as stored"
    sent.clear()
    for req in (RM.FetchEntries(6, 31, 1), RM.FetchEntries(7, 9999, 1)):    # not committed here
        dlog.repairer.on_message("n1", req)
    assert [(m.request_id, m.entries, "not a committed entry" in m.error) for _, m in sent] == \
        [(6, b"", True), (7, b"", True)]
    sent.clear()
    dflip(s, pos[7] + E.HEADER_SIZE + 3)                 # entry 8 damaged here too: stop before it
    dlog.repairer.on_message("n2", RM.FetchEntries(8, 6, 10))
    assert sent[-1][1].entries == s.data.read(pos[5], pos[7] - pos[5])
    dlog.repairer.on_message("n2", RM.FetchEntries(9, 8, 1))
    assert sent[-1][1].entries == b"" and "does not verify" in sent[-1][1].error
    s.close()


def test_fetch_answers_to_one_peer_are_rate_bounded(tmp_path):
    from dledger import messages as RM
    s, pos, dlog, sent = repair_pair(tmp_path)
    dlog.repairer.serve_bytes_per_s = 2 * (pos[1] - pos[0])
    for rid in range(1, 5):
        dlog.repairer.on_message("n1", RM.FetchEntries(rid, 1, 1))
    assert [bool(m.entries) for _, m in sent] == [True, True, False, False]
    assert sent[-1][1].error.startswith("busy")
    dlog.repairer.on_message("n2", RM.FetchEntries(9, 1, 1))
    assert sent[-1][1].entries, "the budget is per peer"
    s.close()


def test_a_fetch_takes_only_its_own_answer_and_times_out(tmp_path):
    from dledger import messages as RM
    from dledger.repair import RepairError
    s, pos, dlog, sent = repair_pair(tmp_path)
    rep = dlog.repairer
    rep.fetch_timeout_s = 0.3
    good = s.data.read(pos[2], pos[3] - pos[2])

    async def go():
        task = asyncio.create_task(rep.fetch("n1", 3))
        await asyncio.sleep(0.01)
        [(peer, req)] = sent
        assert peer == "n1" and (req.index, req.count) == (3, 1)
        rep.on_message("n2", RM.FetchEntriesResponse(req.request_id, 3, b"x" * 10, ""))      # other peer
        rep.on_message("n1", RM.FetchEntriesResponse(req.request_id + 1, 3, b"x" * 10, ""))  # other request
        rep.on_message("n1", RM.FetchEntriesResponse(req.request_id, 4, b"x" * 10, ""))      # other index
        await asyncio.sleep(0.01)
        assert not task.done() and rep.metrics["fetch_unmatched"] == 3
        rep.on_message("n1", RM.FetchEntriesResponse(req.request_id, 3, good, ""))
        assert await task == good
        rep.on_message("n1", RM.FetchEntriesResponse(req.request_id, 3, good, ""))           # duplicate
        assert rep.metrics["fetch_unmatched"] == 4 and not rep._waiting
        t0 = time.monotonic()
        with pytest.raises(RepairError, match="no answer"):
            await rep.fetch("n2", 3)
        assert 0.25 < time.monotonic() - t0 < 2 and not rep._waiting
        task = asyncio.create_task(rep.fetch("n1", 3))
        await asyncio.sleep(0.01)
        rep.on_message("n1", RM.FetchEntriesResponse(sent[-1][1].request_id, 3, b"", "not committed"))
        with pytest.raises(RepairError, match="peer refused: not committed"):
            await task
    asyncio.run(go())
    s.close()


def test_the_repairer_asks_the_leader_first():
    from types import SimpleNamespace
    from dledger.repair import Repairer
    dlog = SimpleNamespace(_leader_id="n3", store=None)
    rep = Repairer(dlog, CorruptionRegistry(), ["n1", "n2", "n3", "n4"])
    for _ in range(20):
        order = rep.peer_order()
        assert order[0] == "n3" and sorted(order) == ["n1", "n2", "n3", "n4"]

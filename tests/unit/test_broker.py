"""Broker semantics: topics, send, pull (RocketMQ getMessage statuses), long polling,
consumer offsets replicated through the log, queries, and input checks.

Method: a Broker over an in-memory ReplicatedLog (`MemLog`), the real ConsumeQueueStore,
a small dispatcher that does what node.store.dispatcher does (committed records -> consume
queues, key index, system handlers, listeners) and in-memory snapshot stores. The same
harness serves test_api.py and test_cli.py. The real LocalLog is covered by the
integration tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno

import pytest

from node.broker import SYS_CONSUMER_OFFSET, Broker, OutgoingMessage, Subscription, wait_future
from node.config import BrokerConfig
from node.replicated_log import PutResult, PutStatus, ScanBatch, ScannedRecord
from node.store import layout as L
from node.store import message as M
from node.store.message import MessageDraft
from node.store.consume_queue import ConsumeQueueStore
from node.store.errors import BadRequest, MessageNotFound, MessageTooLarge, NotLeader, TopicNotExist
from node.store.fileio import FileSystem


# --- harness ------------------------------------------------------------------------------
class MemLog:
    """A ReplicatedLog in memory: committed = appended."""

    mode = "standalone"

    def __init__(self, ip: bytes = b"\x7f\x00\x00\x01", port: int = 10911):
        self.buf = bytearray()
        self.next_qoff: dict[tuple[str, int], int] = {}
        self.ip, self.port = ip, port
        self._futs: list[asyncio.Future] = []
        self.started = self.stopped = False
        self.min_physical_offset = 0
        self.min_position = 0

    async def start(self):
        self.started = True

    async def stop(self):
        self.stopped = True

    def role(self):
        return "STANDALONE"

    def leader(self):
        return None

    def members(self):
        return {}

    def status(self):
        return {"committed_position": len(self.buf)}

    @property
    def committed_position(self):
        return len(self.buf)

    def init_queue_offsets(self, table):
        self.next_qoff = dict(table)

    def queue_offset_of(self, topic, qid):
        return self.next_qoff.get((topic, qid), 0)

    async def append(self, drafts):
        out = []
        for d in drafts:
            key = (d.topic, d.queue_id)
            qoff = self.next_qoff.get(key, 0)
            self.next_qoff[key] = qoff + 1
            phys = len(self.buf)
            self.buf += M.encode_record(d, qoff, phys, 1_700_000_000_000 + phys, self.ip, self.port)
            out.append(PutResult(PutStatus.SEND_OK, phys, d.total_size, qoff, 1_700_000_000_000 + phys))
        futs, self._futs = self._futs, []
        for f in futs:
            if not f.done():
                f.set_result(None)
        return out

    def read(self, phys, size):
        if phys < 0 or size <= 0 or phys + size > len(self.buf):
            raise KeyError(phys)
        data = bytes(self.buf[phys:phys + size])
        total, magic = L.BLANK.unpack_from(data, 0)
        if magic != L.MESSAGE_MAGIC or total != size:
            raise KeyError(phys)
        return data

    def scan(self, position, max_bytes):
        recs, used = [], 0
        while position < len(self.buf) and used < max_bytes:
            total, magic = L.BLANK.unpack_from(self.buf, position)
            if magic != L.MESSAGE_MAGIC:
                from node.store.errors import CorruptRecord
                raise CorruptRecord(position, "bad magic")
            recs.append(ScannedRecord(position, bytes(self.buf[position:position + total])))
            position += total
            used += total
        return ScanBatch(tuple(recs), position)

    async def wait_committed(self, beyond, timeout_s):
        if len(self.buf) <= beyond:
            fut = asyncio.get_running_loop().create_future()
            self._futs.append(fut)
            await wait_future(fut, timeout_s)
        return len(self.buf)


class MemIndex:
    def __init__(self):
        self.keys: dict[str, list[int]] = {}

    def add(self, msg):
        for k in set(msg.keys) | {msg.properties.get(M.PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX) or ""}:
            if k:
                self.keys.setdefault(f"{msg.topic}#{k}", []).append(msg.physical_offset)

    def query(self, topic, key, begin, end, max_num):
        return list(reversed(self.keys.get(f"{topic}#{key}", [])))[:max_num]

    async def query_off_loop(self, topic, key, begin, end, max_num):
        return self.query(topic, key, begin, end, max_num)


class MiniDispatcher:
    """What the real Dispatcher does, minus checkpoints: committed records -> CQ, index, handlers."""

    def __init__(self, rlog, cq_store, index, system_handlers):
        self.log, self.cq, self.index, self.handlers = rlog, cq_store, index, system_handlers
        self.position = 0
        self.listeners = []
        self.behind_bytes = 0

    def add_listener(self, cb):
        self.listeners.append(cb)

    def startup_recover(self, log_end_physical):
        self.cq.recover_all()
        self.cq.truncate_past_physical(log_end_physical)
        return 0

    async def startup_recover_in_background(self, log_end_physical):
        return self.startup_recover(log_end_physical)

    def catch_up(self):
        while self.position < self.log.committed_position:
            batch = self.log.scan(self.position, 1 << 20)
            for rec in batch.records:
                self._dispatch(M.decode_record(rec.data))
            self.position = batch.next_position

    async def catch_up_yielding(self):
        self.catch_up()

    def _dispatch(self, msg):
        self.cq.find_or_create(msg.topic, msg.queue_id).put(msg.queue_offset, msg.physical_offset,
                                                            msg.total_size, M.tags_code(msg.tags))
        self.index.add(msg)
        handler = self.handlers.get(msg.topic)
        if handler:
            handler(msg)
        for cb in self.listeners:
            cb(msg.topic, msg.queue_id, msg.queue_offset + 1)

    async def run(self):
        while True:
            await self.log.wait_committed(self.position, 1.0)
            self.catch_up()


class MemSnapshots:
    def __init__(self):
        self.table: dict = {}
        self.saves = 0

    def load(self):
        return {k: dict(v) for k, v in self.table.items()}

    def save(self, table):
        self.table = {k: dict(v) for k, v in table.items()}
        self.saves += 1


@dataclasses.dataclass
class Harness:
    broker: Broker
    log: MemLog
    topics: MemSnapshots
    offsets: MemSnapshots
    root: str

    async def settle(self) -> None:
        """Wait (bounded) until the dispatcher has caught up with the log."""
        for _ in range(400):
            if self.broker.dispatcher.position >= self.log.committed_position:
                return
            await asyncio.sleep(0.005)
        raise AssertionError("dispatcher did not catch up")


def make_broker(root: str, config: BrokerConfig | None = None, rlog: MemLog | None = None,
                topics: MemSnapshots | None = None, offsets: MemSnapshots | None = None) -> Harness:
    config = config or BrokerConfig(maped_file_size_consume_queue=20 * 64, flush_consumer_offset_interval_ms=100)
    rlog = rlog or MemLog()
    topics = topics or MemSnapshots()
    offsets = offsets or MemSnapshots()
    cq = ConsumeQueueStore(FileSystem(), root, config.cq_units_per_file)
    index = MemIndex()
    holder: dict = {}
    dispatcher = MiniDispatcher(rlog, cq, index, {})
    broker = Broker(config, rlog, cq, index, dispatcher, topics, offsets)
    dispatcher.handlers = broker.system_handlers()
    holder["b"] = broker
    return Harness(broker, rlog, topics, offsets, root)


def run(coro):
    return asyncio.run(coro)


def msg(body=b"hello", **kw) -> OutgoingMessage:
    return OutgoingMessage(body=body, **kw)


# --- tests -----------------------------------------------------------------------------------
def test_topic_create_list_status(tmp_path):
    async def go():
        h = make_broker(str(tmp_path))
        await h.broker.start()
        cfg = await h.broker.create_topic("T1", 4)
        assert (cfg.read_queue_nums, cfg.write_queue_nums, cfg.perm) == (4, 4, 6)
        assert [t.topic for t in h.broker.list_topics()] == ["T1"]
        await h.broker.send("T1", [msg(queue_id=2), msg(queue_id=2)])
        await h.settle()
        status = h.broker.topic_status("T1")
        assert [q["max_offset"] for q in status] == [0, 0, 2, 0]
        assert status[2]["last_updated"] > 1_700_000_000_000 and status[0]["last_updated"] == 0
        with pytest.raises(TopicNotExist):
            h.broker.topic_status("nope")
        await h.broker.stop()
    run(go())


def test_send_round_robin_batch_and_results(tmp_path):
    async def go():
        h = make_broker(str(tmp_path))
        await h.broker.start()
        await h.broker.create_topic("T", 3)
        first = await h.broker.send("T", [msg(b"a"), msg(b"b")])
        await h.settle()
        assert [r.queue_id for r in first] == [0, 0]          # one batch -> one queue
        assert [r.queue_offset for r in first] == [0, 1]
        second = await h.broker.send("T", [msg(b"c")])
        await h.settle()
        assert second[0].queue_id == 1
        r = first[0]
        assert r.status == "SEND_OK" and r.msg_id == r.offset_msg_id and len(r.offset_msg_id) == 32
        uniq = await h.broker.send("T", [msg(properties={"UNIQ_KEY": "ABC"})])
        await h.settle()
        assert uniq[0].msg_id == "ABC"
        await h.broker.stop()
    run(go())


def test_send_rejects_bad_input_and_changes_nothing(tmp_path):
    async def go():
        cfg = BrokerConfig(max_message_size=1000, mapped_file_size_commit_log=1 << 20, max_batch_messages=4,
                           max_request_bytes=1 << 20)
        h = make_broker(str(tmp_path), cfg)
        await h.broker.start()
        await h.broker.create_topic("T", 2)
        before = len(h.log.buf)
        cases = [
            ("nope", [msg()], TopicNotExist),
            ("bad topic!", [msg()], BadRequest),
            ("RMQ_SYS_X", [msg()], BadRequest),
            ("T", [], BadRequest),
            ("T", [msg()] * 5, BadRequest),
            ("T", [msg(queue_id=2)], BadRequest),
            ("T", [msg(queue_id=-1)], BadRequest),
            ("T", [msg(b"x" * 1001)], MessageTooLarge),
            ("T", [msg(), msg(properties={"a\x01": "b"})], BadRequest),
        ]
        for topic, messages, err in cases:
            with pytest.raises(err):
                await h.broker.send(topic, messages)
        assert len(h.log.buf) == before
        await h.broker.stop()
    run(go())


def test_auto_create_topic_when_enabled(tmp_path):
    async def go():
        h = make_broker(str(tmp_path), BrokerConfig(auto_create_topic_enable=True, default_topic_queue_nums=2))
        await h.broker.start()
        (r,) = await h.broker.send("Fresh", [msg()])
        await h.settle()
        assert h.broker.topic("Fresh").write_queue_nums == 2 and r.queue_offset == 0
        await h.broker.stop()
    run(go())


def test_pull_statuses_match_getmessage(tmp_path):
    async def go():
        h = make_broker(str(tmp_path))
        await h.broker.start()
        await h.broker.create_topic("T", 1)
        await h.broker.send("T", [msg(str(i).encode()) for i in range(5)])
        await h.settle()
        b = h.broker
        r = await b.pull("T", 0, 0, 3)
        assert (r.status, r.next_offset, r.min_offset, r.max_offset) == ("FOUND", 3, 0, 5)
        assert [m.body for m in r.messages] == [b"0", b"1", b"2"]
        assert [m.queue_offset for m in r.messages] == [0, 1, 2]
        r = await b.pull("T", 0, 5)
        assert (r.status, r.next_offset) == ("NO_NEW_MSG", 5)
        r = await b.pull("T", 0, 9)
        assert (r.status, r.next_offset) == ("OFFSET_ILLEGAL", 5)
        r = await b.pull("T", 0, 0, 1000)
        assert len(r.messages) == 5                      # capped at 32, here all five
        h.broker.cq_store.get("T", 0)._min = 2           # as if the head expired
        r = await b.pull("T", 0, 1)
        assert (r.status, r.next_offset, r.min_offset) == ("OFFSET_ILLEGAL", 2, 2)
        await b.stop()
    run(go())


@pytest.mark.parametrize("role", ["SLAVE", "FOLLOWER", "CANDIDATE"])
def test_a_slave_or_follower_serves_pulls_only_with_slave_read_enable(tmp_path, role):
    """RocketMQ's PullMessageProcessor rejects pulls on a slave unless slaveReadEnable; here the
    refusal is NOT_LEADER naming the master (clients follow it). Queries are served anyway."""
    async def go():
        h = make_broker(str(tmp_path))
        await h.broker.start()
        await h.broker.create_topic("T", 1)
        await h.broker.send("T", [msg(b"x")])
        await h.settle()
        h.log.role = lambda: role
        h.log.leader = lambda: "10.0.0.1:10911" if role != "CANDIDATE" else None
        with pytest.raises(NotLeader, match="slaveReadEnable=false") as e:
            await h.broker.pull("T", 0, 0)
        assert e.value.leader == ("10.0.0.1:10911" if role != "CANDIDATE" else None)
        assert h.broker.query_by_queue_offset("T", 0, 0).body == b"x"
        h.broker.config = dataclasses.replace(h.broker.config, slave_read_enable=True)
        r = await h.broker.pull("T", 0, 0)
        assert [m.body for m in r.messages] == [b"x"]
        await h.broker.stop()
    run(go())


def test_pull_cap_and_bad_arguments(tmp_path):
    async def go():
        h = make_broker(str(tmp_path), BrokerConfig(max_transfer_count_on_message_in_memory=4))
        await h.broker.start()
        await h.broker.create_topic("T", 2)
        await h.broker.send("T", [msg(queue_id=0) for _ in range(10)])
        await h.settle()
        r = await h.broker.pull("T", 0, 0, 10)
        assert len(r.messages) == 4 and r.next_offset == 4
        for args in [("T", 2, 0), ("T", 0, -1), ("T", 0, 0, 0), ("T", 0, 0, -5), ("T", "x", 0), ("T", 0, 0, 1, "*", -1),
                     ("T", 0, 0, 1, "||")]:
            with pytest.raises(BadRequest):
                await h.broker.pull(*args)
        with pytest.raises(TopicNotExist):
            await h.broker.pull("U", 0, 0)
        await h.broker.stop()
    run(go())


def test_tag_filter_by_hash_then_string(tmp_path):
    async def go():
        h = make_broker(str(tmp_path))
        await h.broker.start()
        await h.broker.create_topic("T", 1)
        # "Aa" and "BB" share a Java hashCode: the hash passes both, the string check splits them.
        assert M.tags_code("Aa") == M.tags_code("BB")
        await h.broker.send("T", [msg(b"1", tags="Aa"), msg(b"2", tags="BB"), msg(b"3", tags="C"), msg(b"4")])
        await h.settle()
        await h.settle()
        r = await h.broker.pull("T", 0, 0, 32, "Aa")
        assert [m.body for m in r.messages] == [b"1"] and r.next_offset == 4
        r = await h.broker.pull("T", 0, 0, 32, "BB || C")
        assert [m.body for m in r.messages] == [b"2", b"3"]
        r = await h.broker.pull("T", 0, 0, 32, "*")
        assert len(r.messages) == 4
        r = await h.broker.pull("T", 0, 0, 32, "Z")
        assert (r.status, r.next_offset) == ("NO_MATCHED_MSG", 4)
        r = await h.broker.pull("T", 0, 0, 1, "C")
        assert [m.body for m in r.messages] == [b"3"] and r.next_offset == 3
        await h.broker.stop()
    run(go())


def test_subscription_parse():
    assert Subscription.parse("*").matches_all and Subscription.parse(None).matches_all
    s = Subscription.parse(" a ||b|| ")
    assert s.tags == {"a", "b"} and s.codes == {M.tags_code("a"), M.tags_code("b")}


def test_long_poll_wakes_on_new_message_and_times_out(tmp_path):
    async def go():
        h = make_broker(str(tmp_path))
        await h.broker.start()
        await h.broker.create_topic("T", 1)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        r = await h.broker.pull("T", 0, 0, 32, None, 300)
        assert r.status == "NO_NEW_MSG" and 0.28 <= loop.time() - t0 < 1.5
        waiter = asyncio.create_task(h.broker.pull("T", 0, 0, 32, None, 5000))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        t0 = loop.time()
        await h.broker.send("T", [msg(b"wake")])
        await h.settle()
        r = await asyncio.wait_for(waiter, 2)
        assert r.status == "FOUND" and r.messages[0].body == b"wake" and loop.time() - t0 < 1.0
        await h.broker.stop()
    run(go())


def test_long_poll_waiter_bound_degrades_to_short_poll(tmp_path):
    async def go():
        h = make_broker(str(tmp_path), BrokerConfig(long_polling_max_waiters=1))
        await h.broker.start()
        await h.broker.create_topic("T", 1)
        held = asyncio.create_task(h.broker.pull("T", 0, 0, 32, None, 2000))
        await asyncio.sleep(0.05)
        t0 = asyncio.get_running_loop().time()
        r = await h.broker.pull("T", 0, 0, 32, None, 2000)
        assert r.status == "NO_NEW_MSG" and asyncio.get_running_loop().time() - t0 < 0.2
        held.cancel()
        await h.broker.stop()
    run(go())


def test_consumer_offsets_go_through_the_log_and_survive_restart(tmp_path):
    async def go():
        h = make_broker(str(tmp_path))
        await h.broker.start()
        await h.broker.create_topic("T", 2)
        await h.broker.send("T", [msg(queue_id=1) for _ in range(7)])
        await h.settle()
        await h.broker.commit_offset("G1", "T", 1, 5)
        await h.broker.commit_offset("G1", "T", 1, 7)
        await h.broker.commit_offset("G2", "T", 0, 0)
        assert h.broker.get_offsets("G1", "T") == {"T": {1: 7}}
        assert h.broker.get_offsets("G2") == {"T": {0: 0}}
        sys_cq = h.broker.cq_store.get(SYS_CONSUMER_OFFSET, 0)
        assert sys_cq.max_offset == 3                   # three records in the system queue
        for bad in [("G1", "T", 1, 8), ("G1", "T", 5, 0), ("G1", "T", 1, -1), ("bad group!", "T", 0, 0),
                    ("G1", "T", 0, True)]:
            with pytest.raises(BadRequest):
                await h.broker.commit_offset(*bad)
        with pytest.raises(TopicNotExist):
            await h.broker.commit_offset("G1", "U", 0, 0)
        await h.broker.stop()
        # Restart with the snapshots lost: everything comes back from the log alone.
        h2 = make_broker(str(tmp_path), rlog=h.log)
        await h2.broker.start()
        assert h2.broker.get_offsets("G1", "T") == {"T": {1: 7}}
        assert h2.broker.topic("T").write_queue_nums == 2
        await h2.broker.stop()
    run(go())


def test_restart_from_snapshot_replays_only_past_its_mark(tmp_path):
    async def go():
        h = make_broker(str(tmp_path))
        await h.broker.start()
        await h.broker.create_topic("T", 1)
        await h.broker.send("T", [msg() for _ in range(3)])
        await h.settle()
        await h.broker.commit_offset("G", "T", 0, 1)
        await h.broker.stop()                            # snapshot holds offset 1, mark 1
        assert h.offsets.table["T@G"] == {0: 1}
        # A commit that reached the log after the snapshot (the node then crashed).
        h.log.started = False
        h2 = make_broker(str(tmp_path), rlog=h.log, topics=h.topics, offsets=h.offsets)
        await h2.broker.start()
        await h2.broker.commit_offset("G", "T", 0, 3)
        h3 = make_broker(str(tmp_path), rlog=h.log, topics=h.topics, offsets=h.offsets)  # no stop: crash
        await h3.broker.start()
        assert h3.broker.get_offsets("G", "T") == {"T": {0: 3}}
        await h3.broker.stop()
    run(go())


def test_queries_by_id_key_and_queue_offset(tmp_path):
    async def go():
        h = make_broker(str(tmp_path))
        await h.broker.start()
        await h.broker.create_topic("T", 2)
        res = await h.broker.send("T", [msg(b"k1", keys=["order-1", "x"]), msg(b"k2", keys=["order-2"]),
                                        msg(b"k3", keys=["order-1"])])
        await h.settle()
        m = h.broker.query_by_id(res[1].offset_msg_id)
        assert m.body == b"k2" and m.queue_offset == res[1].queue_offset
        assert h.broker.query_by_id(res[1].offset_msg_id.lower()).body == b"k2"
        found = await h.broker.query_by_key("T", "order-1", 0, 1 << 60, 10)
        assert [x.body for x in found] == [b"k1", b"k3"]
        assert await h.broker.query_by_key("T", "none", 0, 1 << 60) == []
        m = h.broker.query_by_queue_offset("T", res[2].queue_id, res[2].queue_offset)
        assert m.body == b"k3"
        with pytest.raises(MessageNotFound):
            h.broker.query_by_queue_offset("T", 0, 99)
        bogus = M.encode_offset_msg_id(b"\x7f\x00\x00\x01", 10911, 5)   # mid-record
        with pytest.raises(MessageNotFound):
            h.broker.query_by_id(bogus)
        with pytest.raises(BadRequest):
            h.broker.query_by_id("zz")
        with pytest.raises(BadRequest):
            await h.broker.query_by_key("T", "k", 10, 5)
        # A system record is not a user message, even by its exact id.
        await h.broker.commit_offset("G", "T", 0, 0)
        sys_phys = h.broker.cq_store.get(SYS_CONSUMER_OFFSET, 0).get(0)[0]
        with pytest.raises(MessageNotFound):
            h.broker.query_by_id(M.encode_offset_msg_id(b"\x7f\x00\x00\x01", 10911, sys_phys))
        await h.broker.stop()
    run(go())


def test_health_and_cluster(tmp_path):
    async def go():
        h = make_broker(str(tmp_path))
        assert h.broker.health()["status"] == "DOWN"
        await h.broker.start()
        health = h.broker.health()
        assert health["status"] == "UP" and health["mode"] == "standalone" and health["role"] == "STANDALONE"
        assert health["node_id"] == "broker-a-0" and health["group"] == "broker-a"
        assert h.broker.cluster()["committed_offset"] == 0
        await h.broker.stop()
        assert h.log.stopped
    run(go())


class FullDiskSnapshots(MemSnapshots):
    """Snapshots whose save meets a full disk until `full` is cleared."""

    full = True

    def save(self, table):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        super().save(table)


def test_a_full_disk_leaves_the_snapshots_for_later_and_the_node_serving(tmp_path, caplog):
    """Regression (random-fault runs, a classic master's disk filled): the periodic snapshot
    met ENOSPC, the snapshot task failed, and the node stopped serving."""
    async def go():
        offsets = FullDiskSnapshots()
        h = make_broker(str(tmp_path), offsets=offsets)
        await h.broker.start()
        await h.broker.create_topic("T", 1)
        await h.broker.commit_offset("G", "T", 0, 0)
        await asyncio.sleep(0.35)                  # three snapshot intervals, each refused
        assert h.broker.fatal is None and h.broker.ready
        assert "disk full: topic and consumer-offset snapshots not written" in caplog.text
        assert caplog.text.count("snapshots not written") == 1, "one warning, not one per interval"
        await h.broker.commit_offset("G", "T", 0, 0)  # still serving
        offsets.full = False
        await asyncio.sleep(0.3)
        assert offsets.table.get("T@G") == {0: 0}
        await h.broker.stop()
    run(go())


class HoldingLog(MemLog):
    """A log that takes its queue offsets from the consume queues and can hold writes (LocalLog)."""

    writes_held: str | None = None
    inits = 0

    def hold_writes(self, why):
        self.writes_held = why

    def init_queue_offsets(self, table):
        super().init_queue_offsets(table)
        self.writes_held, self.inits = None, self.inits + 1


@pytest.mark.parametrize("kind", ["from_log", "holds", "neither"])
def test_a_start_on_a_full_disk_goes_on_when_the_log_folds_or_holds_its_queue_offsets(tmp_path, kind):
    """Regression (random-fault runs): a node restarted on a full disk met ENOSPC in the dispatch
    catch-up (a new index file) and did not start. A log that takes queue offsets from its own
    entries (DLedger) starts and lets the dispatcher finish later; one that takes them from the
    consume queues (standalone, classic) starts with its writes held until the dispatcher has
    caught up; a log that can do neither still fails its start."""
    async def go():
        rlog = HoldingLog() if kind == "holds" else MemLog()
        if kind == "from_log":
            rlog.queue_offsets_from_log = True
        await rlog.append([MessageDraft.sealed_plain("T", 0, b"x", None, 1)] * 2)
        h = make_broker(str(tmp_path), rlog=rlog)
        real = h.broker.dispatcher.catch_up

        def full_disk():
            raise OSError(errno.ENOSPC, "No space left on device")
        h.broker.dispatcher.catch_up = full_disk
        if kind == "neither":
            with pytest.raises(OSError):
                await h.broker.start()
            return
        await h.broker.start()
        h.broker.dispatcher.catch_up = real
        if kind == "holds":
            assert "behind the log" in rlog.writes_held and rlog.inits == 0
            h.broker._release_held_writes()             # the dispatcher is behind: still held
            assert rlog.writes_held and rlog.inits == 0
            real()
            h.broker._release_held_writes()
            assert rlog.writes_held is None and rlog.next_qoff == {("T", 0): 2}
        await h.broker.create_topic("T2", 1)             # serving; the dispatcher goes on
        assert h.broker.fatal is None and "T2" in h.broker.topics
        await h.broker.stop()
    run(go())


def test_offset_snapshot_written_periodically(tmp_path):
    async def go():
        h = make_broker(str(tmp_path))
        await h.broker.start()
        await h.broker.create_topic("T", 1)
        await h.broker.commit_offset("G", "T", 0, 0)
        await asyncio.sleep(0.3)
        assert h.offsets.table.get("T@G") == {0: 0}
        await h.broker.stop()
    run(go())

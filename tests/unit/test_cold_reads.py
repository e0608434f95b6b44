"""Reads of old bytes leave the event loop (node/store/cold_reads.py).

Goal: a pull of data far behind the log's end, an HA push of it, and a DLedger leader's push of
old entries do not block the node's event loop for the disk's time; reads of the newest bytes
stay on the loop; the read's own code (parsing, metrics, damage reports) runs on the loop either
way; fetched bytes never outlive a change of the bytes they hold.
Regression: a random-fault run saw a 392 ms stall of a node's loop in `pread`, under a pull; a
DLedger leader catching up a follower from 500 MB behind stalled its loop 400-550 ms in `pread`.
Method: a file system whose reads of "cold" pages take 0.4 s (until read once), under a
SegmentedFile, a real broker, an entry store and a 3-node group on loopback, with a LoopWatchdog.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from node.broker import OutgoingMessage
from node.config import BrokerConfig
from node.loop_watchdog import LoopWatchdog
from node.server import build_broker
from node.store import cold_reads
from node.store.fileio import FileSystem, OsFile
from node.store.segment import SegmentedFile

COLD_READ_S = 0.4


@pytest.fixture(autouse=True)
def every_byte_counts_as_old(monkeypatch):
    """These logs are far smaller than HOT_BYTES, the span behind the end read plainly."""
    monkeypatch.setattr(cold_reads, "HOT_BYTES", 0)


# --- a disk the test controls -------------------------------------------------------------------
class _ColdFile:
    """Reads of pages not read yet since `cold` was set take COLD_READ_S (a disk)."""

    def __init__(self, inner: OsFile, fs: "ColdDisk"):
        self._inner, self._fs = inner, fs

    def pread(self, size: int, offset: int) -> bytes:
        if self._fs.cold and (self._inner.path, offset // 4096) not in self._fs.warm:
            self._fs.disk_reads.append(threading.get_ident())
            time.sleep(COLD_READ_S)
            self._fs.warm.update((self._inner.path, p) for p in range(offset // 4096, (offset + size) // 4096 + 1))
        return self._inner.pread(size, offset)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class ColdDisk(FileSystem):
    """Files under a `where` directory whose pages are all cold once `cold` is set (until a
    read warms them)."""

    def __init__(self, where: str = "/commitlog/"):
        self.where = where
        self.cold = False
        self.warm: set[tuple[str, int]] = set()
        self.disk_reads: list[int] = []      # the thread of each slow read

    def open(self, path):
        handle = super().open(path)
        return _ColdFile(handle, self) if self.where in path else handle


def test_reads_of_the_newest_bytes_are_plain_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(cold_reads, "HOT_BYTES", 32 * 1024)
    fs = ColdDisk()
    sf = SegmentedFile(fs, str(tmp_path / "commitlog"), 64 * 1024)
    sf.load()
    sf.ensure_writable(0).append(os.urandom(64 * 1024))
    fs.cold = True

    async def both() -> list:
        out = []
        for offset in (40 * 1024, 1000):        # within HOT_BYTES of the end, then behind it
            t0 = time.monotonic()
            await cold_reads.read_without_stalling(sf.read, offset, 100)
            out.append(time.monotonic() - t0)
        return out

    fills = cold_reads.FILLS.count
    newest, older = asyncio.run(both())
    sf.close()
    assert newest >= COLD_READ_S, "the newest bytes were read plainly (here: a slow disk read, on the loop)"
    assert cold_reads.FILLS.count == fills + 1, "only the older read was a fill"


def test_an_old_segment_read_is_fetched_on_a_worker_and_then_answered_on_the_loop(tmp_path):
    fs = ColdDisk()
    sf = SegmentedFile(fs, str(tmp_path / "commitlog"), 64 * 1024)
    sf.load()
    data = os.urandom(64 * 1024)
    sf.ensure_writable(0).append(data)
    loop_thread, served_on = threading.get_ident(), []

    def read(offset: int, size: int) -> bytes:
        got = sf.read(offset, size)
        served_on.append(threading.get_ident())   # only a try that was not cut short gets here
        return got

    async def scenario() -> tuple[bytes, int]:
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.get_running_loop().create_task(ticker())
        fs.cold = True
        got = await cold_reads.read_without_stalling(read, 1000, 3000)
        t.cancel()
        return got, ticks

    fills = cold_reads.FILLS.count
    got, ticks = asyncio.run(scenario())
    sf.close()
    assert got == data[1000:4000]
    assert served_on == [loop_thread], "the read completed once, on the loop"
    assert fs.disk_reads and loop_thread not in fs.disk_reads, "the slow read ran on a worker"
    assert ticks >= COLD_READ_S / 0.01 / 2, f"the loop ran {ticks} ticks during a {COLD_READ_S} s disk read"
    assert cold_reads.FILLS.count == fills + 1


def test_without_a_way_to_fetch_the_read_runs_on_the_loop_as_before():
    calls = []

    def read():
        calls.append(cold_reads.must_not_wait())
        if cold_reads.must_not_wait():
            raise cold_reads.DiskWait("no fetch attached")     # e.g. a reader outside SegmentedFile
        return b"x"

    assert asyncio.run(cold_reads.read_without_stalling(read)) == b"x"
    assert calls == [True, False]
    assert not cold_reads.must_not_wait()


# --- a broker over the cold disk ------------------------------------------------------------------
async def fill_topic(b, n: int) -> list[bytes]:
    """Topic T (one queue) with n 1 KB messages, dispatched; their bodies."""
    await b.create_topic("T", 1)
    sent = [b"%04d" % i * 250 for i in range(n)]
    for i in range(0, n, 50):
        await b.send("T", [OutgoingMessage(body=x, queue_id=0) for x in sent[i:i + 50]])
    for _ in range(400):
        if b.dispatcher.position >= b.log.committed_position:
            break
        await asyncio.sleep(0.005)
    return sent


def small_store(tmp_path) -> BrokerConfig:
    """256 KiB commitlog files, 1024-unit consume-queue files, 4 KiB messages at most."""
    return BrokerConfig(store_path_root_dir=str(tmp_path), mapped_file_size_commit_log=256 * 1024,
                        maped_file_size_consume_queue=20 * 1024, max_message_size=4096).validate()


def test_regression_a_pull_of_cold_data_does_not_block_the_event_loop(tmp_path):
    fs = ColdDisk()
    cfg = small_store(tmp_path)

    async def scenario():
        b = build_broker(cfg, fs=fs)
        await b.start()
        try:
            sent = await fill_topic(b, 300)        # 1 KB bodies over two commitlog files
            b.log.commitlog.files.forget_fetched()  # what dispatch fetched (they expire after FETCH_SLOT_TTL_S)
            wd = LoopWatchdog(warn_s=0.2, beat_s=0.01)
            wd.start()
            try:
                fs.cold = True                       # the commitlog's pages leave the page cache
                t0 = time.monotonic()
                r = await b.pull("T", 0, 0, 32)
                elapsed = time.monotonic() - t0
                await asyncio.sleep(0.05)            # the watchdog's tick runs and sees any stall
            finally:
                wd.stop()
            return sent, r, elapsed, wd
        finally:
            await b.stop()

    sent, r, elapsed, wd = asyncio.run(scenario())
    assert [m.body for m in r.messages] == sent[:32]
    assert fs.disk_reads, "the pull did read the cold disk"
    assert elapsed >= COLD_READ_S
    assert wd.stalls == 0, f"the loop was blocked {wd.stalls} time(s), longest {wd.stalled_s_max:.3f} s"
    assert cold_reads.FILLS.max_s >= COLD_READ_S * 0.9


def test_regression_lookups_of_old_messages_do_not_block_the_event_loop(tmp_path):
    """A lookup by offsetMsgId, by key, by queue offset, a topic's status and a group's progress
    read their messages on the loop: on old data each waited for the disk there, as a pull did
    before. Through the HTTP API now, on a cold commitlog: answered, and no loop stall."""
    from aiohttp.test_utils import TestClient, TestServer
    from node.api import make_app
    fs = ColdDisk()
    cfg = small_store(tmp_path)

    async def scenario():
        b = build_broker(cfg, fs=fs)
        await b.start()
        client = TestClient(TestServer(make_app(b)))
        await client.start_server()
        try:
            await b.create_topic("T", 1)
            (row,) = await b.send("T", [OutgoingMessage(body=b"k" * 1000, queue_id=0, keys=["order-7"])])
            await fill_topic(b, 250)
            await b.commit_offset("G", "T", 0, 1)
            b.log.commitlog.files.forget_fetched()
            wd = LoopWatchdog(warn_s=0.2, beat_s=0.01)
            wd.start()
            answers = {}
            try:
                for name, path in [("by_id", f"/messages/{row.offset_msg_id}"), ("by_key", "/topics/T/messages?key=order-7"),
                                   ("by_queue_offset", "/topics/T/queues/0/messages/0"),
                                   ("topic_status", "/topics/T"), ("progress", "/groups/G/progress")]:
                    fs.cold = True                   # the commitlog's pages leave the page cache
                    fs.warm.clear()
                    b.log.commitlog.files.forget_fetched()
                    r = await client.get(path)
                    answers[name] = (r.status, await r.json())
                await asyncio.sleep(0.05)            # the watchdog's tick runs and sees any stall
            finally:
                wd.stop()
            return answers, wd
        finally:
            await client.close()
            await b.stop()

    answers, wd = asyncio.run(scenario())
    assert {k: st for k, (st, _) in answers.items()} == dict.fromkeys(answers, 200), answers
    assert answers["by_id"][1]["keys"] == ["order-7"]
    assert [m["keys"] for m in answers["by_key"][1]["messages"]] == [["order-7"]]
    assert answers["by_queue_offset"][1]["queue_offset"] == 0
    assert fs.disk_reads and all(t != threading.get_ident() for t in fs.disk_reads), \
        "every read of the cold disk ran on a worker"
    assert wd.stalls == 0, f"the loop was blocked {wd.stalls} time(s), longest {wd.stalled_s_max:.3f} s"


def test_metrics_count_the_fills(tmp_path):
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry
    from node.metrics import NodeCollector
    async def scrape() -> str:
        b = build_broker(BrokerConfig(store_path_root_dir=str(tmp_path)).validate())
        await b.start()
        try:
            reg = CollectorRegistry()
            reg.register(NodeCollector(b))
            return generate_latest(reg).decode()
        finally:
            await b.stop()

    text = asyncio.run(scrape())
    assert f"rocketmq_store_cold_read_fill_seconds_count {float(cold_reads.FILLS.count)}" in text
    assert 'rocketmq_store_cold_read_fill_seconds_bucket{le="+Inf"}' in text
    assert "rocketmq_store_cold_read_fill_seconds_sum" in text


def test_a_pull_of_old_commitlog_bytes_through_the_real_file_system_is_fetched_by_a_worker(tmp_path):
    cfg = BrokerConfig(store_path_root_dir=str(tmp_path), mapped_file_size_commit_log=1 << 20,
                       maped_file_size_consume_queue=20 * 1024, max_message_size=4096).validate()

    async def scenario():
        b = build_broker(cfg)
        await b.start()
        try:
            sent = await fill_topic(b, 400)
            b.log.commitlog.files.forget_fetched()      # what dispatch fetched
            fills = [cold_reads.FILLS.count]
            first = await b.pull("T", 0, 0, 32)
            fills.append(cold_reads.FILLS.count)
            later = await b.pull("T", 0, 300, 32)
            fills.append(cold_reads.FILLS.count)
            return sent, first, later, fills
        finally:
            await b.stop()

    sent, first, later, fills = asyncio.run(scenario())
    assert [m.body for m in first.messages] == sent[:32]
    assert [m.body for m in later.messages] == sent[300:332]
    assert fills[1] > fills[0] and fills[2] > fills[1], f"each pull's old bytes were read by a worker: {fills}"


def test_regression_a_read_where_a_fetched_slot_ends_at_a_file_end_reads_the_next_file(tmp_path):
    """A slot fetched near a file's end is cut there; a read starting at that end starts in the
    next file. It was answered b"" from the slot, and a DLedger leader read "a truncated entry"
    at the first entry of a data file and stopped (a real run catching up 300 MB)."""
    sf = SegmentedFile(FileSystem(), str(tmp_path / "data"), 64 * 1024)
    sf.load()
    first, second = os.urandom(64 * 1024), os.urandom(64 * 1024)
    sf.ensure_writable(0).append(first)
    sf.ensure_writable(sf.end).append(second)
    with cold_reads.no_disk_waits(), pytest.raises(cold_reads.DiskWait) as e:
        sf.read(60 * 1024, 100)
    e.value.fetch()                                 # [60 KiB, 64 KiB): cut at the first file's end
    with cold_reads.no_disk_waits():
        assert sf.read(60 * 1024, 100) == first[60 * 1024:60 * 1024 + 100]
        try:
            got = sf.read(64 * 1024, 100)
        except cold_reads.DiskWait as e2:
            e2.fetch()
            got = sf.read(64 * 1024, 100)
    assert got == second[:100]
    sf.close()


def test_fetched_bytes_are_dropped_when_the_bytes_they_hold_change(tmp_path):
    sf = SegmentedFile(FileSystem(), str(tmp_path / "commitlog"), 64 * 1024)
    sf.load()
    first = os.urandom(64 * 1024)
    sf.ensure_writable(0).append(first)
    with cold_reads.no_disk_waits(), pytest.raises(cold_reads.DiskWait) as e:
        sf.read(100, 50)
    e.value.fetch()                                          # a worker fetches [100, 100 + FETCH_BYTES)
    with cold_reads.no_disk_waits():
        assert sf.read(100, 50) == first[100:150]
        assert sf.read(60 * 1024, 8 * 1024) == first[60 * 1024:], "cut at the data end, as a plain read"
    sf.truncate(0)                                           # the old bytes go (a follower's truncation)
    second = os.urandom(64 * 1024)
    sf.ensure_writable(0).append(second)
    with cold_reads.no_disk_waits(), pytest.raises(cold_reads.DiskWait):
        sf.read(100, 50)                                     # not the first bytes, fetched before
    sf.forget_fetched()
    assert sf.read(100, 50) == second[100:150]
    sf.close()


# --- a DLedger leader's pushes to a follower far behind ---------------------------------------------
class _NoteCold:
    def __init__(self):
        self.fetches = []

    def __call__(self, fetch):
        self.fetches.append(fetch)


def test_an_entry_store_defers_a_push_read_of_old_entries_and_serves_them_once_fetched(tmp_path, monkeypatch):
    from dledger import entry_store as ES
    from dledger.messages import Entry, EntryType
    from dledger.raft_storage import NotCached
    monkeypatch.setattr(ES, "_CACHE_MAX_BYTES", 8 * 1024)       # older entries leave the memory cache
    fs = ColdDisk("/data/")
    store = ES.EntryStore(fs, str(tmp_path), "n0", data_segment_size=1 << 20, index_segment_size=32 * 4096)
    store.recover()
    bodies = [b"%05d" % i * 200 for i in range(1, 101)]
    store.append([Entry(i, 1, EntryType.NORMAL, b) for i, b in enumerate(bodies, 1)])
    fs.cold = True
    note = store.cold_reader = _NoteCold()
    got = None
    for _ in range(4):                 # the index file's bytes, then the data's: a fetch each
        before = len(fs.disk_reads)
        try:
            got = store.entries(1, 10, 1 << 20, may_defer=True)
        except NotCached:
            got = None
        assert len(fs.disk_reads) == before, "entries() itself read no cold page"
        if got is not None:
            break
        note.fetches[-1]()                                # what a cold-read worker runs
    assert got is not None and [e.body for e in got] == bodies[:9]
    assert fs.disk_reads and len(note.fetches) in (1, 2), "a fetch read the cold data"
    fs.warm.clear()
    assert [e.body for e in store.entries(1, 3, 1 << 20)] == bodies[:2], "without may_defer: a plain read"
    store.close()


def test_regression_a_leader_catching_up_a_follower_from_cold_entries_keeps_its_loop_free(tmp_path, monkeypatch):
    """Three nodes on loopback; n2 joins empty after 300 entries, which the leader no longer
    holds in memory and whose pages are cold (0.4 s a read): n2 catches up, and no node's loop
    is blocked for it."""
    import random as _random
    from dledger import entry_store as ES
    from dledger.core import RaftConfig
    from dledger.shell import RaftNode, ShellConfig
    from mqstore.localcluster import free_port
    monkeypatch.setattr(ES, "_CACHE_MAX_BYTES", 16 * 1024)
    peers = {f"n{i}": ("127.0.0.1", free_port()) for i in range(3)}
    disks = {n: ColdDisk("/data/") for n in peers}

    def make(n: str) -> RaftNode:
        store = ES.EntryStore(disks[n], str(tmp_path), n, data_segment_size=1 << 20, index_segment_size=32 * 4096)
        return RaftNode(n, "g", peers, store, RaftConfig(), ShellConfig(tick_ms=20), rng=_random.Random(n))

    async def until(cond, seconds: float) -> bool:
        for _ in range(int(seconds / 0.01)):
            if cond():
                return True
            await asyncio.sleep(0.01)
        return cond()

    async def scenario():
        nodes = {n: make(n) for n in ("n0", "n1")}
        for node in nodes.values():
            await node.start()
        wd = LoopWatchdog(warn_s=0.2, beat_s=0.01)
        try:
            assert await until(lambda: any(x.core.role.name == "LEADER" for x in nodes.values()), 10)
            leader = next(x for x in nodes.values() if x.core.role.name == "LEADER")
            for i in range(30):
                leader.propose([b"%05d" % (i * 10 + k) * 200 for k in range(10)])
                await asyncio.sleep(0)
            last = leader.core.last_index
            assert await until(lambda: leader.core.commit_index >= last, 10)
            for d in disks.values():
                d.cold = True                    # every page written so far leaves the page cache
            wd.start()
            late = nodes["n2"] = make("n2")
            await late.start()
            caught_up = await until(lambda: late.store.last_index() >= last, 15)
            await asyncio.sleep(0.05)            # the watchdog's tick runs and sees any stall
            return caught_up, leader.metrics["push_reads_deferred"], disks[leader.node_id].disk_reads, wd
        finally:
            wd.stop()
            for node in nodes.values():
                await node.stop()

    caught_up, deferred, reads, wd = asyncio.run(scenario())
    assert caught_up, "the follower caught up"
    assert wd.stalls == 0, f"a loop was blocked {wd.stalls} time(s), longest {wd.stalled_s_max:.3f} s"
    assert deferred >= 1 and reads, "the leader read cold entries, off the loop"


def test_cold_read_hot_bytes_is_a_broker_conf_key_with_a_floor(tmp_path, monkeypatch):
    from node.config import ConfigError, load_config
    path = tmp_path / "broker.conf"
    path.write_text(f"storePathRootDir={tmp_path}\ncoldReadHotBytes=0\n")
    assert load_config(str(path)).cold_read_hot_bytes == 0
    monkeypatch.setenv("MQSTORE_coldReadHotBytes", "-1")
    with pytest.raises(ConfigError, match="cold_read_hot_bytes|coldReadHotBytes"):
        load_config(str(path))


def test_regression_a_names_fetch_for_a_directory_deleted_meanwhile_does_nothing(tmp_path):
    """The dispatch has a worker fsync a queue's directory before its second new file
    (`DeferredDirSync.off_loop_first`). A topic deleted while that waits has its queue's directory
    renamed aside: the worker's fsync of the old path must not fail the dispatch."""
    from node.store import cold_reads
    from node.store.fileio import DeferredDirSync, FileSystem
    d = tmp_path / "q"
    d.mkdir()
    names = DeferredDirSync(FileSystem(), str(d))
    names.created()                                   # a first file, its name not durable yet
    with cold_reads.no_disk_waits(), pytest.raises(cold_reads.DiskWait) as e:
        names.off_loop_first()
    os.rename(d, tmp_path / ".deleted-q-0")
    e.value.fetch()
    names.off_loop_first()                            # outside the dispatch: never raises

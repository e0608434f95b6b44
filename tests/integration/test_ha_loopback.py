"""Goal: classic HA end to end inside one process over real loopback sockets: HAService,
HAClient and HALog with real commitlogs on disk. Covers SYNC/ASYNC_MASTER acks, SLAVE
_NOT_AVAILABLE, FLUSH_SLAVE_TIMEOUT, a slave far behind catching up across segments, an
empty slave starting at the master's last segment, the slave's committed position and
queue offsets, and a failover where the old master comes back as a slave and truncates
its unreplicated tail durably. Method: asyncio.run per test, tmp directories, short
timers; the process-level drills (kill -9) live in test_ha_processes.py."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from ha.epoch import FILE_NAME as EPOCH_FILE_NAME
from ha.epoch import EpochFile
from ha.ha_log import MASTER, SLAVE, HALog, HALogConfig
from ha.replication import HATimings
from node.local_log import ASYNC_FLUSH, SYNC_FLUSH, LocalLogConfig
from node.replicated_log import PutStatus
from node.store.errors import NotLeader
from node.store.fileio import FileSystem
from node.store.message import MessageDraft, decode_record
from tests.unit.fsync_hooks import FsyncHooked

SEG = 64 * 1024
FAST = HATimings(heartbeat_interval_ms=200, housekeeping_ms=2000, slave_ack_timeout_ms=1500)


def msg(i: int, size: int = 100, q: int = 0) -> MessageDraft:
    return MessageDraft("T", q, (b"%06d" % i) + b"x" * (size - 6), {"TAGS": "a"}).seal()


def lcfg(flush=ASYNC_FLUSH) -> LocalLogConfig:
    return LocalLogConfig(segment_size_bytes=SEG, flush_disk_type=flush, refuse_check_interval_ms=0)


def master_log(root, sync=True, flush=ASYNC_FLUSH, timings=FAST, fs=None, **kw) -> HALog:
    return HALog(fs or FileSystem(), str(root), lcfg(flush), HALogConfig(
        broker_id=0, initial_role=MASTER, sync_master=sync, ha_listen_host="127.0.0.1", ha_listen_port=0,
        self_api_address="127.0.0.1:1", timings=timings, **kw))


def slave_log(root, master: HALog, flush=ASYNC_FLUSH, broker_id=1, timings=FAST) -> HALog:
    return HALog(FileSystem(), str(root), lcfg(flush), HALogConfig(
        broker_id=broker_id, initial_role=SLAVE, sync_master=True, ha_master_address=f"127.0.0.1:{master.ha_port}",
        master_api_address="127.0.0.1:1", ha_listen_host="127.0.0.1", ha_listen_port=0, timings=timings))


async def until(pred, timeout=10.0, what="condition"):
    for _ in range(int(timeout / 0.02)):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def bodies(log: HALog) -> list[bytes]:
    out, pos = [], log.min_position
    for _ in range(10_000):
        if pos >= log.committed_position:
            break
        batch = log.scan(pos, 1 << 20)
        out += [decode_record(r.data).body[:6] for r in batch.records]
        pos = batch.next_position
    return out


def test_sync_master_acks_after_slave_and_slave_commits_what_it_received(tmp_path):
    async def main():
        m = master_log(tmp_path / "m", flush=SYNC_FLUSH)
        await m.start()
        s = slave_log(tmp_path / "s", m, flush=SYNC_FLUSH)
        await s.start()
        await until(lambda: m.core.best_ack() >= 0, what="slave report")
        res = await m.append([msg(i) for i in range(20)])
        assert all(r.status is PutStatus.SEND_OK for r in res)
        end = res[-1].physical_offset + res[-1].size
        assert m.core.best_ack() >= end
        await until(lambda: s.committed_position == end, what="slave committed")
        assert bodies(s) == bodies(m)
        assert s.queue_offset_of("T", 0) == 20
        with pytest.raises(NotLeader) as ei:
            await s.append([msg(99)])
        assert ei.value.leader == "127.0.0.1:1"
        await s.stop()
        await m.stop()
    asyncio.run(main())


def test_sync_master_without_slave_is_slave_not_available_at_once(tmp_path):
    async def main():
        m = master_log(tmp_path / "m")
        await m.start()
        res = await asyncio.wait_for(m.append([msg(1)]), 1.0)
        assert res[0].status is PutStatus.SLAVE_NOT_AVAILABLE
        assert m.read(res[0].physical_offset, res[0].size)   # stored and readable on the master
        await m.stop()
    asyncio.run(main())


def test_async_master_acks_at_once_without_slave(tmp_path):
    async def main():
        m = master_log(tmp_path / "m", sync=False)
        await m.start()
        res = await m.append([msg(1)])
        assert res[0].status is PutStatus.SEND_OK
        await m.stop()
    asyncio.run(main())


def test_silent_slave_gives_flush_slave_timeout(tmp_path):
    """A slave that connects and reports once, then never acks: FLUSH_SLAVE_TIMEOUT after the timeout."""
    from ha.protocol import encode_report
    from ha.shell import encode_frame, read_frame

    async def main():
        m = master_log(tmp_path / "m")
        await m.start()
        r, w = await asyncio.open_connection("127.0.0.1", m.ha_port)
        w.write(encode_frame({"broker_id": 7, "max_offset": 0}))
        await read_frame(r)
        w.write(encode_report(0))
        await w.drain()
        await until(lambda: m.core.best_ack() == 0, what="fake report")
        res = await m.append([msg(1)])
        assert res[0].status is PutStatus.FLUSH_SLAVE_TIMEOUT
        w.close()
        await m.stop()
    asyncio.run(main())


def test_slave_far_behind_catches_up_across_segments(tmp_path):
    async def main():
        m = master_log(tmp_path / "m", sync=False)
        await m.start()
        for i in range(40):   # ~4 MiB over many 64 KiB segments before any slave exists
            await m.append([msg(i * 10 + k, size=10_000, q=k % 3) for k in range(10)])
        assert len(m.commitlog.files.segments) > 20
        s = slave_log(tmp_path / "s", m)
        # The slave starts non-empty at offset 0 only if it reports something non-zero; an empty one
        # starts at the master's last segment (RocketMQ). Seed it with the first segment to catch up.
        os.makedirs(tmp_path / "s" / "commitlog", exist_ok=True)
        first = m.commitlog.files.segments[0]
        with open(tmp_path / "s" / "commitlog" / os.path.basename(first.path), "wb") as f:
            f.write(m.commitlog.files.read(0, SEG))
        await s.start()
        assert s.commitlog.max_offset > 0
        await until(lambda: s.committed_position == m.committed_position, timeout=20, what="catch up")
        assert bodies(s) == bodies(m)
        assert all(s.queue_offset_of("T", q) == m.queue_offset_of("T", q) for q in range(3))
        await s.stop()
        await m.stop()
    asyncio.run(main())


def test_empty_slave_starts_at_masters_last_segment(tmp_path):
    async def main():
        m = master_log(tmp_path / "m", sync=False)
        await m.start()
        for i in range(30):
            await m.append([msg(i, size=5000)])
        last_base = m.commitlog.files.segments[-1].base
        assert last_base > 0
        s = slave_log(tmp_path / "s", m)
        resets = []
        s.reset_listeners.append(resets.append)   # the broker's dispatcher jumps here (ha.wiring)
        await s.start()
        await until(lambda: s.committed_position == m.committed_position, what="slave tail")
        assert s.min_position == last_base
        # Regression: the slave's dispatcher stayed at 0, below the new first offset, and the
        # node stopped ("position 0 is below the first retained offset").
        assert resets == [last_base]
        await s.stop()
        await m.stop()
    asyncio.run(main())


def test_failover_old_master_returns_as_slave_and_truncates_its_tail(tmp_path):
    async def main():
        a = master_log(tmp_path / "a", sync=True)
        await a.start()
        await a.become_master(epoch=1)
        b = slave_log(tmp_path / "b", a)
        await b.start()
        await until(lambda: a.core.best_ack() >= 0)
        acked = await a.append([msg(i) for i in range(10)])
        assert all(r.status is PutStatus.SEND_OK for r in acked)
        await until(lambda: b.committed_position == a.committed_position)
        # Partition: b stops following; a keeps writing a tail nobody acked.
        await b._stop_client()
        await asyncio.sleep(0.1)
        tail = await a.append([msg(100 + i) for i in range(5)])
        assert all(r.status is PutStatus.SLAVE_NOT_AVAILABLE for r in tail)
        a_end = a.commitlog.max_offset
        # Controller elects b at epoch 2; a is told to follow b.
        await b.become_master(epoch=2)
        after = await b.append([msg(200 + i) for i in range(3)])
        assert all(r.status is PutStatus.SLAVE_NOT_AVAILABLE for r in after)   # a not yet following
        truncated = []
        a.truncate_listeners.append(truncated.append)
        await a.become_slave(f"127.0.0.1:{b.ha_port}", "127.0.0.1:1", epoch=2)
        await until(lambda: a.committed_position == b.committed_position, what="old master resynced")
        assert truncated and truncated[0] < a_end
        assert bodies(a) == bodies(b)
        assert b"000100" not in bodies(a)                   # the unacked tail is gone
        assert [b"%06d" % i for i in range(10)] == bodies(b)[:10]   # every acked message survived
        assert a.queue_offset_of("T", 0) == b.queue_offset_of("T", 0) == 13
        # The epoch a slave holds bytes of goes to its epoch file after the bytes (two fsyncs
        # on a worker): it may lag the committed position a moment.
        await until(lambda: [(e.epoch, e.start_offset) for e in a.epochs.entries] == b.ha_epochs(),
                    what="epoch 2 adopted")
        more = await b.append([msg(300)])
        assert more[0].status is PutStatus.SEND_OK
        await a.stop()
        await b.stop()
        # Durable: the truncated tail does not come back after a restart (RocketMQ #10666).
        a2 = HALog(FileSystem(), str(tmp_path / "a"), lcfg(), HALogConfig(
            broker_id=0, initial_role=SLAVE, ha_master_address="127.0.0.1:1", timings=FAST))
        await a2.start()
        assert b"000100" not in bodies(a2)
        assert EpochFile(FileSystem(), str(tmp_path / "a")).load()[-1].epoch == 2
        await a2.stop()
    asyncio.run(main())


def test_master_restarting_within_its_epoch_continues_it_and_ignores_stale_replies(tmp_path):
    async def main():
        cfg = HALogConfig(broker_id=0, controller_mode=True, sync_master=False, ha_listen_host="127.0.0.1",
                          ha_listen_port=0, self_api_address="127.0.0.1:1", self_ha_address="127.0.0.1:2",
                          timings=FAST)
        m = HALog(FileSystem(), str(tmp_path / "m"), lcfg(), cfg)
        await m.start()
        assert m.role() == SLAVE                       # controller mode: nobody is master until told
        with pytest.raises(NotLeader):
            await m.append([msg(0)])
        reply = {"master_id": 0, "epoch": 1, "master_addr": "127.0.0.1:1", "master_ha_addr": "127.0.0.1:2",
                 "sync_state_set": [0], "controller_leader": True}
        await m.on_controller_reply({**reply, "controller_leader": False})
        assert m.role() == SLAVE                       # a follower controller's word does not promote
        await m.on_controller_reply(reply)
        assert m.role() == MASTER
        await m.append([msg(1)])
        await m.stop()
        m2 = HALog(FileSystem(), str(tmp_path / "m"), lcfg(), cfg)
        await m2.start()
        await m2.on_controller_reply(reply)            # same epoch after a restart: continue it
        assert m2.role() == MASTER and [(e.epoch, e.start_offset) for e in m2.epochs.entries] == [(1, 0)]
        await m2.on_controller_reply({**reply, "master_id": 5, "epoch": 0})   # stale: ignored
        assert m2.role() == MASTER
        hb = m2.controller_heartbeat("g")
        assert hb["epoch"] == 1 and hb["max_offset"] == m2.committed_position and hb["ha_addr"] == "127.0.0.1:2"
        await m2.stop()
    asyncio.run(main())


def test_slave_below_masters_retention_restarts_at_masters_first_segment(tmp_path):
    async def main():
        m = master_log(tmp_path / "m", sync=False)
        await m.start()
        for i in range(40):
            await m.append([msg(i, size=5000)])
        # Seed the slave with the master's first segment, then let retention delete it on the master.
        os.makedirs(tmp_path / "s" / "commitlog", exist_ok=True)
        first = m.commitlog.files.segments[0]
        with open(tmp_path / "s" / "commitlog" / os.path.basename(first.path), "wb") as f:
            f.write(m.commitlog.files.read(0, SEG))
        m.commitlog.delete_head(2 * SEG)
        assert m.min_position == 2 * SEG
        s = slave_log(tmp_path / "s", m)
        truncated = []
        s.truncate_listeners.append(truncated.append)
        await s.start()
        await until(lambda: s.committed_position == m.committed_position, what="slave restarted and caught up")
        assert s.min_position == 2 * SEG and truncated == [0]
        assert bodies(s) == bodies(m)
        await s.stop()
        await m.stop()
    asyncio.run(main())


def test_packed_appends_wait_for_slaves_and_many_waiters_release_in_order(tmp_path):
    """The broker's batched path (append_packed) keeps the SYNC_MASTER rule, and concurrent
    waiters are released by the acks that cover them (the waiter heap), none left behind."""
    async def main():
        m = master_log(tmp_path / "m")
        await m.start()
        status, _, placed = await asyncio.wait_for(m.append_packed([msg(0)]), 1.0)
        assert status is PutStatus.SLAVE_NOT_AVAILABLE and len(placed) == 1
        s = slave_log(tmp_path / "s", m)
        await s.start()
        await until(lambda: m.core.best_ack() >= 0, what="slave report")
        outs = await asyncio.gather(*(m.append_packed([msg(i, q=i % 4) for i in range(8)]) for _ in range(40)))
        assert [o[0] for o in outs] == [PutStatus.SEND_OK] * 40
        ends = sorted(p + n for o in outs for p, n, _ in o[2])
        assert m.core.best_ack() >= ends[-1] and m._waiters == []
        with pytest.raises(NotLeader):
            await s.append_packed([msg(1)])
        await until(lambda: s.committed_position == m.committed_position, what="slave committed")
        assert [s.queue_offset_of("T", q) for q in range(4)] == [81, 80, 80, 80]   # msg(0) went to queue 0 first
        await s.stop()
        await m.stop()
    asyncio.run(main())


def test_waiter_that_times_out_leaves_the_heap(tmp_path):
    async def main():
        m = master_log(tmp_path / "m", timings=HATimings(heartbeat_interval_ms=200, housekeeping_ms=2000,
                                                          slave_ack_timeout_ms=300))
        await m.start()
        m.core.on_report(99, 1, 0, now_ms=0)          # a connected slave that never acks more
        status, _, _ = await m.append_packed([msg(1)])
        assert status is PutStatus.FLUSH_SLAVE_TIMEOUT and m._waiters == []
        await m.stop()
    asyncio.run(main())


def test_regression_demoted_live_master_truncates_and_catches_up(tmp_path, caplog):
    """Regression (docker drill disk_full, group broker-b): the master wrote a record its slave
    never got, lost the leader controller and stepped down while alive; the slave was elected
    at a new epoch; the old master, told by the controller to follow it, must truncate that
    record durably in-process, then hold every acked message and the new master's exact bytes.
    A failure inside that session (here a truncate listener raising) used to end the HA client
    task silently: the slave then replicated nothing, with no log line, until restarted."""
    import logging

    async def main():
        a = master_log(tmp_path / "a", sync=True)              # broker 1, the master
        await a.start()
        await a.become_master(epoch=1)
        b = slave_log(tmp_path / "b", a, broker_id=1)           # the slave
        await b.start()
        await until(lambda: a.core.best_ack() >= 0, what="slave report")
        acked = await a.append([msg(i) for i in range(10)])
        assert all(r.status is PutStatus.SEND_OK for r in acked)
        await until(lambda: b.committed_position == a.committed_position, what="slave in step")
        # The HA link is cut; the master writes one record (a topic config) that never replicates.
        await b._stop_client()
        await until(lambda: not a.core.slaves, what="master sees the link gone")
        lost = await a.append([msg(100, size=60)])
        assert lost[0].status is PutStatus.SLAVE_NOT_AVAILABLE
        a_end, fork = a.commitlog.max_offset, lost[0].physical_offset
        # No word from the leader controller: the live master steps down; the controller elects b.
        await a._step_down()
        assert a.role() == SLAVE and a.step_downs == 1
        await b.become_master(epoch=2)
        for i in range(3):   # stored on the new master; no slave follows it yet
            assert (await b.append([msg(200 + i)]))[0].status is PutStatus.SLAVE_NOT_AVAILABLE
        assert b.ha_epochs() == [(1, 0), (2, fork)]
        truncated, fails = [], [1]

        def listener(offset: int) -> None:
            truncated.append(offset)
            if fails:
                fails.pop()
                raise RuntimeError("consume queue cut failed")    # an error no handler expected
        a.truncate_listeners.append(listener)
        # The controller's word reaches the old master in-process (no restart).
        reply = {"master_id": 1, "epoch": 2, "master_ha_addr": f"127.0.0.1:{b.ha_port}",
                 "master_addr": "127.0.0.1:1", "sync_state_set": [1], "controller_leader": True}
        with caplog.at_level(logging.WARNING, logger="ha"):
            await a.on_controller_reply(reply)
            assert a.role() == SLAVE
            await until(lambda: a.client is not None and a.client.connected and
                        a.committed_position == b.committed_position, timeout=15, what="old master resynced")
        assert truncated[0] == fork < a_end                      # the unreplicated tail was cut
        assert a.client.unexpected_errors == 1
        assert any("failed unexpectedly" in r.getMessage() for r in caplog.records)   # loud, not silent
        # More writes on the new master are acked by the old one (it follows, it does not stall).
        tail = await b.append([msg(300 + i) for i in range(20)])
        assert all(r.status is PutStatus.SEND_OK for r in tail)
        await until(lambda: a.committed_position == b.committed_position, what="follows new writes")
        want = [b"%06d" % i for i in range(10)] + [b"%06d" % (200 + i) for i in range(3)] + \
            [b"%06d" % (300 + i) for i in range(20)]
        assert bodies(a) == bodies(b) == want                    # every acked message, nothing else
        end = b.committed_position
        assert a.commitlog.files.read(0, end) == b.commitlog.files.read(0, end)   # identical committed bytes
        assert [(e.epoch, e.start_offset) for e in a.epochs.entries] == b.ha_epochs()
        await a.stop()
        await b.stop()
        # Durable: after a restart the cut record does not come back and the epochs hold.
        a2 = HALog(FileSystem(), str(tmp_path / "a"), lcfg(), HALogConfig(
            broker_id=0, initial_role=SLAVE, ha_master_address="127.0.0.1:1", timings=FAST))
        await a2.start()
        assert b"000100" not in bodies(a2) and a2.commitlog.max_offset == end
        assert EpochFile(FileSystem(), str(tmp_path / "a")).load() == EpochFile(FileSystem(), str(tmp_path / "b")).load()
        await a2.stop()
    asyncio.run(main())


def test_an_offset_commit_on_a_sync_master_without_slave_answers_its_put_status(tmp_path):
    """An offset commit is a record in the commitlog: on a SYNC_MASTER with no slave it is
    stored and applied on the master, and the answer says its replication is not
    confirmed (SLAVE_NOT_AVAILABLE), as a send's does. Before, the status was dropped and
    the commit answered as if the slave had it."""
    from mqstore.localcluster import free_port
    from node.config import load_config
    from node.server import build_broker
    path = tmp_path / "broker.conf"
    path.write_text("\n".join([f"storePathRootDir={tmp_path / 'store'}", "brokerRole=SYNC_MASTER",
                               "brokerIP1=127.0.0.1", f"haListenPort={free_port()}",
                               "mappedFileSizeCommitLog=1048576", "maxMessageSize=65536"]))

    async def main():
        b = build_broker(load_config(str(path), environ={}))
        await b.start()
        try:
            await b.create_topic("T", 1)
            status = await b.commit_offset("G", "T", 0, 0)
            return status, b.get_offsets("G", "T")
        finally:
            await b.stop()

    status, offsets = asyncio.run(main())
    assert status is PutStatus.SLAVE_NOT_AVAILABLE
    assert offsets == {"T": {0: 0}}


class _SlowEpochWrites(FileSystem):
    """The epoch file's atomic write takes 0.4 s (its fsyncs behind another writer)."""

    def write_atomic(self, path, data):
        if path.endswith(EPOCH_FILE_NAME):
            time.sleep(0.4)
        super().write_atomic(path, data)


def test_regression_a_promotion_writes_its_epoch_off_the_event_loop(tmp_path):
    """A slave promoted to master wrote its new epoch (two fsyncs) on the event loop: 256 ms
    in one run behind another writer. Written by a worker thread now; writes open after it."""
    from node.loop_watchdog import LoopWatchdog

    async def main():
        s = HALog(_SlowEpochWrites(), str(tmp_path / "s"), lcfg(), HALogConfig(
            broker_id=1, initial_role=SLAVE, sync_master=False, ha_master_address="127.0.0.1:9",
            master_api_address="127.0.0.1:1", ha_listen_host="127.0.0.1", ha_listen_port=0, timings=FAST))
        await s.start()
        wd = LoopWatchdog(warn_s=0.2, beat_s=0.01)
        wd.start()
        try:
            await s.become_master(epoch=3)
            res = await s.append([msg(1)])
            await asyncio.sleep(0.05)        # the watchdog's tick runs and sees any stall
        finally:
            wd.stop()
            await s.stop()
        return res, EpochFile(FileSystem(), str(tmp_path / "s")).load(), wd

    res, epochs, wd = asyncio.run(main())
    assert res[0].status is PutStatus.SEND_OK
    assert [(e.epoch, e.start_offset) for e in epochs] == [(3, 0)]
    assert wd.stalls == 0, f"the loop was blocked {wd.stalls} time(s), longest {wd.stalled_s_max:.3f} s"


class _CountedSlowEpochWrites(_SlowEpochWrites):
    def __init__(self):
        self.epoch_writes = 0

    def write_atomic(self, path, data):
        if path.endswith(EPOCH_FILE_NAME):
            self.epoch_writes += 1
        super().write_atomic(path, data)


def test_regression_a_slave_writes_its_epoch_file_off_the_event_loop(tmp_path):
    """An old master returning as a slave truncated its tail and adopted the new master's epoch
    with the epoch file written (two fsyncs) on the event loop, in the HA client's session.
    These writes run on the HA log's epoch thread now, in order: with each taking 0.4 s, the
    loop is never blocked, the tail is cut and the file ends equal to the new master's."""
    from node.loop_watchdog import LoopWatchdog

    async def main():
        fs = _CountedSlowEpochWrites()
        a = master_log(tmp_path / "a", sync=True, fs=fs)
        await a.start()
        await a.become_master(epoch=1)
        b = slave_log(tmp_path / "b", a)
        await b.start()
        await until(lambda: a.core.best_ack() >= 0)
        await a.append([msg(i) for i in range(10)])
        await until(lambda: b.committed_position == a.committed_position)
        await b._stop_client()
        await a.append([msg(100 + i) for i in range(5)])       # a tail nobody acked
        await b.become_master(epoch=2)
        await b.append([msg(200 + i) for i in range(3)])
        writes = fs.epoch_writes
        wd = LoopWatchdog(warn_s=0.2, beat_s=0.01)
        wd.start()
        try:
            await a.become_slave(f"127.0.0.1:{b.ha_port}", "127.0.0.1:1", epoch=2)
            await until(lambda: a.committed_position == b.committed_position and a.ha_epochs() == b.ha_epochs(),
                        what="old master resynced and its epochs adopted")
            await asyncio.sleep(0.05)        # the watchdog's tick runs and sees any stall
        finally:
            wd.stop()
        out = fs.epoch_writes - writes, bodies(a), bodies(b), wd
        await a.stop()
        await b.stop()
        return out

    writes, mine, theirs, wd = asyncio.run(main())
    assert writes >= 1, "the epoch file was written while following"
    assert mine == theirs and b"000100" not in mine
    assert wd.stalls == 0, f"the loop was blocked {wd.stalls} time(s), longest {wd.stalled_s_max:.3f} s"


def test_regression_a_broker_being_promoted_reports_master_only_with_its_new_epoch(tmp_path):
    """A slave being promoted took the MASTER role at once (no push applied from then on) but
    reported its old master epoch until the new one was written: with that write on a worker
    thread (0.4 s here) /cluster said MASTER at an epoch another broker had been master of.
    The new epoch is reported with the role now; and a promotion whose epoch write failed is
    taken again by the next call instead of being skipped as done."""
    class FailingOnceEpochWrites(_SlowEpochWrites):
        failures = 1

        def write_atomic(self, path, data):
            if path.endswith(EPOCH_FILE_NAME) and self.failures:
                self.failures -= 1
                raise OSError(5, "Input/output error (test)")
            super().write_atomic(path, data)

    async def main():
        s = HALog(FailingOnceEpochWrites(), str(tmp_path / "s"), lcfg(), HALogConfig(
            broker_id=1, initial_role=SLAVE, sync_master=False, ha_master_address="127.0.0.1:9",
            master_api_address="127.0.0.1:1", ha_listen_host="127.0.0.1", ha_listen_port=0, timings=FAST))
        await s.start()
        seen = []
        try:
            try:
                await s.become_master(epoch=3)
            except OSError:
                pass
            failed = (s.role(), s.status()["accepting_writes"])
            promotion = asyncio.ensure_future(s.become_master(epoch=3))
            while not promotion.done():
                st = s.status()
                seen.append((st["role"], st["master_epoch"]))
                await asyncio.sleep(0.01)
            await promotion
            st = s.status()
            after = (st["role"], st["master_epoch"], st["accepting_writes"])
            res = await s.append([msg(1)])
        finally:
            await s.stop()
        return failed, seen, after, res

    failed, seen, after, res = asyncio.run(main())
    # A failed promotion accepts no writes, and so is not shown as MASTER either
    # (test_ha_promotion_role.py): MASTER is shown only with writes open, at the new epoch.
    assert failed == ("SLAVE", False)
    assert len(seen) >= 10 and all(e == 3 for role, e in seen if role == "MASTER"), seen[:5]
    assert after == ("MASTER", 3, True)
    assert res[0].status is PutStatus.SEND_OK


class _LoopFsyncs(FsyncHooked):
    """Counts the fsyncs made on the event loop's thread (the main one) while `watching`."""

    def __init__(self):
        self.watching, self.on_loop = False, 0

    def before_fsync(self):
        if self.watching and threading.current_thread() is threading.main_thread():
            self.on_loop += 1


def test_regression_an_old_master_truncates_its_tail_off_the_event_loop(tmp_path):
    """An old master's truncation to where its log agrees with the new master's (the tail
    scanned for its queue offsets, zeroed, fsynced, later files removed) ran on the event loop:
    each fsync took up to 0.3 s on a busy disk, and an unreplicated tail may be hundreds of MB.
    Its file work runs on worker threads now, and the truncation still returns only once
    every listener's cut is settled (the consume queues'), before the old master syncs."""
    async def main():
        fs = _LoopFsyncs()
        a = master_log(tmp_path / "a", sync=False, fs=fs)
        await a.start()
        await a.become_master(epoch=1)
        await a.append([msg(i) for i in range(10)])
        b = slave_log(tmp_path / "b", a)
        await b.start()
        await until(lambda: b.committed_position == a.committed_position, what="slave caught up")
        await b._stop_client()
        tail = await a.append([msg(100 + i, size=3000) for i in range(60)])    # past a segment: files to remove
        a_end = a.commitlog.max_offset
        assert a_end > SEG and tail[-1].physical_offset > SEG
        await b.become_master(epoch=2)
        await b.append([msg(200)])
        settled, order = asyncio.Event(), []

        async def settle():
            await asyncio.sleep(0.05)
            order.append("cut settled")
            settled.set()

        a.truncate_listeners.append(lambda offset: (order.append(offset), settle())[1])
        fs.watching = True
        await a.become_slave(f"127.0.0.1:{b.ha_port}", "127.0.0.1:1", epoch=2)
        await until(lambda: a.committed_position == b.committed_position, what="old master resynced")
        fs.watching = False
        assert fs.on_loop == 0, f"{fs.on_loop} fsync(s) of the truncating old master ran on the event loop"
        assert order[0] < a_end and order[1:] == ["cut settled"], order
        assert bodies(a) == bodies(b) and b"000100" not in bodies(a)
        assert len(a.commitlog.files.segments) == 1
        await a.stop()
        await b.stop()
    asyncio.run(main())

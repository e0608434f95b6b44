"""Retention in DLedger mode: head files deleted, queue offsets, topics and consumer offsets
continue across a restart and across InstallBase.

Goal: `retention_tick` at deleteWhen's hour deletes the expired head data files of every
replica below what it has committed, fsynced and dispatched; the consume queues follow.
A replica restarted on its cut log keeps assigning the queue offsets it would have. A
follower that was down while the others cut past its log is reset to the leader's base
(InstallBase): it takes the leader's queue-offset table, topics and consumer offsets as of
the base, drops its consume queues of the old log, dispatches from the base and, made
leader, continues every queue where the group left it.
A replica whose disk is full to the last block gives up its reserve file to write the base
state, cuts, and puts the reserve back.
Before, a DLedger log was never cut (it grew until the disk guard refused sends), and a
replica reset to a leader's base would have restarted its queue offsets from what its log
still held; and a disk with no block left could not be cut at all.
Method: three brokers in DLedger mode (build_broker, real files and loopback sockets) in one
event loop, 128 KiB data files; retention is ticked by hand with a clock at 04:00 so files
written moments ago count as expired (fileReservedTime=1 hour). Then a group of real node
processes, whose own retention loop (every 10 s) cuts files aged by two hours (os.utime) at
a deleteWhen of this hour; kill -9 of all three and a restart continue the queue; and
`mqstore deleteExpiredCommitLog --all` cuts them at once, twelve hours from deleteWhen's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import io
import os
import threading
import time
from datetime import datetime

from dledger.entry import HEADER_SIZE
from node.broker import OutgoingMessage
from node.config import BrokerConfig
from node.server import build_broker
from node.loop_watchdog import LoopWatchdog
from node.store.fileio import FaultyFileSystem, FileSystem
from node.store.reaper import FileReaper
from tests.integration.dledger_group import DLedgerGroup
from tests.integration.test_dledger_inprocess import free_ports, wait_for
from tests.integration.test_node_process import http
from tests.unit.fsync_hooks import FsyncHooked

IDS = ("n0", "n1", "n2")
SEG = 128 * 1024
AT_DELETE_HOUR = datetime(2099, 1, 1, 4, 0)


def configs(tmp_path) -> dict[str, BrokerConfig]:
    ports = free_ports(2 * len(IDS))
    raft, api = dict(zip(IDS, ports)), dict(zip(IDS, ports[len(IDS):]))
    peers = ";".join(f"{n}-127.0.0.1:{p}" for n, p in raft.items())
    apis = ";".join(f"{n}-127.0.0.1:{p}" for n, p in api.items())
    return {n: BrokerConfig(store_path_root_dir=str(tmp_path / n), listen_port=api[n], enable_dleger_commit_log=True,
                            dleger_group="g", dleger_peers=peers, dleger_peer_apis=apis, dleger_self_id=n,
                            mapped_file_size_commit_log=SEG, max_message_size=4096, file_reserved_time_hours=1,
                            delete_when="04", slave_read_enable=True).validate()
            for n in IDS}


async def start(cfg: BrokerConfig):
    b = build_broker(cfg)
    await b.start()
    return b


async def started_group(tmp_path) -> tuple[dict[str, BrokerConfig], dict, str]:
    """Three brokers on real files, started; (their configs, the brokers, the leader)."""
    cfg = configs(tmp_path)
    brokers = {n: await start(cfg[n]) for n in IDS}
    try:
        return cfg, brokers, await leader_of(brokers)
    except BaseException:
        await stop_all(brokers)
        raise


async def started_on(cfg: dict[str, BrokerConfig], fss: dict) -> dict:
    """Three brokers, each on its own file system, started."""
    brokers = {}
    for n in IDS:
        brokers[n] = build_broker(cfg[n], fs=fss[n])
        await brokers[n].start()
    return brokers


async def stop_all(brokers: dict) -> None:
    for b in brokers.values():
        if b.log.node.core is not None and b.log.node._running:
            await b.stop()


async def leader_of(brokers: dict, among=None):
    await wait_for(lambda: any(brokers[n].log.is_writable for n in (among or brokers)), timeout=10)
    return next(n for n in (among or brokers) if brokers[n].log.is_writable)


async def send(b, topic: str, n: int, tag: str) -> list:
    out = []
    for i in range(0, n, 20):
        out += await b.send(topic, [OutgoingMessage(f"{tag}{k}".encode() * 200, queue_id=k % 2)
                                    for k in range(i, min(n, i + 20))])
    return out


async def settled(brokers: dict, names) -> None:
    """Every named replica has committed, dispatched and checkpointed the leader's log."""
    top = max(brokers[n].log.commit_index for n in names)

    def done(n):
        lg = brokers[n].log
        return (lg.commit_index >= top and brokers[n].dispatcher.position >= lg.committed_position
                and lg.store.meta.durable_mark >= top)
    await wait_for(lambda: all(done(n) for n in names), timeout=10)


def data_files(b) -> list[str]:
    return sorted(os.listdir(b.log.store.data.directory))


async def cut(b) -> None:
    """One pass of the broker's retention loop, at deleteWhen's hour; then the node's reaper
    thread removes the files (node/store/reaper.py)."""
    await b.log.retention_tick(AT_DELETE_HOUR)
    b.cq_store.delete_expired(b.log.min_physical_offset)
    if b.fs.reaper is not None:
        assert await asyncio.to_thread(b.fs.reaper.drain, 10)


def test_retention_cuts_every_replica_and_a_reset_follower_continues_the_queues(tmp_path):
    async def main():
        cfg, brokers, lead = await started_group(tmp_path)
        try:
            down = next(n for n in IDS if n != lead)
            other = next(n for n in IDS if n not in (lead, down))
            await brokers[lead].create_topic("T", 2)
            await brokers[lead].create_topic("V", 1)
            await brokers[lead].send("V", [OutgoingMessage(b"v", queue_id=0)] * 3)   # V is never written again
            await send(brokers[lead], "T", 200, "a")
            await settled(brokers, IDS)
            await brokers[down].stop()
            behind = brokers[down].log.store.last_index()

            # While `down` is away: a topic and an offset whose records retention will cut.
            await brokers[lead].create_topic("U", 1)
            await brokers[lead].commit_offset("G", "T", 1, 37)
            await send(brokers[lead], "T", 600, "b")
            await settled(brokers, (lead, other))
            before = {n: data_files(brokers[n]) for n in (lead, other)}
            for n in (lead, other):
                await cut(brokers[n])
                lg = brokers[n].log
                assert len(data_files(brokers[n])) <= len(before[n]) - 3, "expired head files deleted"
                assert lg.store.first_index() > behind + 1, "cut past the stopped follower's log"
                assert brokers[n].cq_store.get("T", 0).min_offset > 0, "consume queues follow the log's head"
            base = brokers[lead].log.store.first_index() - 1
            table = brokers[lead].log._applied_table.snapshot()
            assert table[("T", 0)] == table[("T", 1)] == 400 and table[("V", 0)] == 3

            # The follower returns below the leader's base: InstallBase, then it catches up.
            brokers[down] = await start(cfg[down])
            d = brokers[down]
            await settled(brokers, IDS)
            assert d.log.store.first_index() > behind + 1 and d.log.store.start_pos > 0
            assert d.log._applied_table.snapshot() == brokers[lead].log._applied_table.snapshot()
            assert "U" in d.topics and d.offsets.get("T@G", {}).get(1) == 37
            for q in (0, 1):
                mine, theirs = d.cq_store.get("T", q), brokers[lead].cq_store.get("T", q)
                assert mine.max_offset == theirs.max_offset == 400
                got = await d.pull("T", q, 395, 10)
                want = await brokers[lead].pull("T", q, 395, 10)
                assert [m.body for m in got.messages] == [m.body for m in want.messages] and len(got.messages) == 5

            # Made leader, it continues every queue where the group left it.
            brokers[lead].log.node.transfer_leadership(down)
            assert await leader_of(brokers, among=[down]) == down
            res = await send(d, "T", 4, "c")
            assert [r.queue_offset for r in res] == [400, 400, 401, 401]
            assert [r.queue_offset for r in await d.send("V", [OutgoingMessage(b"v", queue_id=0)])] == [3]

            # A replica restarted on its cut log recovers the same table from its base state.
            await brokers[other].stop()
            assert brokers[other].log.store.first_index() - 1 >= base
            brokers[other] = await start(cfg[other])
            await settled(brokers, IDS)
            assert brokers[other].log._applied_table.snapshot() == d.log._applied_table.snapshot()
        finally:
            await stop_all(brokers)

    asyncio.run(main())


async def left_below_the_base(brokers: dict, lead: str) -> tuple[str, str, int]:
    """A follower stopped while the others write 600 more messages and cut their logs past
    where it stopped: (that follower, the other one, its last index)."""
    down = next(n for n in IDS if n != lead)
    other = next(n for n in IDS if n not in (lead, down))
    await brokers[lead].create_topic("T", 2)
    await send(brokers[lead], "T", 200, "a")
    await settled(brokers, IDS)
    await brokers[down].stop()
    behind = brokers[down].log.store.last_index()
    await send(brokers[lead], "T", 600, "b")
    await settled(brokers, (lead, other))
    for n in (lead, other):
        await cut(brokers[n])
    assert brokers[lead].log.store.first_index() > behind + 1
    return down, other, behind


async def same_tail(b, leader) -> None:
    """`b` serves the last 3 messages of each queue of T as `leader` does (after 402 sent)."""
    for q in (0, 1):
        got = await b.pull("T", q, 398, 10)
        want = await leader.pull("T", q, 398, 10)
        assert [m.body for m in got.messages] == [m.body for m in want.messages] and len(got.messages) == 3


class NoRoomForABase(FileSystem):
    """A disk with no room for a base's state file while `full` (every other write fits);
    removals on a reaper thread, as a node's real file system."""

    def __init__(self):
        self.full, self.refused = True, 0
        self.reaper = FileReaper()

    def write_atomic(self, path, data):
        if self.full and os.path.basename(path).startswith("base-"):
            self.refused += 1
            raise OSError(errno.ENOSPC, "injected ENOSPC", path)
        super().write_atomic(path, data)


def test_regression_a_reset_on_a_full_disk_waits_for_room_and_then_completes(tmp_path, caplog):
    """A follower back below the leader's base is reset to it (InstallBase): the base's state
    file and meta first, then every old file goes. With no room for the state file, even
    after giving up the reserve, the reset stopped the node for good (StoreFatal), though the
    files it would have freed were its own. Now the reset is held and tried again each second
    (to the group a paused follower; its status names the stall), and it completes once there
    is room."""
    async def main():
        cfg, brokers, lead = await started_group(tmp_path)
        try:
            down, other, behind = await left_below_the_base(brokers, lead)

            fs = NoRoomForABase()
            d = brokers[down] = build_broker(cfg[down], fs=fs)
            await d.start()
            await wait_for(lambda: fs.refused >= 4 or d.log.node.fatal is not None, timeout=10)   # tried again
            assert d.log.node.fatal is None, f"the follower stopped on the full disk: {d.log.node.fatal}"
            assert "full" in d.log.node.status()["stalled_on_disk"]
            assert d.log.store.first_index() <= behind, "the old log is served until the reset"
            res = await send(brokers[lead], "T", 2, "c")            # the group goes on without it
            assert [r.queue_offset for r in res] == [400, 400]

            fs.full = False
            await settled(brokers, IDS)
            assert d.log.store.first_index() > behind + 1 and d.log.node.status()["stalled_on_disk"] is None
            assert "the reset written after" in caplog.text
            await same_tail(d, brokers[lead])
        finally:
            await stop_all(brokers)

    asyncio.run(main())


class NoRoomForMeta(NoRoomForABase):
    """No room for the Raft meta file (term and vote, the base it names) either while `full`."""

    def write_atomic(self, path, data):
        if self.full and os.path.basename(path) == "meta":
            self.refused += 1
            raise OSError(errno.ENOSPC, "injected ENOSPC", path)
        super().write_atomic(path, data)


def test_a_follower_back_under_a_new_term_on_a_full_disk_waits_for_room_for_its_term_and_base(tmp_path):
    """A follower returns below the leader's base after the group changed leader: it must
    store the new term, then take the leader's base (InstallBase), and its disk has no room
    for the meta file that both write, nor for the base's state file. It neither stops nor
    answers as if it had stored them: it waits, paused to the group, and once there is room it
    takes the term and the base and catches up. (The term comes in a Ready of its own, before
    the reset: a Ready carrying both is not made here.)"""
    async def main():
        cfg, brokers, lead = await started_group(tmp_path)
        try:
            down, other, behind = await left_below_the_base(brokers, lead)
            old_term = brokers[down].log.store.meta.term
            brokers[lead].log.node.transfer_leadership(other)
            assert await leader_of(brokers, among=[other]) == other
            term = brokers[other].log.node.core.term
            assert term > old_term and brokers[other].log.store.first_index() > behind + 1

            fs = NoRoomForMeta()
            d = brokers[down] = build_broker(cfg[down], fs=fs)
            await d.start()
            await wait_for(lambda: fs.refused >= 4 or d.log.node.fatal is not None, timeout=10)
            assert d.log.node.fatal is None, f"the follower stopped on the full disk: {d.log.node.fatal}"
            assert "full" in (d.log.node.status()["stalled_on_disk"] or "")
            assert d.log.store.meta.term < term, "no term is taken that is not stored"
            res = await send(brokers[other], "T", 2, "c")           # the group goes on without it
            assert [r.queue_offset for r in res] == [400, 400]
            await asyncio.sleep(1.0)                                # and it keeps waiting
            assert d.log.node.fatal is None and d.log.node.status()["stalled_on_disk"]
            assert d.log.store.meta.term < term and d.log.store.first_index() <= behind

            fs.full = False
            await settled(brokers, IDS)
            assert d.log.store.meta.term == brokers[other].log.store.meta.term
            assert d.log.store.first_index() > behind + 1 and d.log.node.status()["stalled_on_disk"] is None
            await same_tail(d, brokers[other])
        finally:
            await stop_all(brokers)

    asyncio.run(main())


def test_regression_an_idle_dispatcher_holds_back_no_cut(tmp_path):
    """A cut stops below what the dispatcher has dispatched, which the log learnt from the
    position each scan starts at. A dispatcher caught up with an idle log scans no more, so
    the files its last batch spanned stayed, aged or not, until new writes came: under load
    (a big last batch) a node process of the retention test below kept two expired files for
    good. Now a dispatcher waiting for new commits marks its position too."""
    async def main():
        cfg, brokers, lead = await started_group(tmp_path)
        try:
            b = brokers[lead]
            await b.create_topic("T", 2)
            await send(b, "T", 600, "a")
            await settled(brokers, IDS)
            for n in IDS:
                lg = brokers[n].log
                try:
                    await wait_for(lambda: lg._scan_floor == lg.committed_position, timeout=5)
                except AssertionError:
                    raise AssertionError(f"{n}: the dispatch floor stayed at {lg._scan_floor}, below the "
                                         f"committed end {lg.committed_position}") from None
            before = data_files(b)
            await cut(b)
            assert data_files(b) == before[-1:], "every file but the one being written goes"
        finally:
            await stop_all(brokers)

    asyncio.run(main())


def test_regression_a_corrupt_entry_no_peer_keeps_goes_with_its_file_and_blocks_nothing(tmp_path):
    """A follower found a bit flipped in an old entry after both peers had cut past it: no peer
    could send it, the repair was retried forever and the node never campaigned again; and while
    the damage was known no data file took a queue-offset table, so its retention could never
    cut the file away ("no queue-offset table for it", found by the random-fault runs). Now the
    table is taken unless an entry it lacks (skipped when applied) precedes it, and a cut drops
    the corrupt ranges of the files it deleted."""
    async def main():
        _, brokers, lead = await started_group(tmp_path)
        try:
            f = next(n for n in IDS if n != lead)
            await brokers[lead].create_topic("T", 2)
            await send(brokers[lead], "T", 600, "a")
            await settled(brokers, IDS)
            for n in IDS:
                if n != f:
                    await cut(brokers[n])
            fl = brokers[f].log
            idx = fl.store.first_index() + 3
            assert min(brokers[n].log.store.first_index() for n in IDS if n != f) > idx, "the peers cut past it"
            e = fl.store.entry_at(idx)
            path = fl.store.data.segment_for(e.pos).path
            rel = e.pos - fl.store.data.segment_for(e.pos).base + HEADER_SIZE + 100
            with open(path, "r+b") as fh:
                fh.seek(rel)
                byte = fh.read(1)[0]
                fh.seek(rel)
                fh.write(bytes([byte ^ 0x10]))
            fl.store.data.forget_fetched()
            assert brokers[f].scrubber.scrub_pass(), "the scrubber finds the flip"
            assert fl.node.core.campaign_blocked
            await wait_for(lambda: fl.repairer.failures >= 2, timeout=15)    # every peer refuses: cut past it
            assert len(fl.corruption) == 1
            assert fl.repairer.metrics["gone_everywhere"] == 1            # their answers say so: asked rarely now
            await send(brokers[lead], "T", 300, "b")      # files folded while the damage is known
            await settled(brokers, IDS)
            before = data_files(brokers[f])
            await cut(brokers[f])
            assert len(data_files(brokers[f])) < len(before) and fl.store.first_index() > idx
            assert len(fl.corruption) == 0 and not fl.node.core.campaign_blocked
            got = await brokers[f].pull("T", 1, 449, 1)
            assert [m.body for m in got.messages] == [b"b299" * 200]
        finally:
            await stop_all(brokers)

    asyncio.run(main())


class SlowFsync(FsyncHooked):
    """Every file and directory fsync takes SLOW_FSYNC_S once `slow` is set; removals on a
    reaper thread, as a node's real file system."""

    def __init__(self):
        self.slow = False
        self.slow_fsyncs = 0
        self.reaper = FileReaper()

    def before_fsync(self):
        if self.slow:
            self.slow_fsyncs += 1
            time.sleep(SLOW_FSYNC_S)


SLOW_FSYNC_S = 0.25


def test_regression_a_cut_on_a_slow_disk_does_not_stall_the_event_loop(tmp_path):
    """Retention's new base (state file and meta: four fsyncs, after any flush in progress)
    was written on the event loop: with every fsync taking 250 ms the loop stopped for about
    a second at each cut, longer than the election timeout, so a leader's cut could cost it
    its leadership. Now the writes run on a worker thread; a watchdog on the loop (the three
    brokers share it) warns of any stall over 150 ms."""
    async def main():
        cfg = configs(tmp_path)
        fss = {n: SlowFsync() for n in IDS}
        brokers = await started_on(cfg, fss)
        try:
            lead = await leader_of(brokers)
            b = brokers[lead]
            await b.create_topic("T", 2)
            await send(b, "T", 600, "a")
            await settled(brokers, IDS)
            before = data_files(b)
            term = b.log.node.core.term
            fss[lead].slow = True
            wd = LoopWatchdog(warn_s=0.15, beat_s=0.01)
            wd.start()
            try:
                await cut(b)
                await asyncio.sleep(0.05)        # the watchdog's tick runs and sees any stall
            finally:
                wd.stop()
                fss[lead].slow = False
            assert len(data_files(b)) <= len(before) - 3, f"expired head files deleted: {before}"
            assert fss[lead].slow_fsyncs >= 4, "the new base was written durably (state file and meta)"
            assert wd.stalls == 0, f"the loop was blocked {wd.stalls} time(s), longest {wd.stalled_s_max:.3f} s"
            assert b.log.is_writable and b.log.node.core.term == term, "the leader kept its term"
            res = await send(b, "T", 2, "b")
            assert [r.queue_offset for r in res] == [300, 300]
            first = b.log.store.first_index()
            await b.stop()
            brokers[lead] = await start(cfg[lead])             # recovers at the base it wrote
            await settled(brokers, IDS)
            assert brokers[lead].log.store.first_index() == first
        finally:
            await stop_all(brokers)

    asyncio.run(main())


class GatedFsync(FsyncHooked):
    """Once `hold` names a directory, fsyncs of its files (and of it) wait at `gate`; removals
    on a reaper thread, as a node's real file system."""

    def __init__(self):
        self.hold = ""
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()
        self.reaper = FileReaper()

    def before_fsync_of(self, path):
        if self.hold and path.startswith(self.hold) and not self.gate.is_set():
            self.entered.set()
            assert self.gate.wait(10)


def test_regression_retentions_cut_never_waits_on_the_event_loop_for_a_flush(tmp_path):
    """Retention's cut takes the base in memory and closes the files below it on the event
    loop, after the new base is written on a worker. A flush that started in between (group
    commit, or the periodic flusher) holds the data files across its fsync, and the cut waited
    for it there: for as long as the fsync took, with every Raft timer of the node waiting
    too. Now no flush starts from the base's writing to the cut (the shell's disk gate)."""
    async def main():
        cfg = {n: dataclasses.replace(c, flush_disk_type="SYNC_FLUSH").validate() for n, c in configs(tmp_path).items()}
        fss = {n: GatedFsync() for n in IDS}
        brokers = await started_on(cfg, fss)
        try:
            lead = await leader_of(brokers)
            b, fs = brokers[lead], fss[lead]
            await b.create_topic("T", 2)
            await send(b, "T", 600, "a")
            await settled(brokers, IDS)
            store, loop, term = b.log.store, asyncio.get_running_loop(), b.log.node.core.term
            write_base = store.write_base

            def write_base_then_a_flush_is_wanted(new):
                write_base(new)
                fs.hold = store.data.directory
                fs.gate.clear()
                threading.Timer(3.0, fs.gate.set).start()   # were the loop to wait, only this frees it
                sending.append(asyncio.run_coroutine_threadsafe(send(b, "T", 2, "c"), loop))  # a group commit
                fs.entered.wait(1.0)         # the flush's fsync under way (it was, before the fix)

            sending: list = []
            store.write_base = write_base_then_a_flush_is_wanted
            before = data_files(b)
            await b.log.retention_tick(AT_DELETE_HOUR)
            assert not fs.gate.is_set(), "retention's cut waited on the loop for a flush's fsync"
            fs.gate.set()
            assert [r.queue_offset for r in await asyncio.wrap_future(sending[0])] == [300, 300]
            assert await asyncio.to_thread(fs.reaper.drain, 10)
            assert len(data_files(b)) <= len(before) - 3, f"expired head files deleted: {before}"
            assert b.log.is_writable and b.log.node.core.term == term, "the leader kept its term"
            res = await send(b, "T", 2, "b")
            assert [r.queue_offset for r in res] == [301, 301]
        finally:
            for fs in fss.values():
                fs.gate.set()
            await stop_all(brokers)

    asyncio.run(main())


def test_a_replica_whose_disk_is_full_to_the_last_block_still_cuts_by_giving_up_its_reserve(tmp_path, caplog):
    """Regression: a replica whose disk had no block left could not write the base state a cut
    needs first, so retention deleted nothing there and its disk stayed full for good. Now
    the store's reserve (diskReserveBytes) is given up for that write and put back from
    the room the cut makes. A replica without a reserve is the contrast: nothing deleted."""
    async def main():
        cfg = configs(tmp_path)
        cfg["n2"] = dataclasses.replace(cfg["n2"], disk_reserve_bytes=0)
        fs = {n: FaultyFileSystem(40 + k) for k, n in enumerate(IDS)}
        brokers = {n: build_broker(cfg[n], fs[n]) for n in IDS}
        for b in brokers.values():
            await b.start()
        try:
            lead = await leader_of(brokers)
            await brokers[lead].create_topic("T", 2)
            await send(brokers[lead], "T", 600, "a")
            await settled(brokers, IDS)
            assert os.path.getsize(brokers["n0"].log.store.reserve.path) == cfg["n0"].disk_reserve_bytes
            for n in ("n0", "n2"):
                fs[n].write_budget_bytes = 0          # not one block left on these two disks
                before = data_files(brokers[n])
                await cut(brokers[n])
                after = data_files(brokers[n])
                if n == "n0":
                    assert len(after) <= len(before) - 3, "expired head files deleted on a full disk"
                    assert brokers[n].log.store.first_index() > 1
                    assert os.path.getsize(brokers[n].log.store.reserve.path) == cfg[n].disk_reserve_bytes
                else:
                    assert after == before, "no reserve: the base state cannot be written, nothing deleted"
            assert "reserve is given up" in caplog.text
            assert "retention could not write the new base" in caplog.text
        finally:
            for f in fs.values():
                f.write_budget_bytes = None
            await stop_all(brokers)

    asyncio.run(main())


# --- real node processes ------------------------------------------------------------------------


def _wait(pred, timeout_s: float, what: str, g: DLedgerGroup):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out: {what}\n{g.tails()}")


def _queue(g: DLedgerGroup, n: str) -> dict:
    try:
        st, doc = http(g.api[n], "GET", "/topics/R", timeout=2)
    except OSError:
        return {}
    return doc["queues"][0] if st == 200 else {}


def _retention_group(tmp_path) -> DLedgerGroup:
    """256 KiB data files, expired after an hour, deleted at this hour (or the next)."""
    hour = datetime.now().hour
    return DLedgerGroup(tmp_path, extra=f"mappedFileSizeCommitLog={256 * 1024}\nfileReservedTime=1\n"
                                        f"deleteWhen={hour:02d};{(hour + 1) % 24:02d}\n").start()


def _send_r(g: DLedgerGroup, leader: str, lo: int, hi: int) -> None:
    for i in range(lo, hi, 100):
        st, doc = http(g.api[leader], "POST", "/topics/R/messages",
                       {"messages": [{"body": _body(j), "queue_id": 0} for j in range(i, min(hi, i + 100))]})
        assert st == 200 and all(r["status"] == "SEND_OK" for r in doc["results"]), doc


def _body(j: int) -> str:
    return f"r{j:05d}" + "x" * 1000


def _age_head_files(g: DLedgerGroup, nodes) -> dict[str, str]:
    """Every data file but the one being written, last modified two hours ago; the data dirs."""
    dirs = {x: os.path.join(os.path.dirname(g.nodes[x].conf), "store", f"dledger-{x}", "data") for x in nodes}
    aged = time.time() - 2 * 3600
    for d in dirs.values():
        files = sorted(os.listdir(d))
        assert len(files) >= 4, files
        for f in files[:-1]:
            os.utime(os.path.join(d, f), (aged, aged))
    return dirs


def test_delete_expired_commitlog_cuts_every_replica_at_once_outside_the_delete_hour(tmp_path):
    from mqstore import cli
    hour = datetime.now().hour
    g = DLedgerGroup(tmp_path, extra=f"mappedFileSizeCommitLog={256 * 1024}\nfileReservedTime=1\n"
                                     f"deleteWhen={(hour + 12) % 24:02d}\n").start()
    try:
        leader = g.leader()
        assert http(g.api[leader], "POST", "/topics", {"topic": "R", "queues": 1})[0] == 200
        _send_r(g, leader, 0, 1200)
        _wait(lambda: all(_queue(g, x).get("max_offset") == 1200 for x in g.nodes), 30, "every replica dispatched", g)
        data = _age_head_files(g, g.nodes)
        before = {x: len(os.listdir(data[x])) for x in g.nodes}
        time.sleep(1.5)     # a pass cuts only below the durable mark, checkpointed about once a second
        out = io.StringIO()
        assert cli.main(["deleteExpiredCommitLog", "--all", "-n", f"127.0.0.1:{g.api[leader]}"], out=out) == 0
        assert out.getvalue().count(": success (the next 20 retention passes") == 3, out.getvalue()
        # The pass runs at once, not at the next 10 s period nor at deleteWhen's hour (12 hours off).
        _wait(lambda: all(_queue(g, x).get("min_offset", 0) > 0 and len(os.listdir(data[x])) < before[x]
                          for x in g.nodes), 8, "every replica cut its expired head at once", g)
        st, doc = http(g.api[leader], "POST", "/topics/R/messages", {"messages": [{"body": "after", "queue_id": 0}]})
        assert st == 200 and doc["results"][0]["queue_offset"] == 1200, doc
    finally:
        g.close()


def test_node_processes_cut_expired_files_and_continue_the_queue_after_a_kill9_of_all(tmp_path):
    g = _retention_group(tmp_path)
    try:
        leader = g.leader()
        assert http(g.api[leader], "POST", "/topics", {"topic": "R", "queues": 1})[0] == 200
        assert http(g.api[leader], "POST", "/topics", {"topic": "S", "queues": 1})[0] == 200
        st, _ = http(g.api[leader], "POST", "/topics/S/messages", {"messages": [{"body": "s", "queue_id": 0}] * 5})
        assert st == 200                      # S is never written again: its messages all go with the cut
        n = 1200
        _send_r(g, leader, 0, n)
        _wait(lambda: all(_queue(g, x).get("max_offset") == n for x in g.nodes), 30, "every replica dispatched", g)
        data = _age_head_files(g, g.nodes)
        # A pass cuts only below a replica's durable mark, checkpointed about once a second: a
        # pass just after the last send may leave a file for the next pass, 10 s later.
        _wait(lambda: all(_queue(g, x).get("min_offset", 0) > 0 and len(os.listdir(data[x])) <= 2 for x in g.nodes),
              40, "every replica's retention loop cut its expired head and the consume queue followed", g)
        heads = {x: _queue(g, x)["min_offset"] for x in g.nodes}
        for x in g.nodes:
            g.kill9(x)
        for p in g.nodes.values():
            p.launch()
        for p in g.nodes.values():
            p.wait_healthy(30.0, statuses=(200, 503))
        leader = g.leader()
        st, doc = http(g.api[leader], "POST", "/topics/R/messages", {"messages": [{"body": "after", "queue_id": 0}]})
        assert st == 200 and doc["results"][0]["queue_offset"] == n, doc
        st, doc = http(g.api[leader], "POST", "/topics/S/messages", {"messages": [{"body": "s", "queue_id": 0}]})
        assert st == 200 and doc["results"][0]["queue_offset"] == 5, doc   # not restarted from what the log holds
        _wait(lambda: all(_queue(g, x).get("max_offset") == n + 1 for x in g.nodes), 30, "the new message dispatched", g)
        for x in g.nodes:
            assert _queue(g, x)["min_offset"] == heads[x]
            st, doc = http(g.api[x], "GET", f"/topics/R/queues/0/messages?offset={n - 2}&max=8")
            assert st == 200 and [m["body"] for m in doc["messages"]] == [_body(n - 2), _body(n - 1), "after"]
    finally:
        g.close()


def test_a_node_process_that_was_down_while_the_others_cut_is_reset_to_the_leaders_base(tmp_path):
    g = _retention_group(tmp_path)
    try:
        leader = g.leader()
        down = next(x for x in g.nodes if x != leader)
        live = [x for x in g.nodes if x != down]
        assert http(g.api[leader], "POST", "/topics", {"topic": "R", "queues": 1})[0] == 200
        _send_r(g, leader, 0, 200)
        _wait(lambda: all(_queue(g, x).get("max_offset") == 200 for x in g.nodes), 30, "every replica dispatched", g)
        g.kill9(down)
        _send_r(g, leader, 200, 1400)
        _wait(lambda: all(_queue(g, x).get("max_offset") == 1400 for x in live), 30, "the live replicas dispatched", g)
        _age_head_files(g, live)
        _wait(lambda: all(_queue(g, x).get("min_offset", 0) > 200 for x in live), 40,
              "the live replicas cut past everything the stopped one holds", g)
        g.nodes[down].launch()
        g.nodes[down].wait_healthy(30.0, statuses=(200, 503))
        _wait(lambda: _queue(g, down).get("max_offset") == 1400, 30, "the returning replica caught up", g)
        assert "log reset to the leader's base" in g.nodes[down].tail(400_000)
        assert _queue(g, down)["min_offset"] == _queue(g, leader)["min_offset"] > 200
        tail = [_body(j) for j in range(1392, 1400)]
        for x in g.nodes:
            st, doc = http(g.api[x], "GET", "/topics/R/queues/0/messages?offset=1392&max=8")
            assert st == 200 and [m["body"] for m in doc["messages"]] == tail, x
    finally:
        g.close()

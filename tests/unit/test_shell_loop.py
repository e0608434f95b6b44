"""The Raft shell never wedges silently: a failure inside a round stops the node loudly.

Regression: an exception other than StoreError raised while a Ready was outstanding ended
the Raft task without a trace; every later propose then failed the core's "call advance()
first" assertion, an HTTP 500 per send while the node still looked healthy.
Method: a one-node group on a free loopback port whose listener raises in on_ready.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from dledger.core import RaftConfig
from dledger.entry_store import EntryStore
from dledger.shell import RaftNode, ShellConfig
from mqstore.localcluster import free_port
from node.store.errors import StoreFatal
from node.store.fileio import FileSystem
from tests.loop_lag import LoopLag
from tests.unit.fsync_hooks import FsyncHooked


async def _until(cond, tries: int = 300) -> None:
    """Poll `cond` every 10 ms, at most `tries` times; the caller asserts what it needs."""
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(0.01)


def one_node(tmp_path) -> RaftNode:
    """A group of one on a free loopback port, ticking every 10 ms (not started)."""
    store = EntryStore(FileSystem(), str(tmp_path), "n0", data_segment_size=1 << 16, index_segment_size=32 * 64)
    return RaftNode("n0", "g", {"n0": ("127.0.0.1", free_port())}, store, RaftConfig(),
                    ShellConfig(tick_ms=10), rng=random.Random(1))


class Exploding:
    def __init__(self):
        self.armed = False
        self.fatal: BaseException | None = None

    def on_recovered(self, node):
        pass

    def on_truncated(self, from_index):
        pass

    def on_ready(self, ready):
        if self.armed:
            raise RuntimeError("listener bug")

    def on_fatal(self, error):
        self.fatal = error


def test_a_failing_round_stops_the_node_instead_of_wedging_it(tmp_path):
    async def scenario():
        node = one_node(tmp_path)
        listener = node.listener = Exploding()
        await node.start()
        try:
            await _until(lambda: node.core.role.name == "LEADER" and node.core.commit_index >= node.core.last_index)
            assert node.core.role.name == "LEADER"
            listener.armed = True
            node.propose([b"x"])
            await _until(lambda: node.fatal is not None)
            assert isinstance(node.fatal, RuntimeError)
            assert listener.fatal is node.fatal
            with pytest.raises(StoreFatal):
                node.propose([b"y"])
        finally:
            await node.stop()

    asyncio.run(scenario())


class GatedFile:
    """An OsFile whose fsync of data files waits for the test to open the gate."""

    def __init__(self, inner, gate):
        self._inner, self._gate = inner, gate

    def fsync(self):
        assert self._gate.wait(10), "the test never opened the fsync gate"
        self._inner.fsync()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class GatedFileSystem(FileSystem):
    def __init__(self):
        import threading
        self.gate = threading.Event()
        self.gate.set()

    def open(self, path):
        handle = super().open(path)
        return GatedFile(handle, self.gate) if "/data/" in path else handle


def test_sync_flush_commits_only_after_the_group_fsync_lands(tmp_path):
    """SYNC_FLUSH with the fsync on a worker thread: a proposed entry is written at once but
    counts toward the commit only when the flusher's fsync returns."""
    async def scenario():
        fs = GatedFileSystem()
        store = EntryStore(fs, str(tmp_path), "n0", data_segment_size=1 << 16, index_segment_size=32 * 64)
        node = RaftNode("n0", "g", {"n0": ("127.0.0.1", free_port())}, store, RaftConfig(),
                        ShellConfig(tick_ms=10, flush_disk_type="SYNC_FLUSH"), rng=random.Random(1))
        await node.start()
        try:
            await _until(lambda: node.core.role.name == "LEADER" and node.core.commit_index >= node.core.last_index)
            assert node.core.role.name == "LEADER"
            fs.gate.clear()
            _first, last = node.propose([b"a", b"b", b"c"])
            await asyncio.sleep(0.3)
            assert store.last_index() == last, "written at once"
            assert node.core.commit_index < last, "committed before its fsync returned"
            assert node.core.durable_index < last
            fs.gate.set()
            await _until(lambda: node.core.commit_index >= last)
            assert node.core.commit_index >= last
            assert store.flushed_index >= last
            assert node.metrics["fsyncs"] >= 1
        finally:
            fs.gate.set()
            await node.stop()

    asyncio.run(scenario())



class Recording:
    def __init__(self, events):
        self.events = events

    def on_recovered(self, node):
        pass

    def on_truncated(self, from_index):
        self.events.append(("truncated", from_index))

    def on_ready(self, ready):
        self.events.append(("ready", ready.committed))

    def on_fatal(self, error):
        pass


def test_a_round_writes_its_messages_before_the_listener_applies_its_commits(tmp_path):
    """A follower's ack (or a leader's pushes) must not wait while the listener applies
    commits: each round flushes the transport first, then hands its Readies over in order."""
    async def scenario():
        node = one_node(tmp_path)
        events: list = []
        node.listener = Recording(events)
        await node.start()
        flush = node.transport.flush
        node.transport.flush = lambda: (events.append(("flush",)), flush())
        try:
            await _until(lambda: node.core.role.name == "LEADER" and node.core.commit_index >= node.core.last_index)
            events.clear()
            _first, last = node.propose([b"a", b"b"])
            await _until(lambda: ("ready", last) in events)
            at = events.index(("ready", last))
            assert ("flush",) in events[:at], events
            committed = [e[1] for e in events if e[0] == "ready"]
            assert committed == sorted(committed), "Readies reach the listener in order"
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_regression_a_proposal_is_persisted_and_committed_in_the_proposer_s_loop_turn(tmp_path):
    """DLedgerLog proposes with wake=False and runs the round itself (run_round): the entries
    are written and pushed before the producer awaits its commit. Before, a proposal woke
    the Raft task, and the round ran one loop turn later. A one-node group commits in that
    same round."""
    async def scenario():
        node = one_node(tmp_path)
        events: list = []
        node.listener = Recording(events)
        await node.start()
        try:
            await _until(lambda: node.core.role.name == "LEADER" and node.core.commit_index >= node.core.last_index)
            events.clear()
            _first, last = node.propose([b"a", b"b"], wake=False)
            assert node.store.last_index() < last
            node.run_round()                           # no await between the proposal and this check
            assert node.store.last_index() == last and node.core.commit_index == last
            assert ("ready", last) in events
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_run_round_from_inside_a_round_leaves_the_round_to_the_raft_task(tmp_path):
    """A listener that proposes while a round hands it Readies cannot start a round inside that
    one (the core holds an outstanding Ready): run_round wakes the Raft task instead, which
    persists and commits the proposal in its next turn."""
    class ProposingOnce(Recording):
        def __init__(self, events):
            super().__init__(events)
            self.node, self.armed, self.proposed, self.persisted_at_once = None, False, None, None

        def on_ready(self, ready):
            super().on_ready(ready)
            if self.armed:
                self.armed = False
                self.proposed = self.node.propose([b"inner"], wake=False)[1]
                self.node.run_round()
                self.persisted_at_once = self.node.store.last_index() >= self.proposed

    async def scenario():
        node = one_node(tmp_path)
        listener = ProposingOnce([])
        listener.node = node
        node.listener = listener
        await node.start()
        try:
            await _until(lambda: node.core.role.name == "LEADER" and node.core.commit_index >= node.core.last_index)
            listener.armed = True
            node.propose([b"outer"], wake=False)
            node.run_round()
            assert listener.proposed is not None and node.fatal is None
            assert not listener.persisted_at_once      # no round ran inside the round
            await _until(lambda: node.core.commit_index >= listener.proposed, tries=50)
            assert node.core.commit_index >= listener.proposed and node.store.last_index() >= listener.proposed
        finally:
            await node.stop()

    asyncio.run(scenario())


class SlowMetaFileSystem(FileSystem):
    """write_atomic of the Raft meta file holds until `hold_s` has passed once armed: a meta
    write (two fsyncs) behind a background writer, which took up to 99 ms here."""

    def __init__(self, hold_s: float):
        import threading
        self.hold_s = hold_s
        self.armed = False
        self.started = threading.Event()
        self.done = threading.Event()

    def write_atomic(self, path, data):
        if self.armed and path.endswith("/meta") and not self.started.is_set():
            self.started.set()
            import time
            time.sleep(self.hold_s)
            self.done.set()
        super().write_atomic(path, data)


def test_regression_a_slow_checkpoint_does_not_stall_the_event_loop(tmp_path):
    """The periodic checkpoint wrote meta (two fsyncs) on the event loop: one that took longer
    than the election timeout silenced a leader's heartbeats, and its followers elected anew
    (a CI run: term 1 -> 3, same leader). It runs on the flusher's worker thread now: while a
    checkpoint is held, the loop still commits proposals."""
    async def scenario():
        fs = SlowMetaFileSystem(hold_s=1.0)
        store = EntryStore(fs, str(tmp_path), "n0", data_segment_size=1 << 16, index_segment_size=32 * 64)
        node = RaftNode("n0", "g", {"n0": ("127.0.0.1", free_port())}, store, RaftConfig(),
                        ShellConfig(tick_ms=10, checkpoint_interval_ms=100), rng=random.Random(1))
        await node.start()
        try:
            await _until(lambda: node.core.role.name == "LEADER" and node.core.commit_index >= node.core.last_index)
            assert node.core.role.name == "LEADER"
            fs.armed = True
            node.propose([b"a"])                 # moves the commit index: the next checkpoint writes
            await _until(lambda: fs.started.is_set())
            assert fs.started.is_set(), "no checkpoint wrote meta"
            _first, last = node.propose([b"b", b"c"])
            await _until(lambda: node.core.commit_index >= last, tries=50)
            assert node.core.commit_index >= last and not fs.done.is_set(), \
                "the loop committed nothing while a checkpoint was writing meta"
            await _until(lambda: node.metrics["checkpoints"])
            assert node.status()["checkpoint_ms_max"] >= 900
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_regression_a_leader_catching_up_a_follower_pushes_in_short_rounds(tmp_path, monkeypatch):
    """A follower far behind: the leader filled the whole push window in one round (64
    batches of 1024 entries read, checked and encoded), so every producer waited behind it.
    Measured with bench_dledger's catch_up (a follower 400 MB behind, a producer sending one
    at a time): 190-240 rounds over 8 ms in 5 s, p99 25-35 ms. Now the core pushes
    `pushes_per_turn` batches per turn and a round ends once it has queued
    ROUND_SEND_BYTES, waking the next; the follower still catches up."""
    from dledger import shell as S
    monkeypatch.setattr(S, "ROUND_SEND_BYTES", 64 * 1024)
    config = RaftConfig(max_batch_entries=16, max_batch_bytes=16 * 1024)
    peers = {f"n{i}": ("127.0.0.1", free_port()) for i in range(3)}

    def make(n: str) -> RaftNode:
        store = EntryStore(FileSystem(), str(tmp_path / n), n, data_segment_size=1 << 22,
                           index_segment_size=32 * 8192)
        return RaftNode(n, "g", peers, store, config, ShellConfig(tick_ms=20), rng=random.Random(n))

    async def scenario():
        nodes = {n: make(n) for n in ("n0", "n1")}
        for node in nodes.values():
            await node.start()
        try:
            await _until(lambda: any(x.core.role.name == "LEADER" for x in nodes.values()), tries=1000)
            leader = next(x for x in nodes.values() if x.core.role.name == "LEADER")
            for i in range(200):                    # 4000 entries of 1 KiB: 4 MB behind
                leader.propose([bytes([i % 251]) * 1024] * 20)
                await asyncio.sleep(0)
            last = leader.core.last_index
            await _until(lambda: leader.core.commit_index >= last, tries=1000)
            rounds: list[int] = []
            real_round = leader._round

            def measured_round():
                before = leader.transport.queued_bytes
                real_round()
                rounds.append(leader.transport.queued_bytes - before)

            leader._round = measured_round
            late = nodes["n2"] = make("n2")
            await late.start()
            await _until(lambda: late.store.last_index() >= last, tries=1500)
            return late.store.last_index() >= last, rounds, config
        finally:
            for node in nodes.values():
                await node.stop()

    caught_up, rounds, config = asyncio.run(scenario())
    assert caught_up, "the follower caught up"
    # One Ready past the budget at most: pushes_per_turn batches to each of 2 followers.
    bound = 64 * 1024 + 2 * config.pushes_per_turn * (config.max_batch_bytes + 4096)
    big = [r for r in rounds if r > 16 * 1024]
    assert len(big) >= 20, f"the catch-up took {len(big)} rounds of pushes: {sorted(rounds)[-5:]}"
    assert max(rounds) <= bound, f"a round queued {max(rounds)} bytes (bound {bound})"


class SlowTermVoteFileSystem(FileSystem):
    """Meta writes that change the term or vote take `hold_s` once armed (two fsyncs behind a
    contended disk: 1.5 s seen); checkpoints of the durable mark are not slowed."""

    def __init__(self, hold_s: float):
        self.hold_s = hold_s
        self.armed = False
        self.last: tuple | None = None

    def write_atomic(self, path, data):
        if path.endswith("/meta"):
            import json
            import time
            doc = json.loads(data)
            now = (doc["term"], doc["voted_for"])
            if self.armed and now != self.last:
                time.sleep(self.hold_s)
            self.last = now
        super().write_atomic(path, data)


def _on_disk(store: EntryStore) -> tuple[int, str | None]:
    import json
    with open(store.meta_path) as f:
        doc = json.load(f)
    return doc["term"], doc["voted_for"]


async def _group_with_leader(nodes: dict[str, RaftNode], wrap_send) -> tuple[RaftNode, list[RaftNode]]:
    """Start `nodes`, each one's transport send wrapped by `wrap_send(node)`; once one leads
    and has committed its first entry: (that leader, the others)."""
    for node in nodes.values():
        await node.start()
        wrap_send(node)
    await _until(lambda: any(x.core.role.name == "LEADER" and x.core.commit_index >= 1
                             for x in nodes.values()), tries=1000)
    old = next(x for x in nodes.values() if x.core.role.name == "LEADER")
    return old, [x for x in nodes.values() if x is not old]


def test_regression_an_election_writes_term_and_vote_off_the_event_loop(tmp_path):
    """A term and vote were written (two fsyncs) on the event loop: a follower's took 1,455 ms
    on a contended disk while its node served nothing else. They are written on a worker
    thread now while the node holds that Ready: three nodes share this test's loop, the two
    followers' term-and-vote writes take 0.4 s each, and the loop never stalls for one. The
    order Raft needs still holds: no vote request or granted vote leaves before its term and
    vote are on disk."""
    from dledger.messages import RequestVote, VoteResponse
    peers = {f"n{i}": ("127.0.0.1", free_port()) for i in range(3)}
    fs = {n: SlowTermVoteFileSystem(hold_s=0.4) for n in peers}
    out_of_order: list[str] = []

    def make(n: str) -> RaftNode:
        store = EntryStore(fs[n], str(tmp_path / n), n, data_segment_size=1 << 16, index_segment_size=32 * 64)
        # 100 ms ticks: an election timeout of 0.6-1.2 s, longer than one slow write.
        return RaftNode(n, "g", peers, store, RaftConfig(), ShellConfig(tick_ms=100), rng=random.Random(n))

    def checked_send(node: RaftNode):
        real = node.transport.send

        def send(dest, msg):
            term, vote = _on_disk(node.store)
            if isinstance(msg, RequestVote) and not msg.pre_vote and (term, vote) < (msg.term, node.node_id):
                out_of_order.append(f"{node.node_id} asked for votes in term {msg.term} with {term, vote} on disk")
            if isinstance(msg, VoteResponse) and msg.granted and not msg.pre_vote and (term, vote) != (msg.term, dest):
                out_of_order.append(f"{node.node_id} voted for {dest} in term {msg.term} with {term, vote} on disk")
            real(dest, msg)
        node.transport.send = send

    async def scenario():
        nodes = {n: make(n) for n in peers}
        try:
            old, rest = await _group_with_leader(nodes, checked_send)
            for x in rest:
                fs[x.node_id].armed = True
            async with LoopLag() as lag:
                await old.stop()
                await _until(lambda: any(x.core.role.name == "LEADER" and x.core.commit_index > x.core.first_index
                                         for x in rest), tries=1000)
                new = next((x for x in rest if x.core.role.name == "LEADER"), None)
                assert new is not None, "no new leader"
                first, last = new.propose([b"after"])
                await _until(lambda: all(x.core.commit_index >= last for x in rest))
                assert all(x.core.commit_index >= last for x in rest)
            return [x.status() for x in rest], lag.worst_s
        finally:
            for node in nodes.values():
                if node._running:
                    await node.stop()

    statuses, worst = asyncio.run(scenario())
    assert not out_of_order, out_of_order
    assert all(s["term_vote_writes"] >= 1 for s in statuses), statuses
    assert max(s["term_vote_write_ms_max"] for s in statuses) >= 390, "the slow writes happened"
    assert worst < 0.2, f"the event loop stalled {worst * 1000:.0f} ms during the election"


def test_regression_a_group_elects_a_leader_when_term_and_vote_writes_outlast_the_election_timeout(tmp_path):
    """Term-and-vote writes of 1.5 s (as seen on a contended disk) against the default
    timers (50 ms ticks, an election timeout of 0.3-0.6 s): every candidate timed out before
    a vote could come back, the terms climbed (term 12 after 30 s) and no leader was elected.
    The clock now stands still during such a write and for as long again after it, so the
    two nodes left after the leader stops elect one within a few write times, in at most
    three new terms."""
    import time
    peers = {f"n{i}": ("127.0.0.1", free_port()) for i in range(3)}
    fs = {n: SlowTermVoteFileSystem(hold_s=1.5) for n in peers}

    def make(n: str) -> RaftNode:
        store = EntryStore(fs[n], str(tmp_path / n), n, data_segment_size=1 << 16, index_segment_size=32 * 64)
        return RaftNode(n, "g", peers, store, RaftConfig(), ShellConfig(), rng=random.Random(n))

    async def scenario():
        nodes = {n: make(n) for n in peers}
        for node in nodes.values():
            await node.start()
        try:
            await _until(lambda: any(x.core.role.name == "LEADER" and x.core.commit_index >= 1
                                     for x in nodes.values()), tries=1000)
            old = next(x for x in nodes.values() if x.core.role.name == "LEADER")
            old_term = old.core.term
            rest = [x for x in nodes.values() if x is not old]
            for x in rest:
                fs[x.node_id].armed = True
            await old.stop()
            t0 = time.monotonic()
            await _until(lambda: any(x.core.role.name == "LEADER" and x.core.commit_index > x.core.first_index
                                     for x in rest), tries=1500)
            took = time.monotonic() - t0
            new = next((x for x in rest if x.core.role.name == "LEADER"), None)
            return old_term, new and new.core.term, took, [x.status()["ticks_paused"] for x in rest]
        finally:
            for node in nodes.values():
                if node._running:
                    await node.stop()

    old_term, new_term, took, paused = asyncio.run(scenario())
    assert new_term is not None, f"no leader {took:.1f} s after the old one stopped"
    # Both survivors may pass the pre-vote at once and split the vote, once or twice (as in
    # tests/integration/test_slow_disk.py); the old shell climbed a term every timeout.
    assert new_term <= old_term + 3, f"terms climbed from {old_term} to {new_term} in {took:.1f} s"
    assert all(p > 0 for p in paused), paused


def test_regression_a_node_recovers_its_entry_store_off_the_event_loop(tmp_path):
    """Random-fault runs saw the event loop blocked for 240-480 ms at each node restart: the
    entry store's recovery (every entry read and its CRCs checked) ran on the loop, and so did
    the listener's replay of the committed log. Both run on a worker thread: with each held
    for 0.2 s the loop never stalls, and the node starts from what the recovery found."""
    peers = {"n0": ("127.0.0.1", free_port())}
    store = EntryStore(FileSystem(), str(tmp_path / "n0"), "n0", data_segment_size=1 << 16,
                       index_segment_size=32 * 64)
    real, threads = store.recover, []

    def held() -> None:
        import threading
        import time
        threads.append(threading.current_thread() is threading.main_thread())
        time.sleep(0.2)

    def slow_recover():
        held()
        return real()

    class SlowReplay(Recording):
        def on_recovered(self, node):
            held()

    store.recover = slow_recover
    node = RaftNode("n0", "g", peers, store, RaftConfig(), ShellConfig(tick_ms=20), rng=random.Random(1))
    node.listener = SlowReplay([])

    async def scenario():
        try:
            async with LoopLag() as lag:
                await node.start()
                await _until(lambda: node.core.role.name == "LEADER" and node.core.commit_index >= 1)
        finally:
            await node.stop()
        return lag.worst_s
    worst = asyncio.run(scenario())
    assert threads == [False, False]      # the recovery, then the replay: neither on the loop
    assert worst < 0.2, f"the event loop stalled {worst * 1000:.0f} ms during recovery"


class SlowFsyncFS(FsyncHooked):
    """Every file and directory fsync takes `hold_s` once armed (any thread)."""

    def __init__(self, hold_s: float):
        self.hold_s, self.armed, self.on_loop = hold_s, False, 0

    def before_fsync(self) -> None:
        if self.armed:
            import threading
            import time
            self.on_loop += threading.current_thread() is threading.main_thread()
            time.sleep(self.hold_s)


def test_regression_a_follower_truncates_its_divergent_tail_off_the_event_loop(tmp_path):
    """A follower's truncation of entries the new leader does not have (zeroes and fsyncs of
    the data and index files, after any flush in progress) ran on the event loop: on a disk
    where each fsync takes 0.3 s the loop stopped for as long as all of them. The cut is
    written on a worker thread now, the Ready held meanwhile: three nodes share this loop,
    and it never stalls. The order still holds: the node's log ends at the new leader's
    entries only after the cut, and it then holds exactly the leader's log."""
    peers = {f"n{i}": ("127.0.0.1", free_port()) for i in range(3)}
    fs = {n: SlowFsyncFS(hold_s=0.3) for n in peers}
    cut_off: set[str] = set()

    def make(n: str) -> RaftNode:
        store = EntryStore(fs[n], str(tmp_path / n), n, data_segment_size=1 << 16, index_segment_size=32 * 64)
        return RaftNode(n, "g", peers, store, RaftConfig(), ShellConfig(tick_ms=20), rng=random.Random(n))

    def partitionable(node: RaftNode) -> None:
        real = node.transport.send

        def send(dest, msg):
            if node.node_id not in cut_off:
                real(dest, msg)
        node.transport.send = send

    async def scenario():
        nodes = {n: make(n) for n in peers}
        try:
            old, rest = await _group_with_leader(nodes, partitionable)
            cut_off.add(old.node_id)                 # nothing it sends arrives any more
            first, last = old.propose([b"lost-%d" % i for i in range(20)])
            await _until(lambda: old.store.last_index() >= last)
            assert old.store.last_index() >= last, "the old leader stored its uncommitted tail"
            await _until(lambda: any(x.core.role.name == "LEADER" for x in rest), tries=1000)
            new = next(x for x in rest if x.core.role.name == "LEADER")
            _, kept = new.propose([b"kept-%d" % i for i in range(5)])
            await _until(lambda: all(x.core.commit_index >= kept for x in rest))
            fs[old.node_id].armed = True
            async with LoopLag() as lag:
                cut_off.clear()
                await _until(lambda: old.core.commit_index >= kept and old.status()["truncations"] >= 1,
                             tries=1000)
            fs[old.node_id].armed = False
            want = new.store.entries(first, kept + 1, 1 << 30)
            got = old.store.entries(first, old.store.last_index() + 1, 1 << 30)
            return old.status(), lag.worst_s, got, want, fs[old.node_id].on_loop
        finally:
            for node in nodes.values():
                if node._running:
                    await node.stop()

    status, worst, got, want, on_loop = asyncio.run(scenario())
    assert status["truncations"] >= 1 and status["truncation_ms_max"] >= 290, status
    assert on_loop == 0, f"{on_loop} fsync(s) of the truncating node ran on the event loop"
    assert worst < 0.2, f"the event loop stalled {worst * 1000:.0f} ms during the truncation"
    assert [(e.index, e.term, e.body) for e in got] == [(e.index, e.term, e.body) for e in want]
    assert not any(e.body.startswith(b"lost-") for e in got)


def test_regression_a_follower_resets_to_the_leaders_base_off_the_event_loop(tmp_path):
    """A follower's reset to the leader's base (InstallBase: the base's state file, meta, then
    every data and index file replaced, each step fsynced) ran on the event loop: on a disk
    where each fsync takes 0.3 s the loop stopped for all of them. The files are written on a
    worker thread now, the store serving its old log meanwhile, and switched to on the loop:
    three nodes share this loop and it never stalls. The follower then holds the leader's log
    from the base on, byte for byte (chain CRCs included)."""
    peers = {f"n{i}": ("127.0.0.1", free_port()) for i in range(3)}
    fs = {n: SlowFsyncFS(hold_s=0.3) for n in peers}

    def make(n: str) -> RaftNode:
        store = EntryStore(fs[n], str(tmp_path / n), n, data_segment_size=1 << 16, index_segment_size=32 * 64)
        return RaftNode(n, "g", peers, store, RaftConfig(), ShellConfig(tick_ms=20), rng=random.Random(n))

    async def scenario():
        nodes = {n: make(n) for n in peers}
        try:
            leader, rest = await _group_with_leader(nodes, lambda node: None)
            away = rest[0].node_id
            await nodes[away].stop()
            _, last = leader.propose([b"x" * 1000 for _ in range(300)])     # about five data files
            await _until(lambda: leader.store.meta.durable_mark >= last and leader.store.flushed_index >= last,
                         tries=1000)
            base = last - 5
            assert leader.store.compact_to(base, b"state"), "the leader cut its head past the stopped follower"
            _, kept = leader.propose([b"after"])
            fs[away].armed = True
            nodes[away] = back = make(away)
            async with LoopLag() as lag:
                await back.start()
                await _until(lambda: back.core.commit_index >= kept and back.store.last_index() >= kept,
                             tries=1500)
            fs[away].armed = False
            raw = [[s.data.read(e.pos, e.end - e.pos) for e in map(s.entry_at, range(base + 1, kept + 1))]
                   for s in (back.store, leader.store)]
            return back.status(), back.store.first_index(), lag.worst_s, raw, fs[away].on_loop, base
        finally:
            for node in nodes.values():
                if node._running:
                    await node.stop()

    status, first, worst, (got, want), on_loop, base = asyncio.run(scenario())
    assert status["resets"] == 1 and status["reset_ms_max"] >= 290, status
    assert first == base + 1
    assert on_loop == 0, f"{on_loop} fsync(s) of the node being reset ran on the event loop"
    assert worst < 0.2, f"the event loop stalled {worst * 1000:.0f} ms during the reset"
    assert got == want

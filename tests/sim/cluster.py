"""A deterministic cluster of RaftCores on a simulated network and disks.

One seed drives everything: the network's delays and losses, each node's
election jitter, the fault schedule and the clients. `Cluster` is the shell
(persist, send, apply, advance: the order real shells use) plus controls for
scripted scenarios; `run_seed` is the randomized fault run.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from dataclasses import dataclass, field

from dledger.core import NotLeader, ProposalDropped, RaftConfig, RaftCore, Ready, Role
from dledger.messages import Entry
from tests.sim.checkers import Checker, SimFailure, decode_counts, encode_counts, queue_of
from tests.sim.disk import SimDisk
from tests.sim.network import NetworkConfig, SimNetwork

SIM_CONFIG = RaftConfig(
    election_timeout_ticks_min=10,
    election_timeout_ticks_max=20,
    heartbeat_ticks=3,
    push_timeout_ticks=12,
    max_inflight_pushes=4,  # small windows and batches exercise the pipeline's edges
    max_batch_entries=4,
    max_batch_bytes=512,
    max_parked_pushes=4,
)
MAX_READY_ROUNDS = 16  # ready/advance rounds per input; more means the core never settles
MAX_DELIVERY_ROUNDS = 64  # zero-delay message rounds within one tick


@dataclass(slots=True)
class SimNode:
    node_id: str
    disk: SimDisk
    core: RaftCore | None = None  # None while crashed
    life: int = 0
    async_flush_ticks: int = 0  # 0: fsync before every advance (SYNC_FLUSH)
    applied: int = 0
    sm_counts: list[int] = field(default_factory=lambda: decode_counts(b""))  # queue -> messages applied
    commit_seen: int = 0
    down_until: int = 0
    last_view: tuple[Role, int] | None = None


@dataclass(slots=True)
class _Pending:
    node_id: str
    life: int
    term: int
    body: bytes


class Cluster:
    def __init__(
        self,
        seed: int,
        node_count: int = 3,
        config: RaftConfig = SIM_CONFIG,
        network: NetworkConfig | None = None,
        steps_hint: int = 0,
    ) -> None:
        self.seed = seed
        self.steps_hint = steps_hint
        self.rng = random.Random(seed)
        self.config = config
        self.ids = tuple(f"n{number}" for number in range(node_count))
        self.net = SimNetwork(random.Random(self.rng.getrandbits(64)), self.ids, network)
        self.nodes = {node_id: SimNode(node_id, SimDisk()) for node_id in self.ids}
        self.checker = Checker(self)
        self.now = 0
        self.trace: deque[str] = deque(maxlen=80)
        self.pending: dict[int, _Pending] = {}
        self._next_body = 0
        for node_id in self.ids:
            self.start(node_id)

    # --- reporting ---------------------------------------------------------------------

    def log(self, event: str) -> None:
        self.trace.append(f"t={self.now} {event}")

    def failure_message(self, problem: str) -> str:
        steps = f" --steps {self.steps_hint}" if self.steps_hint else ""
        return (
            f"seed {self.seed}: {problem}\n"
            f"replay: .venv/bin/python -m tests.sim.run --seed {self.seed}{steps} --nodes {len(self.ids)}\n"
            f"nodes:\n  {self.describe_nodes()}\n"
            f"last events:\n  " + "\n  ".join(self.trace)
        )

    # --- node lifecycle ------------------------------------------------------------------

    def live_nodes(self) -> list[SimNode]:
        return [node for node in self.nodes.values() if node.core is not None]

    def start(self, node_id: str) -> None:
        node = self.nodes[node_id]
        assert node.core is None
        report = node.disk.recover()
        if report.dropped_from is not None:
            kind = "corruption" if report.corrupted else "torn tail"
            self.log(f"{node_id} recovery: {kind}, dropped from {report.dropped_from}")
        node.life += 1
        rng = random.Random(self.rng.getrandbits(64))
        node.core = RaftCore(node_id, self.ids, node.disk, rng, self.config)
        base_index, _ = node.disk.base()
        node.applied = node.commit_seen = base_index
        node.sm_counts = decode_counts(node.disk.base_state())
        self.log(f"{node_id} starts (life {node.life}, last {node.disk.last_index()})")

    def crash(self, node_id: str, torn: bool = False, flip: bool = False) -> None:
        node = self.nodes[node_id]
        assert node.core is not None
        node.core = None
        node.disk.crash(self.rng, torn)
        flipped = node.disk.flip_bit(self.rng) if flip else None
        self.log(f"{node_id} crashes (torn={torn}, flipped={flipped})")

    def restart(self, node_id: str) -> None:
        self.crash(node_id)
        self.start(node_id)

    # --- the shell -------------------------------------------------------------------------

    def process(self, node: SimNode, force: bool = False) -> None:
        """Drain the core's Ready: persist, send, apply, advance."""
        core = node.core
        assert core is not None
        for _ in range(MAX_READY_ROUNDS):
            if not force and not core.has_ready():
                return
            force = False
            ready = core.ready()
            self._note_role(node, ready)
            self._persist(node, ready)
            for destination, message in ready.messages:
                self.net.send(self.now, node.node_id, destination, message)
            self._apply(node, ready.committed)
            core.advance(ready, persisted_index=node.disk.synced_index())
        self.checker.fail(f"{node.node_id}: core still has a Ready after {MAX_READY_ROUNDS} rounds")

    def _note_role(self, node: SimNode, ready: Ready) -> None:
        view = (ready.soft_role, ready.term)
        if view != node.last_view:
            node.last_view = view
            self.log(f"{node.node_id} is {ready.soft_role.value} in term {ready.term} (leader {ready.leader_id})")

    def describe_nodes(self) -> str:
        lines = []
        for node in self.nodes.values():
            core = node.core
            if core is None:
                lines.append(f"{node.node_id}: down, disk last {node.disk.last_index()}")
                continue
            last = core.last_index
            lines.append(
                f"{node.node_id}: {core.role.value} term={core.term} leader={core.leader_id} "
                f"voted={core.voted_for} last=({last}, t{core.term_at(last)}) commit={core.commit_index} "
                f"durable={core.durable_index} catchup={core.needs_catchup_to}"
            )
        return "\n  ".join(lines)

    def _persist(self, node: SimNode, ready: Ready) -> None:
        disk = node.disk
        if ready.reset_base is not None:
            self.checker.on_reset(node, *ready.reset_base)
            disk.reset_to(*ready.reset_base)
            node.applied = ready.reset_base[0]
            node.sm_counts = decode_counts(ready.reset_base[2])
            self.log(f"{node.node_id} installs base {ready.reset_base}")
        if ready.truncate_from is not None:
            self.checker.on_truncate(node, ready.truncate_from)
            disk.truncate_from(ready.truncate_from)
        if ready.entries:
            self.checker.on_entries_written(node, ready.entries)
            disk.append(ready.entries)
        if ready.hard_state is not None:
            disk.set_hard_state(ready.hard_state)
        if node.async_flush_ticks == 0:
            disk.sync()

    def _apply(self, node: SimNode, committed: int) -> None:
        self.checker.on_commit_index(node, committed)
        if committed <= node.applied:
            return
        for entry in node.disk.entries(node.applied + 1, committed + 1, 1 << 62):
            self.checker.on_apply(node, entry)
            queue = queue_of(entry)
            if queue is not None:
                node.sm_counts[queue] += 1
        node.applied = committed

    # --- time --------------------------------------------------------------------------------

    def tick(self) -> None:
        self.now += 1
        for node in self.live_nodes():
            node.core.tick()
            self.process(node)
        self.deliver()
        for node in self.live_nodes():
            if node.disk.pending_fill:           # a push's cold entries are read in now
                node.disk.pending_fill = False
                node.core.entries_fetched()
                self.process(node)
            if node.async_flush_ticks and self.now % node.async_flush_ticks == 0:
                node.disk.sync()
                self.process(node, force=True)
        self._check_acks()
        self.checker.after_step()

    def deliver(self) -> None:
        for _ in range(MAX_DELIVERY_ROUNDS):
            due = self.net.deliver(self.now)
            if not due:
                return
            for source, destination, message in due:
                node = self.nodes[destination]
                if node.core is None:
                    continue
                node.core.step(source, message)
                self.process(node)

    def run(self, ticks: int) -> None:
        for _ in range(ticks):
            self.tick()

    # --- clients -----------------------------------------------------------------------------

    def leaders(self) -> list[SimNode]:
        return [node for node in self.live_nodes() if node.core.role is Role.LEADER]

    def leader(self) -> SimNode | None:
        leaders = self.leaders()
        return max(leaders, key=lambda node: node.core.term) if leaders else None

    def new_body(self) -> bytes:
        self._next_body += 1
        queue = self.rng.randrange(256)
        return bytes([queue]) + f"s{self.seed}-m{self._next_body}".encode()

    def propose(self, count: int = 1) -> tuple[int, int] | None:
        """Propose `count` fresh bodies to the current leader, if any."""
        leader = self.leader()
        if leader is None:
            return None
        bodies = [self.new_body() for _ in range(count)]
        try:
            first, last = leader.core.propose(bodies)
        except (NotLeader, ProposalDropped):
            return None
        for index, body in zip(range(first, last + 1), bodies):
            self.pending[index] = _Pending(leader.node_id, leader.life, leader.core.term, body)
        self.process(leader)
        return first, last

    def _check_acks(self) -> None:
        """An index is acked when its leader commits it and still holds our body."""
        for index in sorted(self.pending):
            pending = self.pending[index]
            node = self.nodes[pending.node_id]
            core = node.core
            if core is None or node.life != pending.life or core.term != pending.term:
                del self.pending[index]  # outcome unknown to the client
                continue
            if core.commit_index < index:
                continue
            del self.pending[index]
            if core.first_index <= index:
                entry = node.disk.entries(index, index + 1, 1 << 62)[0]
                if entry.body == pending.body:
                    self.checker.on_acked(index, pending.body)

    def is_acked(self, index: int) -> bool:
        return index in self.checker.acked

    # --- scripted helpers ----------------------------------------------------------------------

    def wait_for_leader(self, max_ticks: int = 400, exclude: tuple[str, ...] = ()) -> SimNode:
        for _ in range(max_ticks):
            leader = self.leader()
            if leader is not None and leader.node_id not in exclude and self._has_quorum_view(leader):
                return leader
            self.tick()
        self.checker.fail(f"no leader within {max_ticks} ticks")
        raise AssertionError("unreachable")

    def _has_quorum_view(self, leader: SimNode) -> bool:
        # A leader that committed an entry of its own term is a working leader.
        core = leader.core
        return core.commit_index >= 1 and core.term_at(core.commit_index) == core.term

    def commit_fresh_entry(self, max_ticks: int = 400) -> int:
        """Propose one entry and wait until a leader acks it; returns its index."""
        for _ in range(max_ticks):
            proposed = self.propose(1)
            if proposed is not None:
                index = proposed[0]
                for _ in range(max_ticks):
                    self.tick()
                    if self.is_acked(index):
                        return index
                    if index not in self.pending:
                        break
            else:
                self.tick()
        self.checker.fail(f"no entry committed within {max_ticks} ticks of a healed cluster")
        raise AssertionError("unreachable")

    def heal_and_restart_all(self) -> None:
        self.net.heal()
        self.net.config = NetworkConfig(delay_min_ticks=0, delay_max_ticks=1)
        for node in self.nodes.values():
            if node.core is None:
                self.start(node.node_id)
        self.log("faults stop: network healed, all nodes up")

    def final_checks(self) -> None:
        self.checker.check_state_machines()
        self.checker.check_logs_against_registry()
        leader = self.leader()
        if leader is not None:
            self.checker.check_against_leader(leader)


def state_at(disk: SimDisk, upto: int) -> list[int]:
    """The state machine as of entry `upto`: the disk's base state plus its entries up to there."""
    counts = decode_counts(disk.base_state())
    first = disk.first_index()
    if upto >= first:
        for entry in disk.entries(first, upto + 1, 1 << 62):
            queue = queue_of(entry)
            if queue is not None:
                counts[queue] += 1
    return counts


def entries_of(node: SimNode) -> list[Entry]:
    disk = node.disk
    if disk.last_index() < disk.first_index():
        return []
    return disk.entries(disk.first_index(), disk.last_index() + 1, 1 << 62)


# --- the randomized fault run -------------------------------------------------------------------


@dataclass(slots=True)
class FaultProfile:
    """Per-step probabilities of each fault."""

    propose: float = 0.3
    crash: float = 0.01
    torn: float = 0.5
    bit_flip: float = 0.004
    partition: float = 0.02
    heal: float = 0.03
    compact: float = 0.01
    transfer: float = 0.004
    restart_after_ticks: tuple[int, int] = (5, 80)


def _random_network(rng: random.Random) -> NetworkConfig:
    return NetworkConfig(
        drop_rate=rng.choice([0.0, 0.01, 0.05, 0.15]),
        duplicate_rate=rng.choice([0.0, 0.02, 0.1]),
        delay_min_ticks=0,
        delay_max_ticks=rng.choice([0, 1, 3, 6]),
    )


def _random_config(rng: random.Random, ids: tuple[str, ...]) -> RaftConfig:
    preferred = rng.choice(ids) if rng.random() < 0.2 else None
    return RaftConfig(
        election_timeout_ticks_min=SIM_CONFIG.election_timeout_ticks_min,
        election_timeout_ticks_max=SIM_CONFIG.election_timeout_ticks_max,
        heartbeat_ticks=SIM_CONFIG.heartbeat_ticks,
        push_timeout_ticks=SIM_CONFIG.push_timeout_ticks,
        max_inflight_pushes=rng.choice([1, 2, 4, 16]),
        max_batch_entries=rng.choice([1, 3, 8]),
        max_batch_bytes=SIM_CONFIG.max_batch_bytes,
        max_parked_pushes=rng.choice([1, 4]),
        # Bounds the backlog a partitioned leader can pile up (without CheckQuorum
        # it never steps down), so catching up fits the liveness bound.
        max_uncommitted_entries=rng.choice([32, 128, 256]),
        pre_vote=rng.random() < 0.9,
        check_quorum=rng.random() < 0.9,
        preferred_leader_id=preferred,
    )


class FaultRun:
    """Random faults for `steps` ticks, then heal everything and demand progress."""

    def __init__(self, seed: int, steps: int = 300, nodes: int | None = None) -> None:
        rng = random.Random(seed)
        node_count = nodes if nodes is not None else rng.choice([3, 3, 5])
        ids = tuple(f"n{number}" for number in range(node_count))
        config = _random_config(rng, ids)
        # DLedger's push quota on some runs, from a stream of its own (the seeds' other draws
        # unchanged): tiny points and quotas, so followers behind are throttled often.
        quota = random.Random(f"push-quota-{seed}")
        if quota.random() < 0.3:
            config = dataclasses.replace(config, push_throttle_point_bytes=quota.choice([0, 200, 1000]),
                                         push_quota_bytes_per_tick=quota.choice([48, 100, 300]),
                                         push_quota_window_ticks=quota.choice([1, 4]))
        self.cluster = Cluster(
            seed,
            node_count,
            config=config,
            network=_random_network(rng),
            steps_hint=steps,
        )
        self.rng = random.Random(rng.getrandbits(64))
        self.profile = FaultProfile()
        self.steps = steps
        for node in self.cluster.nodes.values():
            if self.rng.random() < 0.3:
                node.async_flush_ticks = self.rng.randint(1, 5)
        # Cold reads on some disks, from a stream of their own (the seeds' other draws unchanged).
        cold = random.Random(f"cold-reads-{seed}")
        for node in self.cluster.nodes.values():
            if cold.random() < 0.3:
                node.disk.cold_rate = cold.choice([0.1, 0.3, 0.6])
                node.disk.cold_rng = random.Random(cold.getrandbits(64))

    def run(self, liveness_ticks: int = 800) -> Cluster:
        cluster = self.cluster
        for _ in range(self.steps):
            self._inject_faults()
            cluster.tick()
        cluster.heal_and_restart_all()
        cluster.wait_for_leader(liveness_ticks)
        cluster.commit_fresh_entry(liveness_ticks)
        cluster.final_checks()
        return cluster

    def _inject_faults(self) -> None:
        cluster, rng, profile = self.cluster, self.rng, self.profile
        for node in cluster.nodes.values():
            if node.core is None and cluster.now >= node.down_until:
                cluster.start(node.node_id)
        if rng.random() < profile.propose:
            cluster.propose(rng.randint(1, 3))
        if rng.random() < profile.crash:
            self._crash_one()
        if rng.random() < profile.bit_flip:
            self._flip_one()
        if rng.random() < profile.partition:
            self._partition()
        if rng.random() < profile.heal:
            cluster.net.heal()
            cluster.log("network healed")
        if rng.random() < profile.compact:
            self._compact_one()
        if rng.random() < profile.transfer:
            self._transfer()

    def _crash_one(self) -> None:
        live = self.cluster.live_nodes()
        if not live:
            return
        node = self.rng.choice(live)
        self.cluster.crash(node.node_id, torn=self.rng.random() < self.profile.torn)
        low, high = self.profile.restart_after_ticks
        node.down_until = self.cluster.now + self.rng.randint(low, high)

    def _flip_one(self) -> None:
        """Corrupt one replica, only while no replica is still catching up
        from an earlier corruption (one bad replica at a time)."""
        cluster = self.cluster
        for node in cluster.nodes.values():
            if node.disk.initial_state().needs_catchup_to is not None:
                return
        live = cluster.live_nodes()
        if not live:
            return
        node = self.rng.choice(live)
        cluster.crash(node.node_id, flip=True)
        cluster.start(node.node_id)

    def _partition(self) -> None:
        cluster, rng = self.cluster, self.rng
        ids = list(cluster.ids)
        rng.shuffle(ids)
        shape = rng.choice(["isolate", "split", "one_way", "bridge"])
        net = cluster.net
        net.heal()
        if shape == "isolate":
            net.isolate(ids[0])
        elif shape == "split":
            cut = rng.randint(1, len(ids) - 1)
            net.split([ids[:cut], ids[cut:]])
        elif shape == "one_way":
            net.one_way(ids[0])
        else:
            net.bridge(ids[0], ids[1], ids[2])
        cluster.log(f"partition {shape}: {net.describe()}")

    def _compact_one(self) -> None:
        node = self.rng.choice(list(self.cluster.nodes.values()))
        if node.core is None:
            return
        keep = self.rng.randint(0, 12)
        upto = min(node.applied, node.disk.synced_index()) - keep
        if upto > node.disk.base()[0]:
            node.disk.compact(upto, encode_counts(state_at(node.disk, upto)))
            self.cluster.log(f"{node.node_id} compacts up to {upto}")

    def _transfer(self) -> None:
        leader = self.cluster.leader()
        if leader is None:
            return
        target = self.rng.choice([peer for peer in self.cluster.ids if peer != leader.node_id])
        leader.core.transfer_leadership(target)
        self.cluster.log(f"{leader.node_id} transfers leadership to {target}")
        self.cluster.process(leader)


def run_seed(seed: int, steps: int = 300, nodes: int | None = None) -> Cluster:
    """Run one randomized seed; raises SimFailure naming the seed on a violation."""
    run = FaultRun(seed, steps, nodes)
    try:
        return run.run()
    except SimFailure:
        raise
    except AssertionError as error:  # an invariant inside the core
        raise SimFailure(run.cluster.failure_message(f"core assertion: {error!r}")) from error

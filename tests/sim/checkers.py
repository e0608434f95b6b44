"""Safety checkers for the simulator, run after every step.

- at most one leader per term;
- log matching: entries with the same (index, term) have the same body and the
  same previous term, hence (by induction) the same prefix. Checked on every
  write, against a registry of everything ever written anywhere;
- committed entries never change: every entry any node applies must equal the
  reference committed log (the union of everything ever applied);
- committed entries never disappear from a majority: the synced logs of a
  majority agree with the reference up to the highest committed index (a node
  that lost entries to a bit flip and may not vote until it has them back
  counts as holding them: it cannot help elect a leader that lacks them);
- truncation and InstallBase never touch a node's applied prefix;
- commit index monotonic per node within one life;
- each node's state machine (per-queue message counts) equals the same state
  rebuilt from the reference log.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from dledger.core import Role
from dledger.messages import Entry, EntryType
from dledger.quorum import quorum_index

if TYPE_CHECKING:
    from tests.sim.cluster import Cluster, SimNode

QUEUES = 4  # the sim's state machine counts messages per queue id = body[0] % QUEUES


class SimFailure(AssertionError):
    """A safety or liveness property failed; the message names the seed."""


_COUNTS = struct.Struct(f">{QUEUES}Q")


def encode_counts(counts: list[int]) -> bytes:
    """The state machine as a base state (what compaction stores and InstallBase carries)."""
    return _COUNTS.pack(*counts)


def decode_counts(state: bytes) -> list[int]:
    return list(_COUNTS.unpack(state)) if state else [0] * QUEUES


def queue_of(entry: Entry) -> int | None:
    if entry.type is not EntryType.NORMAL or not entry.body:
        return None
    return entry.body[0] % QUEUES


class Checker:
    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self.leaders_by_term: dict[int, str] = {}
        self.registry: dict[tuple[int, int], tuple[bytes, int]] = {}  # (index, term) -> (body, prev term)
        self.committed: dict[int, Entry] = {}
        self.max_committed = 0
        # prefix_counts[i] = per-queue counts of committed entries 1..i, so any
        # node's expected state machine is one subtraction away.
        self.prefix_counts: list[tuple[int, ...]] = [(0,) * QUEUES]
        self.acked: dict[int, bytes] = {}  # index -> body of proposals acked to clients

    def fail(self, problem: str) -> None:
        raise SimFailure(self._cluster.failure_message(problem))

    # --- hooks called by the cluster's shell ---------------------------------------------

    def on_entries_written(self, node: SimNode, entries: tuple[Entry, ...]) -> None:
        prev_term = node.disk.term(entries[0].index - 1)
        for entry in entries:
            key = (entry.index, entry.term)
            seen = self.registry.setdefault(key, (entry.body, prev_term))
            if seen != (entry.body, prev_term):
                self.fail(f"log matching: {node.node_id} wrote {key} with a different body or prefix")
            prev_term = entry.term

    def on_truncate(self, node: SimNode, index: int) -> None:
        if index <= node.applied:
            self.fail(f"{node.node_id} truncates from {index} but applied {node.applied}")

    def on_reset(self, node: SimNode, base_index: int, base_term: int, state: bytes) -> None:
        if base_index < node.applied:
            self.fail(f"{node.node_id} reset to base {base_index} below applied {node.applied}")
        reference = self.committed.get(base_index)
        if reference is not None and reference.term != base_term:
            self.fail(f"{node.node_id} reset to base ({base_index}, {base_term}) != committed term {reference.term}")
        if base_index <= self.max_committed and decode_counts(state) != list(self.prefix_counts[base_index]):
            self.fail(f"{node.node_id} reset to base {base_index} with state {decode_counts(state)} != "
                      f"the committed log's {list(self.prefix_counts[base_index])}")

    def on_commit_index(self, node: SimNode, committed: int) -> None:
        if committed < node.commit_seen:
            self.fail(f"{node.node_id} commit index went back from {node.commit_seen} to {committed}")
        node.commit_seen = committed

    def on_apply(self, node: SimNode, entry: Entry) -> None:
        reference = self.committed.setdefault(entry.index, entry)
        if reference != entry:
            self.fail(
                f"committed entry {entry.index} changed: {node.node_id} applies term {entry.term} "
                f"body {entry.body[:24]!r}, reference term {reference.term} body {reference.body[:24]!r}"
            )
        if entry.index > self.max_committed:
            # Every node applies a contiguous range above a committed base, so the
            # reference grows without gaps.
            if entry.index != self.max_committed + 1:
                self.fail(f"{node.node_id} applies {entry.index} but the reference ends at {self.max_committed}")
            counts = list(self.prefix_counts[-1])
            queue = queue_of(entry)
            if queue is not None:
                counts[queue] += 1
            self.prefix_counts.append(tuple(counts))
            self.max_committed = entry.index

    def on_acked(self, index: int, body: bytes) -> None:
        reference = self.committed.get(index)
        if reference is None or reference.body != body:
            self.fail(f"proposal acked at {index} is not the committed entry there")
        self.acked[index] = body

    # --- after every step --------------------------------------------------------------

    def after_step(self) -> None:
        for node in self._cluster.live_nodes():
            core = node.core
            if core.role is Role.LEADER:
                leader = self.leaders_by_term.setdefault(core.term, node.node_id)
                if leader != node.node_id:
                    self.fail(f"two leaders in term {core.term}: {leader} and {node.node_id}")
        self.check_majority_holds_committed()
        self.check_state_machines()

    def check_majority_holds_committed(self) -> None:
        if self.max_committed == 0:
            return
        effective = [self._agreed_upto(node) for node in self._cluster.nodes.values()]
        if quorum_index(effective) < self.max_committed:
            detail = {node_id: value for node_id, value in zip(self._cluster.nodes, effective)}
            self.fail(f"committed index {self.max_committed} no longer on a majority: agreed {detail}")

    def _agreed_upto(self, node: SimNode) -> int:
        """Highest k <= max committed where the node's synced log agrees with the
        reference; logs obey log matching, so agreement is a prefix: bisect."""
        disk = node.disk
        base_index, _ = disk.base()
        lo = base_index  # the base is committed by construction
        hi = min(disk.synced_index(), self.max_committed)
        if hi > lo and not self._agrees(node, lo + 1):
            hi = lo
        while hi > lo:
            mid = (lo + hi + 1) // 2
            if self._agrees(node, mid):
                lo = mid
            else:
                hi = mid - 1
        owed = disk.initial_state().needs_catchup_to or 0
        return max(lo, min(owed, self.max_committed))

    def _agrees(self, node: SimNode, index: int) -> bool:
        reference = self.committed.get(index)
        return reference is not None and node.disk.synced_term(index) == reference.term

    # --- occasional and final full checks ----------------------------------------------

    def check_state_machines(self) -> None:
        """Each live node's state equals the reference log's entries up to its applied
        index, whatever part of them it got through a base state (compaction, restart,
        InstallBase): prefix counts make this O(nodes)."""
        for node in self._cluster.nodes.values():
            if node.core is None:
                continue
            if node.applied > self.max_committed:
                self.fail(f"{node.node_id} applied {node.applied} beyond the reference {self.max_committed}")
            expected = list(self.prefix_counts[node.applied])
            if expected != node.sm_counts:
                self.fail(f"{node.node_id} state machine {node.sm_counts} != rebuilt {expected}")

    def check_logs_against_registry(self) -> None:
        """Every stored entry is one the registry knows, with a consistent prefix."""
        for node in self._cluster.nodes.values():
            disk = node.disk
            if disk.last_index() < disk.first_index():
                continue
            prev_term = disk.term(disk.first_index() - 1)
            for entry in disk.entries(disk.first_index(), disk.last_index() + 1, 1 << 62):
                if self.registry.get((entry.index, entry.term)) != (entry.body, prev_term):
                    self.fail(f"{node.node_id} holds ({entry.index}, {entry.term}) unknown to the registry")
                prev_term = entry.term

    def check_against_leader(self, leader: SimNode) -> None:
        """Each node's applied state equals the state rebuilt from the leader's log."""
        core = leader.core
        for node in self._cluster.nodes.values():
            if node.core is None or node.applied > core.commit_index:
                continue
            start = leader.disk.first_index() - 1
            if node.applied < start:
                continue  # the leader compacted past what this node applied
            expected = decode_counts(leader.disk.base_state())
            for index in range(start + 1, node.applied + 1):
                entry = leader.disk.entries(index, index + 1, 1 << 62)[0]
                queue = queue_of(entry)
                if queue is not None:
                    expected[queue] += 1
            if expected != node.sm_counts:
                self.fail(f"{node.node_id} state {node.sm_counts} != rebuilt from leader log {expected}")

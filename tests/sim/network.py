"""A simulated network: delay (in ticks), drop, duplicate, reorder, partitions.

Reordering falls out of random per-message delays. Partitions are a set of
blocked *directed* links, checked when a message is delivered, so messages in
flight when a partition starts are lost like on a real cut link. Every shape is
a set of blocked links: isolate one node, split into groups, one-way (A hears B
but B does not hear A), bridge (A-B and B-C connected, A-C cut).
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence


@dataclass(slots=True)
class NetworkConfig:
    drop_rate: float = 0.0
    duplicate_rate: float = 0.0
    delay_min_ticks: int = 0  # 0: delivered in the same step it was sent
    delay_max_ticks: int = 0
    max_queued: int = 50_000  # bound on messages in flight; beyond it, sends are dropped


class SimNetwork:
    def __init__(self, rng: random.Random, nodes: Sequence[str], config: NetworkConfig | None = None) -> None:
        self._rng = rng
        self.nodes = tuple(nodes)
        self.config = config or NetworkConfig()
        self._queue: list[tuple[int, int, str, str, object]] = []
        self._seq = itertools.count()
        self._blocked: set[tuple[str, str]] = set()
        # Scripted scenarios may drop chosen messages: (src, dst, msg) -> drop?
        self.drop_if: Callable[[str, str, object], bool] | None = None
        self.sent = 0
        self.dropped = 0

    # --- traffic ----------------------------------------------------------------------

    def send(self, now: int, src: str, dst: str, msg: object) -> None:
        self.sent += 1
        config = self.config
        if self._rng.random() < config.drop_rate or len(self._queue) >= config.max_queued:
            self.dropped += 1
            return
        copies = 2 if self._rng.random() < config.duplicate_rate else 1
        for _ in range(copies):
            delay = self._rng.randint(config.delay_min_ticks, config.delay_max_ticks)
            heapq.heappush(self._queue, (now + delay, next(self._seq), src, dst, msg))

    def deliver(self, now: int) -> list[tuple[str, str, object]]:
        """Messages due at `now`, in delivery order; cut links eat theirs."""
        due: list[tuple[str, str, object]] = []
        while self._queue and self._queue[0][0] <= now:
            _, _, src, dst, msg = heapq.heappop(self._queue)
            if (src, dst) in self._blocked or (self.drop_if is not None and self.drop_if(src, dst, msg)):
                self.dropped += 1
                continue
            due.append((src, dst, msg))
        return due

    def in_flight(self) -> int:
        return len(self._queue)

    def drop_all(self) -> None:
        self.dropped += len(self._queue)
        self._queue.clear()

    # --- partitions -------------------------------------------------------------------

    def heal(self) -> None:
        self._blocked.clear()

    def cut(self, src: str, dst: str) -> None:
        """One-way: messages from src no longer reach dst."""
        self._blocked.add((src, dst))

    def cut_both(self, a: str, b: str) -> None:
        self.cut(a, b)
        self.cut(b, a)

    def isolate(self, node: str) -> None:
        for other in self.nodes:
            if other != node:
                self.cut_both(node, other)

    def split(self, groups: Iterable[Iterable[str]]) -> None:
        """Nodes talk only within their group; unlisted nodes are cut from all."""
        group_of: dict[str, int] = {}
        for number, group in enumerate(groups):
            for node in group:
                group_of[node] = number
        for a in self.nodes:
            for b in self.nodes:
                if a != b and (group_of.get(a, -1) == -1 or group_of.get(a) != group_of.get(b)):
                    self.cut(a, b)

    def one_way(self, deaf: str, others: Iterable[str] | None = None) -> None:
        """`deaf` still reaches the others but hears none of them."""
        for other in others if others is not None else self.nodes:
            if other != deaf:
                self.cut(other, deaf)

    def bridge(self, left: str, middle: str, right: str) -> None:
        """left-middle and middle-right connected, left-right cut, and the
        rest of the cluster (if any) cut from left and right."""
        self.cut_both(left, right)
        for other in self.nodes:
            if other not in (left, middle, right):
                self.cut_both(other, left)
                self.cut_both(other, right)

    def blocked(self) -> frozenset[tuple[str, str]]:
        return frozenset(self._blocked)

    def describe(self) -> str:
        if not self._blocked:
            return "healed"
        return " ".join(f"{a}-x->{b}" for a, b in sorted(self._blocked))

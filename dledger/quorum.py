"""Quorum arithmetic: majorities, the majority-replicated index, vote tallies.

Pure functions over plain values so they can be checked against dumb versions
(tests/property/test_quorum.py). Membership is a fixed voter set; joint
consensus is not implemented.
"""

from __future__ import annotations

import enum
from typing import Callable, Collection, Mapping, Sequence

__all__ = ["VoteResult", "commit_index", "majority", "quorum_index", "vote_result"]


class VoteResult(enum.Enum):
    PENDING = "pending"
    WON = "won"
    LOST = "lost"


def majority(voters: int) -> int:
    """Smallest number of voters that forms a quorum."""
    assert voters >= 1, voters
    return voters // 2 + 1


def quorum_index(match_indexes: Sequence[int]) -> int:
    """Largest index that at least a majority of the voters hold.

    `match_indexes` has one value per voter (the leader included).
    """
    assert match_indexes, "no voters"
    ordered = sorted(match_indexes, reverse=True)
    return ordered[majority(len(ordered)) - 1]


def commit_index(
    current_commit: int,
    match_indexes: Sequence[int],
    term_of: Callable[[int], int],
    current_term: int,
) -> int:
    """The leader's new commit index.

    An index held by a majority is committed only if its entry is from the
    leader's current term (Raft 5.4.2, Figure 8): counting replicas of an older
    term's entry is not enough, because a later leader may still overwrite it.
    Older entries are committed indirectly, by the current term's entry after
    them. The result never goes below `current_commit`.
    """
    candidate = quorum_index(match_indexes)
    if candidate <= current_commit:
        return current_commit
    if term_of(candidate) != current_term:
        return current_commit
    return candidate


def vote_result(votes: Mapping[str, bool], voters: Collection[str]) -> VoteResult:
    """Tally votes (True = granted) from `voters`; ignores anyone else."""
    need = majority(len(voters))
    granted = sum(1 for voter in voters if votes.get(voter) is True)
    rejected = sum(1 for voter in voters if votes.get(voter) is False)
    if granted >= need:
        return VoteResult.WON
    if rejected > len(voters) - need:
        return VoteResult.LOST
    return VoteResult.PENDING

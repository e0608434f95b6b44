"""Property tests for dledger.quorum: each function against a dumb version.

Goal: the commit-index and vote arithmetic is where a subtle bug loses data, so
check it exhaustively-ish. Method: Hypothesis generates voter counts, match
indexes, log terms and vote maps; a brute-force definition is the oracle
(etcd's quorum/quick_test.go does the same).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dledger.quorum import VoteResult, commit_index, majority, quorum_index, vote_result

match_lists = st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=9)


def dumb_quorum_index(matches: list[int]) -> int:
    """The largest index that at least a majority holds, by trying them all."""
    need = len(matches) // 2 + 1
    return max(index for index in range(0, max(matches) + 1) if sum(m >= index for m in matches) >= need)


@given(st.integers(min_value=1, max_value=101))
def test_majority_is_the_smallest_strict_majority(voters):
    need = majority(voters)
    assert 2 * need > voters
    assert 2 * (need - 1) <= voters


@given(match_lists)
def test_quorum_index_matches_the_dumb_definition(matches):
    assert quorum_index(matches) == dumb_quorum_index(matches)


@given(match_lists, st.permutations(range(9)))
def test_quorum_index_ignores_the_order_of_voters(matches, order):
    shuffled = [matches[i] for i in order if i < len(matches)]
    assert quorum_index(shuffled) == quorum_index(matches)


@given(
    matches=match_lists,
    term_steps=st.lists(st.integers(min_value=0, max_value=2), min_size=51, max_size=51),
    current_commit=st.integers(min_value=0, max_value=50),
    current_term=st.integers(min_value=1, max_value=60),
)
@settings(max_examples=300)
def test_commit_index_only_commits_the_current_terms_entries_held_by_a_majority(
    matches, term_steps, current_commit, current_term
):
    terms = [0]
    for step in term_steps[1:]:
        terms.append(terms[-1] + step)  # terms never decrease along a log

    def term_of(index: int) -> int:
        return terms[index]

    result = commit_index(current_commit, matches, term_of, current_term)
    candidate = dumb_quorum_index(matches)
    expected = candidate if candidate > current_commit and terms[candidate] == current_term else current_commit
    assert result == expected
    assert result >= current_commit


@given(
    voters=st.integers(min_value=1, max_value=7),
    answers=st.lists(st.sampled_from([True, False, None]), min_size=7, max_size=7),
    outsiders=st.dictionaries(st.text(min_size=1, max_size=3).map(lambda s: "x" + s), st.booleans(), max_size=3),
)
def test_vote_result_matches_the_dumb_tally(voters, answers, outsiders):
    ids = [f"n{number}" for number in range(voters)]
    votes = {node: answer for node, answer in zip(ids, answers) if answer is not None}
    votes.update(outsiders)  # non-voters never count
    granted = sum(1 for node in ids if votes.get(node) is True)
    undecided = sum(1 for node in ids if node not in votes)
    need = voters // 2 + 1
    if granted >= need:
        expected = VoteResult.WON
    elif granted + undecided < need:
        expected = VoteResult.LOST
    else:
        expected = VoteResult.PENDING
    assert vote_result(votes, ids) is expected

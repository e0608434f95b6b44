"""RaftCore.propose builds its entries without a per-entry Entry() (the leader's hot path).

Method: the batch builder `_new_entries` must give exactly the entries a plain
`Entry(...)` per body gives (Hypothesis over indexes, terms, types, bodies), and a bad
field anywhere in the batch must raise the same InvalidMessage with nothing appended
to the leader's log.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dledger.core import _new_entries
from dledger.messages import Entry, EntryType, InvalidMessage
from tests.unit.test_raft_core import leader_group


@given(st.integers(1, 2**62), st.integers(1, 2**62), st.sampled_from(list(EntryType)),
       st.lists(st.binary(max_size=64), min_size=1, max_size=40))
def test_batch_builder_gives_the_entries_entry_gives(first, term, type_, bodies):
    built = _new_entries(first, term, type_, bodies)
    expected = [Entry(first + i, term, type_, body) for i, body in enumerate(bodies)]
    assert built == expected
    assert all(type(e) is Entry for e in built)
    assert [hash(e) for e in built] == [hash(e) for e in expected]


@pytest.mark.parametrize("first, term, type_, bodies, words", [
    (0, 1, EntryType.NORMAL, [b"a"], "index"),
    (1, 0, EntryType.NORMAL, [b"a", b"b"], "term"),
    (1, 1, 1, [b"a", b"b"], "type"),
    (1, 1, EntryType.NORMAL, ["text"], "body"),
    (1, 1, EntryType.NORMAL, [b"a", b"b", bytearray(b"c")], "body"),
    (1, 1, EntryType.NORMAL, [b"a", None], "body"),
])
def test_batch_builder_rejects_what_entry_rejects(first, term, type_, bodies, words):
    with pytest.raises(InvalidMessage, match=words):
        _new_entries(first, term, type_, bodies)


def test_propose_with_a_bad_body_late_in_the_batch_appends_nothing():
    group = leader_group()
    leader = group["a"]
    before = leader.last_index
    with pytest.raises(InvalidMessage, match="body"):
        leader.propose([b"ok", b"ok", "not bytes"])
    assert leader.last_index == before
    first, last = leader.propose([b"x", b"y"])
    assert (first, last) == (before + 1, before + 2)

"""A controller stores its Raft term and vote on the reserve when the disk is full.

Regression: a controller follower on a disk full to the last block had its election timer
fire (a CI run under load); pysyncobj set the new term in memory, failed to store it
(`raft.journal.meta` is a temp file renamed into place: it needs a free block) and could
store no later term either, so it never rejoined and applied nothing more until space came
back. The term write now gives up the node's reserve on ENOSPC, as the state file's does.
Method: a one-node ControllerStateMachine without its tick thread; pysyncobj's MetaStorer made
to fail with ENOSPC the first time.
"""

from __future__ import annotations

import errno
import os

import pytest
from pysyncobj import journal

from ha.controller import ControllerStateMachine
from mqstore.localcluster import free_port


@pytest.fixture
def full_once(monkeypatch):
    calls = {"n": 0}
    real = journal.MetaStorer.storeMeta

    def store(self, meta):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, meta)
    monkeypatch.setattr(journal.MetaStorer, "storeMeta", store)
    return calls


def _machine(tmp_path, reserve_bytes: int) -> ControllerStateMachine:
    return ControllerStateMachine(f"127.0.0.1:{free_port()}", [], str(tmp_path), reserve_bytes=reserve_bytes,
                                  autoTick=False)


def test_regression_a_term_write_on_a_full_disk_gives_up_the_reserve(tmp_path, full_once):
    sm = _machine(tmp_path, 1 << 16)
    try:
        storer = sm._SyncObj__raftLog._FileJournal__metaStorer
        assert os.path.exists(sm.reserve.path)
        storer.storeMeta({"term": 7, "vote": "n1"})
        assert sm.reserve.given_up == 1 and not os.path.exists(sm.reserve.path)
        assert journal.MetaStorer(storer.getPath()).getMeta() == {"term": 7, "vote": "n1"}
        storer.storeMeta({"term": 8, "vote": None})          # later terms fit in the room left
        assert journal.MetaStorer(storer.getPath()).getMeta() == {"term": 8, "vote": None}
    finally:
        sm.destroy()


def test_without_a_reserve_the_full_disk_error_is_pysyncobjs_to_handle(tmp_path, full_once):
    sm = _machine(tmp_path, 0)
    try:
        storer = sm._SyncObj__raftLog._FileJournal__metaStorer
        with pytest.raises(OSError) as e:
            storer.storeMeta({"term": 7})
        assert e.value.errno == errno.ENOSPC
    finally:
        sm.destroy()

"""Goal: a controller whose disk fills neither dies of it nor loses a decision. Before,
pysyncobj's journal (an mmap grown with ftruncate) took the first decision replicated to a
controller on a full disk as a write into a page with no block behind it: SIGBUS, the process
gone without a word.

Expected outcome: a follower on a full disk keeps applying decisions (journal blocks allocated
ahead, its state written on the reserve it gives up); the leader on a full disk refuses
decisions asked through its API with 507 and a reason, and stays up; a controller that can
persist nothing more stops with exit code 1 and says why, while the other two go on deciding;
restarted with room, it catches up. No controller ever ends by a signal.

Method: three real controller processes, each data directory a small file system of its own
(tests/integration/small_disk.py: a tmpfs; without root the tests fail and say why), filled
and freed by the test; the test plays the brokers (heartbeats), as test_controller_processes
does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from mqstore.localcluster import request as http
from mqstore.localcluster import wait_for
from tests.integration import small_disk
from tests.integration.test_controller_processes import Cluster

pytestmark = pytest.mark.slow
DISK_MIB = 48     # the journal's 16 MiB allocated ahead, the 4 MiB reserve, the state file


def _route_on(c: Cluster, i: int, topic: str) -> bool:
    try:
        return http("GET", c.url(i, f"/routes/{topic}"), timeout=1.0)[0] == 200
    except OSError:
        return False


def _create(c: Cluster, topic: str) -> tuple[int, dict]:
    return http("POST", c.url(c.leader(), "/topics"), {"topic": topic, "queues": 2}, timeout=6.0)


GROW_JOURNAL = """
import sys
from pysyncobj.journal import ResizableFile
from node.store.fileio import FileSystem
path, reserve = sys.argv[1], int(sys.argv[2])
f = ResizableFile(path, defaultContent=bytes(40))   # as FileJournal opens it: 1 KiB, mmap'd
if reserve:
    FileSystem().reserve_blocks(path, reserve)
open(sys.argv[3], "w").write("ready")
input()                            # the test fills the disk now
f.write(1000, b"x" * 64 * 1024)    # grows the file by ftruncate and writes through the mmap
print("written")
"""


@pytest.mark.parametrize("reserve", [0, 1 << 20])
def test_the_journal_grows_into_allocated_blocks_on_a_full_disk(tmp_path, reserve):
    """The mechanism under the fix: pysyncobj's ResizableFile on a full disk dies of SIGBUS
    (the case without a reservation shows the write does land in a hole), and does not once
    the blocks are allocated ahead (ControllerStateMachine does it for its journal)."""
    small_disk.require()
    disk = small_disk.SmallDisk(str(tmp_path / "d"), 8).mount()
    try:
        ready = tmp_path / "ready"
        p = subprocess.Popen([sys.executable, "-c", GROW_JOURNAL, str(tmp_path / "d" / "raft.journal"), str(reserve),
                              str(ready)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        wait_for(ready.exists, timeout=20, what="journal opened")
        disk.fill()
        out, err = p.communicate(b"\n", timeout=20)
    finally:
        disk.unmount()
    if reserve:
        assert p.returncode == 0 and b"written" in out, err.decode()[-2000:]
    else:
        assert p.returncode == -signal.SIGBUS, (p.returncode, err.decode()[-2000:])


def test_controllers_on_full_disks_stay_up_or_stop_cleanly(tmp_path):
    small_disk.require()
    disks = {i: small_disk.SmallDisk(str(tmp_path / f"c{i}"), DISK_MIB).mount() for i in range(3)}
    c = Cluster(str(tmp_path))
    try:
        for i in range(3):
            c.start(i)
        c.leader()

        def master_elected():
            c.beat(1, 0, 0)
            r = c.beat(0, 0, 0)
            return r if r and r["role"] == "MASTER" else None
        wait_for(master_elected, what="first master")
        leader = c.leader()
        f1, f2 = [i for i in range(3) if i != leader]

        # A follower's disk full to the last page: it keeps applying every decision.
        disks[f1].fill()
        for k in range(30):
            st, doc = _create(c, f"Full{k}")
            assert st == 201, doc
        wait_for(lambda: _route_on(c, f1, "Full29"), timeout=10, what="the full follower applied the topics")
        assert c.procs[f1].running
        assert not os.path.exists(tmp_path / f"c{f1}" / "reserve"), "the reserve was given up for the state"

        # The leader's disk full: a topic asked for through its API is refused, with the reason.
        disks[leader].fill()
        st, doc = _create(c, "Refused")
        assert st == 507 and doc["error"] == "SERVICE_NOT_AVAILABLE" and doc["retriable"], doc
        assert "disk" in doc["message"]
        assert c.procs[leader].running and not _route_on(c, leader, "Refused")
        disks[leader].free()
        wait_for(lambda: _create(c, "AfterLeaderFreed")[0] == 201, timeout=10, what="leader decides again")

        # The follower can persist nothing more (its reserve is spent, the disk full again):
        # it stops with exit code 1 and says why; the other two go on.
        disks[f1].fill()
        st, doc = _create(c, "WithoutF1")
        assert st == 201, doc
        wait_for(lambda: not c.procs[f1].running, timeout=10, what="the follower that cannot persist stops")
        assert c.procs[f1].returncode == 1, c.procs[f1].tail()
        assert "cannot persist" in c.procs[f1].tail()
        assert _create(c, "StillDeciding")[0] == 201

        # Restarted with room, it catches up on what it missed.
        disks[f1].free()
        c.start(f1)
        for topic in ("WithoutF1", "StillDeciding"):
            wait_for(lambda: _route_on(c, f1, topic), timeout=20, what=f"restarted follower has {topic}")
        assert all(p.running for p in c.procs.values())
    finally:
        c.stop_all()
        codes = {i: p.returncode for i, p in c.procs.items()}
        for d in disks.values():
            d.unmount()
    assert all(code is not None and code >= 0 for code in codes.values()), f"a controller died of a signal: {codes}"

"""Retention decisions (pure) and their application to a CommitLog.

Method: `decide` gets hand-built segment ages and disk ratios, one rule per test:
expiry at deleteWhen, any hour after an admin's deleteExpiredCommitLog, any hour above 75 %, forced above 85 %, refuse at 90 %,
no holes, batch limit, never the last segment, never past the safe offset.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

import pytest

from node.store.commitlog import CommitLog
from node.store.fileio import FileSystem
from node.store.message import MessageDraft
from node.store.queue_offsets import QueueOffsetTable
from node.store.retention import RetentionConfigError, RetentionPolicy, SegmentAge, apply, decide

SEG = 1000
NOW = datetime(2030, 6, 1, 4, 15)
H = 3600


def ages(*hours_old: float) -> list[SegmentAge]:
    t = NOW.timestamp()
    return [SegmentAge(i * SEG, (i + 1) * SEG, t - h * H) for i, h in enumerate(hours_old)]


P = RetentionPolicy()


def test_expired_segments_go_at_the_delete_hour():
    d = decide(P, NOW, ages(100, 80, 10, 200), 0.30)
    assert d.delete_bases == (0, SEG)
    assert d.delete_upto == 2 * SEG
    assert (d.reason, d.refuse_writes) == ("time", False)


def test_nothing_goes_outside_the_delete_hour_with_room_on_disk():
    d = decide(P, NOW.replace(hour=5), ages(100, 80, 10, 200), 0.74)
    assert d.delete_bases == ()


def test_several_delete_hours_are_accepted():
    p = RetentionPolicy(delete_when="04;16")
    assert decide(p, NOW.replace(hour=16), ages(100, 1), 0.1).delete_bases == (0,)
    with pytest.raises(RetentionConfigError):
        RetentionPolicy(delete_when="04;25").validate()


def test_manual_deletion_takes_expired_segments_at_any_hour_and_no_young_one():
    d = decide(P, NOW.replace(hour=13), ages(100, 80, 10, 200), 0.30, manual=True)
    assert (d.delete_bases, d.reason) == ((0, SEG), "manual")
    assert decide(P, NOW.replace(hour=13), ages(1, 100, 200), 0.30, manual=True).delete_bases == ()
    assert decide(P, NOW, ages(100, 1), 0.30, manual=True).reason == "time"


def test_above_75_percent_expired_segments_go_at_any_hour():
    d = decide(P, NOW.replace(hour=13), ages(100, 80, 10, 1), 0.76)
    assert (d.delete_bases, d.reason) == ((0, SEG), "disk")


def test_above_85_percent_young_segments_go_too():
    d = decide(P, NOW.replace(hour=13), ages(1, 1, 1, 1), 0.86)
    assert (d.delete_bases, d.reason, d.refuse_writes) == ((0, SEG, 2 * SEG), "forced", False)


def test_writes_are_refused_at_90_percent():
    assert decide(P, NOW, ages(1, 1), 0.90).refuse_writes
    assert not decide(P, NOW, ages(1, 1), 0.899).refuse_writes


def test_no_holes_deletion_stops_at_the_first_young_segment():
    assert decide(P, NOW, ages(100, 10, 100, 1), 0.1).delete_bases == (0,)


def test_never_the_last_segment_even_when_forced():
    assert decide(P, NOW, ages(100), 0.99).delete_bases == ()


def test_batch_limit_and_safe_offset():
    p = RetentionPolicy(delete_files_batch_max=2)
    assert decide(p, NOW, ages(100, 100, 100, 100), 0.1).delete_bases == (0, SEG)
    assert decide(P, NOW, ages(100, 100, 100, 100), 0.1, safe_upto=2 * SEG + 5).delete_bases == (0, SEG)


def test_apply_deletes_only_expired_files_of_a_commitlog(tmp_path):
    cl = CommitLog(FileSystem(), str(tmp_path / "commitlog"), 4096, b"\x7f\x00\x00\x01", 1)
    cl.load()
    qt = QueueOffsetTable()
    for _ in range(4):
        cl.append_batch([MessageDraft("T", 0, b"q" * 3000, {}).seal()], qt, 1)
    paths = [s.path for s in cl.files.segments]
    mt = {p: NOW.timestamp() - h * H for p, h in zip(paths, (100, 100, 1, 100))}
    d = apply(cl, P, NOW, 0.2, safe_upto=cl.max_offset, mtime_of=mt.__getitem__)
    assert d.delete_bases == (0, 4096)
    assert [os.path.exists(p) for p in paths] == [False, False, True, True]
    assert cl.min_offset == 2 * 4096
    assert decide(P, NOW + timedelta(days=1), [], 0.5).delete_bases == ()

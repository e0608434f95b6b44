"""Goal: the epoch file is RocketMQ's text format, survives crashes atomically, and the
consistent-point search truncates to the newest shared epoch. Method: encode/decode
round trips (Hypothesis), a FaultyFileSystem crash, and hand-written divergent histories."""

import pytest
from hypothesis import given, strategies as st

from ha.epoch import (EpochEntry, EpochFile, decode, encode, find_consistent_point, with_ends)
from node.store.errors import CorruptRecord
from node.store.fileio import FaultyFileSystem, FileSystem


def E(epoch, start):
    return EpochEntry(epoch, start)


def test_format_matches_rocketmq_checkpoint_file_example():
    # The example in RocketMQ's CheckpointFile javadoc.
    assert encode([E(7, 7000), E(8, 8000)]) == b"2\n773307083\n7-7000\n8-8000\n"


@st.composite
def histories(draw):
    n = draw(st.integers(0, 10))
    epochs = sorted(draw(st.sets(st.integers(1, 10**12), min_size=n, max_size=n)))
    starts = sorted(draw(st.lists(st.integers(0, 2**62), min_size=n, max_size=n)))
    return [E(e, s) for e, s in zip(epochs, starts)]


@given(histories())
def test_round_trip(entries):
    assert decode(encode(entries)) == entries


@pytest.mark.parametrize("raw", [b"", b"x\n0\n", b"1\n0\n1-0\n", b"2\n1\n1-0\n", b"1\n5\n1+0\n",
                                 encode([E(1, 0)]).replace(b"1-0", b"1-9")])
def test_corrupt_files_are_reported(raw):
    with pytest.raises(CorruptRecord):
        decode(raw)


def test_out_of_order_entries_are_corrupt():
    body = b"2-0\n1-10\n"
    import zlib
    raw = b"2\n%d\n" % (zlib.crc32(body) & 0x7FFFFFFF) + body
    with pytest.raises(CorruptRecord):
        decode(raw)


def test_append_is_durable_and_rejects_backward_epochs(tmp_path):
    f = EpochFile(FileSystem(), str(tmp_path))
    f.append(1, 0)
    f.append(3, 500)
    f.append(3, 500)   # idempotent
    assert EpochFile(FileSystem(), str(tmp_path)).load() == [E(1, 0), E(3, 500)]
    with pytest.raises(AssertionError):
        f.append(2, 600)


def test_truncation_does_not_come_back_after_a_crash(tmp_path):
    """RocketMQ #10666: a truncated suffix must not resurrect after a second crash."""
    fs = FaultyFileSystem(seed=1)
    f = EpochFile(fs, str(tmp_path))
    f.append(1, 0)
    f.append(2, 1000)
    f.truncate_suffix(1000)
    fs.crash(torn=True)
    assert EpochFile(fs, str(tmp_path)).load() == [E(1, 0)]


def test_empty_list_is_written_not_skipped(tmp_path):
    f = EpochFile(FileSystem(), str(tmp_path))
    f.append(4, 0)
    f.truncate_suffix(0)
    assert EpochFile(FileSystem(), str(tmp_path)).load() == []


def test_drop_beyond_log_end_keeps_an_epoch_that_starts_exactly_there(tmp_path):
    f = EpochFile(FileSystem(), str(tmp_path))
    f.append(1, 0)
    f.append(2, 100)
    f.append(3, 200)
    f.drop_beyond(100)
    assert f.entries == [E(1, 0), E(2, 100)]


def test_with_ends():
    assert with_ends([E(1, 0), E(2, 100)], 150) == [EpochEntry(1, 0, 100), EpochEntry(2, 100, 150)]


def test_consistent_point_same_history_is_smaller_end():
    local = with_ends([E(1, 0), E(2, 100)], 180)
    master = with_ends([E(1, 0), E(2, 100)], 150)
    assert find_consistent_point(local, master) == 150


def test_old_master_with_unreplicated_tail_truncates_to_new_masters_epoch_start():
    # Old master wrote epoch 2 up to 500, the slave had only 300; slave became master at epoch 3 from 300.
    local = with_ends([E(1, 0), E(2, 100)], 500)
    master = with_ends([E(1, 0), E(2, 100), E(3, 300)], 900)
    assert find_consistent_point(local, master) == 300


def test_same_epoch_number_different_start_is_not_shared():
    local = with_ends([E(1, 0), E(2, 100)], 500)
    master = with_ends([E(1, 0), E(2, 120)], 900)
    assert find_consistent_point(local, master) == 100   # falls back to epoch 1, which ends at 100


def test_no_shared_epoch_is_minus_one():
    assert find_consistent_point(with_ends([E(5, 0)], 10), with_ends([E(6, 0)], 10)) == -1
    assert find_consistent_point([], with_ends([E(6, 0)], 10)) == -1


@given(histories(), st.integers(0, 5), st.integers(0, 2**62))
def test_consistent_point_never_exceeds_either_log(hist, cut, extra):
    cut = min(cut, len(hist))
    if not hist:
        return
    local_max = hist[-1].start_offset + extra % 1000
    master_max = hist[-1].start_offset + (extra // 7) % 1000
    p = find_consistent_point(with_ends(hist, local_max), with_ends(hist, master_max))
    assert p == min(local_max, master_max)

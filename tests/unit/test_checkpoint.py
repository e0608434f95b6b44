"""Checkpoint file: round trip, atomic replace, damage handling.

Goal: a saved checkpoint loads back exactly; a missing or damaged file loads as
zeros (full re-dispatch) and says so; a crash during save leaves the old or the
new version, never a torn one. Method: real files through FaultyFileSystem.
"""

from __future__ import annotations

import logging

from hypothesis import given, settings
from hypothesis import strategies as st

from node.store import layout as L
from node.store.checkpoint import Checkpoint
from node.store.fileio import FaultyFileSystem, FileSystem


def fields(cp: Checkpoint) -> tuple[int, int, int, int]:
    return (cp.physic_msg_timestamp, cp.logics_msg_timestamp, cp.index_msg_timestamp, cp.committed_offset)


def test_missing_file_loads_as_zeros(tmp_path):
    cp = Checkpoint(FileSystem(), str(tmp_path))
    assert cp.load() is False
    assert fields(cp) == (0, 0, 0, 0)
    assert cp.loaded_ok is False


def test_save_then_load_round_trips(tmp_path):
    fs = FileSystem()
    cp = Checkpoint(fs, str(tmp_path))
    cp.physic_msg_timestamp, cp.logics_msg_timestamp, cp.index_msg_timestamp = 30, 20, 10
    cp.committed_offset = 123_456
    cp.save()
    again = Checkpoint(fs, str(tmp_path))
    assert again.load() is True
    assert fields(again) == (30, 20, 10, 123_456)
    assert again.min_timestamp == 10
    assert len(open(cp.path, "rb").read()) == L.CHECKPOINT.size


@settings(deadline=None)     # each example saves with two fsyncs: a busy disk must not fail it
@given(st.integers(0, L.CHECKPOINT.size * 8 - 1))
def test_any_bit_flip_is_detected_and_means_full_redispatch(bit):
    import tempfile
    with tempfile.TemporaryDirectory() as root:     # one per example, removed (not left in /tmp)
        fs = FileSystem()
        cp = Checkpoint(fs, root)
        cp.committed_offset, cp.logics_msg_timestamp = 999, 5
        cp.save()
        raw = bytearray(open(cp.path, "rb").read())
        raw[bit // 8] ^= 1 << (bit % 8)
        open(cp.path, "wb").write(bytes(raw))
        again = Checkpoint(fs, root)
        assert again.load() is False
        assert fields(again) == (0, 0, 0, 0)


def test_damage_is_logged_clearly(tmp_path, caplog):
    fs = FileSystem()
    cp = Checkpoint(fs, str(tmp_path))
    open(cp.path, "wb").write(b"short")
    with caplog.at_level(logging.ERROR):
        assert cp.load() is False
    assert "damaged" in caplog.text
    assert "re-dispatched" in caplog.text


def test_crash_after_save_keeps_the_new_version(tmp_path):
    fs = FaultyFileSystem()
    cp = Checkpoint(fs, str(tmp_path))
    cp.committed_offset = 100
    cp.save()
    cp.committed_offset = 200
    cp.save()
    fs.crash(torn=True)
    again = Checkpoint(fs, str(tmp_path))
    assert again.load() is True
    assert again.committed_offset == 200

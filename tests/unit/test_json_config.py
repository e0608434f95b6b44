"""topics.json and consumerOffset.json: shape, atomic saves, .bak fallback.

Goal: RocketMQ's shapes round-trip; a missing file is a fresh store; a corrupt
file falls back to its .bak and, if that is unusable too, refuses to start with a
clear error instead of silently rewinding consumers. Method: real files.
"""

from __future__ import annotations

import json
import os

import pytest

from node.store.fileio import FaultyFileSystem, FileSystem
from node.store.json_config import ConfigCorrupt, ConsumerOffsetTable, TopicConfig, TopicConfigTable


def test_topics_round_trip_in_rocketmq_shape(tmp_path):
    fs = FileSystem()
    t = TopicConfigTable(fs, str(tmp_path), clock=lambda: 1700000000.5)
    assert t.load() == 0
    t.put(TopicConfig("A", readQueueNums=4, writeQueueNums=4))
    t.put(TopicConfig("B", order=True))
    doc = json.load(open(os.path.join(str(tmp_path), "config", "topics.json")))
    assert doc["topicConfigTable"]["A"] == {"topicName": "A", "readQueueNums": 4, "writeQueueNums": 4,
                                            "perm": 6, "order": False}
    assert doc["dataVersion"] == {"timestamp": 1700000000500, "counter": 2}
    again = TopicConfigTable(fs, str(tmp_path))
    assert again.load() == 2
    assert again.get("B") == TopicConfig("B", order=True)
    assert again.delete("A") is True
    assert again.delete("A") is False
    reloaded = TopicConfigTable(fs, str(tmp_path))
    assert reloaded.load() == 1
    assert set(reloaded.all()) == {"B"}


def test_offsets_round_trip_in_rocketmq_shape(tmp_path):
    fs = FileSystem()
    o = ConsumerOffsetTable(fs, str(tmp_path))
    o.load()
    assert o.query("g", "T", 0) == -1
    o.commit("g", "T", 0, 10)
    o.commit("g", "T", 3, 7)
    o.commit("h", "T", 0, 1)
    assert o.persist() is True
    assert o.persist() is False                  # nothing changed
    doc = json.load(open(o.path))
    assert doc == {"offsetTable": {"T@g": {"0": 10, "3": 7}, "T@h": {"0": 1}}}
    again = ConsumerOffsetTable(fs, str(tmp_path))
    assert again.load() == 2
    assert again.offsets("g", "T") == {0: 10, 3: 7}
    assert again.groups_of("T") == ["g", "h"]
    assert again.topics_of("g") == ["T"]
    with pytest.raises(ValueError):
        again.commit("g", "T", 0, -1)


def test_corrupt_file_falls_back_to_bak(tmp_path, caplog):
    fs = FileSystem()
    o = ConsumerOffsetTable(fs, str(tmp_path))
    o.commit("g", "T", 0, 5)
    o.persist()
    o.commit("g", "T", 0, 6)
    o.persist()                                  # .bak now holds offset 5
    open(o.path, "wb").write(b'{"offsetTable": {"T@g": {"0": 6')
    again = ConsumerOffsetTable(fs, str(tmp_path))
    again.load()
    assert again.query("g", "T", 0) == 5
    assert "corrupt" in caplog.text


def test_corrupt_file_without_good_bak_is_refused(tmp_path):
    fs = FileSystem()
    o = ConsumerOffsetTable(fs, str(tmp_path))
    o.commit("g", "T", 0, 5)
    o.persist()
    open(o.path, "wb").write(b"\x00\x00garbage")
    with pytest.raises(ConfigCorrupt, match="no .*bak"):
        ConsumerOffsetTable(fs, str(tmp_path)).load()
    open(o.path + ".bak", "wb").write(b"[1, 2]")
    with pytest.raises(ConfigCorrupt, match="corrupt too"):
        ConsumerOffsetTable(fs, str(tmp_path)).load()


def test_bad_shape_is_refused(tmp_path):
    fs = FileSystem()
    t = TopicConfigTable(fs, str(tmp_path))
    os.makedirs(os.path.dirname(t.path))
    open(t.path, "w").write(json.dumps({"topicConfigTable": {"A": {"readQueueNums": "x", "bogus": 1}}}))
    with pytest.raises(ConfigCorrupt, match="topicConfigTable"):
        t.load()


def test_a_corrupt_file_never_overwrites_a_good_bak(tmp_path):
    fs = FileSystem()
    o = ConsumerOffsetTable(fs, str(tmp_path))
    o.commit("g", "T", 0, 5)
    o.persist()
    o.commit("g", "T", 0, 6)
    o.persist()
    open(o.path, "wb").write(b"{broken")
    o.commit("g", "T", 0, 7)
    o.persist()
    assert json.load(open(o.path + ".bak"))["offsetTable"]["T@g"]["0"] == 5
    assert ConsumerOffsetTable(fs, str(tmp_path)).load() == 1


def test_saves_are_atomic_across_a_crash(tmp_path):
    fs = FaultyFileSystem(seed=3)
    o = ConsumerOffsetTable(fs, str(tmp_path))
    for i in range(5):
        o.commit("g", "T", 0, i)
        o.persist()
    fs.crash(torn=True)
    again = ConsumerOffsetTable(fs, str(tmp_path))
    again.load()
    assert again.query("g", "T", 0) == 4

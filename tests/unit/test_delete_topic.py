"""deleteTopic removes the topic's consume queues and consumer offsets, as RocketMQ does, and
neither live dispatch nor re-dispatch after a restart brings them back.

Method: a real standalone broker (LocalLog, Dispatcher, ConsumeQueueStore, index) in a temp
dir, driven in-process. Each test writes a topic and a group's offsets, deletes the topic
and checks the `consumequeue/<topic>` directory, the offsets and the queries; then stops the
broker, optionally removes the dispatch checkpoint (so the whole commitlog is dispatched
again, old records of the deleted topic included) and the offsets snapshot, starts a new
broker on the same files and checks again. Re-creating the topic starts it empty.
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from node.broker import OutgoingMessage
from node.config import BrokerConfig
from node.server import build_broker
from node.store.checkpoint import FILE_NAME as CHECKPOINT_FILE
from node.store.errors import TopicNotExist
from node.store.reaper import FileReaper
from tests.unit.fsync_hooks import FsyncHooked

TOPIC = "Gone"
KEEP = "Kept"
GROUP = "g1"


def new_broker(root: str):
    cfg = BrokerConfig(store_path_root_dir=root, mapped_file_size_commit_log=72 * 1024,
                       maped_file_size_consume_queue=20 * 64, max_message_size=4096).validate()
    return build_broker(cfg)


def cq_dir(root: str, topic: str) -> str:
    return os.path.join(root, "consumequeue", topic)


async def started(root: str):
    b = new_broker(root)
    await b.start()
    return b


async def write(b, topic: str, n: int, tag: str) -> None:
    await b.send(topic, [OutgoingMessage(body=f"{tag}-{i}".encode(), keys=[f"{tag}-key"], queue_id=i % 2)
                         for i in range(n)])


async def wait_dispatched(b) -> None:
    for _ in range(500):
        if b.dispatcher.position >= b.log.committed_position:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("dispatch did not catch up")


async def bodies(b, topic: str, qid: int) -> list[str]:
    """The queue's messages from its min offset (a re-created topic's queue offsets go on
    from the deleted one's, as the log hands them out; its queue starts there)."""
    lo = b.topic_status(topic)[qid]["min_offset"]
    r = await b.pull(topic, qid, lo, 64)
    return [m.body.decode() for m in r.messages]


async def setup(root: str):
    b = await started(root)
    await b.create_topic(TOPIC, 2)
    await b.create_topic(KEEP, 2)
    await write(b, TOPIC, 6, "old")        # 3 per queue
    await write(b, KEEP, 2, "keep")
    await wait_dispatched(b)
    await b.commit_offset(GROUP, TOPIC, 0, 2)
    await b.commit_offset(GROUP, KEEP, 0, 1)
    await wait_dispatched(b)
    assert os.path.isdir(cq_dir(root, TOPIC))
    return b


def check_deleted(b, root: str) -> None:
    assert not os.path.exists(cq_dir(root, TOPIC)), os.listdir(os.path.join(root, "consumequeue"))
    assert b.cq_store.get(TOPIC, 0) is None and b.cq_store.get(TOPIC, 1) is None
    assert TOPIC not in {t.topic for t in b.list_topics()}
    with pytest.raises(TopicNotExist):
        b.topic_status(TOPIC)
    assert b.get_offsets(GROUP) == {KEEP: {0: 1}}          # only the deleted topic's offsets went
    assert os.path.isdir(cq_dir(root, KEEP))


@pytest.mark.parametrize("lose_checkpoint", [False, True], ids=["clean-restart", "full-redispatch"])
def test_delete_topic_removes_queues_and_offsets_and_stays_deleted_after_restart(tmp_path, lose_checkpoint):
    root = str(tmp_path)

    async def main():
        b = await setup(root)
        await b.delete_topic(TOPIC)
        check_deleted(b, root)
        await b.stop()
        if lose_checkpoint:
            # Everything from the log's start is dispatched again: old records of the deleted
            # topic come by before the deletion record does.
            os.remove(os.path.join(root, CHECKPOINT_FILE))
        b = await started(root)
        try:
            if lose_checkpoint:
                assert b.dispatcher.dispatched_records >= 10      # it really re-dispatched the old records
            check_deleted(b, root)
            assert await bodies(b, KEEP, 0) == ["keep-0"] and await bodies(b, KEEP, 1) == ["keep-1"]
        finally:
            await b.stop()

    asyncio.run(main())


def test_recreated_topic_starts_empty_and_survives_restarts(tmp_path):
    root = str(tmp_path)

    async def main():
        b = await setup(root)
        await b.delete_topic(TOPIC)
        await b.create_topic(TOPIC, 2)
        assert [q["max_offset"] - q["min_offset"] for q in b.topic_status(TOPIC)] == [0, 0]
        await write(b, TOPIC, 2, "new")
        await wait_dispatched(b)
        await b.commit_offset(GROUP, TOPIC, 1, 4)
        await wait_dispatched(b)
        assert await bodies(b, TOPIC, 0) == ["new-0"] and await bodies(b, TOPIC, 1) == ["new-1"]
        assert [m.body for m in await b.query_by_key(TOPIC, "old-key")] == []    # old records are not the new topic's
        assert len(await b.query_by_key(TOPIC, "new-key")) == 2
        await b.stop()
        for lose in (False, True):
            if lose:
                os.remove(os.path.join(root, CHECKPOINT_FILE))
            b = await started(root)
            try:
                assert await bodies(b, TOPIC, 0) == ["new-0"], lose
                assert await bodies(b, TOPIC, 1) == ["new-1"], lose
                assert b.get_offsets(GROUP, TOPIC) == {TOPIC: {1: 4}}, lose    # the new commit, not the old
            finally:
                await b.stop()

    asyncio.run(main())


def test_offsets_snapshot_saved_before_the_deletion_is_purged_at_start(tmp_path):
    """A crash after the deletion but before the next offsets save leaves the deleted topic's
    offsets in consumerOffset.json; the start finds the deletion and drops them."""
    root = str(tmp_path)

    async def main():
        b = await setup(root)
        b._save_snapshots()
        snapshot = os.path.join(root, "config", "consumerOffset.json")
        stale = open(snapshot, "rb").read()
        await b.delete_topic(TOPIC)
        await b.stop()
        with open(snapshot, "wb") as f:
            f.write(stale)                  # as if the process died before saving again
        assert TOPIC in stale.decode()
        b = await started(root)
        try:
            check_deleted(b, root)
        finally:
            await b.stop()

    asyncio.run(main())


def test_redispatch_does_not_write_old_records_into_a_recreated_queue(tmp_path):
    """Deleted, restarted (the standalone log hands out queue offsets from 0 again), re-created
    and written: the old and the new records share queue offsets. A full re-dispatch must
    skip the old ones, not write them over the new queue's units and repair them back."""
    root = str(tmp_path)

    async def main():
        b = await setup(root)
        await b.delete_topic(TOPIC)
        await b.stop()
        b = await started(root)
        await b.create_topic(TOPIC, 2)
        await write(b, TOPIC, 2, "new")
        await wait_dispatched(b)
        first = [q["min_offset"] for q in b.topic_status(TOPIC)]
        await b.stop()
        os.remove(os.path.join(root, CHECKPOINT_FILE))
        b = await started(root)
        try:
            assert [q["min_offset"] for q in b.topic_status(TOPIC)] == first
            assert await bodies(b, TOPIC, 0) == ["new-0"] and await bodies(b, TOPIC, 1) == ["new-1"]
            assert [b.cq_store.get(TOPIC, q).repaired_units for q in (0, 1)] == [0, 0]
        finally:
            await b.stop()

    asyncio.run(main())


def test_regression_deleting_a_topic_never_waits_on_the_event_loop_for_its_files(tmp_path):
    """The deletion's dispatch closed each of the topic's queues, removed their directories and
    fsynced the parent on the event loop; closing a queue waits for a flush of it in progress
    (an fsync on a worker thread), so the loop waited for that fsync. Now the queues' directories
    are renamed aside on the loop and the reaper's thread closes and removes them; a directory
    a crash left aside is removed at the next start."""
    root = str(tmp_path)

    class Gated(FsyncHooked):
        def __init__(self):
            self.gate, self.entered = threading.Event(), threading.Event()
            self.gate.set()
            self.reaper = FileReaper()

        def before_fsync_of(self, path):
            if os.path.join("consumequeue", TOPIC) in path and not self.gate.is_set():
                self.entered.set()
                assert self.gate.wait(10)

    def aside() -> list[str]:
        return [n for n in os.listdir(os.path.join(root, "consumequeue")) if n.startswith(".")]

    async def main():
        fs = Gated()
        b = build_broker(new_broker(root).config, fs=fs)
        await b.start()
        try:
            await b.create_topic(TOPIC, 2)
            await b.create_topic(KEEP, 2)
            await write(b, TOPIC, 6, "old")
            await write(b, KEEP, 2, "keep")
            await wait_dispatched(b)
            fs.gate.clear()
            threading.Timer(3.0, fs.gate.set).start()    # were the loop to wait, only this frees it
            flushing = asyncio.ensure_future(b.dispatcher.flush_in_background())
            for _ in range(500):
                if fs.entered.is_set():
                    break
                await asyncio.sleep(0.01)
            assert fs.entered.is_set(), "a flush of the topic's queues is under way"
            await b.delete_topic(TOPIC)
            await wait_dispatched(b)
            assert not fs.gate.is_set(), "deleting the topic waited on the loop for a flush's fsync"
            assert not os.path.exists(cq_dir(root, TOPIC)) and b.cq_store.get(TOPIC, 0) is None
            fs.gate.set()
            await flushing
            assert await asyncio.to_thread(fs.reaper.drain, 10)
            assert aside() == []
            await b.create_topic(TOPIC, 2)                 # the name is free at once
            await write(b, TOPIC, 2, "new")
            await wait_dispatched(b)
            assert await bodies(b, TOPIC, 0) == ["new-0"]
        finally:
            fs.gate.set()
            await b.stop()
        left = os.path.join(root, "consumequeue", ".deleted-Gone-0-1")   # as a crash would leave it
        os.makedirs(left)
        open(os.path.join(left, "00000000000000000000"), "wb").write(b"\0" * 20)
        b = await started(root)
        try:
            assert aside() == []
            assert await bodies(b, TOPIC, 0) == ["new-0"] and await bodies(b, KEEP, 1) == ["keep-1"]
        finally:
            await b.stop()

    asyncio.run(main())

"""Goal: a broker that writes (standalone, master, leader) takes the controller's topics as the
controller holds them: created, grown, and with the controller's perm; never shrunk or deleted.
Method: an in-memory broker (tests/unit/test_broker.py's harness) fed heartbeat-reply topics
through `ha.controller_server.topics_of_reply`, as the ControllerClient does."""

from __future__ import annotations

import asyncio

import pytest

from ha.controller_server import topics_of_reply
from node.store.errors import NoPermission
from tests.unit.test_broker import make_broker, msg


def reply(**topics):
    """A heartbeat reply naming `topics` as {name: (queues, perm)}."""
    return {"topics": {t: list(range(q)) for t, (q, _) in topics.items()},
            "topic_perms": {t: p for t, (_, p) in topics.items()}}


def test_perm_changed_on_the_controller_reaches_the_broker(tmp_path):
    """Regression: topics created or grown on the controller reached brokers, a perm change did not."""
    async def go():
        h = make_broker(str(tmp_path))
        await h.broker.start()
        b = h.broker
        assert await b.apply_controller_topics(topics_of_reply(reply(T=(4, 6)))) == ["T"]
        await b.send("T", [msg(queue_id=1)])
        assert await b.apply_controller_topics(topics_of_reply(reply(T=(4, 6)))) == []      # nothing to do
        assert await b.apply_controller_topics(topics_of_reply(reply(T=(4, 4)))) == ["T"]   # read-only now
        await h.settle()
        t = b.topic("T")
        assert (t.read_queue_nums, t.write_queue_nums, t.perm) == (4, 4, 4)
        with pytest.raises(NoPermission):
            await b.send("T", [msg(queue_id=1)])
        # Fewer queues and writable again: perm follows, queues never shrink.
        assert await b.apply_controller_topics(topics_of_reply(reply(T=(2, 6)))) == ["T"]
        await h.settle()
        t = b.topic("T")
        assert (t.read_queue_nums, t.write_queue_nums, t.perm) == (4, 4, 6)
        await b.send("T", [msg(queue_id=3)])
        await b.stop()
    asyncio.run(go())


def test_reply_perm_out_of_range_falls_back_to_read_write():
    assert topics_of_reply(reply(A=(2, 9), B=(1, 2))) == {"A": (2, 6), "B": (1, 2)}

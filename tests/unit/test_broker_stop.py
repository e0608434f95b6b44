"""A node's stop keeps its fsyncs off the event loop.

Regression: at stop the dispatcher's last flush, the last snapshots, the consume queues' flush
and the removal of the abort marker fsynced on the loop; a random-fault run on a slow disk saw
a 591 ms stall in the first of them, with the node's other tasks (Raft's, HA's) held behind it.
Here every fsync takes 250 ms and a watchdog on the loop warns of any stall over 150 ms."""

from __future__ import annotations

import asyncio
import time

from node.broker import OutgoingMessage
from node.config import BrokerConfig
from node.loop_watchdog import LoopWatchdog
from node.server import build_broker
from tests.unit.fsync_hooks import FsyncHooked

SLOW_FSYNC_S = 0.25


class SlowFsync(FsyncHooked):
    """Every file and directory fsync takes SLOW_FSYNC_S once `slow` is set."""

    def __init__(self):
        self.slow = False
        self.slow_fsyncs = 0

    def before_fsync(self):
        if self.slow:
            self.slow_fsyncs += 1
            time.sleep(SLOW_FSYNC_S)


def test_regression_a_stop_on_a_slow_disk_does_not_stall_the_event_loop(tmp_path):
    fs = SlowFsync()
    cfg = BrokerConfig(store_path_root_dir=str(tmp_path), mapped_file_size_commit_log=256 * 1024,
                       maped_file_size_consume_queue=20 * 1024, max_message_size=4096).validate()

    async def scenario():
        b = build_broker(cfg, fs=fs)
        await b.start()
        await b.create_topic("T", 2)
        for i in range(20):
            await b.send("T", [OutgoingMessage(body=b"m%d" % i, queue_id=i % 2)])
        await asyncio.sleep(0.05)
        fs.slow = True
        wd = LoopWatchdog(warn_s=0.15, beat_s=0.01)
        wd.start()
        try:
            await b.stop()
            await asyncio.sleep(0.05)           # the watchdog's tick runs and sees any stall
        finally:
            wd.stop()
        return wd

    wd = asyncio.run(scenario())
    assert fs.slow_fsyncs >= 3, "the stop did fsync (snapshots, queues, checkpoint, the log)"
    assert wd.stalls == 0, f"the loop was blocked {wd.stalls} time(s), longest {wd.stalled_s_max:.3f} s"

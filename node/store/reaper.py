"""Old files removed off the event loop, oldest first, each durable before the next.

Retention deletes whole head files of a segmented file set: the commitlog's, every consume
queue's, a DLedger store's data and index files. Each removal is an unlink and a directory
fsync, made durable before the next so that a crash leaves the oldest files, never a gap
(node/store/segment.py `delete_head`). On a busy disk that fsync waits for the file system's
journal, tens to hundreds of ms, and a retention pass may remove a file of every queue.
RocketMQ runs this work on threads of its own (CleanCommitLogService,
CleanConsumeQueueService); here the owner detaches the files on its loop (in memory: no read,
flush or fetch sees them after that, and their descriptors are closed) and one reaper thread
per node removes them, in the order they were given.

The queue is bounded: a job that finds it full waits for room where it was submitted (a
bound, not a drop; run there at once, it would pass older files still queued and leave a gap).
A file not yet removed when the process ends is still a head file at the next start, before
the live ones with no gap, and retention takes it again.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)

MAX_PENDING = 1024       # removal jobs waiting (one per delete_head call); more wait for room
CLOSE_DRAIN_S = 30.0     # an owner's close waits this long for the removals it gave the reaper


class FileReaper:
    def __init__(self, max_pending: int = MAX_PENDING):
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue(max_pending)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.waited_for_room = 0   # jobs that met a full queue

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` on the reaper thread after every job submitted before it; with the queue
        full, wait here until there is room."""
        self._ensure_thread()
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            self.waited_for_room += 1
            self._jobs.put(job)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every job submitted so far has run; False if `timeout_s` passed first."""
        if self._thread is None:
            return True
        done = threading.Event()
        try:
            self._jobs.put(done.set, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="file-reaper", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - a job records its own failure; this only keeps the thread
                log.exception("file reaper: a removal job failed")


def run_or_hand_over(reaper: FileReaper | None, job: Callable[[], None]) -> bool:
    """`job` on `reaper`'s thread, or here and now without one; True if it was handed over."""
    if reaper is None:
        job()
        return False
    reaper.submit(job)
    return True

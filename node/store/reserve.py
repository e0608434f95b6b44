"""The store's reserve: room kept for the writes that must come before a full disk is freed.

A disk filled to the last block (by anything: the store's own guard stops appends well
before) would otherwise keep a node from freeing it. A restart writes before it can run
retention: the abort marker (standalone and classic), meta (DLedger); a DLedger retention cut
writes its base state and meta before it deletes a file. So each store root keeps
`<storePathRootDir>/reserve`, `diskReserveBytes` of allocated zeros (not a sparse hole). Such
a write that meets ENOSPC gives the reserve up, says so, and is tried once more; every write
after it has that room too (a DLedger node's term and vote, so it can be elected). Once given
up, the reserve comes back after retention has deleted files, or once the disk has room again
(`restore_if_room`, each second from the broker's retention loop: at least RESTORE_ROOM_FACTOR
times its size free), so a second full disk finds it in place (found by the random-fault runs: a node whose
disk filled twice, restarted the second time, could not write its meta at recovery).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from node.store.errors import is_enospc
from node.store.fileio import FileSystem

log = logging.getLogger(__name__)

RESERVE_FILE = "reserve"
RESTORE_ROOM_FACTOR = 3     # a spent reserve comes back on its own once this many times its size is free


class DiskReserve:
    def __init__(self, fs: FileSystem, store_root: str, size: int):
        assert size >= 0
        self.fs = fs
        self.size = size
        self.path = os.path.join(store_root, RESERVE_FILE)
        self.given_up = 0      # times it was given up (status, tests)
        self._spent = False    # given up, and no deletion since: its room is the node's to use
        self._lock = threading.Lock()   # giving it up and putting it back, from any thread

    def ensure(self, freed: bool = False) -> bool:
        """Put the reserve file in place if it is not; True when it is. `freed`: retention has
        just deleted files (a spent reserve comes back only then, not to take its room away
        from the writes it was given up for). Best effort: on a full disk it stays missing
        (logged) and the next deletion tries again. With a size of 0 a file left by an earlier
        setting is removed."""
        if self.size == 0:
            self.fs.remove(self.path)
            return False
        with self._lock:
            if self._spent and not freed:
                return False
            self._spent = False
            try:
                self.fs.allocate(self.path, self.size)
                return True
            except OSError as e:
                log.warning("no room for the %d-byte reserve %s (%s); tried again after the next retention "
                            "deletion", self.size, self.path, e)
                return False

    def restore_if_room(self) -> bool:
        """Put a missing reserve back when the disk has room again (RESTORE_ROOM_FACTOR times its
        size free): cheap enough for a periodic tick (a stat, and a statfs while missing). True
        when it is in place."""
        if self.size == 0:
            return False
        if self.fs.exists(self.path):
            return True
        if self.fs.free_bytes(os.path.dirname(self.path)) < RESTORE_ROOM_FACTOR * self.size:
            return False
        return self.ensure(freed=True)

    def using(self, write: Callable[[], None], what: str) -> None:
        """`write()`; if it meets a full disk and the reserve is there, give the reserve up and
        `write()` once more (its error, if it fails again, is the caller's). Safe from any
        thread: a worker's write (a DLedger node's term and vote, the controller's Raft meta)
        and the event loop's (a retention cut, putting the reserve back) may meet here."""
        try:
            write()
            return
        except Exception as e:  # noqa: BLE001 - only ENOSPC is ours; anything else is re-raised as is
            if not is_enospc(e) or self.size == 0:
                raise
            with self._lock:
                if self.fs.exists(self.path):
                    log.warning("disk full writing %s: the %d-byte reserve %s is given up for it", what,
                                self.size, self.path)
                    self.fs.remove(self.path)
                    self.fs.fsync_dir(os.path.dirname(self.path))
                    self.given_up += 1
                    self._spent = True
                elif not self._spent:
                    raise       # no reserve here to give up
                # else: given up already (by another writer a moment ago): its room may be left
        write()

"""The `abort` marker: exists while the store runs, removed by a clean stop.

Found at start, it means the last run did not stop cleanly, so recovery walks
from the checkpoint instead of trusting the last files (RocketMQ's
DefaultMessageStore.isTempFileExist / createTempFile). Creation and removal
are fsynced (file and directory) so the marker itself survives a crash.
"""

from __future__ import annotations

import os

from node.store.fileio import FileSystem

ABORT_FILE_NAME = "abort"


def abort_path(store_root: str) -> str:
    return os.path.join(store_root, ABORT_FILE_NAME)


def exists(fs: FileSystem, store_root: str) -> bool:
    return fs.exists(abort_path(store_root))


def create(fs: FileSystem, store_root: str) -> None:
    """Durably create the marker (write_atomic fsyncs the file and the directory)."""
    fs.makedirs(store_root)
    fs.write_atomic(abort_path(store_root), str(os.getpid()).encode("ascii"))


def remove(fs: FileSystem, store_root: str) -> None:
    """Durably remove the marker: after this returns, a crash still reads as a clean stop."""
    fs.remove(abort_path(store_root))
    fs.fsync_dir(store_root)

"""A real file system that calls `before_fsync()` ahead of every file and directory fsync: the
tests that hold or slow a node's fsyncs subclass it."""

from __future__ import annotations

from node.store.fileio import FileSystem


class FsyncHooked(FileSystem):
    def before_fsync(self) -> None:
        """Called on the fsyncing thread before each fsync."""

    def fsync_dir(self, path):
        self.before_fsync()
        super().fsync_dir(path)

    def open(self, path):
        handle, fs = super().open(path), self

        class Hooked:
            def __getattr__(self, name):
                return getattr(handle, name)

            def fsync(self):
                fs.before_fsync()
                handle.fsync()
        return Hooked()

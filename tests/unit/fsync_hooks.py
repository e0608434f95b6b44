"""A real file system that calls `before_fsync()` ahead of every file and directory fsync: the
tests that hold or slow a node's fsyncs subclass it (`before_fsync_of(path)` where the file
matters)."""

from __future__ import annotations

from node.store.fileio import FileSystem


class FsyncHooked(FileSystem):
    def before_fsync(self) -> None:
        """Called on the fsyncing thread before each fsync."""

    def before_fsync_of(self, path: str) -> None:
        """Called on the fsyncing thread before each fsync of `path` (a file or a directory)."""
        self.before_fsync()

    def fsync_dir(self, path):
        self.before_fsync_of(path)
        super().fsync_dir(path)

    def open(self, path):
        handle, fs = super().open(path), self

        class Hooked:
            def __getattr__(self, name):
                return getattr(handle, name)

            def fsync(self):
                fs.before_fsync_of(path)
                handle.fsync()
        return Hooked()

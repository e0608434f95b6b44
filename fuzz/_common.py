"""Shared runner for the harnesses: corpus directories, libFuzzer defaults, allowed errors.

`run(target, test_one_input, modules)` instruments `modules` (so coverage guides the
mutations), then hands control to libFuzzer. Unless the command line names corpus
directories, the committed seeds `fuzz/corpus/<target>/` are read and new inputs are
written to a scratch directory (`$MQSTORE_FUZZ_DIR/<target>`, default under the
system temp dir), never into the committed seeds. Crash inputs land there too.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import sys
import tempfile
from typing import Callable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS_ROOT = os.path.join(HERE, "corpus")
# Per-input limits: a decoder that needs more than this on a few KB of input is a bug.
DEFAULT_FLAGS = ("-rss_limit_mb=1536", "-malloc_limit_mb=512", "-timeout=20", "-max_len=8192")


def scratch_dir(target: str) -> str:
    root = os.environ.get("MQSTORE_FUZZ_DIR") or os.path.join(tempfile.gettempdir(), "mqstore-fuzz")
    path = os.path.join(root, target)
    os.makedirs(path, exist_ok=True)
    return path


def libfuzzer_argv(target: str, argv: Sequence[str]) -> list[str]:
    """argv with our defaults for every flag the caller did not give, and the corpus dirs."""
    args = list(argv)
    given = {a.split("=", 1)[0] for a in args[1:] if a.startswith("-")}
    for flag in DEFAULT_FLAGS:
        if flag.split("=", 1)[0] not in given:
            args.append(flag)
    scratch = scratch_dir(target)
    if "-artifact_prefix" not in given:
        args.append(f"-artifact_prefix={scratch}/")
    if not any(not a.startswith("-") for a in args[1:]):
        # First directory receives new inputs; the committed seeds are only read.
        args += [os.path.join(scratch, "corpus"), os.path.join(CORPUS_ROOT, target)]
        os.makedirs(args[-2], exist_ok=True)
    return args


def run(target: str, test_one_input: Callable[[bytes], None], modules: Sequence[str]) -> None:
    import atheris   # dev extra; imported here so the harness modules import without it

    # Recovery paths log every cut they make; at thousands of inputs a second that is noise.
    logging.disable(logging.CRITICAL)

    # Instrument the decoders: the harnesses import them lazily, so the first import is here.
    already = [m for m in modules if m in sys.modules]
    assert not already, f"imported before instrumentation: {already}"
    with atheris.instrument_imports(include=["node", "dledger", "ha"]):
        for name in modules:
            importlib.import_module(name)
    atheris.Setup(libfuzzer_argv(target, sys.argv), test_one_input)
    atheris.Fuzz()


def replay(test_one_input: Callable[[bytes], None], target: str) -> int:
    """Run every committed seed of `target` once (no atheris needed); returns the count."""
    directory = os.path.join(CORPUS_ROOT, target)
    n = 0
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            test_one_input(f.read())
        n += 1
    return n


def fast_filesystem():
    """Real files without fsync: a harness re-creates its store per input, durability is not
    what it tests, and an fsync per input would make the run a disk benchmark."""
    from node.store.fileio import FileSystem, OsFile

    class _File(OsFile):
        __slots__ = ()

        def fsync(self) -> None:
            pass

    class _FS(FileSystem):
        def open(self, path: str):
            return _File(path, os.open(path, os.O_RDWR | os.O_CREAT, 0o644))

        def fsync_dir(self, path: str) -> None:
            pass

    return _FS()


def scratch_root(target: str) -> str:
    """A directory for a harness's files under its scratch dir, one per process. libFuzzer
    leaves by exit() (no Python atexit), so dirs of processes that are gone are removed here.
    In memory (/dev/shm) where there is one: the harnesses rewrite their files per input."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        root = os.path.join("/dev/shm", f"mqstore-fuzz-{os.getuid()}", target)
        os.makedirs(root, exist_ok=True)
    else:
        root = scratch_dir(target)
    for name in os.listdir(root):
        if name.startswith("store-") and name[6:].isdigit() and not _alive(int(name[6:])):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    path = os.path.join(root, f"store-{os.getpid()}")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

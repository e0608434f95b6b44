"""LD_PRELOAD shims for real node processes: built once per test session from their C source.

    path = build("wallclock_shim.c")      # the shared library, compiled on first use
    env = preload(proc_env, path)         # LD_PRELOAD for a process, beside any shim it has
    class WallClock(SettingShim): ...     # one integer setting per process, in a file of its own

Each shim reads its setting from a file named by an environment variable, so a test changes
a running process's fault by rewriting that file. Needs a C compiler (`cc`); without one
`build` raises with that reason.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
_built: dict[tuple[str, int], str] = {}     # (source, mtime) -> built library, per interpreter


def build(source_name: str) -> str:
    """The shared library of tests/integration/<source_name>, compiled into a temp dir on first use."""
    source = os.path.join(HERE, source_name)
    key = (source, os.stat(source).st_mtime_ns)
    if key in _built and os.path.exists(_built[key]):
        return _built[key]
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError(f"the {source_name} shim needs a C compiler (cc): apt-get install gcc")
    where = tempfile.mkdtemp(prefix="mqstore-shim-")
    atexit.register(shutil.rmtree, where, True)   # a process already running keeps its mapping
    out = os.path.join(where, os.path.splitext(source_name)[0] + ".so")
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", out, source, "-ldl"], check=True,
                   capture_output=True, timeout=60)
    _built[key] = out
    return out


def unavailable(source_name: str) -> str | None:
    """Why the shim cannot be used here (no C compiler, it does not build), or None."""
    try:
        build(source_name)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return str(e)
    return None


def preload(env: dict[str, str] | None, library: str) -> dict[str, str]:
    """`env` with `library` added to LD_PRELOAD (after any shim already there)."""
    env = dict(env or {})
    have = env.get("LD_PRELOAD", "").split()
    env["LD_PRELOAD"] = " ".join([*have, library] if library not in have else have)
    return env


def write_setting(path: str, value: int) -> None:
    """Replace a shim's setting file atomically (a process reads it within ~20 ms)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{value}\n")
    os.replace(tmp, path)


class SettingShim:
    """A shim whose setting is one integer per named process, in a file of that process's own
    (its path in the environment variable ENV). Every process starts at 0, the shim's
    "no fault"; `reset` puts every one back there."""

    SOURCE = ""     # the shim's C source, in tests/integration
    ENV = ""        # the variable naming its setting file
    SUFFIX = ""     # the setting file's name is <process name><SUFFIX>

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.library = build(self.SOURCE)
        self.settings: dict[str, int] = {}

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}{self.SUFFIX}")

    def attach(self, name: str, proc) -> None:
        """Run `proc` (an mqstore.localcluster.Proc not started yet) under the shim as `name`."""
        if name not in self.settings:
            self.write(name, 0)
        proc.env = {**preload(proc.env, self.library), self.ENV: self._path(name)}

    def write(self, name: str, value: int) -> None:
        write_setting(self._path(name), value)
        self.settings[name] = value

    def reset(self) -> None:
        for name in list(self.settings):
            self.write(name, 0)

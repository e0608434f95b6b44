"""`mqstore cluster up --detach` as a user runs it, on free loopback ports, for the cluster-up tests."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Callable, Iterable, Iterator

from mqstore import cluster as mc
from mqstore import localcluster as lc


@contextlib.contextmanager
def cluster_up(d: str, ports_of: Callable[[int], Iterable[int]], processes: int, *extra: str) -> Iterator[str]:
    """Runs `python -m mqstore.cli cluster up --detach --dir d ...extra` on a base port whose every
    port (`ports_of(base)`) is free, yields what it printed, and at the end checks that
    `cluster down` ends exactly `processes` processes."""
    r = subprocess.run([sys.executable, "-m", "mqstore.cli", "cluster", "up", "--detach", "--dir", d,
                        "--base-port", str(lc.free_base_port(ports_of)), *extra],
                       capture_output=True, text=True, timeout=120)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        yield r.stdout
    finally:
        stopped = mc.stop(d)
        assert r.returncode != 0 or len(stopped) == processes

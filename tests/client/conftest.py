"""Fixtures: one standalone node shared by a module's tests (each test uses its own topics and groups)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Awaitable

import pytest

from tests.client.nodes import Standalone

_names = itertools.count()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = Standalone(tmp_path_factory.mktemp("client")).start()
    yield n
    n.close()


@pytest.fixture
def name():
    """A fresh topic/group name per call: tests share a node, never a topic."""
    return lambda prefix="T": f"{prefix}{next(_names)}"


def run(coro: Awaitable[Any], timeout_s: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def eventually(pred, timeout_s: float = 15.0, step_s: float = 0.05, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(step_s)

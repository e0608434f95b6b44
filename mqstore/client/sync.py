"""Synchronous faces of the asyncio clients: each runs its asyncio twin on a private loop thread.

`Producer(...).send(msg)` submits `AsyncProducer.send(msg)` to the loop thread and waits for
it. Callbacks (send_async, listeners that are coroutine functions) run on that loop thread;
plain-function listeners run on the consumer's thread pool. Iterating a `Consumer` without
a listener (`for msg in consumer`) acknowledges each message when the next one is asked for.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from typing import Any, Callable

from mqstore.client.admin import AsyncAdmin
from mqstore.client.consumer import AsyncConsumer, AsyncPullConsumer
from mqstore.client.errors import MQClientError
from mqstore.client.producer import AsyncProducer
from mqstore.client.transaction import AsyncTransactionProducer

CALL_TIMEOUT_S = 600.0          # bound on any one synchronous call


class _LoopThread:
    """One event loop on one daemon thread, owned by one synchronous client."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        if threading.current_thread() is self._thread:
            raise MQClientError("a synchronous client method was called from its own loop thread "
                                "(e.g. inside a coroutine listener); use the asyncio client there")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10.0)
        if not self._thread.is_alive():
            self.loop.close()


class _Sync:
    """Wraps an asyncio client: coroutine methods become blocking calls; the rest pass through."""

    _async_cls: type = object

    def __init__(self, *args: Any, **kw: Any):
        self._lt = _LoopThread(f"mqstore-{type(self).__name__}")

        async def build() -> Any:
            return self._async_cls(*args, **kw)
        try:
            self._aio = self._lt.run(build())
        except BaseException:
            self._lt.stop()
            raise
        self._started = False

    @property
    def aio(self) -> Any:
        """The asyncio client underneath (use it only on its loop: `self.loop`)."""
        return self._aio

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._lt.loop

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)      # private state of the wrapper itself (and no recursion on _aio)
        attr = getattr(self._aio, name)
        if inspect.iscoroutinefunction(attr):
            @functools.wraps(attr)
            def call(*args: Any, **kw: Any) -> Any:
                return self._lt.run(attr(*args, **kw))
            return call
        return attr

    def start(self):
        self._lt.run(self._aio.start())
        self._started = True
        return self

    def shutdown(self) -> None:
        if self._lt.loop.is_closed():
            return
        try:
            if self._started:
                self._lt.run(self._aio.close())
        finally:
            self._started = False
            self._lt.stop()

    close = shutdown

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class Producer(_Sync):
    """Synchronous producer: `send`, `send_batch`, `send_oneway`, `send_async(msg, on_success)`."""

    _async_cls = AsyncProducer

    def send_async(self, msg: Any, on_success: Callable | None = None, on_exception: Callable | None = None,
                   **kw: Any) -> Any:
        """Returns a concurrent.futures.Future of the SendResult; callbacks run on the loop thread."""
        async def submit() -> Any:
            return self._aio.send_async(msg, on_success, on_exception, **kw)
        task = self._lt.run(submit())
        return asyncio.run_coroutine_threadsafe(_await(task), self._lt.loop)


class TransactionProducer(Producer):
    _async_cls = AsyncTransactionProducer


class PullConsumer(_Sync):
    _async_cls = AsyncPullConsumer


class Admin(_Sync):
    _async_cls = AsyncAdmin


class Consumer(_Sync):
    """Synchronous push consumer: give a listener, or iterate (`for msg in consumer`)."""

    _async_cls = AsyncConsumer

    def __iter__(self) -> "Consumer":
        return self

    def __next__(self) -> Any:
        try:
            return self._lt.run(self._aio.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def poll(self, timeout_s: float) -> Any:
        """The next message (acknowledging the previous one), or None after timeout_s."""
        return self._lt.run(self._aio.getone(timeout_s))

    def reconsume_later(self, msg: Any) -> None:
        self._aio.reconsume_later(msg)


async def _await(task: asyncio.Task) -> Any:
    return await task

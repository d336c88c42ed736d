"""Eager tasks: a new task runs its first step inside `create_task`, not one loop pass later.

Why: a dispatch timer fires in the middle of a loop pass that may be handling hundreds of chunk
reads; a task created there starts only after the rest of that pass and the next poll, and on
Python 3.11 aiohttp writes the request body from one more task of its own, another pass later.
Under 20k chunks/s those passes are what a dispatch waits for. With eager tasks the request
leaves the client inside the timer's callback.

On Python 3.12+ `eager_task_factory` is the standard library's `asyncio.eager_task_factory`.
On 3.11 (the oldest version the project supports) that public API does not exist, and no public
API can take its place: a coroutine's first step has to run with the new task registered as the
loop's current task (so `asyncio.current_task()`, `asyncio.timeout` and aiohttp's timeouts inside
that step see the task they belong to), and 3.11 exposes the current-task bookkeeping only as
the private `asyncio.tasks._enter_task` / `_leave_task` (3.12 does that swap inside `Task`
itself when it starts eagerly). So on 3.11 this module runs the first step itself under those
two functions and hands the step's outcome to an ordinary `asyncio.Task` through the `_Started`
shim. The shim is dropped, with the import of the private functions, when the project requires
3.12.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import contextvars
import sys
from asyncio.tasks import _enter_task, _leave_task  # type: ignore[attr-defined]
from collections.abc import Coroutine, Generator, Iterator
from typing import Any


class _Started(collections.abc.Coroutine):  # type: ignore[type-arg]
    """Wraps a coroutine whose first step already ran; hands its outcome to the Task.

    The Task's own first step gets what the eager step yielded (the future it waits on), its
    return value, or its exception; every later send/throw goes straight to the coroutine.
    """

    __slots__ = ("_coro", "_error", "_first", "_pending", "_result", "_returned")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._coro = coro
        self._pending = True
        self._first: Any = None
        self._returned = False
        self._result: Any = None
        self._error: BaseException | None = None

    def start(self) -> None:
        try:
            self._first = self._coro.send(None)
        except StopIteration as stop:
            self._returned, self._result = True, stop.value
        except BaseException as exc:  # delivered to the Task, which decides what it means
            self._error = exc

    def send(self, value: Any) -> Any:
        if self._pending:
            self._pending = False
            if self._returned:
                raise StopIteration(self._result)
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            return self._first
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if self._pending:
            self._pending = False
            if self._returned or self._error is not None:  # nothing left to interrupt
                raise typ if val is None else val
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, Any]:
        raise TypeError("an eager task's coroutine is driven by its Task only")


def _eager_factory_311(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
) -> asyncio.Task[Any]:
    context = kwargs.pop("context", None) or contextvars.copy_context()
    shim = _Started(coro)
    task: asyncio.Task[Any] = asyncio.Task(shim, loop=loop, context=context, **kwargs)
    outer = asyncio.current_task(loop)
    if outer is not None:
        _leave_task(loop, outer)
    _enter_task(loop, task)
    try:
        context.run(shim.start)
    finally:
        _leave_task(loop, task)
        if outer is not None:
            _enter_task(loop, outer)
    return task


eager_task_factory: Any = (
    asyncio.eager_task_factory  # type: ignore[attr-defined]
    if sys.version_info >= (3, 12)
    else _eager_factory_311
)
"""A loop task factory (`loop.set_task_factory`) whose tasks start eagerly."""


@contextlib.contextmanager
def eager_tasks(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """Every task created on `loop` inside the block starts eagerly."""
    before = loop.get_task_factory()
    loop.set_task_factory(eager_task_factory)
    try:
        yield
    finally:
        loop.set_task_factory(before)

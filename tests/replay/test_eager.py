"""Eager tasks (agentab.replay.eager): first step inside create_task, Task semantics kept."""

from __future__ import annotations

import asyncio

import pytest

from agentab.replay.eager import eager_tasks


def _run(coro_fn: object) -> object:
    async def main() -> object:
        loop = asyncio.get_running_loop()
        with eager_tasks(loop):
            return await coro_fn()  # type: ignore[operator]

    return asyncio.run(main())


def test_first_step_runs_inside_create_task_as_the_current_task() -> None:
    async def main() -> tuple[object, ...]:
        outer = asyncio.current_task()
        loop = asyncio.get_running_loop()
        log: list[object] = []

        async def child() -> str:
            log.append(asyncio.current_task())
            await asyncio.sleep(0)
            log.append(asyncio.current_task())
            return "done"

        t = loop.create_task(child())  # created from inside a task
        after = (len(log), asyncio.current_task() is outer)
        result = await t
        return after, log[0] is t, log[1] is t, result

    # The child's first step ran (as the current task) before create_task returned, and the
    # outer task was current again afterwards.
    assert _run(main) == ((1, True), True, True, "done")


def test_from_a_plain_callback_result_exception_and_cancel() -> None:
    async def main() -> tuple[object, ...]:
        loop = asyncio.get_running_loop()
        made: dict[str, asyncio.Task[object]] = {}
        steps: list[str] = []

        async def returns_at_once() -> int:
            steps.append("returns")
            return 7

        async def raises_at_once() -> None:
            steps.append("raises")
            raise ValueError("boom")

        async def waits() -> str:
            steps.append("waits")
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return "saw the cancel"
            return "not cancelled"

        def fire() -> None:  # like the runner's timer callback: no current task
            made["r"] = loop.create_task(returns_at_once())
            made["e"] = loop.create_task(raises_at_once())
            made["w"] = loop.create_task(waits())
            steps.append("callback done")
            made["w"].cancel()  # before the Task's own first step

        loop.call_soon(fire)
        await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="boom"):
            await made["e"]
        return tuple(steps), await made["r"], await made["w"], made["w"].cancelled()

    assert _run(main) == (
        ("returns", "raises", "waits", "callback done"),
        7,
        "saw the cancel",
        False,
    )

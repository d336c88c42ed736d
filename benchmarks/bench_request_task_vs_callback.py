"""What a request's asyncio Task costs the simulator, against a callback chain doing the same.

Why: the runner sends every request from a Task of its own (`Runner._execute` ->
`_run_request` -> `EngineTarget.send`, three coroutine frames, suspended once on the engine's
`Timeline.finished` future). For the in-process engine the same work could run as two plain
loop callbacks (the dispatch as a `call_soon`, the end as the future's done callback), which
keeps every event in the same place in the loop's queue but is a second request path to
maintain. This measures the price of the Task alone, so that trade is judged on a figure:

- `future only`: the loop passes a request needs anyway (a future created, resolved a pass
  later, two `sleep(0)` passes), the floor both forms share;
- `task`: the same plus a Task through three coroutine frames awaiting the future, removing
  itself from a dict when done (as `Runner._execute` does);
- `callbacks`: the same plus `call_soon` of a function that registers the future's done
  callback, which removes the request from a dict.

The printed extra cost per request of each form over the floor, medians of --repeats, on the
stock asyncio loop (the simulator's virtual loop adds the same to each form).

    taskset -c 1 python benchmarks/bench_request_task_vs_callback.py [--requests N] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any


async def _send(fut: asyncio.Future[None]) -> None:
    await fut


async def _run_request(fut: asyncio.Future[None]) -> None:
    await _send(fut)


async def _execute(fut: asyncio.Future[None], tasks: dict[object, None]) -> None:
    try:
        await _run_request(fut)
    finally:
        tasks.pop(asyncio.current_task(), None)


async def _drive(n: int, start: Callable[[asyncio.Future[None], int], None]) -> float:
    """Seconds for `n` requests: each a future that `start` may hand to a form, resolved a
    loop pass later, then one more pass (the floor every form shares)."""
    loop = asyncio.get_running_loop()
    t = time.perf_counter()
    for i in range(n):
        fut = loop.create_future()
        start(fut, i)
        await asyncio.sleep(0)
        fut.set_result(None)
        await asyncio.sleep(0)
    return time.perf_counter() - t


async def future_only(n: int) -> float:
    return await _drive(n, lambda _fut, _i: None)


async def with_task(n: int) -> float:
    loop = asyncio.get_running_loop()
    tasks: dict[object, None] = {}

    def start(fut: asyncio.Future[None], _i: int) -> None:
        tasks[loop.create_task(_execute(fut, tasks))] = None

    seconds = await _drive(n, start)
    assert not tasks
    return seconds


async def with_callbacks(n: int) -> float:
    loop = asyncio.get_running_loop()
    pending: dict[int, None] = {}

    def begin(fut: asyncio.Future[None], key: int) -> None:
        fut.add_done_callback(lambda _f: pending.pop(key, None))

    def start(fut: asyncio.Future[None], i: int) -> None:
        pending[i] = None
        loop.call_soon(begin, fut, i)

    seconds = await _drive(n, start)
    assert not pending
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    forms: dict[str, Callable[[int], Coroutine[Any, Any, float]]] = {
        "future only": future_only,
        "task": with_task,
        "callbacks": with_callbacks,
    }
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(args.repeats):  # the forms alternate, so a drift of the machine hits each
        for name, form in forms.items():
            times[name].append(asyncio.run(form(args.requests)) / args.requests * 1e6)
    med = {name: statistics.median(v) for name, v in times.items()}
    floor = med["future only"]
    for name, us in med.items():
        extra = "" if name == "future only" else f"  (+{us - floor:.2f} us over the floor)"
        print(f"{name:12s} {us:6.2f} us a request{extra}")
    saved = med["task"] - med["callbacks"]
    print(f"callbacks instead of a task save {saved:.2f} us a request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

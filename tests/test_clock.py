"""The virtual loop's selector: polls skipped while callbacks are ready, nothing lost by it."""

from __future__ import annotations

import asyncio
import socket
import threading

from agentab.clock import run_virtual


def test_thread_callback_runs_before_the_clock_jumps() -> None:
    """A worker thread's result is seen before a pending timer moves the clock past it."""

    async def main() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        done = asyncio.Event()
        threading.Thread(target=lambda: loop.call_soon_threadsafe(done.set)).start()
        timer = asyncio.ensure_future(asyncio.sleep(3600))
        while not done.is_set():
            await asyncio.sleep(0)  # zero-timeout iterations: most of their polls are skipped
        timer.cancel()
        return 1, loop.time() - t0

    ok, elapsed = run_virtual(main())
    assert ok == 1 and elapsed == 0.0


def test_busy_loop_still_sees_a_socket() -> None:
    """Ready callbacks every iteration do not starve real descriptors (every 16th poll)."""

    async def main() -> bytes:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        got: asyncio.Future[bytes] = loop.create_future()
        loop.add_reader(a, lambda: got.done() or got.set_result(a.recv(10)))
        b.send(b"hi")
        try:
            for _ in range(1000):
                if got.done():
                    break
                await asyncio.sleep(0)
            return await asyncio.wait_for(got, 0)
        finally:
            loop.remove_reader(a)
            a.close()
            b.close()

    assert run_virtual(main()) == b"hi"

"""The virtual loop's selector skips its non-blocking polls while only its self-pipe is
registered; threads, readers and signal handlers must still reach the loop."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading

from agentab.clock import VirtualTimeLoop, run_virtual


def test_thread_result_reaches_the_loop_while_timers_run() -> None:
    async def main() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(1.0)
                ticks += 1

        task = loop.create_task(ticker())
        value = await loop.run_in_executor(None, lambda: 7)
        task.cancel()
        return value, loop.time()

    value, _t = run_virtual(main())
    assert value == 7


def test_readers_are_polled() -> None:
    async def main() -> bytes:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        got: asyncio.Future[bytes] = loop.create_future()
        loop.add_reader(a.fileno(), lambda: got.set_result(a.recv(16)))
        threading.Thread(target=b.send, args=(b"x",)).start()
        while not got.done():  # timers keep the loop from blocking
            await asyncio.sleep(0.5)
        loop.remove_reader(a.fileno())
        a.close()
        b.close()
        return got.result()

    assert run_virtual(main()) == b"x"


def test_signal_handlers_turn_the_polls_back_on() -> None:
    loop = VirtualTimeLoop()
    try:
        assert loop._clock.fds <= loop._clock.own_fds
        loop.add_signal_handler(signal.SIGWINCH, lambda: None)
        assert loop._clock.fds > loop._clock.own_fds
        loop.remove_signal_handler(signal.SIGWINCH)
    finally:
        loop.close()

"""The client's idle connections expire before the server's: a request is never written into a
connection the server is closing (tests/replay/fault_server.py, a real aiohttp server in a
thread, so the server's idle timer runs while the client's loop is blocked)."""

from __future__ import annotations

import asyncio
import time

from agentab.calibrate.client import CalibrationTarget, LoadRequest
from agentab.replay.targets.base import Outcome
from agentab.replay.targets.http import CLIENT_KEEPALIVE_S

from .fault_server import FaultServer

UVICORN_KEEPALIVE_S = 5.0  # vLLM's and SGLang's server closes a connection idle this long


async def _send_with_stall(url: str, stall_s: float, **target_kw: float) -> list[Outcome]:
    """Two requests; between them the client's loop is blocked for `stall_s`, as a GC pause or a
    busy core blocks it, so it cannot see the server close the idle connection."""
    target = CalibrationTarget(url, **target_kw)
    await target.start()
    outs = []
    try:
        for i, stall in enumerate((0.0, stall_s)):
            time.sleep(stall)
            out = Outcome()
            await target.send(LoadRequest(f"L0-P0-N{i}", [1, 2, 3], 4), out)
            outs.append(out)
    finally:
        await target.close()
    return outs


def test_default_expires_idle_connections_before_a_uvicorn_server_closes_them() -> None:
    assert CLIENT_KEEPALIVE_S < UVICORN_KEEPALIVE_S
    with FaultServer(keepalive_s=UVICORN_KEEPALIVE_S) as srv:
        outs = asyncio.run(_send_with_stall(srv.url, UVICORN_KEEPALIVE_S + 0.3))
        ports = [srv.client_ports["L0-P0-N0"], srv.client_ports["L0-P0-N1"]]
    assert [(o.error_class, len(o.chunk_times)) for o in outs] == [(None, 4), (None, 4)]
    assert ports[0] != ports[1]  # the idle connection was dropped, a new one opened


def test_a_connection_idle_less_than_the_keepalive_is_reused() -> None:
    with FaultServer(keepalive_s=2.0) as srv:
        outs = asyncio.run(_send_with_stall(srv.url, 0.1, keepalive_s=1.0))
        ports = [srv.client_ports["L0-P0-N0"], srv.client_ports["L0-P0-N1"]]
    assert [(o.error_class, len(o.chunk_times)) for o in outs] == [(None, 4), (None, 4)]
    assert ports[0] == ports[1]  # no connect in the second request's TTFT


def test_a_short_keepalive_survives_a_stall_past_the_servers_idle_limit() -> None:
    with FaultServer(keepalive_s=0.3) as srv:
        outs = asyncio.run(_send_with_stall(srv.url, 0.6, keepalive_s=0.2))
    assert [(o.error_class, len(o.chunk_times)) for o in outs] == [(None, 4), (None, 4)]

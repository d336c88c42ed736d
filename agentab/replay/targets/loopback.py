"""LoopbackTarget: an engine behind agentab's OpenAI server, on the client's own event loop.

Why: the HTTP path (serialization, SSE, aiohttp on both sides) measured against the engine's own
emission times, with one clock for client and server, so the difference between what the client
saw and what the server wrote is the HTTP path alone (tests and benchmarks compare them).
"""

from __future__ import annotations

from typing import Any

from agentab.engine.server import EngineServer, start_server
from agentab.replay.targets.http import HttpTarget


class LoopbackTarget(HttpTarget):
    """Serves `engine` on 127.0.0.1 (a free port) when started; records emission times."""

    def __init__(self, engine: Any) -> None:
        super().__init__("http://127.0.0.1:1")  # the real port is known once started
        self.server = EngineServer(engine, record_emissions=True)
        self._runner: Any = None

    async def start(self) -> None:
        self._runner, port = await start_server(self.server, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}"
        await super().start()

    async def close(self) -> None:
        await super().close()
        if self._runner is not None:
            await self._runner.cleanup()

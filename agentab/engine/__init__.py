"""agentab.engine: what serves the traffic.

A vLLM-V1-style scheduler with paged KV blocks and a prefix cache, speculative decoding and the
two decode paths, shared by the simulator (a HardwareProfile prices each step) and, later, the
local torch engine. `build_simulator` returns an `Engine` running on asyncio's clock.
"""

from agentab.engine.core import Engine
from agentab.engine.profile import HardwareProfile, load_profile
from agentab.engine.sim import build_simulator
from agentab.engine.types import EngineRequest, FinalUsage, PromptPrefix, TokenEvent

__all__ = [
    "Engine",
    "EngineRequest",
    "FinalUsage",
    "HardwareProfile",
    "PromptPrefix",
    "TokenEvent",
    "build_simulator",
    "load_profile",
]

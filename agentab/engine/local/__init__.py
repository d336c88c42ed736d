"""The local engine: the shared scheduler driving a real torch model of Kimi-K2-shaped layers.

`build_local_engine(preset, decode_backend, **options)` returns an `agentab.engine.Engine`
whose executor runs every step through the model (docs/engine.md, "The local engine").
"""

from agentab.engine.local.build import OPTIONS, build_local_engine

__all__ = ["OPTIONS", "build_local_engine"]

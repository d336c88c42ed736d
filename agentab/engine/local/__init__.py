"""The local engine: the shared scheduler driving a real torch model of Kimi-K2-shaped layers.

`agentab.engine.local.build.build_local_engine(preset, decode_backend, **options)` returns an
`agentab.engine.Engine` whose executor runs every step through the model (docs/engine.md, "The
local engine"). The package imports nothing itself: `config` and `launch` (what an experiment
file is checked against) work without torch; `build` and the model need it.
"""

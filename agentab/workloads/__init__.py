"""agentab.workloads: what traffic looks like.

The trace model (`Workload` of `Session`s holding `Request`s and `Subagent`s), importers
(AgentX/Weka JSON, Mooncake JSONL, native JSONL), exporters, the AgentX-style generator and the
deterministic token content of prompts (`tokens`).
"""

from agentab.workloads.io import load, save
from agentab.workloads.model import Request, Session, Subagent, Workload

__all__ = ["Request", "Session", "Subagent", "Workload", "load", "save"]

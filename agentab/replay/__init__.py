"""agentab.replay: how traffic is sent (plan, targets, runner, run records).

`simulate_to_dir` (virtual clock, in-process simulator) and `replay_to_dir` (real clock, an
OpenAI-compatible URL) write a run dir: manifest.json, records/*.arrow, metrics/*.arrow.
"""

from agentab.replay.api import replay_to_dir, run_to_dir, simulate_to_dir
from agentab.replay.options import ReplayOptions
from agentab.replay.records import RECORD_SCHEMA, scan_records

__all__ = [
    "RECORD_SCHEMA",
    "ReplayOptions",
    "replay_to_dir",
    "run_to_dir",
    "scan_records",
    "simulate_to_dir",
]

"""agentab.replay: how traffic is sent (plan, targets, runner).

`simulate_to_dir` (virtual clock, in-process simulator) and `replay_to_dir` (real clock, an
OpenAI-compatible URL) write a run dir: manifest.json, records/*.arrow, metrics/*.arrow, in the
format `agentab.rundir` defines (and reads back).
"""

from agentab.replay.api import replay_to_dir, run_to_dir, simulate_to_dir
from agentab.replay.options import ReplayOptions

__all__ = [
    "ReplayOptions",
    "replay_to_dir",
    "run_to_dir",
    "simulate_to_dir",
]

"""AIPerf's own Weka trace loader reads what `agentab workload convert --to agentx` writes.

The loader runs in the AIPerf venv (scripts/install-aiperf.sh) on an export of two generated
sessions whose turn-0 prompt is shorter than the whole blocks of its system + tools prefix:
`agentx-1-00017` (prefix 6,277 tokens, 99 blocks; prompt 6,313 tokens, 98 full blocks) and
`agentx-1-00005`, whose subagent agent_010 has the same shape (5,702 and 5,751 tokens).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from agentab.workloads import load
from agentab.workloads.generator import generate, load_config
from agentab.workloads.io import save
from agentab.workloads.model import Workload

LOADER = Path(__file__).with_name("aiperf_weka_load.py")


def two_sessions() -> Workload:
    sessions = generate(load_config("agentx-coding"), 18, 1).sessions
    return Workload((sessions[5], sessions[17]))


def test_the_export_covers_every_block_a_partial_last_one_included(tmp_path: Path) -> None:
    workload = two_sessions()
    save(workload, tmp_path / "out", "agentx")
    exported = json.loads(next((tmp_path / "out").glob("0001_*.json")).read_text())
    first = exported["requests"][0]
    prefix = exported["tool_tokens"] + exported["system_tokens"]
    assert (prefix, first["in"]) == (6277, 6313)
    assert len(first["hash_ids"]) == math.ceil(6313 / 64) == 99 >= math.ceil(prefix / 64)
    # The partial block's id is fresh: no request of the workload uses it.
    used = {h for s in workload.sessions for r in s.all_requests() for h in r.hash_ids}
    assert first["hash_ids"][-1] not in used
    # Reading the export back drops those ids again: the same workload, to the content hash.
    assert load(tmp_path / "out").content_hash == workload.content_hash


@pytest.mark.aiperf
def test_aiperf_loads_the_agentx_export(tmp_path: Path, aiperf_python: str) -> None:
    workload = two_sessions()
    save(workload, tmp_path / "out", "agentx")
    proc = subprocess.run(
        [aiperf_python, str(LOADER), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    subagents = sum(1 for s in workload.sessions for _ in s.subagents())
    assert built == {
        "traces": ["agentx-1-00005", "agentx-1-00017"],
        "conversations": len(workload.sessions) + subagents,  # 2 + 15
        "turns": workload.num_requests(),  # 880
        "max_tokens": sum(r.out_tokens for s in workload.sessions for r in s.all_requests()),
    }

"""A run warms its target with its first request before the clock starts: the prompt builder's
first-use compile (0.2-1 s) would otherwise hold up the run's first dispatches, which with no
warmup requests are profiling requests, all of them late by as much."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np

from agentab.replay import ReplayOptions
from agentab.replay.api import run_to_dir
from agentab.replay.targets.base import Outcome, RequestSpec
from agentab.replay.targets.engine import EngineTarget
from agentab.replay.targets.recorded import RecordedTarget
from agentab.workloads.model import Request, Session, Workload


class _CallLog(RecordedTarget):
    """Recorded timing; logs each warm and send with the loop time it happened at."""

    def __init__(self) -> None:
        super().__init__(time_factor=0.01)
        self.calls: list[tuple[str, str, float]] = []

    def warm(self, spec: RequestSpec) -> None:
        self.calls.append(("warm", spec.request_id, asyncio.get_running_loop().time()))

    async def send(self, spec: RequestSpec, out: Outcome) -> None:
        self.calls.append(("send", spec.request_id, asyncio.get_running_loop().time()))
        await super().send(spec, out)


def _workload() -> Workload:
    return Workload(
        tuple(
            Session(
                f"s{i}",
                16,
                tuple(
                    Request(t=0.1 * k, in_tokens=64, out_tokens=4, hash_ids=(1, 2), api_time=0.01)
                    for k in range(2)
                ),
            )
            for i in range(3)
        )
    )


def test_a_real_clock_run_warms_with_its_first_request_before_its_clock_starts(
    tmp_path: Path,
) -> None:
    target = _CallLog()
    options = ReplayOptions(
        concurrency=3, start_window=(0.0, 0.0), warmup_requests=0, duration_s=None, passes=1
    )
    run = run_to_dir(
        _workload(), target, replay=options, out_dir=tmp_path / "run", virtual=False,
        progress=False,
    )  # fmt: skip
    kinds = [kind for kind, _, _ in target.calls]
    assert kinds == ["warm"] + ["send"] * 6
    sends = [(rid, t) for kind, rid, t in target.calls if kind == "send"]
    # lane 0's first request: the one the run sends first
    assert target.calls[0][1] == sends[0][0]
    t0 = json.loads((run / "manifest.json").read_text())["clock_t0"]
    assert target.calls[0][2] <= t0 <= sends[0][1]


def test_warming_the_in_process_target_leaves_its_prompt_reuse_as_it_was() -> None:
    """EngineTarget builds each prompt from its agent's previous one; the warm build must not
    count as that previous prompt, or the engine would be told the first real prompt shares it."""
    session = _workload().sessions[0]
    spec = RequestSpec("r0", session, session.items[0], 7, 4, 0)
    warmed, cold = EngineTarget(None), EngineTarget(None)
    warmed.warm(spec)
    first_warmed = warmed._prompts.build(session, session.items[0], salt=7)
    first_cold = cold._prompts.build(session, session.items[0], salt=7)
    assert first_warmed.shared_tokens == first_cold.shared_tokens == 0
    assert np.array_equal(first_warmed.ids, first_cold.ids)

"""An arm's decode backend is checked against what its server says it runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from agentab.engine import build_simulator
from agentab.engine.server import EngineServer, start_server
from agentab.errors import AgentabError
from agentab.replay import replay_to_dir
from agentab.replay.options import ReplayOptions
from agentab.workloads.generator import generate, load_config

OPTS = ReplayOptions(concurrency=1, duration_s=None, max_requests=2, warmup_requests=0, seed=1)


def _replay_against(backend: str, declared: str | None, out: Path) -> Path:
    """Serve the simulator with `backend` in a thread's loop; replay, declaring `declared`."""
    import threading

    ready: dict[str, object] = {}
    stop = threading.Event()

    def serve() -> None:
        async def main() -> None:
            server = EngineServer(build_simulator("gb300-tp16-kimi-k3", backend))
            runner, port = await start_server(server, "127.0.0.1", 0)
            ready["url"] = f"http://127.0.0.1:{port}"
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await runner.cleanup()

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        while "url" not in ready:
            thread.join(0.05)
        extra = {} if declared is None else {"decode_backend": declared}
        workload = generate(load_config("agentx-coding"), 1, 3)
        return replay_to_dir(
            workload, url=str(ready["url"]), replay=OPTS, out_dir=out, manifest_extra=extra,
            progress=False,
        )  # fmt: skip
    finally:
        stop.set()
        thread.join(10)


def test_a_server_that_contradicts_the_declared_backend_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AgentabError, match=r"the arm declares 'auto' but .* runs "
                       r"'latency_specialized' \(are the arms' URLs swapped\?\)"):  # fmt: skip
        _replay_against("latency_specialized", "auto", tmp_path / "swapped")


def test_the_refusal_names_an_enum_backend_by_its_value(tmp_path: Path) -> None:
    """`ab` declares its arms' backends as DecodeBackend members: named as in the file."""
    from agentab.engine.options import DecodeBackend

    with pytest.raises(AgentabError) as exc:
        _replay_against("auto", DecodeBackend.LATENCY_SPECIALIZED, tmp_path / "swapped")  # type: ignore[arg-type]
    assert "the arm declares 'latency_specialized' but http://127.0.0.1:" in str(exc.value)
    assert "runs 'auto' (are the arms' URLs swapped?)" in str(exc.value)


def test_a_backend_the_server_reports_is_marked_observed(tmp_path: Path) -> None:
    run = _replay_against("latency_specialized", "latency_specialized", tmp_path / "ok")
    manifest = orjson.loads((run / "manifest.json").read_bytes())
    assert manifest["decode_backend"] == "latency_specialized"
    assert manifest["decode_backend_source"] == "observed"


def test_a_report_says_when_labels_are_declared_not_observed(tmp_path: Path) -> None:
    """Against servers that report no backend (as vLLM in attach mode), the A/B report says
    that its arm labels are the experiment's word only."""
    from agentab.analysis.compare import compare_runs
    from agentab.analysis.load import load_run
    from agentab.analysis.markdown import comparison_markdown

    from .fault_server import FaultServer

    workload = generate(load_config("agentx-coding"), 1, 3)
    runs = []
    with FaultServer() as srv:
        for backend in ("auto", "latency_specialized"):
            runs.append(
                replay_to_dir(
                    workload,
                    url=srv.url,
                    replay=OPTS,
                    out_dir=tmp_path / backend,
                    manifest_extra={"decode_backend": backend, "arm": backend},
                    progress=False,
                )
            )
    manifests = [orjson.loads((r / "manifest.json").read_bytes()) for r in runs]
    assert [m["decode_backend_source"] for m in manifests] == ["declared", "declared"]
    report = comparison_markdown(compare_runs([load_run(runs[0])], [load_run(runs[1])]))
    assert "Arm labels are **declared**, not observed" in report

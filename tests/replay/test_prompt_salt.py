"""Prompt salts: a rerun against a warm server starts cold; a recorded salt reproduces prompts.

The server is `agentab serve`'s EngineServer over the simulator on loopback (real HTTP); its
prefix cache outlives each replay, as a vLLM server's does between two runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import polars as pl
import pytest

from agentab.engine import build_simulator
from agentab.engine.server import EngineServer, start_server
from agentab.errors import AgentabError
from agentab.replay import replay_to_dir
from agentab.replay.options import ReplayOptions
from agentab.replay.plan import build_plan
from agentab.rundir import scan_records
from agentab.workloads.generator import generate, load_config

OPTS = ReplayOptions(
    concurrency=2, duration_s=None, max_requests=2, warmup_requests=0, start_window=(0, 0), seed=1
)
WORKLOAD = generate(load_config("agentx-coding"), 2, 3)


@contextmanager
def warm_server() -> Iterator[str]:
    """One simulator server, in a thread's loop, for every replay of a test."""
    ready: dict[str, str] = {}
    stop = threading.Event()

    def serve() -> None:
        async def main() -> None:
            server = EngineServer(build_simulator("h200-tp1-kimi-shard"))
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
        yield ready["url"]
    finally:
        stop.set()
        thread.join(10)


def first_requests(run: Path) -> pl.DataFrame:
    """Each lane's first request: what a warm cache would serve from the previous run."""
    df = scan_records(run).collect()
    return df.sort("sent_s").group_by("lane", maintain_order=True).first().sort("lane")


def salt_of(run: Path) -> str:
    return orjson.loads((run / "manifest.json").read_bytes())["replay"]["prompt_salt"]


def test_a_rerun_with_the_same_seed_does_not_start_on_cached_prompts(tmp_path: Path) -> None:
    with warm_server() as url:
        runs = [
            replay_to_dir(WORKLOAD, url=url, replay=OPTS, out_dir=tmp_path / n, progress=False)
            for n in ("first", "again")
        ]
        first, again = (first_requests(r) for r in runs)
        assert first["error_class"].to_list() == [None, None]
        assert first["cached_tokens"].to_list() == [0, 0]
        assert again["cached_tokens"].to_list() == [0, 0]  # a fresh salt: nothing cached
        assert salt_of(runs[0]) != salt_of(runs[1])
        # The recorded salt sends the first run's exact prompts: the server has all their
        # full blocks (16 tokens each) cached.
        replayed = ReplayOptions.from_mapping({**OPTS.to_dict(), "prompt_salt": salt_of(runs[0])})
        run = replay_to_dir(
            WORKLOAD, url=url, replay=replayed, out_dir=tmp_path / "same", progress=False
        )
        same = first_requests(run)
        assert salt_of(run) == salt_of(runs[0])
        assert same["prompt_tokens"].to_list() == first["prompt_tokens"].to_list()
        assert same["cached_tokens"].to_list() == [n // 16 * 16 for n in first["prompt_tokens"]]


def test_equal_options_give_equal_salts_and_a_prompt_salt_changes_them() -> None:
    a = build_plan(WORKLOAD, ReplayOptions.from_mapping({**OPTS.to_dict(), "prompt_salt": "x"}))
    b = build_plan(WORKLOAD, ReplayOptions.from_mapping({**OPTS.to_dict(), "prompt_salt": "x"}))
    c = build_plan(WORKLOAD, ReplayOptions.from_mapping({**OPTS.to_dict(), "prompt_salt": "y"}))
    salts = [[p.closed_play(lane, 0).salt for lane in range(2)] for p in (a, b, c)]  # type: ignore[union-attr]
    assert salts[0] == salts[1] and len(set(salts[0])) == 2
    assert not set(salts[0]) & set(salts[2])


@pytest.mark.parametrize("bad", ["", "x" * 129, "a\nb", 7])
def test_a_bad_prompt_salt_is_refused(bad: object) -> None:
    with pytest.raises(AgentabError, match="replay option prompt_salt must be 1 to 128 printable"):
        ReplayOptions(prompt_salt=bad)  # type: ignore[arg-type]

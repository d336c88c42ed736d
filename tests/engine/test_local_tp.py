"""Tensor parallelism of the local engine on the CPU: two ranks (gloo, two processes) compute
what one rank computes, for both decode backends."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentab.engine.local.build import build_local_engine  # noqa: E402
from agentab.errors import AgentabError  # noqa: E402

from .test_local_engine import prompt, run  # noqa: E402

# prefill, mixed and pure-decode steps, with a request arriving while others decode
TRACE = {
    0: [("A", prompt(40, 1), 7)],
    1: [("B", prompt(30, 5), 5)],
    3: [("C", prompt(70, 9), 4)],
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "latency_specialized"])
def test_two_ranks_give_the_tokens_of_one(backend):
    one = run(build_local_engine("tiny", backend, device="cpu", seed=3), TRACE)
    eng = build_local_engine("tiny", backend, device="cpu", seed=3, tp=2)
    try:
        assert eng.describe()["tp"] == 2 and eng.describe()["gpu_count"] == 2
        two = run(eng, TRACE)
        counts = eng.metrics()
    finally:
        eng.executor.close()
    assert two == one
    assert [len(two[k]) for k in "ABC"] == [7, 5, 4]
    if backend == "latency_specialized":
        assert counts["agentab:decode_steps_specialized_total"] > 0
    assert all(p.returncode == 0 for p in eng.executor.workers)  # the worker stopped cleanly


def test_a_tp_that_does_not_divide_the_layer_is_refused_before_starting():
    with pytest.raises(AgentabError, match="tp: 3 does not divide the 32000 vocab rows"):
        build_local_engine("tiny", "auto", device="cpu", tp=3)
    with pytest.raises(AgentabError, match="tp: 8 does not divide n_heads = 4 of layer tiny"):
        build_local_engine("tiny", "auto", device="cpu", tp=8)


@pytest.mark.slow
def test_a_tp2_server_serves_and_stops_with_its_worker():
    """`agentab serve --tp 2` answers, and a SIGTERM to its whole process group (how an A/B arm
    is stopped) ends the server and its worker rank cleanly."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    import orjson

    args = [sys.executable, "-m", "agentab", "serve", "--engine", "local", "--preset", "tiny"]
    args += ["--device", "cpu", "--tp", "2", "--port", "0"]
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line
        url = "http://127.0.0.1:" + line.split("127.0.0.1:")[1].split()[0]
        body = orjson.dumps({"prompt": list(range(5, 30)), "max_tokens": 4})
        req = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            assert orjson.loads(r.read())["usage"]["completion_tokens"] == 4
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "agentab serve: stopped" in out
        time.sleep(0.5)
        left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True)
        assert left.stdout.strip() == ""  # no worker rank outlives the server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

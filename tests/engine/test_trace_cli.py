"""`agentab engine trace`: one JSON line per step, then a summary; bad input exits 2."""

from __future__ import annotations

import itertools

import orjson
import pytest

from agentab.cli import main
from agentab.workloads import Request, Session, Workload, save


def test_trace_of_a_two_turn_session(tmp_path, capsysbinary):
    # turn 2 repeats turn 1's two leading blocks (hash ids 1, 2): 32 cached tokens
    session = Session(
        id="s",
        block_size=16,
        items=(
            Request(t=0.0, in_tokens=40, out_tokens=3, hash_ids=(1, 2)),
            Request(t=5.0, in_tokens=60, out_tokens=2, hash_ids=(1, 2, 3)),
        ),
    )
    path = tmp_path / "w.jsonl"
    save(Workload((session,)), path)
    main(["engine", "trace", str(path), "--decode-backend", "latency_specialized"])
    lines = [orjson.loads(x) for x in capsysbinary.readouterr().out.splitlines()]
    *steps, last = lines
    shape = [
        (s["num_prefill_tokens"], s["num_decode_tokens"], s["path"], s["requests"]) for s in steps
    ]
    assert shape == [
        (40, 0, "standard", [{"id": "s:0", "tokens": 40, "cached_tokens": 0}]),
        (0, 1, "specialized", [{"id": "s:0", "tokens": 1, "cached_tokens": 0}]),
        (0, 1, "specialized", [{"id": "s:0", "tokens": 1, "cached_tokens": 0}]),
        (28, 0, "standard", [{"id": "s:1", "tokens": 28, "cached_tokens": 32}]),
        (0, 1, "specialized", [{"id": "s:1", "tokens": 1, "cached_tokens": 32}]),
    ]
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]
    for a, b in itertools.pairwise(steps):  # back to back: no gap between steps
        assert b["t_start_s"] == pytest.approx(a["t_start_s"] + a["duration_s"], abs=1e-12)
    summary = last["summary"]
    assert summary["requests"] == 2
    assert summary["prompt_tokens"] == 100
    assert summary["completion_tokens"] == 5
    assert summary["cached_tokens"] == 32
    assert summary["metrics"]["agentab:steps_specialized_total"] == 3
    assert summary["engine"]["decode_backend"] == "latency_specialized"


def test_trace_bad_input_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["engine", "trace", str(tmp_path / "missing.jsonl")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.jsonl" in err


def test_trace_bad_acceptance_probs(tmp_path, capsys):
    session = Session(id="s", block_size=16, items=(Request(t=0.0, in_tokens=4, out_tokens=1),))
    path = tmp_path / "w.jsonl"
    save(Workload((session,)), path)
    with pytest.raises(SystemExit):
        main(["engine", "trace", str(path), "--num-draft-tokens", "2", "--acceptance-probs", "x"])
    assert "--acceptance-probs" in capsys.readouterr().err


def test_trace_stops_when_its_reader_goes(tmp_path):
    # `agentab engine trace ... | head -1`: once the pipe closes, the trace ends, silently.
    import subprocess
    import sys

    from agentab.workloads.generator import generate, load_config

    path = tmp_path / "w.jsonl"
    save(generate(load_config("agentx-coding"), 40, 1), path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentab", "engine", "trace", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = orjson.loads(proc.stdout.readline())
    assert first["step"] == 0
    proc.stdout.close()
    assert proc.wait(timeout=120) == 0
    assert proc.stderr.read() == b""


def test_trace_takes_a_fractional_acceptance_length(tmp_path, capsysbinary):
    session = Session(
        id="s", block_size=16, items=(Request(t=0.0, in_tokens=40, out_tokens=30, hash_ids=()),)
    )
    path = tmp_path / "w.jsonl"
    save(Workload((session,)), path)
    args = ["--num-draft-tokens", "3", "--acceptance-length", "2.5"]
    main(["engine", "trace", str(path), *args])
    summary = orjson.loads(capsysbinary.readouterr().out.splitlines()[-1])["summary"]
    assert summary["engine"]["spec"]["acceptance_length"] == 2.5
    assert summary["completion_tokens"] == 30

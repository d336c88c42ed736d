"""`agentab ab` end to end on the simulator: interleaved runs, reports, and early refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENT = """\
name = "tiny-ab"
repeats = 2
seed = 3

[workload]
generate = { preset = "agentx-coding", sessions = 6 }

[gpus]
count = 16

[replay]
concurrency = 2
duration_s = 120.0
warmup_requests = 1

[engine]
kind = "simulator"
profile = "gb300-tp16-kimi-k3"
num_draft_tokens = 7
acceptance_probs = [0.9, 0.82, 0.74, 0.66, 0.58, 0.5, 0.42]

[analysis]
resamples = 2000

[[arms]]
decode_backend = "auto"

[[arms]]
name = "fast"
decode_backend = "latency_specialized"
"""


def agentab(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentab", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def experiment(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    root = tmp_path_factory.mktemp("ab")
    path = root / "exp.toml"
    path.write_text(EXPERIMENT)
    out = root / "out"
    return out, agentab("ab", path, "-o", out)


def test_ab_runs_the_arms_interleaved_and_prints_the_report(experiment) -> None:
    out, result = experiment
    assert result.returncode == 0, result.stderr
    assert result.stdout == (out / "report.md").read_text()
    assert result.stdout.startswith("# A/B report: tiny-ab: auto (A) vs fast (B)")
    manifests = {
        (arm, k): json.loads((out / arm / f"run-{k}" / "manifest.json").read_text())
        for arm in ("auto", "fast")
        for k in (1, 2)
    }
    order = sorted(manifests, key=lambda key: manifests[key]["started_at"])
    assert order == [("auto", 1), ("fast", 1), ("fast", 2), ("auto", 2)]  # ABBA
    for (arm, k), m in manifests.items():
        assert m["arm"] == arm and m["repeat"] == k - 1 and m["replay"]["seed"] == 3 + k - 1
        assert m["decode_backend"] == ("auto" if arm == "auto" else "latency_specialized")
        assert (out / arm / f"run-{k}" / "summary.json").is_file()
    assert (out / "experiment.toml").read_text() == EXPERIMENT
    # One prompt salt per invocation, shared by every run: both arms of a repeat send
    # identical prompts (the seed keeps repeats apart).
    salts = {m["replay"]["prompt_salt"] for m in manifests.values()}
    assert len(salts) == 1 and len(salts.pop()) == 16
    # Progress by default: outside a terminal, each run ends with a plain line of its counters.
    for (arm, k), m in manifests.items():
        run = out / arm / f"run-{k}"
        last = [line for line in result.stderr.splitlines() if line.startswith(f"simulate {run}:")]
        assert last and f"done {m['stats']['finished']:,} in flight 0 errors 0" in last[-1]


def test_a_report_on_simulated_runs_says_so_from_the_manifests(experiment) -> None:
    # The experiment file has no notes: the caveat comes from what the runs recorded.
    out, result = experiment
    caveat = (
        "- **Simulated, not measured**: engine agentab-sim, hardware profile gb300-tp16-kimi-k3 "
        "(status published-derived: derived from published figures, not measured); "
        "spec-decode acceptance is configured (7 draft tokens, per-position acceptance 0.90, "
        "0.82, 0.74, 0.66, 0.58, 0.50, 0.42), not measured. Measure your own traffic on your "
        "own engine before deciding."
    )
    assert caveat in result.stdout.splitlines()
    report = agentab("report", out / "auto" / "run-1")
    assert report.returncode == 0, report.stderr
    assert caveat in report.stdout.splitlines()


def test_ab_comparison_json_and_html(experiment) -> None:
    out, _ = experiment
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["guard"] == [] and comparison["confounded_by"] == []
    assert comparison["repeat_interval"] == "paired"
    headline = comparison["metrics"]["p90_interactivity_tok_s"]
    assert headline["ci_low"] <= headline["ratio"] <= headline["ci_high"]
    assert len(headline["runs_a"]) == len(headline["repeat_ratios"]) == 2
    assert comparison["bootstrap"]["resamples"] == 2000
    assert (out / "report.html").stat().st_size > 3_000_000  # plotly inlined


def test_ab_refuses_a_gpu_count_the_profile_does_not_have(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT.replace("count = 16", "count = 8"))
    result = agentab("ab", path, "-o", tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"agentab: error: {path}: [gpus] count is 8 but simulator profile "
        "'gb300-tp16-kimi-k3' models 16 GPUs"
    ]
    assert not (tmp_path / "out").exists()


def test_ab_refuses_a_dir_of_another_experiment(experiment, tmp_path: Path) -> None:
    out, _ = experiment
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT.replace("repeats = 2", "repeats = 3"))
    result = agentab("ab", path, "-o", out)
    assert result.returncode == 2
    assert result.stderr.startswith(f"agentab: error: {out}: holds a different experiment")
    assert result.stderr.count("\n") == 1


def test_an_ab_stopped_by_max_runs_resumes_to_the_same_report(experiment, tmp_path: Path) -> None:
    _, whole = experiment
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT)
    out = tmp_path / "out"
    first = agentab("ab", path, "-o", out, "--max-runs", "3")
    assert first.returncode == 0, first.stderr
    assert first.stdout == "" and not (out / "report.md").exists()
    assert (
        f"agentab ab: stopped after 3 run(s) (--max-runs): 3 of 4 runs complete; run the same "
        f"command on {out} to continue"
    ) in first.stderr
    kept = (out / "fast" / "run-1" / "manifest.json").read_text()
    second = agentab("ab", path, "-o", out)
    assert second.returncode == 0, second.stderr
    assert f"resuming {out}: 3 of 4 runs complete, 1 to run" in second.stderr
    assert (out / "fast" / "run-1" / "manifest.json").read_text() == kept  # not run again
    # the simulator is deterministic: the resumed A/B reports what the one-shot A/B reported
    assert second.stdout == whole.stdout
    again = agentab("ab", path, "-o", out)
    assert "4 of 4 runs complete, 0 to run" in again.stderr
    assert again.stdout == whole.stdout
    # the run made after the resume shares the prompt salt of the other arm of its repeat
    salts = {
        json.loads((out / arm / f"run-{k}" / "manifest.json").read_text())["replay"]["prompt_salt"]
        for arm in ("auto", "fast")
        for k in (1, 2)
    }
    assert salts == {(out / "prompt_salt").read_text().strip()}


def test_an_unfinished_run_is_run_again_on_resume(experiment, tmp_path: Path) -> None:
    import shutil

    full, whole = experiment
    out = tmp_path / "out"
    shutil.copytree(full, out)
    manifest = out / "auto" / "run-2" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "status": "interrupted"}))
    (out / "auto" / "run-2" / "stray.txt").write_text("from the attempt that was cut short")
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT)
    result = agentab("ab", path, "-o", out)
    assert result.returncode == 0, result.stderr
    assert "3 of 4 runs complete, 1 to run" in result.stderr
    assert json.loads(manifest.read_text())["status"] == "completed"
    assert not (out / "auto" / "run-2" / "stray.txt").exists()
    assert result.stdout == whole.stdout


def test_a_resume_onto_runs_of_other_engine_code_is_refused_before_running(
    experiment, tmp_path: Path
) -> None:
    import shutil

    full, _ = experiment
    out = tmp_path / "out"
    shutil.copytree(full, out)
    kept = out / "auto" / "run-1" / "manifest.json"
    assert len(json.loads(kept.read_text())["engine_source"]) == 16
    # a run made by another version of the engine code, and one left unfinished to resume
    kept.write_text(json.dumps({**json.loads(kept.read_text()), "engine_source": "0" * 16}))
    unfinished = out / "fast" / "run-2" / "manifest.json"
    unfinished.write_text(
        json.dumps({**json.loads(unfinished.read_text()), "status": "interrupted"})
    )
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT)
    result = agentab("ab", path, "-o", out)
    assert result.returncode != 0
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"agentab: error: {out / 'auto' / 'run-1'}: ran engine code ")
    assert "0000000000000000, this install's is " in line and "-o NEW_DIR" in line
    assert json.loads(unfinished.read_text())["status"] == "interrupted"  # nothing removed


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ('name = "fast"\ndecode_backend = "latency_specialized"', 'decode_backend = "warp"'),
            "{path}:29: arms[1].decode_backend: expected one of auto, latency_specialized, "
            "got 'warp'",
        ),
        (
            ("num_draft_tokens = 7", "num_draft_tokens = 7\nmax_num_seqs = 0"),
            "{path}:20: engine.max_num_seqs: expected int >= 1, got 0",
        ),
        (
            ("num_draft_tokens = 7", "num_draft_tokens = 7\nkv_block = 64"),
            "{path}:20: engine.kv_block: unknown option (known: specialized_max_tokens, profile,",
        ),
        (
            ("num_draft_tokens = 7", 'num_draft_tokens = "7"'),
            "{path}:19: engine.num_draft_tokens: expected int, got '7'",
        ),
        (
            ("acceptance_probs = [0.9, 0.82,", "acceptance_probs = [0.82,"),
            "{path}: arm 'auto': acceptance_probs: needs 7 values (one per draft position)",
        ),
        (
            ("sessions = 6", "sessions = 1000000000"),
            "{path}: [workload.generate]: --sessions must be <= 10,000 (got 1,000,000,000; "
            "about 1 MB per session)",
        ),
        (
            ("concurrency = 2", "concurrency = 0"),
            "{path}:12: [replay]: replay option concurrency must be an integer from 1 to "
            "100,000 (lanes, each a live session tree)",
        ),
        (
            ("concurrency = 2", "concurrency = 100000000"),
            "{path}:12: [replay]: replay option concurrency must be an integer from 1 to "
            "100,000 (lanes, each a live session tree)",
        ),
    ],
)
def test_ab_refuses_a_bad_arm_or_input_before_any_run(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    path = tmp_path / "exp.toml"
    assert change[0] in EXPERIMENT
    path.write_text(EXPERIMENT.replace(*change))
    result = agentab("ab", path, "-o", tmp_path / "out")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentab: error: " + message.format(path=path))
    assert not (tmp_path / "out").exists()  # a start refused leaves nothing


BAD_TRACE = '{"id": "s1", "models": ["m"], "block_size": 64, "hash_id_scope": "local", '
BAD_TRACE += '"requests": [{"t": 0.0, "type": "n", "model": "m", "in": 128, "out": -5}]}\n'


@pytest.mark.parametrize("sweep", [False, True], ids=["ab", "sweep"])
@pytest.mark.parametrize(
    ("trace", "message"),
    [
        (None, "{trace}: no such file"),
        (BAD_TRACE, "{trace}: session 's1': request 0: field 'out' is negative (-5)"),
    ],
    ids=["missing", "malformed"],
)
def test_a_bad_trace_is_refused_before_the_experiment_dir_exists(
    tmp_path: Path, sweep: bool, trace: str | None, message: str
) -> None:
    path = tmp_path / "exp.toml"
    trace_path = tmp_path / "trace.json"
    if trace is not None:
        trace_path.write_text(trace)
    text = EXPERIMENT.replace(
        'generate = { preset = "agentx-coding", sessions = 6 }', f'path = "{trace_path.name}"'
    )
    if sweep:
        text = text.replace("concurrency = 2\n", "").replace(
            "[analysis]", "[sweep]\nconcurrency = [1, 2]\n\n[analysis]"
        )
    path.write_text(text)
    out = tmp_path / "out"
    result = agentab("ab", path, "-o", out)
    assert (result.returncode, result.stdout) == (2, "")
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "agentab: error: " + message.format(trace=trace_path)
    ), result.stderr
    assert not out.exists()  # nothing a later `ab -o out` would take for a resume


def test_ab_refuses_an_experiment_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_bytes(b'name = "caf\xe9"\n' + EXPERIMENT.encode())
    result = agentab("ab", path, "-o", tmp_path / "out")
    assert (result.returncode, result.stderr) == (
        2,
        f"agentab: error: {path}: not UTF-8 text (byte 11); TOML is UTF-8\n",
    )


def test_until_decided_stops_at_the_first_decided_block(tmp_path: Path) -> None:
    # The specialized path is far faster here (B/A about 1.6): decided at the third block,
    # the fewest the sequence decides on, before the 5 allowed.
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT)
    out = tmp_path / "out"
    result = agentab("ab", path, "-o", out, "--until-decided", "--max-repeats", "5")
    assert result.returncode == 0, result.stderr
    seq = json.loads((out / "comparison.json").read_text())["sequential"]
    assert seq["verdict"] == "better" and seq["blocks"] == 3
    assert seq["ci_low"] > 1.0
    assert sorted(p.name for p in (out / "auto").iterdir()) == ["run-1", "run-2", "run-3"]
    assert "**Sequential** (--until-decided): decided **better** after 3 repeats per arm" in (
        result.stdout
    )


def test_block_seconds_sets_each_blocks_window(tmp_path: Path) -> None:
    # Blocks of 40 s in a file of 120 s windows: every run's manifest records the block's
    # window, the report and comparison.json name it, and the sequence decides (B/A about 1.6
    # here) within the 5 blocks allowed, running exactly the blocks it reports.
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT)
    out = tmp_path / "out"
    args = ("ab", path, "-o", out, "--until-decided", "--max-repeats", "5")
    result = agentab(*args, "--block-seconds", "40")
    assert result.returncode == 0, result.stderr
    seq = json.loads((out / "comparison.json").read_text())["sequential"]
    assert (seq["verdict"], seq["block_s"]) == ("better", 40.0)
    blocks = seq["blocks"]
    assert 3 <= blocks <= 5  # the sequence decides on no fewer than three blocks
    runs = sorted(p.relative_to(out).as_posix() for p in out.glob("*/run-*"))
    assert runs == [f"{arm}/run-{k}" for arm in ("auto", "fast") for k in range(1, blocks + 1)]
    for run in runs:
        replay = json.loads((out / run / "manifest.json").read_text())["replay"]
        assert replay["duration_s"] == 40.0
    assert (
        f"**Sequential** (--until-decided): decided **better** after {blocks} repeats per arm "
        "of 40 s: " in result.stdout
    )
    assert "up to 5 repeats x 2 arms of 40 s, until decided" in result.stderr


def test_block_seconds_defaults_to_the_files_window(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT)
    out = tmp_path / "out"
    result = agentab("ab", path, "-o", out, "--until-decided", "--max-repeats", "3")
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "comparison.json").read_text())["sequential"]["block_s"] == 120.0
    manifest = json.loads((out / "fast" / "run-3" / "manifest.json").read_text())
    assert manifest["replay"]["duration_s"] == 120.0


def test_a_resume_keeps_the_block_length(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT)
    out = tmp_path / "out"
    args = ("ab", path, "-o", out, "--until-decided")
    first = agentab(*args, "--block-seconds", "40", "--max-runs", "2")
    assert first.returncode == 0, first.stderr
    other = agentab(*args, "--block-seconds", "60")
    assert other.returncode == 2
    assert other.stderr == (
        f"agentab: error: {out / 'auto' / 'run-1'}: ran a 40 s window, this invocation runs "
        "60 s windows; runs of two lengths do not pool: resume with the --block-seconds (and "
        "--until-decided) its runs ran, or start a new dir with -o NEW_DIR\n"
    )
    fixed = agentab("ab", path, "-o", out)
    assert fixed.returncode == 2
    assert "ran a 40 s window, this invocation runs 120 s windows;" in fixed.stderr
    same = agentab(*args, "--block-seconds", "40")
    assert same.returncode == 0, same.stderr
    seq = json.loads((out / "comparison.json").read_text())["sequential"]
    assert (seq["verdict"], seq["block_s"]) == ("better", 40.0)
    assert len(list((out / "auto").glob("run-*"))) == seq["blocks"]  # the resume ran the rest


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--block-seconds", "40"), "--block-seconds applies with --until-decided (see "),
        (("--until-decided", "--block-seconds", "0"), "--block-seconds 0.0: must be a positive "),
        (("--until-decided", "--block-seconds", "nan"), "--block-seconds nan: must be a positive"),
        (
            ("--until-decided", "--block-seconds", "121"),
            "--block-seconds 121: longer than the file's window ([replay] duration_s = 120); "
            "blocks are meant to be shorter (a longer window belongs in the file)",
        ),
    ],
)
def test_block_seconds_is_refused_in_one_line(
    tmp_path: Path, extra: tuple[str, ...], message: str
) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT)
    result = agentab("ab", path, "-o", tmp_path / "out", *extra)
    assert result.returncode == 2
    assert result.stderr.startswith(f"agentab: error: {message}")
    assert result.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_block_seconds_is_refused_when_runs_end_on_a_request_count(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(
        EXPERIMENT.replace("warmup_requests = 1", "warmup_requests = 1\nlane_requests = 4")
    )
    out = tmp_path / "out"
    result = agentab("ab", path, "-o", out, "--until-decided", "--block-seconds", "40")
    assert result.returncode == 2
    assert result.stderr == (
        f"agentab: error: --block-seconds: {path}: runs end after [replay] lane_requests "
        "requests per lane, not on a window; a block is one such run\n"
    )
    assert not out.exists()


def test_dry_run_runs_nothing_and_plans_from_a_pilot(experiment, tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text(EXPERIMENT)
    fresh = agentab("ab", path, "--dry-run", "-o", tmp_path / "none")
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stdout.splitlines()[0] == (
        "tiny-ab: 4 runs (2 repeats x 2 arms), 120 s profiling window each, engine simulator; "
        "arms auto (A) and fast (B); nothing was run"
    )
    assert not (tmp_path / "none").exists()
    out, _ = experiment  # two completed repeats: a pilot
    planned = agentab("ab", path, "--dry-run", "-o", out, "--effect", "0.1")
    assert planned.returncode == 0, planned.stderr
    assert "# Plan: detect a change of 10% in P90 interactivity with 80% power" in planned.stdout
    assert "| 120 s |" in planned.stdout


def test_plan_prints_repeats_per_window_from_an_experiment_dir(experiment) -> None:
    out, _ = experiment
    result = agentab("plan", out, "--window", "60", "--window", "240", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    (point,) = doc["points"]
    assert point["pilot"]["repeats"] == 2 and point["pilot"]["window_s"] == 120.0
    rows = point["plans"]
    assert [r["window_s"] for r in rows] == [60.0, 240.0]
    assert all(r["repeats"] is None or r["repeats"] >= 2 for r in rows)


def test_plan_refuses_what_is_not_a_pilot(tmp_path: Path) -> None:
    result = agentab("plan", tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"agentab: error: {tmp_path}: no experiment.toml: not an experiment dir written by "
        "`agentab ab`"
    )

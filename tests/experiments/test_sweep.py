"""`agentab ab` with a [sweep] on the simulator: layout, interleaving, seeds, the reports, resume
after an interruption, refusals, and `--fail-if-worse`."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agentab.errors import AgentabError
from agentab.experiments.experiment import load_experiment
from agentab.experiments.experiment_dir import is_complete
from agentab.rundir import scan_metrics, scan_records

SWEEP = """\
name = "tiny-sweep"
repeats = 2
seed = 5

[workload]
generate = { preset = "agentx-coding", sessions = 16 }

[gpus]
count = 16

[replay]
duration_s = 240.0
warmup_requests = 1
scrape_metrics = true
scrape_interval_s = 10.0

[sweep]
concurrency = [8, 2]

[engine]
kind = "simulator"
profile = "gb300-tp16-kimi-k3"
num_draft_tokens = 7
acceptance_probs = [0.9, 0.82, 0.74, 0.66, 0.58, 0.5, 0.42]

[analysis]
resamples = 500

[[arms]]
decode_backend = "auto"

[[arms]]
name = "fast"
decode_backend = "latency_specialized"
"""
ARMS = ("auto", "fast")
RUNS = [(c, arm, k) for c in (8, 2) for k in (1, 2) for arm in ARMS]


def agentab(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentab", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def manifests(out: Path) -> dict[tuple[int, str, int], dict]:
    return {
        (c, arm, k): json.loads((out / f"concurrency-{c}/{arm}/run-{k}/manifest.json").read_text())
        for c, arm, k in RUNS
    }


@pytest.fixture(scope="module")
def sweep(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, Path, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("sweep")
    path = root / "sweep.toml"
    path.write_text(SWEEP)
    out = root / "out"
    return path, out, agentab("ab", path, "-o", out, "--workers", "1")  # one run at a time


def test_every_point_runs_both_arms_interleaved_with_the_same_seeds(sweep) -> None:
    _, out, result = sweep
    assert result.returncode == 0, result.stderr
    found = manifests(out)
    order = sorted(found, key=lambda key: found[key]["started_at"])
    assert order == RUNS  # points in the file's order; per point A B A B
    for (c, arm, k), m in found.items():
        assert m["status"] == "completed"
        assert m["replay"]["concurrency"] == c and m["sweep_point"] == {"concurrency": c}
        assert m["repeat"] == k - 1 and m["replay"]["seed"] == 5 + k - 1 and m["seed"] == 5 + k - 1
        assert m["decode_backend"] == ("auto" if arm == "auto" else "latency_specialized")
        # The sweep's salt (kept for a resume) with the point appended: the arms of a point
        # share prompts, two points against one server do not.
        salt = (out / "prompt_salt").read_text().strip()
        assert m["replay"]["prompt_salt"] == f"{salt}@concurrency-{c}"


def test_the_sweep_reports_lead_with_the_recommendation(sweep) -> None:
    _, out, result = sweep
    data = json.loads((out / "sweep.json").read_text())
    assert [p["point"] for p in data["points"]] == [2, 8]  # sorted for the report
    line = data["recommendation"]["line"]
    assert result.stdout.startswith(f"**Recommendation**: {line}.\n")
    assert result.stdout == (out / "report.md").read_text()
    for p in data["points"]:
        point = json.loads((out / f"concurrency-{p['point']}/comparison.json").read_text())
        headline = point["metrics"]["p90_interactivity_tok_s"]
        assert (p["ratio"], p["ci_low"], p["ci_high"], p["verdict"]) == (
            headline["ratio"],
            headline["ci_low"],
            headline["ci_high"],
            headline["verdict"],
        )
        assert p["a"]["p90_interactivity_tok_s"]["runs"] == headline["runs_a"]
        # auto never takes the specialized path; the specialized arm takes some of its steps
        assert p["a"]["specialized_decode_share"]["value"] == 0.0
        assert 0.0 < p["b"]["specialized_decode_share"]["value"] <= 1.0
        assert (
            p["b"]["throughput_per_gpu_uncached_tok_s"]["value"]
            < (p["b"]["throughput_per_gpu_tok_s"]["value"])
        )
    page = (out / "report.html").read_text()
    assert page.count('class="plotly-graph-div"') == 3
    assert "Frontier: P90 interactivity vs throughput per GPU" in page
    assert f"<b>Recommendation</b>: {line}." in page


def test_running_the_same_command_again_runs_nothing(sweep) -> None:
    path, out, _ = sweep
    before = manifests(out)
    again = agentab("ab", path, "-o", out)
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stderr and "8 of 8 runs complete, 0 to run" in again.stderr
    assert manifests(out) == before


def test_an_interrupted_sweep_completes_only_its_missing_runs(tmp_path: Path) -> None:
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentab", "ab", str(path), "-o", str(out), "--workers", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    for line in proc.stderr:  # interrupt once two runs are done
        if line.lstrip().startswith("[2/8]"):
            proc.send_signal(signal.SIGINT)
            break
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    done = {key for key in RUNS if is_complete(out / f"concurrency-{key[0]}/{key[1]}/run-{key[2]}")}
    assert {(8, "auto", 1), (8, "fast", 1)} <= done and len(done) < len(RUNS)
    kept = {key: m for key, m in manifests_present(out).items() if key in done}
    again = agentab("ab", path, "-o", out)
    assert again.returncode == 0, again.stderr
    assert f"{len(done)} of 8 runs complete, {8 - len(done)} to run" in again.stderr
    after = manifests(out)
    assert all(after[key] == m for key, m in kept.items())  # not run again
    assert all(m["status"] == "completed" for m in after.values())


def manifests_present(out: Path) -> dict:
    found = {}
    for c, arm, k in RUNS:
        file = out / f"concurrency-{c}/{arm}/run-{k}/manifest.json"
        if file.is_file():
            found[(c, arm, k)] = json.loads(file.read_text())
    return found


def test_a_run_that_did_not_complete_is_run_again(sweep, tmp_path: Path) -> None:
    path, out, _ = sweep
    import shutil

    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    file = copy / "concurrency-2/fast/run-2/manifest.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "status": "interrupted"}))
    before = manifests(copy)
    again = agentab("ab", path, "-o", copy)
    assert again.returncode == 0, again.stderr
    assert "7 of 8 runs complete, 1 to run" in again.stderr
    after = manifests(copy)
    assert [key for key in RUNS if after[key] != before[key]] == [(2, "fast", 2)]


def test_a_dir_of_another_experiment_is_refused(sweep, tmp_path: Path) -> None:
    _, out, _ = sweep
    other = tmp_path / "other.toml"
    other.write_text(SWEEP.replace("repeats = 2", "repeats = 3"))
    result = agentab("ab", other, "-o", out)
    assert result.returncode == 2
    assert result.stderr.startswith(f"agentab: error: {out}: holds a different experiment")
    assert result.stderr.count("\n") == 1


def test_fail_if_worse_exits_1_when_b_is_significantly_worse(tmp_path: Path) -> None:
    # swapped arms: B is the default path, slower than the specialized one at low load
    text = (
        SWEEP.replace('name = "fast"\ndecode_backend = "latency_specialized"', "SWAP")
        .replace('decode_backend = "auto"', 'name = "fast"\ndecode_backend = "latency_specialized"')
        .replace("SWAP", 'decode_backend = "auto"')
        .replace("concurrency = [8, 2]", "concurrency = [8]")
        .replace("repeats = 2", "repeats = 3")  # two runs leave a t interval too wide to judge
    )
    path = tmp_path / "swapped.toml"
    path.write_text(text)
    result = agentab("ab", path, "-o", tmp_path / "out", "--fail-if-worse")
    data = json.loads((tmp_path / "out/sweep.json").read_text())
    assert data["points"][0]["verdict"] == "worse", data["points"][0]
    assert data["recommendation"]["worse_points"] == [8]
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "agentab: auto is significantly worse in P90 interactivity at concurrency 8 "
        "(--fail-if-worse)"
    )
    plain = agentab("ab", path, "-o", tmp_path / "out")  # a resume, and no gate
    assert plain.returncode == 0, plain.stderr


def test_a_rate_sweep_runs_open_loop(tmp_path: Path) -> None:
    text = SWEEP.replace("concurrency = [8, 2]", "rate = [0.05]").replace(
        "repeats = 2", "repeats = 1"
    )
    path = tmp_path / "rate.toml"
    path.write_text(text)
    result = agentab("ab", path, "-o", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    m = json.loads((tmp_path / "out/rate-0.05/fast/run-1/manifest.json").read_text())
    assert m["replay"]["rate"] == 0.05 and m["sweep_point"] == {"rate": 0.05}
    assert "there is no verdict (fewer than 2 runs per arm" in result.stdout.splitlines()[0]


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("concurrency = [8, 2]", "concurrency = []",
         "sweep.toml:18: [sweep] concurrency must be a non-empty array"),
        ("concurrency = [8, 2]", "concurrency = [8, 0]",
         "sweep.toml:18: [sweep] concurrency values must be an integer >= 1"),
        ("concurrency = [8, 2]", "concurrency = [8, 8]",
         "sweep.toml:18: [sweep] concurrency lists a value twice"),
        ("concurrency = [8, 2]", "rate = [0.5, -1]",
         "sweep.toml:18: [sweep] rate values must be numbers > 0"),
        ("concurrency = [8, 2]", "concurrency = [8]\nrate = [1.0]",
         "sweep.toml:17: [sweep] needs exactly one of"),
        ("concurrency = [8, 2]", "concurency = [8]",
         "sweep.toml:18: unknown key 'concurency' in [sweep]"),
        ("duration_s = 240.0", "duration_s = 240.0\nconcurrency = 4",
         "sweep.toml:13: [replay] concurrency is set by [sweep] concurrency"),
        ("duration_s = 240.0", "duration_s = 240.0\nrate = 0.5",
         "sweep.toml:13: a concurrency sweep is closed loop"),
    ],
)  # fmt: skip
def test_sweep_mistakes_are_one_line_naming_where(
    tmp_path: Path, old: str, new: str, expected: str
) -> None:
    path = tmp_path / "sweep.toml"
    assert old in SWEEP
    path.write_text(SWEEP.replace(old, new, 1))
    with pytest.raises(AgentabError) as exc:
        load_experiment(path)
    assert expected in str(exc.value) and "\n" not in str(exc.value)


def test_two_workers_write_the_runs_one_process_writes(sweep, tmp_path: Path) -> None:
    path, out, first = sweep
    assert first.returncode == 0, first.stderr
    (tmp_path / "out").mkdir()
    # the same prompt salt as the one-process sweep, so both send the same prompts
    (tmp_path / "out" / "prompt_salt").write_text((out / "prompt_salt").read_text())
    (tmp_path / "out" / "experiment.toml").write_text((out / "experiment.toml").read_text())
    result = agentab("ab", path, "-o", tmp_path / "out", "--workers", "2")
    assert result.returncode == 0, result.stderr
    assert "agentab ab: 8 runs on 2 processes" in result.stderr
    for c, arm, k in RUNS:
        run = f"concurrency-{c}/{arm}/run-{k}"
        one = scan_records(out / run).collect().sort("request_id")
        two = scan_records(tmp_path / "out" / run).collect().sort("request_id")
        assert one.equals(two), run
    points = [json.loads((d / "sweep.json").read_text())["points"] for d in (out, tmp_path / "out")]
    for p in points:
        for point in p:
            for side in ("a", "b"):
                point[side].pop("runs", None)
    assert points[0] == points[1]


def test_workers_apply_to_a_simulated_sweep_only(tmp_path: Path) -> None:
    path = tmp_path / "ab.toml"
    path.write_text(SWEEP.replace("[sweep]\nconcurrency = [8, 2]\n", ""))
    result = agentab("ab", path, "-o", tmp_path / "out", "--workers", "2")
    assert result.returncode == 2
    assert "--workers applies to a [sweep] on the simulator" in result.stderr


# What differs between two executions of one run by nature: the wall clock and the process.
PROCESS_FIELDS = ("started_at", "finished_at", "writer", "placement")


def assert_same_experiment_dir(one: Path, other: Path) -> None:
    """`other` holds what `one` holds: every file byte for byte (paths into the dir written as
    `one`'s), the manifests field for field but for the wall clock and the process that ran
    them, the records and metrics as the same Arrow rows. Left out: each dir's lock file (the
    pid that held it) and report.html (plotly draws a random element id per plot)."""

    def files(root: Path) -> set[str]:
        found = set()
        for p in root.rglob("*"):
            if p.is_file() and p.name not in (".agentab.lock", "report.html"):
                rel = p.relative_to(root)
                table = rel.parent.name in ("records", "metrics")
                found.add(str(rel.parent / "*") if table else str(rel))
        return found

    assert files(one) == files(other)
    for rel in sorted(files(one)):
        if rel.endswith("/*"):  # a table's part files: split where the wall-clock flushes fell
            run, table = Path(rel).parent.parent, Path(rel).parent.name
            scan = scan_records if table == "records" else scan_metrics
            assert scan(one / run).collect().equals(scan(other / run).collect()), rel
            continue
        a = (one / rel).read_bytes()
        b = (other / rel).read_bytes().replace(str(other).encode(), str(one).encode())
        if rel.endswith("manifest.json"):
            ma, mb = json.loads(a), json.loads(b)
            for key in PROCESS_FIELDS:
                ma.pop(key, None)
                mb.pop(key, None)
            assert ma == mb, rel
        else:
            assert a == b, rel


@pytest.mark.ray
@pytest.mark.slow
def test_a_ray_sweep_writes_the_runs_one_process_writes(sweep, tmp_path: Path) -> None:
    path, out, first = sweep
    assert first.returncode == 0, first.stderr
    ray_out = tmp_path / "ray"
    ray_out.mkdir()
    # the one-process sweep's salt, so both send the same prompts
    (ray_out / "prompt_salt").write_text((out / "prompt_salt").read_text())
    (ray_out / "experiment.toml").write_text((out / "experiment.toml").read_text())
    result = agentab("ab", path, "-o", ray_out, "--ray", "local", "--workers", "2", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "agentab ab: 8 runs as Ray tasks on local (2 CPUs)" in result.stderr
    assert "[8/8]" in result.stderr and "8/8 done, 0 running, 0 failed" in result.stderr
    assert_same_experiment_dir(out, ray_out)
    for c, arm, k in RUNS:
        where = json.loads((ray_out / f"concurrency-{c}/{arm}/run-{k}/manifest.json").read_text())
        assert where["placement"]["runner"] == "ray"
        assert where["placement"]["host"] == socket.gethostname()
        assert re.fullmatch(r"[0-9a-f]{56}", where["placement"]["node"])
        local = json.loads((out / f"concurrency-{c}/{arm}/run-{k}/manifest.json").read_text())
        here = {"runner": "process", "host": socket.gethostname(), "node": None}
        assert local["placement"] == here


def test_ray_applies_to_a_simulated_sweep_only(tmp_path: Path) -> None:
    path = tmp_path / "ab.toml"
    path.write_text(SWEEP.replace("[sweep]\nconcurrency = [8, 2]\n", ""))
    result = agentab("ab", path, "-o", tmp_path / "out", "--ray", "local")
    assert result.returncode == 2
    assert "--ray applies to a [sweep] on the simulator" in result.stderr


def test_workers_with_a_ray_cluster_address_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "sweep.toml"
    path.write_text(SWEEP)
    result = agentab("ab", path, "-o", tmp_path / "out", "--ray", "auto", "--workers", "2")
    assert result.returncode == 2
    assert "--workers applies with --ray local" in result.stderr
    assert not (tmp_path / "out").exists()

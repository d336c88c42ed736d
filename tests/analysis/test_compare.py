"""Comparisons: the guard refuses confounded runs; the bootstrap finds real effects only."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentab.analysis.compare import compare_runs
from agentab.analysis.guard import check, manifest_differences
from agentab.analysis.load import load_run, load_runs
from agentab.analysis.markdown import comparison_markdown
from agentab.errors import AgentabError

from .rundirs import manifest, synthetic_records, write_run


def test_guard_refuses_gpu_count_and_names_it_first() -> None:
    a = [manifest()]
    b = [manifest(gpu_count=8, decode_backend="latency_specialized", tp=8)]
    diffs = manifest_differences(a, b)
    assert [d.field for d in diffs] == ["gpu_count", "tp"]
    with pytest.raises(AgentabError) as err:
        check(diffs)
    message = str(err.value)
    assert "\n" not in message
    assert message.index("gpu_count (A: 16, B: 8)") < message.index("tp (A: 16, B: 8)")


def test_guard_accepts_runs_differing_only_in_backend_and_per_run_fields() -> None:
    a = [manifest(seed=1, replay__seed=1, started_at="x", arm="auto")]
    b = [
        manifest(
            decode_backend="latency_specialized",
            arm="latency_specialized",
            seed=2,
            replay__seed=2,
            started_at="y",
            gpu_ids=[8, 9],
        )
    ]
    assert manifest_differences(a, b) == []


def test_guard_masks_the_backend_inside_a_server_command() -> None:
    cmd = (
        "vllm serve kimi --tensor-parallel-size 16 "
        '--additional-config \'{{"decode_backend": "{}"}}\''
    )
    a = [manifest(command=cmd.format("auto"))]
    b = [manifest(command=cmd.format("latency_specialized"), decode_backend="latency_specialized")]
    assert manifest_differences(a, b) == []
    c = [manifest(command=cmd.format(8001, "auto").replace("16", "8"))]
    assert [d.field for d in manifest_differences(a, c)] == ["command"]


def test_guard_ranks_the_seed_article_confounders_in_order() -> None:
    a = [manifest()]
    b = [
        manifest(
            workload_hash="x",
            replay__concurrency=4,
            spec=None,
            kv_cache_dtype="fp8",
            model="other",
            gpu_name="H200",
            gpu_count=8,
            profile__hash="q",
        )
    ]
    fields = [d.field for d in manifest_differences(a, b)]
    assert fields[:4] == ["gpu_count", "gpu_name", "model", "kv_cache_dtype"]
    assert fields.index("workload_hash") < fields.index("replay.concurrency")
    assert fields.index("replay.concurrency") < fields.index("profile.hash")


def test_guard_flags_disagreement_within_one_side() -> None:
    diffs = manifest_differences([manifest(), manifest(tp=8)], [manifest(), manifest()])
    assert [d.field for d in diffs] == ["tp"]


def test_allow_diff_must_name_a_real_difference() -> None:
    diffs = manifest_differences([manifest()], [manifest(gpu_count=8)], ["gpu_count"])
    assert check(diffs, ["gpu_count"]) == ["gpu_count"]
    with pytest.raises(AgentabError, match="--allow-diff tp: no such difference"):
        check(manifest_differences([manifest()], [manifest()], ["tp"]), ["tp"])


def write_arm(root: Path, seeds: tuple[int, ...], itl_scale: float = 1.0, **changes) -> list[Path]:
    """One run dir per seed (repeat k = seeds[k]), as `agentab ab` lays out an arm."""
    return [
        write_run(
            root / f"run-{k + 1}",
            synthetic_records(seed, itl_scale=itl_scale),
            manifest(repeat=k, **changes),
        )
        for k, seed in enumerate(seeds)
    ]


LS = {"decode_backend": "latency_specialized", "arm": "latency_specialized"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[Path]]:
    root = tmp_path_factory.mktemp("pair")
    return write_arm(root / "a", (5, 6)), write_arm(root / "b", (5, 6), itl_scale=0.5, **LS)


def test_halved_itl_doubles_p90_interactivity_and_is_significant(
    pair: tuple[list[Path], list[Path]],
) -> None:
    a, b = pair
    result = compare_runs(
        [load_run(p) for p in a], [load_run(p) for p in b], resamples=2000, seed=1
    )
    assert result.repeat_pairing == "paired" and result.withheld == []
    m = result.metrics["p90_interactivity_tok_s"]
    assert m.ratio == pytest.approx(2.0, rel=1e-9)
    assert m.ci_low == pytest.approx(2.0, rel=1e-9) and m.ci_high == pytest.approx(2.0, rel=1e-9)
    assert m.verdict == "better"
    assert (m.n_a, m.n_b) == (320, 320)  # 2 runs x 20 sessions x 8 requests, each with an ITL
    assert result.metrics["itl_s.p90"].verdict == "better"  # lower ITL is better
    ttft = result.metrics["ttft_s.p90"]  # untouched: identical in both arms
    assert (ttft.ratio, ttft.ci_low, ttft.ci_high) == (1.0, 1.0, 1.0)
    assert ttft.verdict == "equivalent"  # identical arms: inside the +-3% margin
    assert result.confounded_by == []
    doc = result.to_json()
    assert doc["metrics"]["p90_interactivity_tok_s"]["verdict"] == "better"
    size = {"runs": 2, "sessions": 20, "requests": 320, "itl_requests": 320}
    assert doc["sample"] == {"a": size, "b": size}
    assert doc["verdict_withheld"] == []
    line = next(x for x in comparison_markdown(result).splitlines() if x.startswith("**P90"))
    assert line.endswith(
        "**better**; this comparison could detect a change of +-0.0% (80% power) "
        "(A: 2 run(s), 20 sessions, 320 requests (320 with an ITL); "
        "B: 2 run(s), 20 sessions, 320 requests (320 with an ITL))."
    ), line


def test_one_run_per_arm_gets_no_verdict(pair: tuple[list[Path], list[Path]]) -> None:
    a, b = pair
    result = compare_runs([load_run(a[0])], [load_run(b[0])], resamples=500, seed=1)
    m = result.metrics["p90_interactivity_tok_s"]
    assert m.ratio == pytest.approx(2.0, rel=1e-9)  # the effect is there, and still no verdict
    assert m.verdict == "no verdict"
    assert result.metrics["ttft_s.p90"].verdict == "no verdict"
    assert result.withheld[0].startswith("fewer than 2 runs per arm (A 1, B 1)")


def test_small_samples_get_no_verdict_and_say_so(tmp_path: Path) -> None:
    # Two repeats of two sessions: a CI can look narrow, but it rests on 2 sessions and 32
    # requests per arm, below the minimum sample.
    def arm(root: Path, itl_scale: float, **changes) -> list[Path]:
        return [
            write_run(
                root / f"run-{k}",
                synthetic_records(9 + k, sessions=2, itl_scale=itl_scale),
                manifest(repeat=k, **changes),
            )
            for k in range(2)
        ]

    a, b = arm(tmp_path / "a", 1.0), arm(tmp_path / "b", 0.5, **LS)
    result = compare_runs([load_run(p) for p in a], [load_run(p) for p in b], resamples=500)
    assert result.withheld == [
        "fewer than 10 sessions per arm (A 2, B 2)",
        "fewer than 200 requests with an ITL per arm (A 32, B 32)",
    ]
    assert {r.verdict for r in result.metrics.values()} <= {"no verdict", "n/a"}
    md = comparison_markdown(result)
    assert (
        "**no verdict**: fewer than 10 sessions per arm (A 2, B 2); fewer than 200 requests with "
        "an ITL per arm (A 32, B 32); this comparison could detect a change of +-0.0% (80% "
        "power) (A: 2 run(s), 2 sessions, 32 requests (32 with an ITL); "
        "B: 2 run(s), 2 sessions, 32 requests (32 with an ITL))."
    ) in md
    assert "| no verdict | +-0.0% | 32 / 32 |" in md


def test_confounded_comparison_is_labelled(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", synthetic_records(5), manifest())
    b = write_run(tmp_path / "b", synthetic_records(5), manifest(gpu_count=8))
    with pytest.raises(AgentabError, match="gpu_count"):
        compare_runs([load_run(a)], [load_run(b)], resamples=100)
    result = compare_runs([load_run(a)], [load_run(b)], allow_diff=["gpu_count"], resamples=100)
    assert result.confounded_by == ["gpu_count"]
    # Same requests, half the GPUs: throughput per GPU doubles, all of it from the GPU count.
    assert result.metrics["throughput_per_gpu_tok_s"].ratio == pytest.approx(2.0)


def test_load_runs_finds_the_run_dirs_below_a_folder(
    pair: tuple[list[Path], list[Path]],
) -> None:
    a, b = pair
    assert [r.path for r in load_runs(a[0].parent.parent)] == sorted(a + b)
    with pytest.raises(AgentabError, match="no run dirs"):
        load_runs(a[0] / "records")


def test_two_repeats_say_why_the_interval_is_wide(pair: tuple[list[Path], list[Path]]) -> None:
    a, b = pair  # two repeats per arm
    result = compare_runs([load_run(p) for p in a], [load_run(p) for p in b], resamples=200)
    text = comparison_markdown(result)
    assert "- Two repeats per arm: the interval over the repeats has 1 degree of freedom" in text
    single = compare_runs([load_run(a[0])], [load_run(b[0])], resamples=200)
    assert "Two repeats per arm" not in comparison_markdown(single)

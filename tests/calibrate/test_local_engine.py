"""Calibration from the local engine's own step timings: `agentab calibrate --engine local`
launches `agentab serve --engine local --preset tiny` on the CPU (one server per decode
path), times the load with the engine's step counters (agentab:step_seconds_*_total), and
writes a profile whose facts come from the engine. The CPU is shared and noisy, so values
are checked for sense, not accuracy; the figures are printed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")  # the local engine serves a torch model

from agentab.cli import main
from agentab.engine.profile import load_profile

EXPERIMENT = """
name = "tiny-local"
[workload]
generate = { preset = "agentx-coding", sessions = 2, seed = 1 }
[gpus]
count = 1
[replay]
concurrency = 1
[engine]
kind = "local"
preset = "tiny"
device = "cpu"
max_num_seqs = 32
kv_blocks = 2048
[[arms]]
decode_backend = "auto"
[[arms]]
decode_backend = "latency_specialized"
"""


@pytest.mark.slow
def test_calibrate_from_the_local_engines_step_counters(tmp_path: Path, capsys) -> None:
    out = tmp_path / "local-tiny-cpu.toml"
    experiment = tmp_path / "experiment.toml"  # the engine options come from its [engine] table
    experiment.write_text(EXPERIMENT)
    main(
        [
            "calibrate",
            "--engine-config",
            str(experiment),
            "--specialized",
            "--batches",
            "1,4",
            "--steps",
            "32",
            "--prefill-repeats",
            "1",
            "--contexts",
            "64,512",
            "--allow-assumed",
            "spec_decode.drafter_step_us",
            "-o",
            str(out),
            "--quiet",
        ]
    )
    report = json.loads(out.with_suffix(".fit.json").read_text())
    assert report["timing"] == "engine"
    assert report["assumed"] == ["spec_decode.drafter_step_us"]
    for path in ("standard", "specialized"):
        rows = report["measurements"][path]["decode"]
        assert [r["engine_path"] for r in rows] == [path] * 4
        assert all(r["engine_steps"] >= 8 for r in rows)
        print(path, [round(r["engine_step_s"] * 1e3, 2) for r in rows], "ms per step")
    prefill = report["measurements"]["standard"]["prefill"]
    assert all(r["engine_steps"] == 1 and r["engine_s"] > 0 for r in prefill)
    assert report["measurements"]["specialized"]["prefill"] == []
    # the server splits each prefill request's TTFT: what the step left out is the frontend's
    assert all(set(r["server_s"]) == {"intake", "queue", "prefill", "output"} for r in prefill)
    front = report["frontend"]
    assert front["split"] == "server" and len(front["requests"]) == len(prefill)
    print(f"frontend: intake {front['intake_us']:.0f} us, output {front['output_us']:.0f} us")
    p = load_profile(out)
    assert (p.kv_block_size_tokens, p.kv_capacity_blocks, p.cuda_graph_max_tokens) == (16, 2048, 1)
    assert p.gpu_name == "cpu" and p.model == "agentab-local-tiny"
    # on the CPU the local engine schedules one step at a time, and says so
    assert p.async_scheduling is False
    assert p.frontend_intake_us == pytest.approx(front["intake_us"], rel=1e-5)
    assert p.frontend_output_us == pytest.approx(front["output_us"], rel=1e-5)
    assert p.frontend_intake_us + p.frontend_output_us > 0
    assert "async_scheduling = false  # [E] /agentab/describe" in out.read_text()
    assert p.mixed_decode_row_us >= 0.0 and len(report["mixed"]["residuals"]) == 3
    mixed = report["measurements"]["standard"]["mixed"]
    assert all(r["engine_s"] is not None for r in mixed)
    print("mixed steps", [(r["rows"], round(r["engine_s"] * 1e3, 2)) for r in mixed], "ms")
    assert p.standard.batch_tokens.tolist()[:2] == [1.0, 4.0]
    assert p.specialized.batch_tokens.tolist() == [1.0, 4.0]
    assert (p.standard.layer_time_us > 0).all() and (p.specialized.layer_time_us > 0).all()
    assert report["scheduler"] == {
        "max_num_seqs": 32,
        "max_num_batched_tokens": 2048,
        "block_size": 16,
        "kv_blocks": 2048,
    }
    assert f"wrote {out}" in capsys.readouterr().out

    # the same measurements fitted again, timing nothing: the same profile terms
    refit = tmp_path / "refit.toml"
    args = ["calibrate", "--refit", str(out.with_suffix(".fit.json")), "-o", str(refit)]
    main([*args, "--allow-assumed", "spec_decode.drafter_step_us"])
    q = load_profile(refit)
    assert q.standard.layer_time_us.tolist() == p.standard.layer_time_us.tolist()
    assert q.specialized.layer_time_us.tolist() == p.specialized.layer_time_us.tolist()
    assert q.prefill_tokens_per_s_per_gpu == p.prefill_tokens_per_s_per_gpu
    again = json.loads(refit.with_suffix(".fit.json").read_text())
    assert again["measurements"] == report["measurements"]
    assert again["refit_of"]["report"] == str(out.with_suffix(".fit.json"))
    assert again["refit_of"]["date"] == report["provenance"]["date"]
    assert "# refit of the measurements of" in refit.read_text().splitlines()[1]


SPEC_EXPERIMENT = EXPERIMENT.replace(
    "[[arms]]",
    """[engine.speculative_config]
num_speculative_tokens = 3
draft_layers = 1
rejection_sample_method = "synthetic"
synthetic_acceptance_length = 3.0
[[arms]]""",
    1,
)


@pytest.mark.slow
def test_calibrate_times_the_drafter_of_an_engine_config_with_speculative_decoding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a speculative config the decode paths are timed without drafts (a verify step is
    priced as a decode step of its padded tokens) and a third server, the config as given,
    times the drafter: its seconds per drafting step from the engine's counters, fitted as
    `drafter_step_us + rows * drafter_row_us`, both [C], nothing assumed about it."""
    out = tmp_path / "spec.toml"
    experiment = tmp_path / "experiment.toml"
    experiment.write_text(SPEC_EXPERIMENT)
    assumed = ["--allow-assumed", "decode.specialized"]  # one path timed: the test's time
    main(["calibrate", "--engine-config", str(experiment), "--batches", "1,4", "--steps", "16",
          "--prefill-repeats", "1", "--contexts", "64,256", "-o", str(out),
          *assumed])  # fmt: skip
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    # the progress lines name a mixed phase's rows as they run: verify rows where it drafts
    assert re.search(r"\[standard \d+/\d+\] mixed \d+ beside \d+ decode rows", printed)
    assert re.search(r"\[drafter \d+/\d+\] mixed \d+ beside 4 verify rows", printed)
    assert not re.search(r"\[drafter .* decode rows", printed)
    report = json.loads(out.with_suffix(".fit.json").read_text())
    assert report["assumed"] == ["decode.specialized"]
    # the standard path's load ran without drafts, the drafter's with them, on auto
    standard = report["measurements"]["standard"]["decode"]
    assert all(r["engine_draft_steps"] is None for r in standard)
    drafter = report["measurements"]["drafter"]["decode"]
    assert [r["batch"] for r in drafter] == [1, 1, 4, 4]
    assert all(r["engine_draft_steps"] >= 8 and r["engine_draft_s"] > 0 for r in drafter)
    assert report["engine"]["drafter"]["decode_backend"] == "auto"
    # the draft-free server holds max_num_seqs x (1 + k) rows: its batches reach the verify
    # steps' token counts
    assert report["engine"]["drafter"]["max_num_seqs"] == 32
    assert report["engine"]["standard"]["max_num_seqs"] == 32 * 4
    assert report["measurements"]["drafter"]["prefill"] == []
    # its mixed phases: a prompt beside 1, 2 and 4 verify rows, each step on the engine's clock
    mixed = report["measurements"]["drafter"]["mixed"]
    assert [r["rows"] for r in mixed] == [1, 2, 4]
    assert all(r["engine_s"] > 0 and r["decode_step_s"] > 0 for r in mixed)
    print("mixed verify steps", [(r["rows"], round(r["engine_s"] * 1e3, 2)) for r in mixed], "ms")
    fit = report["drafter"]
    assert [r["rows"] for r in fit["mixed_verify"]["residuals"]] == [1, 2, 4]
    assert p_mixed_verify(fit) >= 0.0
    assert [r["batch"] for r in fit["residuals"]] == [1, 1, 4, 4]
    p = load_profile(out)
    assert p.drafter_step_us == pytest.approx(fit["step_us"]["value"], rel=1e-5)
    assert p.drafter_row_us == pytest.approx(fit["row_us"]["value"], rel=1e-5)
    assert p.drafter_step_us + 4 * p.drafter_row_us > 0
    # its verify steps (4 tokens a row) at two contexts: the verify rows' context term
    assert report["load"]["drafter"]["draft_tokens"] == 3
    assert fit["verify_context_us"]["value"] >= 0.0
    assert [r["batch"] for r in fit["verify_residuals"]] == [1, 1, 4, 4]
    assert p.verify_context_token_us == pytest.approx(fit["verify_context_us"]["value"], rel=1e-5)
    assert p.mixed_verify_row_us == pytest.approx(p_mixed_verify(fit), rel=1e-5)
    text = out.read_text()
    assert "# [C]" in text.split("mixed_verify_row_us = ")[1].splitlines()[0]
    assert "drafter_step_us = " in text and "# [C]" in text.split("drafter_step_us = ")[1]
    print(f"drafter: {p.drafter_step_us:.0f} us per step + {p.drafter_row_us:.0f} us per row")
    # refit: the drafter's measurements travel with the report
    refit = tmp_path / "refit.toml"
    main(["calibrate", "--refit", str(out.with_suffix(".fit.json")), "-o", str(refit), *assumed])
    q = load_profile(refit)
    assert (q.drafter_step_us, q.drafter_row_us) == (p.drafter_step_us, p.drafter_row_us)
    assert q.verify_context_token_us == p.verify_context_token_us
    assert q.mixed_verify_row_us == p.mixed_verify_row_us


def p_mixed_verify(fit: dict) -> float:
    """The fitted cost per verify row of a mixed step, as the report records it."""
    return float(fit["mixed_verify"]["us_per_decode_row"]["value"])


@pytest.mark.slow
def test_a_calibration_in_parts_fits_as_one(tmp_path: Path, capsys) -> None:
    """`--only` times some of the servers and keeps their measurements without a profile (a
    calibration longer than one sitting); `--refit A --refit B` fits the parts together, each
    path's measurements as its part recorded them."""
    experiment = tmp_path / "experiment.toml"
    experiment.write_text(SPEC_EXPERIMENT)
    load = ["--batches", "1,4", "--steps", "16", "--prefill-repeats", "1", "--contexts", "64,256"]
    parts = {}
    for only in ("standard", "drafter"):
        out = tmp_path / f"{only}.toml"
        main(["calibrate", "--engine-config", str(experiment), *load, "--only", only,
              "-o", str(out), "--quiet"])  # fmt: skip
        assert not out.exists()  # measurements only: no profile
        parts[only] = json.loads(out.with_suffix(".fit.json").read_text())
        assert list(parts[only]["measurements"]) == [only]
        assert list(parts[only]["engine"]) == [only]
        assert f"wrote {out.with_suffix('.fit.json')}: measurements of {only} only" in (
            capsys.readouterr().out
        )
    merged = tmp_path / "merged.toml"
    reports = [str(tmp_path / f"{only}.fit.json") for only in ("standard", "drafter")]
    main(["calibrate", "--refit", reports[0], "--refit", reports[1], "-o", str(merged),
          "--allow-assumed", "decode.specialized"])  # fmt: skip
    report = json.loads(merged.with_suffix(".fit.json").read_text())
    assert report["measurements"] == {
        "standard": parts["standard"]["measurements"]["standard"],
        "drafter": parts["drafter"]["measurements"]["drafter"],
    }
    assert report["refit_of"]["parts"] == reports
    assert report["load"]["drafter"]["draft_tokens"] == 3
    p = load_profile(merged)
    assert p.drafter_step_us == pytest.approx(report["drafter"]["step_us"]["value"], rel=1e-5)
    assert p.verify_context_token_us == pytest.approx(
        report["drafter"]["verify_context_us"]["value"], rel=1e-5
    )
    assert p.mixed_verify_row_us == pytest.approx(p_mixed_verify(report["drafter"]), rel=1e-5)
    source = report["provenance"]["engine_source"]
    assert len(source) == 16 and "# Engine source: " + source in merged.read_text()
    # a part timed on other engine code: refused, unless the change is declared harmless
    changed = tmp_path / "drafter-changed.fit.json"
    part = json.loads(Path(reports[1]).read_text())
    part["engine"]["drafter"]["engine_source"] = "0123456789abcdef"
    changed.write_text(json.dumps(part))
    mixed = ["--refit", reports[0], "--refit", str(changed)]
    mixed += ["--allow-assumed", "decode.specialized"]
    with pytest.raises(SystemExit):
        main(["calibrate", *mixed, "-o", str(tmp_path / "x.toml")])
    assert capsys.readouterr().err.endswith(
        f"runs engine source 0123456789abcdef, the standard path's "
        f"({parts['standard']['engine']['standard']['url']}) "
        f"{source}: a profile describes one engine (--allow-engine-change fits them anyway, for "
        "a change that leaves the steps' time alone)\n"
    )
    main(["calibrate", *mixed, "--allow-engine-change", "-o", str(tmp_path / "mixed.toml")])
    mixed_report = json.loads((tmp_path / "mixed.fit.json").read_text())
    assert mixed_report["provenance"]["engine_source"] == (
        f"standard {source}, drafter 0123456789abcdef"
    )
    assert mixed_report["measurements"] == report["measurements"]
    # one path measured twice, or a server the calibration does not launch: one line each
    for args, message in (
        (["--refit", reports[0], "--refit", reports[0]], "the standard path is measured in an"),
        (["--url", "http://127.0.0.1:9", "--allow-engine-change"], "--allow-engine-change applies"),
        (["--engine-config", str(experiment), "--only", "specialized"], "--only specialized: "),
        (["--url", "http://127.0.0.1:9", "--only", "standard"], "--only: the local engine's"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["calibrate", *args, "-o", str(tmp_path / "x.toml")])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_the_specialized_server_is_timed_up_to_its_specialized_max_tokens(tmp_path: Path) -> None:
    """An engine whose `specialized_max_tokens` is 2 runs a decode step of 4 rows on the
    standard path: the specialized server's load stops at batch 2, and every phase it timed
    ran on the specialized path."""
    experiment = tmp_path / "experiment.toml"
    experiment.write_text(EXPERIMENT.replace("kv_blocks = 2048", "kv_blocks = 2048\n"
                                             "specialized_max_tokens = 2"))  # fmt: skip
    out = tmp_path / "specialized.toml"
    main(["calibrate", "--engine-config", str(experiment), "--specialized", "--only",
          "specialized", "--batches", "1,2,4", "--steps", "16", "--contexts", "64,256",
          "-o", str(out), "--quiet"])  # fmt: skip
    report = json.loads(out.with_suffix(".fit.json").read_text())
    decode = report["measurements"]["specialized"]["decode"]
    assert [(r["batch"], r["engine_path"]) for r in decode] == [
        (1, "specialized"), (1, "specialized"), (2, "specialized"), (2, "specialized"),
    ]  # fmt: skip

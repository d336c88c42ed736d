"""Calibrating the same server again: the prompts of an earlier run sit in its prefix cache.

A load that resent them would time cache hits as prefills, so each run draws a fresh seed
unless one is given, and a given seed whose prompts the server already holds is refused at
the warm-up, before any phase is timed. A profile that cannot be written (here: a field the
load cannot identify, not accepted) keeps the measurements in the fit report for `--refit`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentab.cli import main
from agentab.engine.profile import load_profile
from tests.serving import served

TRUTH = Path(__file__).with_name("truth.toml")
SMALL = ["--batches", "1,2", "--steps", "16", "--prefill-repeats", "1", "--quiet"]
ASSUMED = ("spec_decode.drafter_step_us", "decode.cuda_graph_max_tokens", "decode.specialized")


def calibrate(url: str, out: Path, *extra: str) -> None:
    main(["calibrate", "--url", url, "-o", str(out), *SMALL, *extra])


def allowed() -> list[str]:
    return [arg for field in ASSUMED for arg in ("--allow-assumed", field)]


def test_a_second_calibration_of_one_server_times_fresh_prompts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with served("--profile", str(TRUTH), "--max-model-len", "4096") as url:
        # 1: seed 5, without accepting the unidentified fields: no profile, measurements kept
        first = tmp_path / "first.toml"
        with pytest.raises(SystemExit) as exc:
            calibrate(url, first, "--seed", "5")
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        kept = tmp_path / "first.fit.json"
        assert "refusing to write a profile with a guess" in err
        assert err.endswith(
            f"no profile written, the measurements are kept in {kept} "
            f"(`agentab calibrate --refit {kept} -o {first}` fits them again)"
        )
        assert not first.exists()
        report = json.loads(kept.read_text())
        assert report["load"]["standard"]["seed"] == 5
        assert len(report["measurements"]["standard"]["decode"]) == 4  # 2 batches x 2 contexts

        # a refit that fails the same way leaves the report it read as it was
        before = kept.read_bytes()
        with pytest.raises(SystemExit):
            main(["calibrate", "--refit", str(kept), "-o", str(first)])
        assert "no profile written" in capsys.readouterr().err
        assert kept.read_bytes() == before and not first.exists()

        # the kept measurements fit again into a profile, timing nothing
        refit = tmp_path / "refit.toml"
        main(["calibrate", "--refit", str(kept), "-o", str(refit), *allowed()])
        assert load_profile(refit).standard.batch_tokens[:2].tolist() == [1, 2]

        # 2: seed 5 again: its prompts are cached; refused at the warm-up
        with pytest.raises(SystemExit):
            calibrate(url, tmp_path / "again.toml", "--seed", "5", *allowed())
        err = capsys.readouterr().err.strip()
        assert err.startswith(
            f"agentab: error: {url}: the server's prefix cache already holds the prompts of "
            "calibration seed 5 ("
        )
        assert err.endswith(
            "an earlier calibration sent them; leave --seed out (a fresh seed each run) or "
            "restart the server"
        )
        assert not (tmp_path / "again.fit.json").exists()

        # 3: no seed: a fresh one, no prompt cached, every prefill point as planned
        third = tmp_path / "third.toml"
        calibrate(url, third, *allowed())
    report = json.loads(third.with_suffix(".fit.json").read_text())
    assert report["load"]["standard"]["seed"] != 5
    planned = {tuple(p) for p in report["load"]["standard"]["prefill"]}
    measured = {(r["new"], r["cached"]) for r in report["measurements"]["standard"]["prefill"]}
    assert measured == planned

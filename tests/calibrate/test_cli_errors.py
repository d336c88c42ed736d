"""Bad calibrate/fidelity invocations end in one `agentab: error:` line, before any load."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentab.cli import main


def error_of(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("agentab: error: "), err
    return err[0]


def test_calibrate_needs_a_server_or_the_local_engine(tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "p.toml")
    assert "give --url" in error_of(["calibrate", "-o", out], capsys)
    msg = error_of(["calibrate", "-o", out, "--url", "http://x", "--preset", "tiny"], capsys)
    assert "local-engine options" in msg
    msg = error_of(["calibrate", "-o", str(tmp_path / "p.json"), "--url", "http://x"], capsys)
    assert "a profile is a .toml file" in msg
    assert "does not answer" in error_of(
        ["calibrate", "-o", out, "--url", "http://127.0.0.1:9"], capsys
    )
    msg = error_of(["calibrate", "-o", out, "--url", "http://x", "--allow-assumed", "nope"], capsys)
    assert "--allow-assumed" in msg


def test_engine_config_must_be_a_local_experiment(tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "p.toml")
    examples = Path(__file__).parents[2] / "examples"
    sim = str(examples / "agentx-gb300-tp16.toml")
    msg = error_of(["calibrate", "-o", out, "--engine-config", sim], capsys)
    assert msg == (
        f"agentab: error: --engine-config {sim}: [engine] kind is 'simulator'; "
        'calibration launches a local engine (kind "local")'
    )
    local = str(examples / "local-tiny-cpu.toml")
    msg = error_of(["calibrate", "-o", out, "--engine-config", local, "--preset", "tiny"], capsys)
    assert "drop --preset / --device" in msg
    msg = error_of(["calibrate", "-o", out, "--engine-config", local, "--url", "http://x"], capsys)
    assert "drop --url" in msg


def test_fidelity_needs_the_engine_limits(tmp_path: Path, capsys) -> None:
    profile = Path(__file__).with_name("truth.toml")  # a profile without a fit report
    wl = tmp_path / "w.jsonl"
    wl.write_text("")
    msg = error_of(
        ["fidelity", str(wl), "--profile", str(profile), "--url", "http://x", "-o", str(tmp_path)],
        capsys,
    )
    assert "--max-num-seqs: the engine's value is not in" in msg


def test_a_mixed_step_whose_decode_steps_ran_slow_is_unusable_not_negative() -> None:
    """The mixed step's time is what the counters' seconds leave after the decode steps around
    it at the window's decode time; a busy host that slows those steps leaves nothing, and the
    phase is run again rather than fitted with a step of negative length."""
    from agentab.calibrate.client import MixedMeasurement, PhaseUnusable, _engine_mixed
    from agentab.calibrate.facts import DECODE_STEPS, STEP_SECONDS, STEPS

    names = [n.format(path="standard") for n in (STEP_SECONDS, STEPS, DECODE_STEPS)]

    def sample(t: float, seconds: float, steps: int, decode: int) -> tuple[float, dict]:
        return t, dict(zip(names, (seconds, float(steps), float(decode)), strict=True))

    s0, s1 = sample(0.0, 0.0, 0, 0), sample(1.0, 0.080, 8, 8)  # 10 ms a decode step
    m = MixedMeasurement(rows=2, new=64, context_tokens=0.0, client_s=float("nan"))
    _engine_mixed(m, s0, s1, sample(2.0, 0.080 + 0.045, 12, 11), "mixed phase")
    assert (m.decode_step_s, round(m.engine_s, 9)) == (0.010, 0.015)  # 3 decode steps + 15 ms
    slow = sample(2.0, 0.080 + 0.025, 12, 11)  # 25 ms for all 4: less than 3 decode steps
    with pytest.raises(PhaseUnusable, match=r"mixed phase: the prompt's step came out -5.000 ms"):
        _engine_mixed(m, s0, s1, slow, "mixed phase")

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

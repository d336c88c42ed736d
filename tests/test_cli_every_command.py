"""Every command and subcommand, found by walking the click group (a new command is covered
without editing this file): `--help` works, one bad argument ends in one `agentab: error:` line
and a non-zero exit, and no output holds a traceback. Every output option follows the one rule
of `agentab.outputs`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest

from agentab.cli import cli, main
from agentab.outputs import RULE, OutputPath

OUTPUT_FLAGS = {"-o", "--out", "--output", "--html", "--profile-out"}


def commands() -> list[tuple[str, ...]]:
    """The path of every command below `agentab`, groups included, from the group itself."""
    found: list[tuple[str, ...]] = []

    def walk(group: click.Group, path: tuple[str, ...]) -> None:
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            assert command is not None, name
            found.append((*path, name))
            if isinstance(command, click.Group):
                walk(command, (*path, name))

    walk(cli, ())
    return found


def command_of(path: tuple[str, ...]) -> click.Command:
    command: click.Command = cli
    for name in path:
        assert isinstance(command, click.Group)
        found = command.get_command(click.Context(command), name)
        assert found is not None
        command = found
    return command


def bad_arguments(path: tuple[str, ...], tmp: Path) -> list[str]:
    """One bad argument for the command: a missing file for its required inputs (its output
    options get a fresh path, so that the input is what is wrong); a command that needs
    nothing gets an option it does not have, a group a subcommand it does not have."""
    command = command_of(path)
    if isinstance(command, click.Group):
        return ["no-such-command"]
    args: list[str] = []
    for param in command.params:
        if not param.required:
            continue
        if isinstance(param.type, OutputPath):
            value = str(tmp / "out" / "x.toml")
        elif isinstance(param.type, click.Choice):
            value = str(param.type.choices[0])
        else:
            value = str(tmp / "missing.toml")
        if isinstance(param, click.Option):
            args.append(param.opts[0])
        args.append(value)
    return args or ["--no-such-option"]


ALL = commands()
IDS = [" ".join(p) for p in ALL]


def test_the_walk_finds_the_commands_and_subcommands() -> None:
    assert {"ab", "serve", "workload", "workload generate", "kernels bench"} <= set(IDS)


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_help(path: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    code = 0
    try:
        main([*path, "--help"])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out.startswith(f"Usage: agentab {' '.join(path)} ")
    assert "Traceback" not in out.out + out.err


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_one_bad_argument(path: tuple[str, ...], tmp_path: Path) -> None:
    args = bad_arguments(path, tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "agentab", *path, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert result.returncode != 0, output
    lines = result.stderr.splitlines()
    assert lines and lines[-1].startswith("agentab: error: "), output
    assert len([line for line in lines if line.startswith("agentab: error: ")]) == 1, output


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_every_output_option_follows_the_rule(path: tuple[str, ...]) -> None:
    for param in command_of(path).params:
        if isinstance(param, click.Option) and OUTPUT_FLAGS & set(param.opts):
            assert isinstance(param.type, OutputPath), param.opts
            assert (param.help or "").endswith(RULE), param.opts


def test_inputs_of_the_wrong_kind_are_one_line(tmp_path: Path) -> None:
    """What the walk's bad arguments led to: a folder where a file is read, a seed numpy
    cannot take."""
    from tests.analysis.rundirs import manifest, synthetic_records, write_run

    run = write_run(tmp_path / "a", synthetic_records(1), manifest())
    (tmp_path / "folder").mkdir()
    cases = {
        ("ab", "folder"): "folder: is a folder, not an experiment file (.toml)",
        ("compare", str(run), str(run), "--seed", "-1"): (
            "Invalid value for '--seed': -1 is not in the range x>=0. (see 'agentab compare "
            "--help')"
        ),
        ("plan", "folder", "--seed", "-1"): (
            "Invalid value for '--seed': -1 is not in the range x>=0. (see 'agentab plan --help')"
        ),
        ("serve", "--port", "99999"): (
            "Invalid value for '--port': 99999 is not in the range 0<=x<=65535. (see 'agentab "
            "serve --help')"
        ),
    }
    for args, message in cases.items():
        result = subprocess.run(
            [sys.executable, "-m", "agentab", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert (result.returncode, result.stderr) == (2, f"agentab: error: {message}\n"), args

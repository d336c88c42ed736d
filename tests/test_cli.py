"""The command line routes every documented command and turns user errors into exit 2."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from agentab.cli import cli, main


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0, result.output
    for name in cli.list_commands(None):  # type: ignore[arg-type]
        assert name in result.output


def test_unknown_command_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agentab", "no-such-command"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "no-such-command" in proc.stderr


def test_main_turns_agentab_error_into_one_line(capsys) -> None:
    import click

    from agentab import cli as cli_module
    from agentab.errors import AgentabError

    @click.command()
    def boom() -> None:
        raise AgentabError("trace.json: line 3: field 'in' is negative")

    cli_module.cli.add_command(boom, "boom-test")
    try:
        try:
            main(["boom-test"])
        except SystemExit as exc:
            assert exc.code == 2
    finally:
        cli_module.cli.commands.pop("boom-test", None)
    err = capsys.readouterr().err
    assert err.strip() == "agentab: error: trace.json: line 3: field 'in' is negative"


def test_usage_errors_are_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agentab", "workload", "generate", "--sessions", "x", "-o", "y"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        "agentab: error: Invalid value for '--sessions': 'x' is not a valid integer."
        " (see 'agentab workload generate --help')\n"
    )

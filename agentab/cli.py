"""The `agentab` command line.

Each subpackage owns its commands in its own `cli.py`; this group only routes to them and imports
them lazily, so `agentab workload inspect` never pays for torch or aiohttp imports it does not use.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings

import click

from agentab import __version__
from agentab.errors import AgentabError, AgentabWarning
from agentab.redact import redact_text

# command name -> "module:attribute"; the module is imported only when the command runs.
COMMANDS: dict[str, str] = {
    "workload": "agentab.workloads.cli:workload",
    "engine": "agentab.engine.cli:engine",
    "serve": "agentab.engine.server_cli:serve",
    "simulate": "agentab.replay.cli:simulate",
    "replay": "agentab.replay.cli:replay",
    "ab": "agentab.experiments.cli:ab",
    "plan": "agentab.experiments.cli:plan",
    "report": "agentab.analysis.cli:report",
    "compare": "agentab.analysis.cli:compare",
    "export": "agentab.analysis.cli:export",
    "kernels": "agentab.kernels.cli:kernels",
    "calibrate": "agentab.calibrate.cli:calibrate",
    "fidelity": "agentab.calibrate.cli:fidelity",
    "acceptance": "agentab.calibrate.cli:acceptance",
}


def _module_exists(target: str) -> bool:
    return importlib.util.find_spec(target.split(":")[0]) is not None


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        # A command whose module is not part of this build is not offered.
        available = {name for name, target in COMMANDS.items() if _module_exists(target)}
        return sorted(available | set(self.commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return super().get_command(ctx, cmd_name)
        if not _module_exists(target):
            return None
        module_name, attr = target.split(":")
        module = importlib.import_module(module_name)
        return getattr(module, attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="agentab")
def cli() -> None:
    """Decide whether an opt-in decode path is worth turning on for your traffic.

    agentab replays AgentX-style coding-agent traffic (long contexts, multi-turn sessions,
    pauses, subagents, prefix-cache reuse) against an engine, runs A/B comparisons that hold the
    GPU count fixed so only the decode path changes, and reports P90 per-user interactivity.

    Output paths (-o/--out, --output, --html, --profile-out): missing parent folders are
    created before a command starts its work; a path that cannot be written is refused then.
    """


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # type: ignore[no-untyped-def]
    if issubclass(category, AgentabWarning):
        click.echo(f"agentab: warning: {redact_text(str(message))}", err=True)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become one line on stderr and exit status 2."""
    warnings.showwarning = _show_warning
    try:
        cli.main(args=argv, prog_name="agentab", standalone_mode=False)
    except AgentabError as exc:
        # a server's URL in a message loses its credentials (a terminal's output is logged too)
        click.echo(f"agentab: error: {redact_text(str(exc))}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("agentab: aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:
        # One line, like every other user error: what is wrong, and where to look.
        command = exc.ctx.command_path if exc.ctx is not None else "agentab"
        click.echo(f"agentab: error: {exc.format_message()} (see '{command} --help')", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"agentab: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except ModuleNotFoundError as exc:
        # An optional dependency a command imports on its first line (`serve --engine local`
        # and torch): the install command, not a traceback. Any other missing module is a bug.
        from agentab.extras import EXTRA_OF, missing_message

        name = (exc.name or "").split(".")[0]
        if name not in EXTRA_OF:
            raise
        words = sys.argv[1:] if argv is None else argv
        command = " ".join(["agentab", *words[:1]])
        click.echo(f"agentab: error: {missing_message(name, command)}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()

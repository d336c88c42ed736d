"""Progress of a long run on stderr: requests done / in flight / errors, tokens/s.

In a terminal, a live bar that rich redraws 4 times a second. Anywhere else (a log file, a
pipe, CI) one plain line every `AGENTAB_PROGRESS_INTERVAL_S` seconds of wall time (default 10)
and a last one when the run ends, each ending with a newline, so a log shows how a long run
went without filling up with redraws. Both read the runner's counters from a helper thread, so
the replay loop pays nothing per request. On the virtual clock the times shown are virtual
seconds.
"""

from __future__ import annotations

import os
import sys
import threading
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from agentab.errors import AgentabError

if TYPE_CHECKING:
    from agentab.replay.runner import Runner

INTERVAL_ENV = "AGENTAB_PROGRESS_INTERVAL_S"
DEFAULT_INTERVAL_S = 10.0


def line_interval_s() -> float:
    """Seconds between two plain progress lines (`AGENTAB_PROGRESS_INTERVAL_S`)."""
    raw = os.environ.get(INTERVAL_ENV)
    if raw is None:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise AgentabError(f"{INTERVAL_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


class ProgressView:
    """Context manager showing the runner's progress on stderr (no-op when disabled)."""

    def __init__(
        self, runner: Runner, *, enabled: bool, label: str, stream: TextIO | None = None
    ) -> None:
        self.runner = runner
        self.enabled = enabled
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self._live: Live | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def counters(self) -> str:
        """The figures both views show, as plain text."""
        s = self.runner.stats
        t = self.runner.now_s
        tok_s = s.completion_tokens / t if t > 0 else 0.0
        return (
            f"t={t:,.0f}s done {s.finished:,} in flight {s.inflight:,} "
            f"errors {s.errors:,} ({s.error_rate:.1%}) {tok_s:,.0f} tok/s"
        )

    def phase(self) -> str:
        """Where the run is: warmup, or how far into the profiling window."""
        window = self.runner.profiling_s
        if window is None:
            return "warmup"
        duration = self.runner.opts.duration_s
        if duration:
            return f"profiling {min(window, duration):,.0f}/{duration:,.0f}s"
        return f"profiling {window:,.0f}s"

    def plain_line(self) -> str:
        return f"{self.label}: {self.phase()}, {self.counters()}"

    def render(self) -> Table:
        s = self.runner.stats
        t = self.runner.now_s
        tok_s = s.completion_tokens / t if t > 0 else 0.0
        line = Text.assemble(
            f"t={t:,.0f}s done {s.finished:,} in flight {s.inflight:,} ",
            (f"errors {s.errors:,} ({s.error_rate:.1%})", "red" if s.errors else ""),
            f" {tok_s:,.0f} tok/s",
            no_wrap=True,
            overflow="ellipsis",
        )
        grid = Table.grid(padding=(0, 1))
        duration = self.runner.opts.duration_s
        window = self.runner.profiling_s
        if window is None:
            grid.add_row(Text("warmup", style="yellow"), line)
        elif duration:
            bar = ProgressBar(total=duration, completed=min(window, duration), width=16)
            grid.add_row(bar, line)
        else:
            grid.add_row(line)
        return grid

    def _print_lines(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._write(self.plain_line())

    def _write(self, line: str) -> None:
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed pipe must not end the run
            self._stop.set()

    def __enter__(self) -> ProgressView:
        if not self.enabled:
            return self
        console = Console(file=self.stream)
        if console.is_terminal:
            self._live = Live(
                get_renderable=self.render,
                console=console,
                refresh_per_second=4,
                transient=False,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._live.start()
            return self
        interval = line_interval_s()
        self._thread = threading.Thread(
            target=self._print_lines, args=(interval,), name="agentab-progress", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._write(self.plain_line())

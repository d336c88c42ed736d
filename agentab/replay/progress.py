"""A live progress line for long runs: requests done / in flight / errors, tokens/s.

It reads the runner's counters from rich's refresh thread (4 times a second), so the replay loop
pays nothing per request. On the virtual clock the times shown are virtual seconds.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from agentab.replay.runner import Runner


class ProgressView:
    """Context manager showing the runner's progress on stderr (no-op when disabled)."""

    def __init__(self, runner: Runner, *, enabled: bool, label: str) -> None:
        self.runner = runner
        self.enabled = enabled
        self.label = label
        self._live: Live | None = None

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

    def __enter__(self) -> ProgressView:
        if self.enabled:
            self._live = Live(
                get_renderable=self.render,
                console=Console(stderr=True),
                refresh_per_second=4,
                transient=False,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._live.start()
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

"""Fixtures for the workload tests: agentab's console entry point, run in-process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from agentab.cli import main

DATA = Path(__file__).resolve().parents[1] / "data"


def run_main(*args: str) -> int:
    """`agentab ARGS` through `agentab.cli.main`; its exit status (0 when it returns)."""
    try:
        main(list(args))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


@pytest.fixture
def cli() -> Callable[..., int]:
    return run_main

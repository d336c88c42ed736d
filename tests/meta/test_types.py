"""The package type-checks: mypy, with the settings of pyproject.toml's [tool.mypy], reports no
error anywhere in agentab/. A wrong signature or a moved name then fails here, before it fails
at run time on an engine the tests cannot reach (the GPU paths, a vLLM server)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_reports_no_error_in_the_package() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--hide-error-context"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]

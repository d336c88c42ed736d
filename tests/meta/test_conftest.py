"""The shared test setup skips a test for what the test is marked with, and nothing else."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]
CONFTEST = (REPO / "tests" / "conftest.py").read_text()


def test_a_folder_named_like_a_marker_does_not_skip_its_tests(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No vLLM venv here: only the marked test may be skipped, not its unmarked neighbour in a
    # package that happens to be called `vllm`.
    monkeypatch.setenv("AGENTAB_VLLM_PYTHON", str(pytester.path / "no-such-python"))
    monkeypatch.delenv("AGENTAB_REQUIRE_VLLM", raising=False)
    pytester.makeconftest(CONFTEST.replace("REPO_ROOT = ", "REPO_ROOT = Path('/nonexistent') #"))
    pytester.makeini("[pytest]\nmarkers =\n    vllm: x\n    gpu: x\n    chromium: x\n")
    pkg = pytester.mkpydir("vllm")
    (pkg / "test_x.py").write_text(
        "import pytest\n\n"
        "def test_plain():\n    pass\n\n"
        "@pytest.mark.vllm\ndef test_marked():\n    pass\n"
    )
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)


def test_a_required_component_fails_instead_of_skipping(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTAB_VLLM_PYTHON", str(pytester.path / "no-such-python"))
    monkeypatch.setenv("AGENTAB_REQUIRE_VLLM", "1")
    pytester.makeconftest(CONFTEST.replace("REPO_ROOT = ", "REPO_ROOT = Path('/nonexistent') #"))
    pytester.makeini("[pytest]\nmarkers =\n    vllm: x\n    gpu: x\n    chromium: x\n")
    pytester.makepyfile(test_y="import pytest\n\n@pytest.mark.vllm\ndef test_marked():\n    pass\n")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)


def test_no_first_party_import_is_skipped() -> None:
    # importorskip on a module of this package turns a broken import of our code into a skip.
    pattern = re.compile(r"importorskip\(\s*[\"']agentab")
    offenders = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "tests").rglob("*.py"))
        if pattern.search(path.read_text())
    ]
    assert offenders == []


# The extras the README's test command does not install (`pip install -e '.[dev]'`).
_EXTRAS = ("torch", "triton", "cutlass", "numba", "safetensors", "ray")
_WITHOUT_EXTRAS = (
    "import sys\n"
    f"for name in {_EXTRAS!r}:\n"
    "    sys.modules[name] = None  # importing it raises ImportError, as where it is absent\n"
)


def _run_without_extras(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_EXTRAS + script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_suite_collects_without_the_optional_extras() -> None:
    """CI installs every extra, so a test module that imports torch (or a module of ours that
    does) without skipping would break the README's test command on a fresh machine unseen."""
    proc = _run_without_extras(
        "import pytest\n"
        "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests']))\n"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "error" not in proc.stdout.splitlines()[-1], proc.stdout[-3000:]


def test_every_example_experiment_parses_without_the_optional_extras() -> None:
    """Checking an experiment file (a local-engine one included) is configuration work: it must
    not need torch, which only the machine that runs the engine has."""
    proc = _run_without_extras(
        "from pathlib import Path\n"
        "from agentab.experiments.experiment import load_experiment\n"
        "for path in sorted(Path('examples').glob('*.toml')):\n"
        "    load_experiment(path)\n"
        "print(sorted(n for n, m in sys.modules.items() if m and n.split('.')[0] == 'torch'))\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"

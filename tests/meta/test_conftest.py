"""The shared test setup skips a test for what the test is marked with, and nothing else."""

from __future__ import annotations

import re
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

"""Shared test setup.

Tests that need an outside component (the vLLM CPU venv, the AIPerf venv, headless chromium,
the gpu extra: the CuTe DSL compiler and Triton; the ray extra) are marked. Locally they are
skipped when the component is absent; in CI `.ci/run` sets AGENTAB_REQUIRE_<MARK>=1, and then a
missing component fails the test instead, so CI can never pass by skipping them.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Triton kernels run in Triton's interpreter on CPU tensors, which has to be switched on before
# triton is imported (it decides at each kernel's definition); no test runs on a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
# CuTe DSL kernels compile afresh in tests (an API break of the DSL shows), without the disk
# cache a server uses; tests/kernels/test_cute_compile_cache.py turns it on in its processes.
os.environ.setdefault("AGENTAB_CUTE_CACHE", "0")


def _vllm_python() -> str | None:
    path = os.environ.get("AGENTAB_VLLM_PYTHON")
    if path and Path(path).exists():
        return path
    default = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    return str(default) if default.exists() else None


def _aiperf_python() -> str | None:
    path = os.environ.get("AGENTAB_AIPERF_PYTHON")
    if path and Path(path).exists():
        return path
    default = REPO_ROOT / ".venv-aiperf" / "bin" / "python"
    return str(default) if default.exists() else None


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _gpu_extra() -> bool:
    """The gpu extra's compilers: the CuTe DSL (cutlass) and Triton."""
    return all(importlib.util.find_spec(m) is not None for m in ("cutlass", "triton"))


def _ray_extra() -> bool:
    """The ray extra (`agentab ab --ray`)."""
    return importlib.util.find_spec("ray") is not None


AVAILABLE = {
    "vllm": _vllm_python,
    "aiperf": _aiperf_python,
    "chromium": _chromium,
    "gpu": _gpu_extra,
    "ray": _ray_extra,
}


def needed_components(item: pytest.Item) -> list[str]:
    """The outside components a test is marked as needing, from its own markers only.

    `item.keywords` also holds the names of the test's package and module (tests/vllm/ puts
    "vllm" there), so testing a name against it would skip every test in that folder.
    """
    return [mark for mark in AVAILABLE if item.get_closest_marker(mark) is not None]


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in needed_components(item):
        if AVAILABLE[mark]():
            continue
        if os.environ.get(f"AGENTAB_REQUIRE_{mark.upper()}") == "1":
            pytest.fail(f"{mark} is required here (AGENTAB_REQUIRE_{mark.upper()}=1) but absent")
        pytest.skip(f"{mark} not available here")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The interpreter of the vLLM CPU venv."""
    path = _vllm_python()
    if path is None:
        pytest.fail("vLLM venv not found (set AGENTAB_VLLM_PYTHON or run .ci/run)")
    return path


@pytest.fixture(scope="session")
def aiperf_python() -> str:
    """The interpreter of the AIPerf venv (scripts/install-aiperf.sh)."""
    path = _aiperf_python()
    if path is None:
        pytest.fail("AIPerf venv not found (set AGENTAB_AIPERF_PYTHON or run .ci/run)")
    return path


@pytest.fixture(scope="session")
def chromium_path() -> str:
    path = _chromium()
    if path is None:
        pytest.fail("chromium not found")
    return path


@pytest.fixture(autouse=True)
def _thaw_frozen_objects():
    """Commands run in-process freeze what was alive when they loaded a trace (a command's
    process ends with its run; this one goes on): hand those objects back to the collector
    after each test, so fixtures that die later in reference cycles are still reclaimed."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()

"""Every Python script under scripts/ and benchmarks/ imports on a CPU machine, and every name it
takes from agentab (at the top or inside a function) still exists.

The scripts run only on a GPU machine or by hand, so nothing else exercises them: a name moved in
agentab would otherwise surface as an ImportError on the device, after the machine was paid for.
Each script is loaded from its file path the way `python path/to/script.py` loads it (its own
folder first on sys.path, `__name__` not "__main__", so `main` does not run). All scripts load in
one child process, so torch is imported once and no script's import-time state (custom ops,
sys.path entries) leaks into the rest of the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Scripts that import files they do not ship with: their docstring's recipe generates those files
# first. They are parsed and their agentab names checked, but not imported.
NOT_IMPORTABLE = {
    "benchmarks/kernels/research/standard_variants.py": (
        "imports copies of older layer code that its docstring's recipe writes next to it"
    ),
}

# Optional extras: a script that needs one is skipped where the extra is absent. The gpu extra's
# modules follow conftest's rule for the `gpu` mark: absent with AGENTAB_REQUIRE_GPU=1 is a failure.
TORCH_EXTRA = {"torch", "safetensors"}
GPU_EXTRA = {"triton", "cutlass", "tvm_ffi", "cuda"}

CHILD = r"""
import ast, importlib, importlib.util, json, sys, traceback
from pathlib import Path

repo, scripts, skip_import = Path(sys.argv[1]), sys.argv[2].split(","), set(sys.argv[3].split(","))
sys.path.insert(0, str(repo))
results = {}


def missing_module(exc):
    name = getattr(exc, "name", None)
    return name.split(".")[0] if isinstance(exc, ModuleNotFoundError) and name else None


def agentab_names(tree):
    # (line, module, name) for every `from agentab... import name` and (line, module, None) for
    # `import agentab...`, wherever it stands in the file.
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "agentab":
                for alias in node.names:
                    yield node.lineno, node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "agentab":
                    yield node.lineno, alias.name, None


for i, rel in enumerate(scripts):
    path = repo / rel
    result = {"status": "ok", "detail": ""}
    try:
        tree = ast.parse(path.read_text(), str(path))
        if rel not in skip_import:
            name = f"_agentab_script_{i}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            saved_path = list(sys.path)
            sys.path.insert(0, str(path.parent))
            try:
                spec.loader.exec_module(module)
            finally:
                sys.path[:] = saved_path
        for lineno, mod_name, attr in agentab_names(tree):
            mod = importlib.import_module(mod_name)
            if attr is None or attr == "*" or hasattr(mod, attr):
                continue
            if importlib.util.find_spec(f"{mod_name}.{attr}") is None:
                raise ImportError(f"{rel}:{lineno}: cannot import name {attr!r} from {mod_name!r}")
    except BaseException as exc:
        missing = missing_module(exc)
        if missing is not None:
            result = {"status": "missing", "detail": missing}
        else:
            result = {"status": "error", "detail": traceback.format_exc()[-3000:]}
    results[rel] = result
print("RESULTS " + json.dumps(results))
"""


def scripts() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "scripts/*.py", "benchmarks/*.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted(p for p in listed if not p.startswith("benchmarks/results/"))


SCRIPTS = scripts()


@pytest.fixture(scope="module")
def import_results() -> dict[str, dict[str, str]]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO), ",".join(SCRIPTS), ",".join(NOT_IMPORTABLE)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULTS "))


def test_the_scripts_are_found() -> None:
    assert "scripts/gpu/local_engine.py" in SCRIPTS
    assert "benchmarks/bench_replay.py" in SCRIPTS
    assert set(NOT_IMPORTABLE) <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_imports_and_its_agentab_names_exist(
    script: str, import_results: dict[str, dict[str, str]]
) -> None:
    result = import_results[script]
    if result["status"] == "missing":
        module = result["detail"]
        if module in TORCH_EXTRA:
            pytest.skip(f"{script} needs {module} (the torch extra)")
        if module in GPU_EXTRA:
            if os.environ.get("AGENTAB_REQUIRE_GPU") == "1":
                pytest.fail(f"{script} needs {module} (the gpu extra), required here but absent")
            pytest.skip(f"{script} needs {module} (the gpu extra)")
        pytest.fail(f"{script} imports {module}, which is not installed and is no extra")
    assert result == {"status": "ok", "detail": ""}, result["detail"]

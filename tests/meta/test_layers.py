"""agentab's packages import only downwards, in the layer order ARCHITECTURE.md states.

The order is what lets a layer be read, tested and replaced on its own: workloads know nothing
of how traffic is sent, the engine nothing of the replay that drives it, analysis nothing of the
engines that produced the run dirs it reads. Every import counts, a lazy one inside a function
included: it is as much a dependency as a top-level one, only paid for later.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "agentab"

# Bottom up. A module may import its own layer and any layer below it, never one above.
LAYERS: list[set[str]] = [
    {
        "errors",
        "clock",
        "numba_jit",
        "digest",
        "outputs",
        "extras",
        "redact",
        "dir_lock",
        "ray_connect",
        "__init__",
    },  # shared by every layer
    {"rundir"},  # the run dir's format: replay writes it, analysis reads it
    {"workloads"},
    {"kernels"},
    {"engine"},  # the local engine's executor runs the kernels' decoder layers
    {"replay"},  # the EngineTarget calls the in-process engine
    {"analysis"},  # reads run dirs
    {"experiments"},  # experiment files, arms, repeats and sweeps: runs replays, then analysis
    {"calibrate"},
    {"cli", "__main__"},
]

# Analysis reads run dirs and runs nothing: of the layers below it, it uses the run dir's format
# (rundir) and the workloads, and nothing of replay or the engine.
SKIPPED: dict[str, set[str]] = {"analysis": {"replay", "engine"}}

# Imports that break the layering, as (importing file, imported package): none. Nothing may be
# added here; a new entry needs the code moved instead.
KNOWN_LAYER_VIOLATIONS: set[tuple[str, str]] = set()


def layer_of(package: str) -> int:
    for index, layer in enumerate(LAYERS):
        if package in layer:
            return index
    raise AssertionError(f"agentab.{package} belongs to no layer: add it to LAYERS")


def module_name(path: Path, package_dir: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, package_dir: Path = PACKAGE) -> list[str]:
    """Every agentab name `path` imports, as `package.module.name`, lazy imports included.

    `from agentab.rundir import scan_records` and `from agentab import rundir` both give a name
    under `agentab.rundir`, which `top_package` maps to the rundir layer.
    """
    name = module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found += [f"{module}.{alias.name}" for alias in node.names]
    return [m for m in found if m.startswith("agentab.")]


def top_package(module: str, package_dir: Path = PACKAGE) -> str:
    """The layer unit a module belongs to: `agentab.replay.api` -> replay, `agentab` -> __init__.

    A name that is neither a subpackage nor a top-level module (`agentab.__version__`) is one of
    the package root's own names.
    """
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    if (package_dir / parts[1]).is_dir() or (package_dir / f"{parts[1]}.py").is_file():
        return parts[1]
    return "__init__"


def violations(package_dir: Path = PACKAGE) -> set[tuple[str, str]]:
    """(importing file, imported package) for every import against the layering."""
    found = set()
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir.parent).as_posix()
        source = top_package(module_name(path, package_dir), package_dir)
        skipped = SKIPPED.get(source, set())
        for module in imported_modules(path, package_dir):
            target = top_package(module, package_dir)
            if target == source:
                continue
            if layer_of(target) > layer_of(source) or target in skipped:
                found.add((rel, target))
    return found


def test_every_package_belongs_to_a_layer() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    for name in packages | modules:
        layer_of(name)


def test_no_layer_imports_one_above_it() -> None:
    assert violations() - KNOWN_LAYER_VIOLATIONS == set()


def test_each_known_violation_is_still_one() -> None:
    """An entry whose file still exists must still break the layering (else it is deleted from
    the list); an entry whose file has moved out of the package is simply stale."""
    present = {v for v in KNOWN_LAYER_VIOLATIONS if (REPO / v[0]).exists()}
    assert present <= violations()


def test_the_rules_see_upward_skipped_and_lazy_imports(tmp_path: Path) -> None:
    """The scan itself, on a small package: what it must catch and what it must let through."""
    package = tmp_path / "agentab"
    for sub in ("analysis", "replay", "engine", "experiments", "workloads", "rundir"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text("")
    (package / "workloads" / "model.py").write_text(
        "from agentab.errors import AgentabError\nfrom agentab import __version__\n"
    )
    (package / "engine" / "core.py").write_text("from ..workloads import model\n")
    probe = package / "analysis" / "probe.py"
    probe.write_text(
        "from agentab.rundir import scan_records\n"
        "from agentab import rundir\n"
        "from agentab.workloads.model import Workload\n"
        "from . import load\n"
        "def run():\n"
        "    from agentab.replay.records import scan_metrics\n"
        "    import agentab.engine.sim\n"
        "    from ..experiments import arms\n"
    )
    assert imported_modules(probe, package) == [
        "agentab.rundir.scan_records",
        "agentab.rundir",
        "agentab.workloads.model.Workload",
        "agentab.analysis.load",
        "agentab.replay.records.scan_metrics",
        "agentab.engine.sim",
        "agentab.experiments.arms",
    ]
    assert violations(package) == {
        ("agentab/analysis/probe.py", "replay"),
        ("agentab/analysis/probe.py", "engine"),
        ("agentab/analysis/probe.py", "experiments"),
    }

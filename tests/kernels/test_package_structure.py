"""`agentab.kernels` is one production kernel set: what `kernels bench`, `kernels check` and the
local engine run, configured by arguments. Parsed with `ast`, so no kernel toolchain is needed:
no module takes another module's private (underscore) names, the modules import each other
without cycles, none reads the environment (except the documented compile-target
default and the compile cache's place), and none imports the research code under benchmarks/."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "agentab" / "kernels"
ROOT = "agentab.kernels"
# CuTe DSL needs the target named to compile without a GPU (cute/common.py says why); where the
# compiled kernels' disk cache lives and whether it is used (cute/cache.py) select no kernel.
ENV_ALLOWED = {
    ("cute/common.py", "setdefault", "CUTE_DSL_ARCH"),
    ("cute/cache.py", "get", "AGENTAB_CUTE_CACHE"),
    ("cute/cache.py", "get", "AGENTAB_CACHE_DIR"),
}


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        found[".".join([ROOT, *parts])] = ast.parse(path.read_text(), str(path))
    return found


def resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `module`)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")[: -node.level]
    return ".".join([*base, node.module] if node.module else base)


def imports(module: str, tree: ast.Module) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import, nested ones too."""
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            src = resolve(module, node)
            out += [(src, a.name, node.lineno) for a in node.names]
    return out


def test_the_parser_sees_the_package() -> None:
    mods = modules()
    assert {f"{ROOT}.specialized", f"{ROOT}.cute.moe", f"{ROOT}.cute.moe_mma"} <= set(mods)
    deps = internal_graph(mods)
    assert f"{ROOT}.cute.moe_routing" in deps[f"{ROOT}.cute.moe_mma"]


def test_no_module_imports_another_modules_private_names() -> None:
    mods = modules()
    hits = []
    for module, tree in mods.items():
        aliases: dict[
            str, str
        ] = {}  # local name -> module, for `import x as m` / `from p import m`
        for src, name, line in imports(module, tree):
            if name is None:
                continue
            if name.startswith("_") and not name.startswith("__"):
                hits.append(f"{module}:{line}: from {src} import {name}")
            if f"{src}.{name}" in mods or src == ROOT:
                aliases[name] = f"{src}.{name}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                hits.append(f"{module}:{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    assert hits == []


def internal_graph(mods: dict[str, ast.Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, tree in mods.items():
        for src, name, _line in imports(module, tree):
            for target in (f"{src}.{name}" if name else None, src):
                if target in mods and target != module:
                    graph[module].add(target)
                    break
    return graph


def test_no_import_cycles() -> None:
    graph = internal_graph(modules())
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_no_environment_reads_except_the_compile_target_default() -> None:
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in {"environ", "getenv", "environb"}:
                hits.append((rel, node.lineno, node.attr))
            if isinstance(node, ast.ImportFrom) and node.module == "os":
                hits += [(rel, node.lineno, a.name) for a in node.names
                         if a.name in {"environ", "getenv", "environb"}]  # fmt: skip
    allowed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "environ"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and (rel, node.func.attr, node.args[0].value) in ENV_ALLOWED
            ):
                allowed.append((rel, node.func.value.lineno, "environ"))
    assert sorted(set(hits) - set(allowed)) == []
    assert len(allowed) == len(ENV_ALLOWED)


def test_research_code_is_not_imported() -> None:
    hits = [
        f"{module}:{line}: {src}"
        for module, tree in modules().items()
        for src, _name, line in imports(module, tree)
        if src.split(".")[0] == "benchmarks"
    ]
    assert hits == []

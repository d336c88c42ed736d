"""Optional dependencies missing: one line before any work, with the install command that
works for this install (a clone here). The missing module is hidden from a real subprocess by
a sitecustomize that makes the import system not find it, so the real code path runs."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from agentab.extras import EXTRA_OF, install_command

REPO = Path(__file__).resolve().parent.parent

HIDE = """\
import os, sys

HIDDEN = set(os.environ["AGENTAB_TEST_HIDE"].split(","))


class Hide:
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.inner, name)


sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
"""


def hiding(tmp_path: Path) -> Path:
    """A folder holding the sitecustomize that hides modules, to put first on PYTHONPATH."""
    site = tmp_path / "hide"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(HIDE)
    return site


def without(
    modules: str, tmp_path: Path, *args: str | Path, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """`agentab ARGS` in a fresh interpreter where `modules` (comma-separated) are not found."""
    path = os.pathsep.join([str(hiding(tmp_path)), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "AGENTAB_TEST_HIDE": modules}
    return subprocess.run(
        [sys.executable, "-m", "agentab", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )


def test_the_hiding_works(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(hiding(tmp_path)), "AGENTAB_TEST_HIDE": "torch"}
    probe = "import importlib.util as u; print(u.find_spec('torch'))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert out.stdout == "None\n", out.stderr


def test_serve_local_without_torch_is_one_line_with_the_clone_command(tmp_path: Path) -> None:
    result = without("torch", tmp_path, "serve", "--engine", "local", "--preset", "tiny")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "agentab: error: agentab serve needs torch, which is not installed here; install it "
        "with: pip install -e '.[torch]'\n"
    )


def test_ab_of_a_local_engine_without_torch_refuses_before_the_first_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = without("torch", tmp_path, "ab", "examples/local-tiny-cpu.toml", "-o", out)
    assert result.returncode == 2
    assert result.stderr == (
        'agentab: error: examples/local-tiny-cpu.toml: [engine] kind "local" (the local torch '
        "engine) needs torch, which is not installed here; install it with: "
        "pip install -e '.[torch]'\n"
    )
    assert not out.exists()


def test_ab_on_ray_without_ray_refuses_before_the_first_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ("ab", "examples/sweep-gb300-tp16.toml", "-o", out, "--ray", "local")
    result = without("ray", tmp_path, *args)
    assert result.returncode == 2
    assert result.stderr == (
        "agentab: error: --ray needs ray, which is not installed here; install it with: "
        "pip install -e '.[ray]'\n"
    )
    assert not out.exists()


def test_calibrate_of_a_local_engine_without_torch(tmp_path: Path) -> None:
    args = ("calibrate", "--engine", "local", "--preset", "tiny", "-o", tmp_path / "p.toml")
    result = without("torch", tmp_path, *args)
    assert result.returncode == 2
    assert result.stderr == (
        "agentab: error: --engine local (the local torch engine) needs torch, which is not "
        "installed here; install it with: pip install -e '.[torch]'\n"
    )


def test_outside_the_clone_the_hint_names_its_path(tmp_path: Path) -> None:
    result = without(
        "torch", tmp_path, "serve", "--engine", "local", "--preset", "tiny", cwd=tmp_path
    )
    assert result.stderr.endswith(f"pip install -e '{REPO}[torch]'\n")


def test_html_without_plotly_warns_and_says_how_to_get_the_plots(tmp_path: Path) -> None:
    from tests.analysis.rundirs import manifest, synthetic_records, write_run

    a = write_run(tmp_path / "a", synthetic_records(1), manifest())
    b = write_run(
        tmp_path / "b",
        synthetic_records(1, itl_scale=0.8),
        manifest(decode_backend="latency_specialized", arm="latency_specialized"),
    )
    page = tmp_path / "r.html"
    result = without("plotly", tmp_path, "compare", a, b, "--html", page, "--resamples", "200")
    assert result.returncode == 0, result.stderr
    assert result.stderr == (
        "agentab: warning: the HTML report has no plots: plotly is not installed here; install "
        "it with: pip install -e '.[report]'\n"
    )
    assert "<p>Plots need plotly: <code>pip install -e '.[report]'</code>.</p>" in page.read_text()


def test_kernels_without_torch_name_the_gpu_extra(tmp_path: Path) -> None:
    result = without("torch", tmp_path, "kernels", "check")
    assert result.returncode == 2
    assert result.stderr == (
        "agentab: error: agentab kernels needs torch, which is not installed here; install it "
        "with: pip install -e '.[gpu]'\n"
    )


def test_every_extra_named_is_one_pyproject_defines_with_its_module() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for module, extra in EXTRA_OF.items():
        names = " ".join(extras[extra]).replace("nvidia-cutlass-dsl", "cutlass")
        assert module in names, (module, extra)


@pytest.mark.parametrize(
    ("direct_url", "expected"),
    [
        ("", "pip install 'agentab[torch]'"),
        ('{"url": "https://example.org/agentab.whl"}', "pip install 'agentab[torch]'"),
        (
            '{"url": "file:///src/ab", "dir_info": {"editable": true}}',
            "pip install -e '/src/ab[torch]'",
        ),
        ('{"url": "file:///src/ab", "dir_info": {}}', "pip install '/src/ab[torch]'"),
    ],
)
def test_install_command_outside_a_source_tree(
    tmp_path: Path, direct_url: str, expected: str
) -> None:
    """An index install, a wheel from elsewhere, a local folder (editable or not: PEP 610)."""
    package = tmp_path / "site-packages" / "agentab"
    package.mkdir(parents=True)
    assert install_command("torch", package_dir=package, direct_url=direct_url) == expected


def test_install_command_in_a_source_tree(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("")
    package = tmp_path / "agentab"
    package.mkdir()
    assert install_command("report", package_dir=package, cwd=tmp_path) == (
        "pip install -e '.[report]'"
    )
    assert install_command("report", package_dir=package, cwd=Path("/")) == (
        f"pip install -e '{tmp_path.resolve()}[report]'"
    )

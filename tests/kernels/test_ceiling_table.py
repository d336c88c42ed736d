"""benchmarks/kernels/ceiling_table.py: the committed table is what the script makes from the
committed results, and measured verify shapes join it when their files exist."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "kernels" / "ceiling_table.py"
TABLE = REPO / "benchmarks" / "results" / "kernels-h200-targets-vs-read-ceiling.md"


def _module():
    spec = importlib.util.spec_from_file_location("ceiling_table", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_committed_table_is_the_scripts_output(tmp_path: Path) -> None:
    out = tmp_path / "table.md"
    subprocess.run([sys.executable, str(SCRIPT), "-o", str(out)], check=True,
                   capture_output=True, cwd=REPO)  # fmt: skip
    assert out.read_text() == TABLE.read_text()


def test_ceilings_targets_and_verdicts() -> None:
    m = _module()
    ceiling = m.read_ceiling()
    assert ceiling["plain"]["us"] == 43.86 and ceiling["structure"]["us"] == 55.27
    assert ceiling["plain"]["tb_s"] == pytest.approx(182_583_296 / 43.86e-6 / 1e12)
    assert [m.target(t) for t in (1, 2, 32, 48, 64)] == [1.8, 1.3, 1.3, 1.0, 1.0]
    # at 64 tokens the 80% roofline condition can be the stricter one
    assert m.required(64, 3.44e9, 2000.0) == pytest.approx(3.44e9 / (0.8 * 4.3e12) * 1e6)
    rows = {(r["context"], r["tokens"]): r for r in m.decode_rows(ceiling)}
    assert rows[(4096, 32)]["verdict"].startswith("out of reach")
    assert rows[(4096, 2)]["required_us"] == pytest.approx(159.24 / 1.3)


def test_verify_shapes_join_when_measured(monkeypatch) -> None:
    m = _module()
    doc = {"verify_rows": [
        {"shape": "1x4", "tokens": 4, "graph_rows": 4, "standard_us": 210.0,
         "specialized_us": 180.0, "bytes": 450e6, "bytes_distinct": 440e6},
        {"shape": "2x4", "tokens": 8, "graph_rows": 8, "standard_error": "RuntimeError"},
    ]}  # fmt: skip
    real = m.load
    monkeypatch.setattr(m, "load", lambda rel: doc if "verify" in rel else real(rel))
    rows, missing = m.verify_rows(m.read_ceiling())
    assert missing == [] and [r["shape"] for r in rows] == ["1x4", "1x4"]  # both contexts
    r = rows[0]
    assert r["required_us"] == pytest.approx(210.0 / 1.3)
    assert r["required_share"] == pytest.approx(440e6 / (210.0 / 1.3) / 1e6 / 4.3)
    assert r["miss"] == pytest.approx(180.0 / (210.0 / 1.3) - 1)

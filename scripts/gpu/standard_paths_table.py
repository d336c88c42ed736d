"""The short table `standard_paths.sh` prints last: check results per path, bench per batch.

Usage: python3 scripts/gpu/standard_paths_table.py CHECK_JSON RESULTS_JSON (either may be
missing: a step that timed out left none, and the table says so).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def check_lines(path: Path) -> list[str]:
    if not path.is_file():
        return [f"check: no {path} (timed out or failed before writing it)"]
    doc = json.loads(path.read_text())
    by_path: dict[str, list[dict]] = {}
    for r in doc["results"]:
        by_path.setdefault(r["path"], []).append(r)
    lines = ["path            passed failed  max out_err  max h1_err  expert mismatches"]
    for name, rows in by_path.items():
        ok = sum(bool(r["ok"]) for r in rows)
        out = max((r.get("out_err", float("nan")) for r in rows), default=float("nan"))
        h1 = max((r.get("h1_err", float("nan")) for r in rows), default=float("nan"))
        mism = sum(r.get("expert_mismatches", 0) for r in rows)
        lines.append(f"{name:15s} {ok:6d} {len(rows) - ok:6d} {out:12.2e} {h1:11.2e} {mism:18d}")
    return lines


def bench_lines(path: Path) -> list[str]:
    if not path.is_file():
        return [f"bench: no {path} (timed out or failed before writing it)"]
    from agentab.kernels.bench import table

    return table(json.loads(path.read_text())).splitlines()


def main(argv: list[str]) -> int:
    check, results = (Path(a) for a in argv[1:3])
    print("\n".join(["", *check_lines(check), "", *bench_lines(results)]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""OSL and ITL of the request table: the server's count first, the counted chunk tokens for a
record without it, and the same values whether or not any record needs the count."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from agentab.analysis.load import load_run
from agentab.analysis.metrics import request_table

from .rundirs import rec, write_run

# r1's chunk tokens (1 + 1 + 2 = 4) disagree with the server's count (5): the count wins.
SERVED = [
    rec("r1", chunk_times_s=[0.5, 0.75, 1.0], chunk_tokens=[1, 1, 2], completion_tokens=5),
    rec("r2", chunk_times_s=[0.25, 0.5], chunk_tokens=[1, 1], completion_tokens=2),
]
COUNTED = rec("r3", chunk_times_s=[0.5, 0.625, 0.75], chunk_tokens=[1, 2, 1],
              completion_tokens=None)  # fmt: skip


def _table(tmp_path: Path, name: str, records: list[dict]) -> pl.DataFrame:
    run = load_run(write_run(tmp_path / name, records))
    return request_table(run.records).collect().sort("request_id")


def test_the_servers_count_is_the_osl_when_every_record_has_it(tmp_path: Path) -> None:
    t = _table(tmp_path, "served", SERVED)
    assert t["osl"].to_list() == [5, 2]
    assert t["itl_s"].to_list() == [0.125, 0.25]
    assert t.schema["osl"] == pl.Int64


def test_a_record_without_the_count_takes_its_chunk_tokens(tmp_path: Path) -> None:
    t = _table(tmp_path, "mixed", [*SERVED, COUNTED])
    assert t["osl"].to_list() == [5, 2, 4]
    assert t["itl_s"].to_list() == [0.125, 0.25, 0.25 / 3]
    served_alone = _table(tmp_path, "served", SERVED)
    assert t.filter(pl.col("request_id") != "r3").equals(served_alone)

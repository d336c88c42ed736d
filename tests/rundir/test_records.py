"""Run records: schema, atomic part files, compaction and crash-safe reading."""

from __future__ import annotations

import json
import time
from pathlib import Path

import polars as pl
import pytest

from agentab.errors import AgentabError
from agentab.rundir import (
    ADDED_RECORD_COLUMNS,
    RECORD_SCHEMA,
    PartWriter,
    part_files,
    scan_records,
)


def _row(i: int, **over: object) -> dict[str, object]:
    row: dict[str, object] = {
        "request_id": f"r{i}",
        "session_id": "s",
        "lane": 0,
        "pass": 0,
        "agent_id": "main",
        "turn": i,
        "phase": "profiling",
        "planned_s": float(i),
        "sent_s": float(i) + 0.001,
        "chunk_times_s": [0.1, 0.2],
        "chunk_tokens": [1, 1],
        "reasoning_chunks": None,
        "prompt_tokens": 100,
        "completion_tokens": 2,
        "cached_tokens": None,
        "osl": 2,
        "error_class": None,
        "error_message": None,
        "warning_class": None,
        "warning_message": None,
        "target": None,
    }
    row.update(over)
    return row


def _run_dir(tmp_path: Path) -> Path:
    (tmp_path / "manifest.json").write_text(json.dumps({"seed": 1}))
    return tmp_path


def test_rows_round_trip_with_schema(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    with PartWriter(run / "records", RECORD_SCHEMA) as w:
        w.add(_row(0))
        w.add(_row(1, error_class="timeout", error_message="no bytes for 5 s", chunk_times_s=[]))
    df = scan_records(run).collect()
    assert df.schema == RECORD_SCHEMA
    assert df["request_id"].to_list() == ["r0", "r1"]
    assert df["chunk_times_s"].to_list() == [[0.1, 0.2], []]
    assert df["error_class"].to_list() == [None, "timeout"]
    assert df["cached_tokens"].null_count() == 2


def test_background_flush_within_a_second(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    w = PartWriter(run / "records", RECORD_SCHEMA, flush_interval_s=0.5)
    try:
        w.add(_row(0))
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not part_files(run / "records"):
            time.sleep(0.02)
        # Readable while the writer is still open (what a SIGKILL would leave).
        assert scan_records(run).collect()["request_id"].to_list() == ["r0"]
    finally:
        w.close()


def test_compaction_keeps_every_row_once(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    w = PartWriter(run / "records", RECORD_SCHEMA, compact_every=4)
    for i in range(10):
        w.add(_row(i))
        w.flush()
    w.close()
    names = sorted(p.name for p in part_files(run / "records"))
    # 0-3 and 4-7 merged during the run, 8 and 9 left as they were written
    assert names == [
        "part-00000000-00000003.arrow",
        "part-00000004-00000007.arrow",
        "part-00000008-00000008.arrow",
        "part-00000009-00000009.arrow",
    ]
    df = scan_records(run).collect()
    assert sorted(df["turn"].to_list()) == list(range(10))


def test_merged_file_hides_parts_left_by_a_crash(tmp_path: Path) -> None:
    """A crash after writing the merged file but before deleting its parts reads once."""
    run = _run_dir(tmp_path)
    rec = run / "records"
    w = PartWriter(rec, RECORD_SCHEMA, compact_every=1000)
    for i in range(3):
        w.add(_row(i))
        w.flush()
    w._stop.set()  # simulate: merged file written, small parts not yet deleted
    frames = [pl.read_ipc(p) for p in sorted(rec.glob("part-*.arrow"))]
    pl.concat(frames).write_ipc(rec / "part-00000000-00000002.arrow")
    assert len(list(rec.glob("part-*.arrow"))) == 4
    assert sorted(scan_records(run).collect()["turn"].to_list()) == [0, 1, 2]
    # A torn temp file is never read.
    (rec / ".tmp-part-00000003-00000003.arrow").write_bytes(b"ARROW1\x00garbage")
    assert scan_records(run).collect().height == 3


def test_empty_run_dir_has_schema(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    df = scan_records(run).collect()
    assert df.height == 0 and df.schema == RECORD_SCHEMA


def test_not_a_run_dir(tmp_path: Path) -> None:
    with pytest.raises(AgentabError, match="not a run dir"):
        scan_records(tmp_path / "nope")


def test_flat_list_columns_equal_row_wise_construction(tmp_path: Path) -> None:
    # The writer buffers list columns flat; the frame must equal polars' own row-wise one,
    # including empty lists, null lists, and a part with nothing but empty lists.
    rows = [
        _row(0, chunk_times_s=[0.5, 0.25, 1e-9], chunk_tokens=[3, 1, 2]),
        _row(1, chunk_times_s=[], chunk_tokens=None, error_class="connect"),
        _row(2, chunk_times_s=[7.0], chunk_tokens=[]),
        _row(3, chunk_times_s=[], chunk_tokens=None),
    ]
    run = _run_dir(tmp_path)
    # and a part whose every row has items (the writer's shortcut without the rows' join)
    full = [_row(4, chunk_times_s=[0.5, 2.0], chunk_tokens=[1, 2]), _row(5, chunk_times_s=[9.0])]
    with PartWriter(run / "records", RECORD_SCHEMA) as w:
        w.add_many(rows)
        w.flush()
        w.add(rows[3])
        w.flush()
        w.add_many(full)
    got = scan_records(run).collect()
    names = list(RECORD_SCHEMA.names())
    written = [*rows, rows[3], *full]
    want = pl.DataFrame(
        [tuple(r[n] for n in names) for r in written], schema=RECORD_SCHEMA, orient="row"
    )
    assert got.equals(want)
    assert got["chunk_tokens"].to_list() == [[3, 1, 2], None, [], None, None, [1, 2], [1, 1]]
    assert got["chunk_times_s"].to_list() == [
        [0.5, 0.25, 1e-9], [], [7.0], [], [], [0.5, 2.0], [9.0]
    ]  # fmt: skip


def test_a_bad_list_item_is_refused_whole(tmp_path: Path) -> None:
    with PartWriter(tmp_path / "records", RECORD_SCHEMA) as w:
        with pytest.raises(AgentabError, match="record column chunk_times_s"):
            w.add(_row(0, chunk_times_s=[0.1, "x"]))
        w.add(_row(1))
    df = pl.read_ipc(part_files(tmp_path / "records")[0])
    assert df["request_id"].to_list() == ["r1"]
    assert df["chunk_times_s"].to_list() == [[0.1, 0.2]]


def test_a_value_out_of_its_columns_range_loses_no_other_row(tmp_path: Path) -> None:
    # An output length of 2**63 does not fit Int64: refused on its own, before it can fail the
    # conversion of the batch it would have joined.
    with PartWriter(tmp_path / "records", RECORD_SCHEMA) as w:
        w.add(_row(0))
        with pytest.raises(AgentabError, match=r"^record column osl: 9223372036854775808 does"):
            w.add(_row(1, osl=2**63))
        with pytest.raises(AgentabError, match="record column lane: 2147483648 does not fit"):
            w.add(_row(2, lane=2**31))
        w.add(_row(3))
    df = pl.read_ipc(part_files(tmp_path / "records")[0])
    assert df["request_id"].to_list() == ["r0", "r3"]


def test_a_torn_or_foreign_part_is_named_in_one_line(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    with PartWriter(run / "records", RECORD_SCHEMA) as w:
        w.add(_row(0))
    part = part_files(run / "records")[0]
    whole = part.read_bytes()
    part.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(AgentabError) as torn:
        scan_records(run)
    assert str(torn.value) == (f"{part}: not a readable Arrow file (out-of-spec: InvalidFooter)")
    part.write_bytes(whole)
    foreign = run / "records" / "part-00000099-00000099.arrow"
    pl.DataFrame({"a": [1]}).write_ipc(foreign)
    with pytest.raises(AgentabError) as other:
        scan_records(run)
    assert str(other.value) == (
        f"{foreign}: not a part of this run's table (missing request_id, session_id, lane and "
        "18 more)"
    )


def test_a_part_written_before_the_warning_columns_reads_with_them_null(tmp_path: Path) -> None:
    # Run dirs from before `warning_class` / `warning_message` existed keep being readable: their
    # parts get the two columns as null, beside parts that have them.
    run = _run_dir(tmp_path)
    older = pl.Schema({k: v for k, v in RECORD_SCHEMA.items() if k not in ADDED_RECORD_COLUMNS})
    with PartWriter(run / "records", older) as w:
        w.add(_row(0))
    with PartWriter(run / "records", RECORD_SCHEMA) as w:
        w.add(_row(1, warning_class="empty_chunks", warning_message="1 chunk(s) without text"))
    df = scan_records(run).collect().sort("request_id")
    assert df.schema == RECORD_SCHEMA
    assert df["warning_class"].to_list() == [None, "empty_chunks"]
    assert df["chunk_times_s"].to_list() == [[0.1, 0.2], [0.1, 0.2]]
    # A run dir of old parts only reads the same way.
    for part in part_files(run / "records")[1:]:
        part.unlink()
    assert scan_records(run).collect()["warning_message"].to_list() == [None]

"""`agentab engine verify-bench`: verify shapes built as the local engine builds a verify step,
their bytes as the attention kernels read them, the results rows and table, the options' errors.

The engine comparison drives the CPU engine through the GPU's graph step logic (replayed
eagerly) and records what its verify steps hand the decode graphs; the bench's inputs for the
same rows must be the same positions, slots, block tables and split length."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agentab.engine.local.verify_bench import finish_verify_row, full_table, verify_shapes
from agentab.engine.local.verify_shapes import (
    VerifyShape,
    graph_inputs,
    kv_entries,
    parse_verify,
    step_bytes,
    verify_step,
)
from agentab.errors import AgentabError
from agentab.kernels.bench import table
from agentab.kernels.config import get_preset

REPO = Path(__file__).resolve().parents[2]
TINY = get_preset("tiny")


def test_shapes_are_every_k_at_every_row_count_padded_as_the_engines_graphs() -> None:
    shapes = parse_verify("7,3,5", "1,2,4,8")
    assert [s.label for s in shapes[:4]] == ["1x4", "2x4", "4x4", "8x4"]
    by_label = {s.label: (s.tokens, s.graph_rows) for s in shapes}
    assert by_label["1x6"] == (6, 8) and by_label["2x6"] == (12, 16)
    assert by_label["8x6"] == (48, 48) and by_label["8x8"] == (64, 64)
    assert verify_shapes("", "") is None
    assert [s.rows for s in verify_shapes("3", "")] == [1, 2, 4, 8]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("verify", "rows", "message"),
    [
        ("0", "", "--verify: 0 drafts per row"),
        ("8", "", "--verify: 8 drafts per row"),
        ("3,x", "", "--verify: 'x' is not a number"),
        (",", "", "--verify: needs"),
        ("3", "0", "--verify-rows: 0: needs row counts >= 1"),
        ("3", "two", "--verify-rows: 'two' is not a number"),
        ("7", "1,9", "--verify-rows: 9 rows of 1 + 7 tokens pad to 72"),
        ("", "2", "--verify-rows: needs --verify"),
    ],
)
def test_bad_values_are_refused_naming_the_option(verify: str, rows: str, message: str) -> None:
    with pytest.raises(AgentabError, match="^" + message.replace("+", r"\+")):
        verify_shapes(verify, rows)


def test_the_cli_refuses_in_one_line_with_exit_2(capsys) -> None:
    from agentab.cli import main

    for args in (
        ["--verify", "9"],
        ["--verify", "3", "--verify-rows", "16,32"],
        ["--verify", "", "--verify-rows", "1"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(["engine", "verify-bench", *args])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("agentab: error: --verify") and err.count("\n") == 1
    with pytest.raises(SystemExit) as exc:
        main(["engine", "verify-bench", "--verify", "3", "--paths", "standard,fast"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("agentab: error: --paths: unknown path 'fast'")
    out = subprocess.run(
        [sys.executable, "-m", "agentab.engine.local.verify_bench", "--verify-rows", "0"],
        capture_output=True, text=True, cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "error: --verify-rows: 0" in out.stderr


def test_kv_entries_and_bytes_are_exact_for_a_small_case() -> None:
    """Tiny preset, one row of 1 + 2 tokens after 5 cached ones, blocks of 4: the graph holds 4
    rows, the last padding at position 0 in the scratch block (9)."""
    step = verify_step(VerifyShape(1, 2), 5, block_size=4)
    assert step.positions.tolist() == [5, 6, 7]
    assert step.block_tables.tolist() == [[0, 1, 2]]  # ceil((5 + 1 + 2 * 2) / 4) blocks
    positions = np.array([5, 6, 7, 0])
    tables = np.array([[0, 1, 2], [0, 1, 2], [0, 1, 2], [9, 0, 0]])
    assert kv_entries(positions, tables, 4) == (6 + 7 + 8 + 1, 8 + 1)
    # dense weights 127,648 elements + 5 touched experts x 24,576, bf16: 501,056 bytes; each
    # entry 80 values (160 bytes): 22 read (9 distinct), 4 written; 4 rows x 256 in and out
    read, distinct = step_bytes(TINY, positions, tables, 4, touched=5.0)
    assert (TINY.dense_weight_elems(), TINY.expert_weight_elems()) == (127_648, 24_576)
    assert read == 501_056 + 22 * 160 + 4 * 160 + 4 * 256 * 2 * 2 == 509_312
    assert distinct == 501_056 + 9 * 160 + 4 * 160 + 4 * 256 * 2 * 2 == 507_232


def test_two_rows_read_their_own_blocks_each_query_up_to_its_position() -> None:
    step = verify_step(VerifyShape(2, 1), 5, block_size=4)
    assert step.block_tables.tolist() == [[0, 1], [2, 3]]
    assert step.positions.tolist() == [5, 6, 5, 6]
    assert step.slot_mapping.tolist() == [5, 6, 13, 14]
    assert step.context_lens.tolist() == [7, 7]
    tables = step.block_tables[[0, 0, 1, 1]]
    assert kv_entries(step.positions, tables, 4) == (6 + 7 + 6 + 7, 7 + 7)


def _engine_verify_loads(monkeypatch) -> list[dict]:
    """Every verify step's load into a decode graph of the CPU engine (k = 3, two requests):
    the token rows, the graph's packed inputs after the load and the call's arguments."""
    torch = pytest.importorskip("torch")
    from agentab.engine.local.build import OPTIONS, local_engine_from
    from agentab.engine.local.cuda import GraphInputs
    from agentab.engine.options import LocalOptions, decode_options

    loads: list[dict] = []
    original = GraphInputs.load

    def spy(self, rows, max_context, scratch_slot, scratch_block, pool_scratch):  # type: ignore[no-untyped-def]
        original(self, rows, max_context, scratch_slot, scratch_block, pool_scratch)
        if rows.drafts is None:  # the drafter's loads carry drafts; a verify step's do not
            loads.append({"rows": rows, "b": self.b, "max_blocks": self.max_blocks,
                          "scratch_block": scratch_block, "dev": self.dev.clone()})  # fmt: skip

    monkeypatch.setattr(GraphInputs, "load", spy)
    opts = decode_options(
        LocalOptions,
        {"preset": "tiny", "decode_backend": "auto", "device": "cpu", "seed": 3,
         "speculative_config": {"num_speculative_tokens": 3, "draft_layers": 1},
         "max_model_len": 256},
        known=OPTIONS,
    )  # fmt: skip
    eng = local_engine_from(opts, graphs_on_cpu=True)
    s = eng.scheduler
    for rid, n, start, out in (("A", 37, 1, 12), ("B", 11, 4, 30), ("C", 23, 9, 30)):
        s.add(rid, (np.arange(n, dtype=np.int64) * 7919 + start) % 31999 + 1, out)
    with torch.inference_mode():
        while s.has_work():
            plan = s.schedule()
            s.update(plan, eng.executor.execute(plan, s.model_inputs(plan)))
    return loads


def _rows_of(positions: np.ndarray, tables: np.ndarray) -> list[np.ndarray]:
    """The token indices of each sequence: consecutive positions with one block table."""
    groups, start = [], 0
    for i in range(1, len(positions) + 1):
        if (
            i == len(positions)
            or positions[i] != positions[i - 1] + 1
            or not np.array_equal(tables[i], tables[i - 1])
        ):
            groups.append(np.arange(start, i))
            start = i
    return groups


def test_verify_inputs_are_the_engines_for_the_same_rows(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    loads = _engine_verify_loads(monkeypatch)
    uniform = []
    for load in loads:
        rows = load["rows"]
        groups = _rows_of(rows.positions, rows.block_tables)
        if len(groups) >= 2 and all(len(g) == 4 for g in groups):
            uniform.append((load, groups))
    assert len(uniform) >= 3  # uniform steps of 2 and 3 rows of 1 + 3 tokens
    assert {len(g) for _, g in uniform} >= {2, 3}
    for load, groups in uniform:
        rows = load["rows"]
        first = np.array([g[0] for g in groups])
        shape = VerifyShape(len(groups), 3)
        step = verify_step(shape, rows.positions[first], 16, rows.block_tables[first])
        assert shape.graph_rows == load["b"]
        st = graph_inputs(step, shape.graph_rows, load["max_blocks"], load["scratch_block"],
                          torch.device("cpu"))  # fmt: skip
        b = load["b"]
        engine = load["dev"]
        # positions and slots, the split length, the block tables (token id, pool places aside)
        assert torch.equal(st.dev[b : 3 * b + 1], engine[b : 3 * b + 1])
        assert torch.equal(st.dev[6 * b + 1 :], engine[6 * b + 1 :])
        assert step.slot_mapping.tolist() == rows.slots.tolist()


def test_build_gives_every_layer_the_graphs_inputs_and_its_own_cache() -> None:
    pytest.importorskip("torch")
    from agentab.engine.local.verify_shapes import build, max_len_for
    from agentab.kernels.standard import StandardPath
    from agentab.kernels.weights import init_weights

    shape = VerifyShape(1, 2)
    max_len = max_len_for([shape], 5, block_size=4)
    vb = build(TINY, shape, 5, max_len, layers=2, seed=0, device="cpu", block_size=4)
    st = vb.inputs
    pos, tables = vb.host_rows()
    assert pos.tolist() == [5, 6, 7, 0] and tables[3, 0] == 3  # scratch block after row 0's 3
    assert st.new_slots.tolist() == [5, 6, 7, 12]
    for s in vb.states:
        assert s.paged.block_table is st.block_table and s.paged.split_len is st.split_len
        assert s.positions.tolist() == [5, 6, 7, 0] and s.paged.max_len == max_len
    assert vb.states[0].cache.data_ptr() != vb.states[1].cache.data_ptr()
    # a step writes each row's entry at its slot, as the engine's layers do
    w = init_weights(TINY, 1)
    before = vb.states[0].cache.clone()
    StandardPath(TINY, w, max_len).step(vb.x, vb.states[0])
    changed = (vb.states[0].cache != before).any(-1).nonzero().flatten().tolist()
    assert changed == [5, 6, 7, 12]


def test_verify_rows_and_table() -> None:
    detail = {n: {"bytes": 215_000_000, "bytes_distinct": 129_000_000, "touched_experts": 30.0,
                  "kernel_names": ["k"]} for n in ("standard", "specialized")}  # fmt: skip
    row = {"shape": "1x4", "rows": 1, "k": 3, "query_tokens": 4, "tokens": 4, "graph_rows": 4,
           "context": 4096, "standard_us": 200.0, "standard_kernels": 30,
           "specialized_us": 100.0, "specialized_kernels": 10}  # fmt: skip
    row = finish_verify_row(row, detail)
    assert (row["speedup"], row["speedup_vs"]) == (2.0, "standard")
    assert (row["roofline_fraction"], row["roofline_fraction_distinct"]) == (0.5, 0.3)
    assert (row["standard_roofline_fraction"], row["standard_roofline_fraction_distinct"]) == (
        0.25,
        0.15,
    )
    out = full_table({"rows": [], "verify_rows": [row]}).splitlines()
    assert out[2].split()[:3] == ["verify", "tokens", "graph"]
    assert out[3].split() == ["1x4", "4", "4", "200.0", "100.0", "2.00", "30", "10", "215.0",
                              "129.0", "0.50", "0.30"]  # fmt: skip
    assert "verify" not in table({"rows": []})


def test_run_verify_steps_the_layers_over_the_built_inputs(monkeypatch) -> None:
    """The bench's verify loop on the CPU: the eager standard layer stands in for both paths
    and one eager pass of the chained layers for the timed graph."""
    pytest.importorskip("torch")
    from agentab.engine.local import verify_bench
    from agentab.kernels import paths
    from agentab.kernels.harness import layer_chain
    from agentab.kernels.standard import StandardPath
    from agentab.kernels.weights import init_weights

    made: list[tuple[str, int, int | None]] = []

    def make_path(name, cfg, w, context, batch, paged_slots=None):  # type: ignore[no-untyped-def]
        made.append((name, batch, paged_slots))
        return StandardPath(cfg, w, context)

    def time_layers(p, states, x, iters, build_s, breakdown):  # type: ignore[no-untyped-def]
        outs = layer_chain(x, p, states)()
        touched = float(len({int(i) for o in outs for i in o.ids.flatten()}))
        return {"us_per_layer": 50.0, "p10_us_per_layer": 49.0, "p90_us_per_layer": 51.0,
                "kernels": 3, "kernel_names": ["a", "b", "c"], "touched_experts": touched,
                "build_s": 0.0, "eager_kernel_breakdown": None}  # fmt: skip

    monkeypatch.setattr(paths, "make_path", make_path)
    monkeypatch.setattr(verify_bench, "time_layers", time_layers)
    weights = [init_weights(TINY, s) for s in (1, 2)]
    shapes = parse_verify("2", "1,2")
    rows = verify_bench.run_verify(TINY, weights, shapes, 5, 5, 0, ("standard", "specialized"))
    assert [(r["shape"], r["tokens"], r["graph_rows"]) for r in rows] == [
        ("1x3", 3, 4),
        ("2x3", 6, 8),
    ]
    slots = {s: (-(-(5 + 1 + 4) // 16) * s + 1) * 16 for s in (1, 2)}  # tables + scratch block
    assert made == [(n, b, slots[r]) for r, b in ((1, 4), (2, 8)) for n in verify_bench.VERIFY_PATHS
                    for _ in weights]  # fmt: skip
    for r in rows:
        assert r["speedup"] == 1.0 and r["max_len"] == 16
        assert r["bytes"] > r["bytes_distinct"] > 0

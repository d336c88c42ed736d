"""Speculative decoding's verify shapes for `agentab engine verify-bench`, built as the local
engine builds a verify step on the GPU.

A verify row of a sequence with c cached tokens is 1 + k query tokens at positions c..c+k. The
engine's decode graphs run it as 1 + k token rows that share the row's block table, each
writing its own cache slot (`engine.local.cuda`); every layer writes all rows' entries before
it attends, so query j attends over c + j + 1 entries, the step's earlier queries included.
The step runs at the graph's padded size (1, 2, 4, then multiples of 8: `engine.paths`), its
padding rows decoding at position 0 into a scratch block. The inputs here come from the
engine's own functions: the scheduler's flat layout (`engine.outputs.flat_layout`), the
executor's token rows (`cuda.verify_token_rows`), the graph's packed inputs with their split
length (`cuda.GraphInputs.load`) and each layer's paged state (`GraphInputs.layer_state`).

Bytes (`step_bytes`): the attention core, shared by both paths, runs one set of programs per
token row, so each of a row's 1 + k queries reads the row's cached entries itself. `bytes`
counts what the kernels read that way (repeated entries may be served from L2 rather than
HBM); `bytes_distinct` counts each entry once, the fewest any kernel must move. Both count
every weight the step touches once, each row's new entry written, and the activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from agentab.engine.outputs import StepInputs, flat_layout
from agentab.engine.paths import padded_tokens
from agentab.errors import AgentabError
from agentab.kernels.config import BF16_BYTES, LayerConfig

if TYPE_CHECKING:
    import torch

BLOCK_SIZE = 16  # the local engine's default block size (engine.options)
GRAPH_MAX = 512  # the engine's largest captured graph (scheduler's cuda_graph_max_tokens)
MAX_QUERY = 8  # vLLM's specialized path takes uniform verify steps of up to 8 query tokens
MAX_ROWS = 64  # and at most 64 padded token rows (specialized.M_MAX)
DEFAULT_ROWS = (1, 2, 4, 8)


@dataclass(frozen=True)
class VerifyShape:
    """`rows` sequences verifying `k` drafts each: rows x (1 + k) query tokens."""

    rows: int
    k: int

    @property
    def queries(self) -> int:
        return 1 + self.k

    @property
    def tokens(self) -> int:
        return self.rows * self.queries

    @property
    def graph_rows(self) -> int:
        """The padded token rows of the engine's graph that runs the step."""
        return padded_tokens(self.tokens, GRAPH_MAX)

    @property
    def label(self) -> str:
        return f"{self.rows}x{self.queries}"


def _numbers(option: str, text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise AgentabError(f"{option}: {part!r} is not a number") from None
    if not out:
        raise AgentabError(f"{option}: needs a comma-separated list of numbers")
    return sorted(set(out))


def parse_verify(verify: str, rows: str) -> list[VerifyShape]:
    """`--verify 3,5,7 --verify-rows 1,2,4,8` -> the shapes (rows, k), every k at every row
    count; bad values are a one-line error naming the option."""
    ks = _numbers("--verify", verify)
    for k in ks:
        if not 1 <= k <= MAX_QUERY - 1:
            raise AgentabError(
                f"--verify: {k} drafts per row: the specialized path verifies 1..{MAX_QUERY - 1} "
                f"(1 + k <= {MAX_QUERY} query tokens)"
            )
    counts = _numbers("--verify-rows", rows)
    if counts[0] < 1:
        raise AgentabError(f"--verify-rows: {counts[0]}: needs row counts >= 1")
    shapes = [VerifyShape(r, k) for k in ks for r in counts]
    for s in shapes:
        if s.graph_rows > MAX_ROWS:
            raise AgentabError(
                f"--verify-rows: {s.rows} rows of 1 + {s.k} tokens pad to {s.graph_rows} token "
                f"rows; the specialized path takes at most {MAX_ROWS}"
            )
    return shapes


def table_width(context: int, k: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks in a verify row's table: its context, the 1 + k tokens and the k lookahead slots
    the scheduler holds for a row scheduled ahead (engine.model_io.model_inputs)."""
    return -(-(context + 1 + 2 * k) // block_size)


def verify_step(
    shape: VerifyShape,
    context: int | np.ndarray,
    block_size: int = BLOCK_SIZE,
    block_tables: np.ndarray | None = None,
) -> StepInputs:
    """The step's inputs as the scheduler lays a uniform verify step out: every row `context`
    cached tokens (one count, or one per row) and 1 + k new ones. Without `block_tables`, row i
    owns the consecutive blocks [i w, (i + 1) w) of w = `table_width` each."""
    n = shape.rows
    computed = np.broadcast_to(np.asarray(context, dtype=np.int64), (n,)).copy()
    num_new = np.full(n, shape.queries, dtype=np.int64)
    if block_tables is None:
        w = table_width(int(computed.max()), shape.k, block_size)
        block_tables = np.arange(n * w, dtype=np.int64).reshape(n, w)
    starts, positions, slots = flat_layout(computed, num_new, block_tables, block_size)
    return StepInputs(
        token_ids=np.zeros(len(positions), dtype=np.int64),
        positions=positions,
        starts=starts,
        context_lens=computed + num_new,
        block_tables=block_tables,
        slot_mapping=slots,
        is_decode=np.ones(n, dtype=np.bool_),
        block_size=block_size,
    )


def graph_inputs(
    step: StepInputs, graph_rows: int, max_blocks: int, scratch_block: int, device: Any
) -> Any:
    """The graph's packed inputs for the step, filled as the executor fills a verify step's
    (`cuda.GraphInputs`; the tokens' places in the token pool are not used here)."""
    from agentab.engine.local.cuda import GraphInputs, verify_token_rows

    st = GraphInputs(graph_rows, max_blocks, device)
    t = len(step.token_ids)
    rows = verify_token_rows(step, np.full(t, -1, dtype=np.int64), np.zeros(t, dtype=np.int64))
    bs = step.block_size
    st.load(rows, int(step.context_lens.max()), scratch_block * bs, scratch_block, 0)
    return st


def kv_entries(positions: np.ndarray, tables: np.ndarray, block_size: int) -> tuple[int, int]:
    """(cache entries the attention kernels read, distinct entries among them) for token rows
    at `positions` with block tables `tables` (one row each): a token at position p reads
    entries 0..p of its table."""
    read = int((positions + 1).sum())
    slots = [
        tables[i, np.arange(p + 1) // block_size] * block_size + np.arange(p + 1) % block_size
        for i, p in enumerate(positions.tolist())
    ]
    distinct = int(np.unique(np.concatenate(slots)).size) if slots else 0
    return read, distinct


def step_bytes(
    cfg: LayerConfig, positions: np.ndarray, tables: np.ndarray, block_size: int, touched: float
) -> tuple[int, int]:
    """(bytes as the kernels read them, bytes with each cache entry once) of one layer's step
    over these token rows (padding rows included): touched weights once, the cache reads, one
    new entry written per row, each row's input read and output written."""
    read, distinct = kv_entries(positions, tables, block_size)
    rows = len(positions)
    weights = (cfg.dense_weight_elems() + touched * cfg.expert_weight_elems()) * BF16_BYTES
    fixed = weights + rows * cfg.kv_width * BF16_BYTES + 2 * rows * cfg.hidden * BF16_BYTES
    entry = cfg.kv_width * BF16_BYTES
    return int(fixed + read * entry), int(fixed + distinct * entry)


@dataclass
class VerifyBuild:
    """One verify shape ready to step: the graph's inputs, a paged cache per layer, the input."""

    shape: VerifyShape
    step: StepInputs
    inputs: Any  # cuda.GraphInputs
    states: list[Any]  # DecodeState per layer
    x: torch.Tensor
    slots: int  # cache slots per layer

    def host_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(positions, block tables) of every graph row as the kernels see them."""
        st = self.inputs
        pos = st.pos_slots64[0].cpu().numpy()
        return pos, st.block_table.cpu().numpy()


def build(
    cfg: LayerConfig,
    shape: VerifyShape,
    context: int,
    max_len: int,
    layers: int,
    seed: int,
    device: Any,
    block_size: int = BLOCK_SIZE,
) -> VerifyBuild:
    """The shape's step over `layers` layers, each with its own paged cache of random entries
    (the engine's `PagedLatentCache`: one block table for all layers), the scratch block last.
    `max_len` bounds every sequence (the engine's max_model_len: it sizes the attention's split
    grid and the graph's block tables)."""
    import torch

    from agentab.engine.local.kv_cache import PagedLatentCache

    step = verify_step(shape, context, block_size)
    scratch = int(step.block_tables.max()) + 1
    cache = PagedLatentCache(layers, scratch + 1, block_size, cfg.kv_width, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen, device=device))
    st = graph_inputs(step, shape.graph_rows, -(-max_len // block_size), scratch, device)
    pos_slots = st.pos_slots64.to(torch.int32)  # (the engine's graph derives it once a step)
    states = [
        st.layer_state(cache.layer(i), block_size, max_len, st.new_slots, pos_slots)
        for i in range(layers)
    ]
    x = torch.randn(shape.graph_rows, cfg.hidden, generator=gen, device=device)
    return VerifyBuild(shape, step, st, states, x.to(torch.bfloat16), (scratch + 1) * block_size)


def max_len_for(shapes: list[VerifyShape], context: int, block_size: int = BLOCK_SIZE) -> int:
    """One `max_len` for every shape of a run (a compiled layer takes it as a constant)."""
    k = max(s.k for s in shapes)
    return table_width(context, k, block_size) * block_size

"""The standard forward cut into piecewise-graph pieces (engine.local.piecewise), run eagerly on
the CPU: the pieces in sequence, with attention between them, must give exactly what
`standard_forward` gives, hidden states and cache entries alike, when the step fills its token
bucket. Padded up to a larger bucket, no slot but the rows' own and the scratch block's is
written, the rows' cache entries are the standard forward's, and the hidden states are equal to
a GEMM's rounding, which depends on how many rows it multiplies (fp32: a few 1e-6; fp64: 1e-15,
or the router's fp32 logits' 1e-6). The cache is bf16: now and then such an fp32 difference
moves an entry to the neighbouring bf16 value (which entry, if any, depends on the CPU's BLAS
kernels), and the step's own attention reads it; the entries then agree to one bf16 unit and
the hidden states to 1e-3.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentab.engine.local.config import model_config  # noqa: E402
from agentab.engine.local.forward import DeviceBatch, standard_forward  # noqa: E402
from agentab.engine.local.kv_cache import PagedLatentCache  # noqa: E402
from agentab.engine.local.model import build_weights  # noqa: E402
from agentab.engine.local.piecewise import PiecewiseGraphs, token_buckets  # noqa: E402
from agentab.errors import AgentabError  # noqa: E402

from .test_local_mixed_step import BLOCK, NUM_BLOCKS, ROWS, hand_step  # noqa: E402
from .test_local_spec import MIXED, engine, greedy_spec, run  # noqa: E402
from .test_local_spec_graphs import graph_engine  # noqa: E402

CPU = torch.device("cpu")
SCRATCH_BLOCK = NUM_BLOCKS  # one block past those `hand_step` draws from
PREFILL = [(0, 9), (5, 14)]  # prefill chunks only: a first chunk and a later one
DECODE = [(16, 1), (40, 1), (3, 1)]  # one token per row (a decode step too large for graphs)


def test_buckets_double_to_256_then_grow_by_256_up_to_the_largest_step():
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(600) == [16, 32, 64, 128, 256, 512, 600]
    assert token_buckets(8) == [8]
    assert token_buckets(8192) == token_buckets(2048)  # larger steps run eagerly
    assert token_buckets(1000, limit=300) == [16, 32, 64, 128, 256, 300]


def _setup(dtype: torch.dtype):
    cfg = model_config("tiny", num_layers=4, weight_sets=2)
    w = build_weights(cfg, CPU, 3, dtype)
    cache = PagedLatentCache(cfg.num_layers, NUM_BLOCKS + 1, BLOCK, cfg.layer.kv_width, CPU)
    gen = torch.Generator().manual_seed(4)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))  # earlier tokens' entries
    return cfg, w, cache


@pytest.mark.parametrize("rows", [ROWS, PREFILL, DECODE], ids=["mixed", "prefill", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("pad", [0, 1, 21])
def test_the_pieces_give_the_standard_forwards_hidden_states_and_cache(rows, dtype, pad):
    cfg, w, cache = _setup(dtype)
    inputs = hand_step(rows, seed=6)
    n = len(inputs.token_ids)
    before = cache.data.clone()
    want = standard_forward(cfg, w, cache, DeviceBatch.of(inputs, CPU), dtype)
    want_cache = cache.data.clone()

    cache.data.copy_(before)
    scratch = SCRATCH_BLOCK * BLOCK
    pieces = PiecewiseGraphs(cfg, w, cache, dtype, [n - 1, n + pad], scratch, None, capture=False)
    t = pieces.bucket_for(n)
    assert t == n + pad
    got = pieces.forward(DeviceBatch.of(inputs, CPU), t)
    real = slice(0, SCRATCH_BLOCK * BLOCK)  # every slot but the scratch block's
    written = (want_cache != before).any(dim=2).any(dim=0)  # the rows' new slots
    kept = ~written[real]
    assert torch.equal(cache.data[:, real][:, kept], before[:, real][:, kept])
    if pad == 0:
        assert torch.equal(got, want)
        assert torch.equal(cache.data, want_cache)
    elif torch.equal(cache.data[:, real], want_cache[:, real]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        # a GEMM's ~1e-6 rounding difference moved a bf16 entry across a rounding boundary
        # (one unit: 2^-8 to 2^-7 of its value); the step's own attention reads that entry
        torch.testing.assert_close(cache.data[:, real], want_cache[:, real], rtol=2**-7, atol=0)
        assert dtype == torch.float32  # fp64's 1e-15 differences leave bf16 alone
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_a_step_after_a_larger_one_reads_none_of_its_leftovers():
    """The buffers hold the previous step's rows past this one's: the padding must be reset,
    so a small step after a large one gives what it gives on fresh buffers."""
    dtype = torch.float32
    cfg, w, cache = _setup(dtype)
    large, small = hand_step(ROWS, seed=6), hand_step(PREFILL, seed=7)
    before = cache.data.clone()
    fresh = PiecewiseGraphs(cfg, w, cache, dtype, [64], SCRATCH_BLOCK * BLOCK, None, capture=False)
    want = fresh.forward(DeviceBatch.of(small, CPU), 64)
    want_cache = cache.data.clone()

    cache.data.copy_(before)
    used = PiecewiseGraphs(cfg, w, cache, dtype, [64], SCRATCH_BLOCK * BLOCK, None, capture=False)
    used.forward(DeviceBatch.of(large, CPU), 64)
    cache.data.copy_(before)
    got = used.forward(DeviceBatch.of(small, CPU), 64)
    assert torch.equal(got, want)
    real = slice(0, SCRATCH_BLOCK * BLOCK)
    assert torch.equal(cache.data[:, real], want_cache[:, real])


def test_out_index_selects_the_tokens_the_standard_forward_would():
    dtype = torch.float32
    cfg, w, cache = _setup(dtype)
    inputs = hand_step(ROWS, seed=8)
    index = torch.tensor([0, 3, 5, 20])
    before = cache.data.clone()
    want = standard_forward(cfg, w, cache, DeviceBatch.of(inputs, CPU), dtype, out_index=index)
    cache.data.copy_(before)
    pieces = PiecewiseGraphs(cfg, w, cache, dtype, [48], SCRATCH_BLOCK * BLOCK, None, capture=False)
    got = pieces.forward(DeviceBatch.of(inputs, CPU), 48, out_index=index)
    assert torch.equal(got, want)


def test_captured_pieces_need_the_grouped_moe():
    dtype = torch.float32
    cfg, w, cache = _setup(dtype)
    with pytest.raises(ValueError, match="grouped MoE"):
        PiecewiseGraphs(cfg, w, cache, dtype, [16], 0, None, capture=True)


# -- the engine with `prefill_graphs`: the executor's steps through the pieces ------------------


def _piecewise_counts(eng) -> tuple[float, float, float, float]:
    m = eng.metrics()
    return (m["agentab:piecewise_steps_total"], m["agentab:piecewise_too_large_steps_total"],
            m["agentab:eager_steps_total"], m["agentab:graph_steps_total"])  # fmt: skip


def test_the_engine_serves_every_standard_step_in_the_pieces_with_the_eager_engines_tokens():
    plain = run(engine(max_num_batched_tokens=10), MIXED).tokens
    eng = engine(max_num_batched_tokens=10, prefill_graphs=True)
    d = run(eng, MIXED)
    assert d.tokens == plain
    pieces, too_large, eager, graphs = _piecewise_counts(eng)
    assert pieces == len(d.steps) and too_large == eager == graphs == 0
    facts = eng.describe()
    assert facts["prefill_graphs"] is True and facts["prefill_graph_tokens"] == [10]
    assert facts["prefill_graphs_source"] == "option"
    unset = engine(max_num_batched_tokens=10).describe()  # the CPU's default: off
    assert unset["prefill_graphs"] is False and unset["prefill_graph_tokens"] is None
    assert unset["prefill_graphs_source"] == "default"


@pytest.mark.parametrize(
    ("kind", "tp", "on"),
    [("cuda", 1, True), ("cuda", 2, False), ("cpu", 1, False), ("cpu", 2, False)],
)
def test_prefill_graphs_left_unset_are_on_for_one_gpu_only(kind, tp, on):
    from agentab.engine.local.build import default_prefill_graphs

    assert default_prefill_graphs(kind, tp) is on


def test_steps_larger_than_the_largest_bucket_run_eagerly_and_are_counted():
    plain = run(engine(max_num_batched_tokens=10), MIXED).tokens
    eng = engine(max_num_batched_tokens=10, prefill_graphs=True)
    ex = eng.executor  # pieces for steps of up to 8 tokens: those of 9 and 10 no longer fit
    ex.piecewise = PiecewiseGraphs(ex.cfg, ex.w, ex.cache, ex.dtype, [8],
                                   ex.piecewise.scratch_slot, None, capture=False)  # fmt: skip
    d = run(eng, MIXED)
    assert d.tokens == plain
    sizes = [int(p.num_prefill_tokens + p.num_decode_tokens) for p, _ in d.steps]
    pieces, too_large, eager, _ = _piecewise_counts(eng)
    assert too_large == eager == sum(n > 8 for n in sizes) > 0
    assert pieces == sum(n <= 8 for n in sizes) > 0


@pytest.mark.parametrize("spec", [None, greedy_spec(3, 1)], ids=["plain", "verify"])
def test_with_decode_graphs_the_pieces_serve_the_steps_the_graphs_do_not(spec):
    """The GPU's executor (decode graphs, run eagerly here): pure-decode and pure verify steps
    in the graphs, prefill and mixed steps (verify rows beside prefill chunks too) in the
    pieces, nothing eager, and plain greedy decoding's tokens."""
    plain = run(engine(max_num_batched_tokens=10), MIXED).tokens
    eng = graph_engine("auto", spec, max_num_batched_tokens=10, prefill_graphs=True)
    d = run(eng, MIXED)
    assert d.tokens == plain
    pieces, too_large, eager, graphs = _piecewise_counts(eng)
    mixed = sum(not p.is_decode.all() for p, _ in d.steps)
    assert pieces == mixed > 0 and graphs == len(d.steps) - mixed > 0
    assert too_large == eager == 0


def test_prefill_graphs_are_refused_with_tensor_parallelism():
    with pytest.raises(AgentabError, match="prefill_graphs: not with tensor parallelism"):
        engine(tp=2, prefill_graphs=True)


def test_an_arm_passes_prefill_graphs_to_its_server_which_parses_it():
    from agentab.engine.local.launch import local_launch, serve_args
    from agentab.engine.server_cli import serve

    launch = local_launch({"preset": "tiny", "device": "cpu", "prefill_graphs": True}, "auto")
    args = serve_args(launch, 8000)
    assert args[args.index("--prefill-graphs") + 1] == "True"
    parsed = serve.make_context("serve", args[args.index("serve") + 1 :]).params
    assert parsed["prefill_graphs"] is True
    off = serve_args(local_launch({"preset": "tiny", "device": "cpu"}, "auto"), 8000)
    assert "--prefill-graphs" not in off  # the default is left to the server

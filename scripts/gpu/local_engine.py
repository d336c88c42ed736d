# ruff: noqa: E501  (log lines)
"""One device call: the local engine on the H200, checked and timed before any A/B.

Run on the GPU machine (repo root):  source .gpu/setup.sh && python3 scripts/gpu/local_engine.py
Stages (STAGES, comma-separated; default all):
  paged   the paged Triton MLA decode against the torch math on a random block table
  smoke   k2-tp8-shard at 4 layers over 2 weight sets, both backends (SMOKE_BACKENDS): prefill +
          graph decode, tokens compared across backends and against eager recomputation
  timing  k2-tp8-shard at full depth (61 layers over 8 sets), each backend in turn: decode step
          device time at batch 1 and 8 (context ~4096) against `kernels bench` x layers + the
          LM head, and the device's idle time between consecutive decode steps (steps driven
          directly: schedule -> execute -> update)
  serve   the same at batch 1 through the engine loop (worker thread, asyncio), as served
  prefill k2-tp8-shard at full depth on the standard path with the A/B's engine options: prefill
          kernels of one 8,192-token chunk (torch profiler), throughput of one 32k prompt and of
          4 prompts of 16k (chunks of 8,192 tokens), then the decode step at that batch
  prefill_small  k2-tp8-shard at full depth on the standard path: where a short prefill step's
          time goes (the fixed ~140 ms a 32-token prompt costs on the device): prefill steps of
          32 and 512 new tokens after 8,192 cached, each step's host launch time against its
          device time, and the torch profiler's CPU and CUDA view of one 32-token step (op
          calls per layer, the ops with the most host time, the device's busy time). With
          PREFILL_GRAPHS=1 the engine also captures piecewise graphs (the prefill_graphs
          option) and every step and the profile run twice, eager and piecewise, on one engine
  mixed   k2-tp8-shard at full depth, the standard forward (eager) on hand-built steps over a
          filled cache: (a) a prefill of 720 new tokens after 8,000 cached, (b) 15 decode rows
          of contexts 4,000-16,000, (c) both in one mixed step; device time of each (CUDA
          events, median of 7), (c)-(a) per decode row, and the decode rows' outputs in (c)
          against (b); with PREFILL_GRAPHS=1 each step also through the piecewise graphs
          (host launch, device and wall time, the profiler's kernel time of (c) in each mode,
          and (c)'s hidden states and ids piecewise against eager)
  spec    speculative decoding on the GPU: (a) k2-tp8-shard at 4 layers, both backends: greedy
          verification with a 1-layer drafter and a self-drafting one (tokens against plain
          greedy decoding, acceptance), synthetic L=6 with 7 drafts (5 accepted every step);
          (b) the seed's headline configuration at full depth: one request at a time, a 1-token
          prompt, 1,000 tokens out, k=7, synthetic acceptance 6, a 1-layer drafter, both
          backends in ABBA order over SPEC_REPEATS repeats, through the engine loop (async):
          decode tokens/s after the first token, B/A with a t interval, the verify step's
          device time against `kernels bench` at 8 tokens x 61 layers + the LM head + the
          drafts, host idle between steps; and the same without drafts (the B1 figure)
KV_BLOCKS overrides the A/B engine's 40,960 KV blocks of the prefill and prefill_small stages (45
GiB of cache: the H200's figure; 16384 fits an 80 GB H100, and a step's time does not depend on it).
Writes $OUT/local_engine.json and prints a short table last.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

T0 = time.time()
OUT = Path(os.environ.get("OUT", "out"))
# The device is named in main(), not here: importing this file on a machine without CUDA (the
# scripts' import test) must not touch the device or create $OUT.
RESULTS: dict = {"torch": torch.__version__}
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def save() -> None:
    (OUT / "local_engine.json").write_text(json.dumps(RESULTS, indent=2, default=str))


def stage_paged() -> None:
    from agentab.kernels.attention import PagedKV, mla_decode_torch, mla_decode_triton, split_plan
    from agentab.kernels.config import get_preset

    cfg = get_preset("k2-tp8-shard")
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for b, lens in ((1, [4096]), (3, [17, 900, 5000]), (8, [1 + 611 * i for i in range(8)])):
        bs, max_len, nblocks = 16, 8192, 4096
        cache = torch.randn(nblocks * bs, cfg.kv_width, device="cuda", generator=g).bfloat16()
        perm = torch.randperm(nblocks, device="cuda", generator=g)
        table = perm[: b * (max_len // bs)].view(b, -1).int()
        pos = torch.tensor([n - 1 for n in lens], device="cuda", dtype=torch.int32)
        q_lat = torch.randn(b, cfg.n_heads, cfg.kv_lora, device="cuda", generator=g).bfloat16()
        q_pe = torch.randn(b, cfg.n_heads, cfg.qk_rope, device="cuda", generator=g).bfloat16()
        split = torch.tensor([split_plan(b, max(lens))[1]], device="cuda", dtype=torch.int32)
        slots = torch.zeros(b, device="cuda", dtype=torch.int64)
        paged = PagedKV(cache, table, slots, torch.stack([pos, slots.int()]), bs, max_len, split)
        got = mla_decode_triton(cfg, q_lat, q_pe, cache, pos, paged).float()
        idx = torch.arange(max_len, device="cuda")
        dense = cache[table.long()[:, idx // bs] * bs + idx % bs]
        want = mla_decode_torch(cfg, q_lat, q_pe, dense, pos).float()
        err = float((got - want).norm() / want.norm())
        rows.append({"batch": b, "lens": lens, "rel_err": err})
        log(f"paged attention batch {b}: rel err {err:.2e}")
    RESULTS["paged"] = rows
    save()


def drive(
    eng, prompts: list[np.ndarray], n: int, check: list | None = None
) -> tuple[dict[str, list[int]], list]:
    """Add the prompts, step until done (schedule -> execute -> update); outputs and steps.

    With `check` (a list), every pure-decode step is also recomputed by the eager standard
    forward on the same inputs, and (graph ids == eager ids) per row is appended: one-step
    agreement, free of the drift that compounds over autoregressive steps."""
    from agentab.engine.local.cuda import greedy_cuda
    from agentab.engine.local.forward import DeviceBatch, standard_forward

    s = eng.scheduler
    ex = eng.executor
    for i, p in enumerate(prompts):
        s.add(f"r{i}", p, n)
    outs: dict[str, list[int]] = {}
    steps = []
    while s.has_work():
        plan = s.schedule()
        inputs = s.model_inputs(plan)
        out = ex.execute(plan, inputs)
        if check is not None and plan.is_decode.all():
            with torch.inference_mode():
                b = DeviceBatch.of(inputs, ex.device, ex.last_sampled)
                x = standard_forward(ex.cfg, ex.w, ex.cache, b, ex.dtype, ex.grouped)
                eager = greedy_cuda(ex.cfg, ex.w, x).cpu().numpy()
            check.extend((eager == out.sampled).tolist())
        steps.append(
            {
                "path": plan.path,
                "rows": len(plan.slots),
                "decode": bool(plan.is_decode.all()),
                "device_s": out.device_s,
                "idle_s": out.idle_s,
                "host_s": out.duration_s,
                "context": int((plan.computed_before + plan.num_sched).max()),
            }
        )
        reqs, counts, _ = s.update(plan, out)
        for req, k in zip(reqs, counts, strict=True):
            outs.setdefault(req.id, []).extend(s.output_ids(req, k).tolist())
    return outs, steps


def free(eng) -> None:
    del eng
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def stage_smoke() -> None:
    from agentab.engine.local.build import build_local_engine

    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 32000, size=n) for n in (37, 300, 1200)]
    res = {}
    backends = os.environ.get("SMOKE_BACKENDS", "auto,latency_specialized").split(",")
    for backend in backends:
        t = time.time()
        eng = build_local_engine(
            "k2-tp8-shard",
            backend,
            device="cuda",
            num_layers=4,
            weight_sets=2,
            kv_blocks=4096,
            max_num_seqs=8,
            max_model_len=8192,
        )
        build_s = time.time() - t
        agree_steps: list = []
        outs, steps = drive(eng, prompts, 24, agree_steps)
        # the same continuation recomputed eagerly: prompt + first 12 outputs, 12 more tokens
        cont = [np.concatenate([p, np.array(outs[f"r{i}"][:12])]) for i, p in enumerate(prompts)]
        again, _ = drive(eng, cont, 12)
        agree = np.mean(
            [
                a == b
                for i in range(3)
                for a, b in zip(again[f"r{i}"], outs[f"r{i}"][12:], strict=True)
            ]
        )
        m = eng.metrics()
        res[backend] = {
            "build_s": build_s,
            "outputs": outs,
            "one_step_agreement_with_eager": float(np.mean(agree_steps)),
            "one_step_rows": len(agree_steps),
            "recompute_agreement": float(agree),
            "graph_steps": m["agentab:graph_steps_total"],
            "eager_steps": m["agentab:eager_steps_total"],
            "decode_steps_specialized": m["agentab:decode_steps_specialized_total"],
            "prefix_hits": eng.scheduler.counters["prefix_cache_hits"],
            "steps": steps[:6],
        }
        log(
            f"smoke {backend}: built {build_s:.1f}s, graph steps {m['agentab:graph_steps_total']:.0f}, "
            f"eager {m['agentab:eager_steps_total']:.0f}, recompute agreement {agree:.3f}, one-step graph vs eager {np.mean(agree_steps):.3f} of {len(agree_steps)} rows"
        )
        free(eng)
    if len(res) == 2:
        a, b = res["auto"]["outputs"], res["latency_specialized"]["outputs"]
        same = np.mean([x == y for k in a for x, y in zip(a[k], b[k], strict=True)])
        res["token_agreement_auto_vs_specialized"] = float(same)
        log(
            f"smoke: tokens equal across backends at {same:.3f} of positions (bf16, random weights)"
        )
    RESULTS["smoke"] = res
    save()


def lm_head_us(eng) -> float:
    from agentab.engine.local.cuda import greedy_cuda
    from agentab.kernels.harness import capture, time_replays

    out = {}
    for b in (1, 8):
        x = torch.randn(b, eng.executor.cfg.layer.hidden, device="cuda").bfloat16()
        graph, _ = capture(lambda x=x: greedy_cuda(eng.executor.cfg, eng.executor.w, x))
        out[b] = time_replays(graph, iters=200)["median"]
    return out


def stage_timing() -> None:
    from agentab.engine.local.build import build_local_engine

    bench = json.loads((ROOT / "benchmarks/results/kernels-h200.json").read_text())
    per_layer = {r["batch"]: r for r in bench["rows"]}
    rng = np.random.default_rng(4)
    res = {}
    for backend in ("latency_specialized", "auto"):
        t = time.time()
        eng = build_local_engine(
            "k2-tp8-shard",
            backend,
            device="cuda",
            kv_blocks=16384,
            max_num_seqs=8,
            max_model_len=8192,
        )
        build_s = time.time() - t
        log(
            f"timing {backend}: built in {build_s:.1f}s, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        )
        head = lm_head_us(eng)
        row = {
            "build_s": build_s,
            "lm_head_us": head,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
        for batch in (1, 8):
            prompts = [rng.integers(1, 32000, size=4000) for _ in range(batch)]
            _outs, steps = drive(eng, prompts, 96)
            dec = [s for s in steps if s["decode"] and s["rows"] == batch][8:]
            dev = statistics.median(s["device_s"] for s in dec) * 1e6
            idle = statistics.median(s["idle_s"] for s in dec) * 1e6
            host = statistics.median(s["host_s"] for s in dec) * 1e6
            key = "specialized_us" if backend == "latency_specialized" else "standard_us"
            pred = 61 * per_layer[batch][key] + head[batch]
            row[f"batch{batch}"] = {
                "decode_steps": len(dec),
                "device_us": dev,
                "idle_us": idle,
                "host_us": host,
                "predicted_us": pred,
                "vs_pred": dev / pred,
                "idle_frac": idle / dev,
                "paths": sorted({s["path"] for s in dec}),
            }
            log(
                f"timing {backend} batch {batch}: step {dev:.0f} us (bench x 61 + head {pred:.0f}, "
                f"{dev / pred:.3f}), idle {idle:.0f} us ({idle / dev:.1%}), host {host:.0f} us"
            )
        res[backend] = row
        save()
        free(eng)
    RESULTS["timing"] = res
    save()


def stage_serve() -> None:
    """The engine loop itself (worker thread, asyncio, token events): device idle per decode
    step at batch 1 as `agentab serve` runs it, from the engine's own counters."""
    import asyncio

    from agentab.engine.local.build import build_local_engine
    from agentab.engine.types import EngineRequest

    res = {}
    rng = np.random.default_rng(6)
    for backend in ("latency_specialized", "auto"):
        eng = build_local_engine(
            "k2-tp8-shard",
            backend,
            device="cuda",
            kv_blocks=16384,
            max_num_seqs=8,
            max_model_len=8192,
        )

        async def one(eng=eng) -> dict:
            eng.start()
            try:
                before = None
                async for _ev in eng.generate(
                    EngineRequest("s0", rng.integers(1, 32000, size=4000), 200)
                ):
                    if before is None:  # first token: prefill done; count decode from here
                        before = dict(eng.metrics())
                after = eng.metrics()
            finally:
                await eng.stop()
            keys = (
                "agentab:decode_steps_specialized_total",
                "agentab:decode_steps_standard_total",
                "agentab:decode_device_busy_seconds_total",
                "agentab:decode_device_idle_seconds_total",
                "agentab:host_launch_seconds_total",
            )
            return {k.split(":")[1]: after[k] - before[k] for k in keys}

        d = asyncio.run(one())
        steps = d["decode_steps_specialized_total"] + d["decode_steps_standard_total"]
        busy = d["decode_device_busy_seconds_total"] / steps * 1e6
        idle = d["decode_device_idle_seconds_total"] / steps * 1e6
        launch = d["host_launch_seconds_total"] / steps * 1e6
        res[backend] = {
            "decode_steps": steps,
            "busy_us": busy,
            "idle_us": idle,
            "idle_frac": idle / busy,
            "host_launch_us": launch,
        }
        log(
            f"serve {backend}: {steps:.0f} decode steps, busy {busy:.0f} us, idle {idle:.0f} us ({idle / busy:.1%}); host time to launch {launch:.0f} us"
        )
        free(eng)
    RESULTS["serve"] = res
    save()


# the engine options of the A/Bs (examples/local-k2-h200.toml's [engine] table)
AB_ENGINE = {
    "device": "cuda",
    "kv_blocks": int(os.environ.get("KV_BLOCKS", "40960")),
    "max_num_seqs": 16,
    "max_num_batched_tokens": 8192,
    "max_model_len": 36864,
}


def stage_prefill() -> None:
    from agentab.engine.local.build import build_local_engine

    rng = np.random.default_rng(7)
    eng = build_local_engine("k2-tp8-shard", "auto", **AB_ENGINE)
    res = {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        drive(eng, [rng.integers(1, 32000, size=8192)], 1)
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=15, max_name_column_width=60
    )
    (OUT / "prefill-profile.txt").write_text(table)
    print(table[:4000], flush=True)
    for name, sizes in (("one-32k", [32000]), ("4x16k", [16000] * 4)):
        torch.cuda.synchronize()
        t = time.time()
        _outs, steps = drive(eng, [rng.integers(1, 32000, size=n) for n in sizes], 24)
        wall = time.time() - t
        pre = [s for s in steps if not s["decode"]]
        pre_s = sum(s["device_s"] for s in pre)
        dec = [s for s in steps if s["decode"] and s["rows"] == len(sizes)][4:]
        row = {
            "prompt_tokens": sum(sizes),
            "prefill_steps": len(pre),
            "prefill_device_s": pre_s,
            "prefill_tok_s": sum(sizes) / pre_s if pre_s else None,
            "wall_s": wall,
            "decode_step_us": statistics.median(s["device_s"] for s in dec) * 1e6 if dec else 0.0,
            "decode_rows": len(sizes),
        }
        res[name] = row
        log(
            f"prefill {name}: {sum(sizes)} tokens in {len(pre)} steps, {pre_s:.2f} s on the device "
            f"({row['prefill_tok_s']:.0f} tok/s); decode step at batch {len(sizes)} "
            f"{row['decode_step_us']:.0f} us; wall {wall:.1f} s"
        )
        save()
    RESULTS["prefill"] = res
    save()
    free(eng)


def kernel_time_ms(events) -> float:
    """The device's kernel time (ms) in a profile's averaged events: the kernel rows only. An
    aten op's row carries its kernels' time as its own device time too, so a sum over every row
    counts each eagerly launched kernel twice (and a graph-replayed one, which has no aten
    parent, once)."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e3


def prefill_graphs_on() -> bool:
    """PREFILL_GRAPHS=1: engines of the prefill_small and mixed stages capture the piecewise
    graphs, and those stages time each step both ways."""
    return os.environ.get("PREFILL_GRAPHS", "0") == "1"


def forward_modes(ex) -> list[tuple[str, object]]:
    """("eager", None), and ("piecewise", the executor's pieces) where it has them: setting
    `ex.piecewise` to either makes its standard steps run that way."""
    pieces = getattr(ex, "piecewise", None)
    return [("eager", None)] + ([("piecewise", pieces)] if pieces is not None else [])


def stage_prefill_small() -> None:
    from torch.profiler import ProfilerActivity, profile

    from agentab.engine.local.build import build_local_engine

    rng = np.random.default_rng(11)
    t = time.time()
    eng = build_local_engine(
        "k2-tp8-shard", "auto", **AB_ENGINE, prefill_graphs=prefill_graphs_on()
    )
    log(f"prefill_small: built in {time.time() - t:.1f}s (prefill graphs {prefill_graphs_on()})")
    s, ex = eng.scheduler, eng.executor
    layers = ex.cfg.num_layers
    modes = forward_modes(ex)
    base = rng.integers(1, 32000, size=8192)
    ex.piecewise = None
    drive(eng, [base], 1)  # the cached prefix (and a first, warming prefill)

    def one_step(new: int, tag: str) -> dict:
        """One prefill step of `new` tokens after the cached prefix: host launch vs device."""
        s.add(tag, np.concatenate([base, rng.integers(1, 32000, size=new)]), 1)
        plan = s.schedule()
        inputs = s.model_inputs(plan)
        torch.cuda.synchronize()
        t = time.perf_counter()
        launched = ex.launch(plan, inputs)
        host_s = time.perf_counter() - t
        out = ex.collect(launched)
        wall_s = time.perf_counter() - t
        s.update(plan, out)
        while s.has_work():  # its one decode token, if any
            p2 = s.schedule()
            s.update(p2, ex.execute(p2, s.model_inputs(p2)))
        return {
            "new": new,
            "cached": int(plan.computed_before.max()),
            "host_launch_ms": host_s * 1e3,
            "device_ms": out.device_s * 1e3,
            "wall_ms": wall_s * 1e3,
        }

    res: dict = {}
    for mode, pieces in modes:
        ex.piecewise = pieces
        before = dict(ex.counters)
        rows = []
        for k, new in enumerate([32, 32, 32, 512, 512, 512]):
            rows.append({"mode": mode, **one_step(new, f"small-{mode}-{k}")})
            r = rows[-1]
            log(
                f"prefill {r['new']} after {r['cached']} ({mode}): host launch {r['host_launch_ms']:.1f} ms, "
                f"device {r['device_ms']:.1f} ms, wall {r['wall_ms']:.1f} ms"
            )
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            profiled = one_step(32, f"small-{mode}-profiled")
        events = prof.key_averages()
        calls = sum(e.count for e in events if e.key.startswith("aten::"))
        table = events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
        suffix = "" if mode == "eager" else f"-{mode}"
        (OUT / f"prefill-small-profile{suffix}.txt").write_text(table)
        print(table[:6000], flush=True)
        counted = {k: ex.counters[k] - before[k] for k in ("piecewise_steps", "eager_steps",
                                                           "graph_steps", "piecewise_too_large_steps")}  # fmt: skip
        res[mode] = {
            "steps": rows,
            "profiled": profiled,
            "aten_calls": calls,
            "aten_calls_per_layer": calls / layers,
            "self_cpu_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
            "self_cuda_ms": kernel_time_ms(events),
            "counters": counted,
            # the goal's figure: a 32-token step's time as served (launch to ids on the host,
            # median of the unprofiled steps) over the device's own work in it (the profiled
            # step's kernel time)
            "wall_over_kernel_32": statistics.median(r["wall_ms"] for r in rows if r["new"] == 32)
            / kernel_time_ms(events),
        }
        log(
            f"profiled 32-token prefill ({mode}): {calls} aten calls ({calls / layers:.0f} per layer), "
            f"self CPU {res[mode]['self_cpu_ms']:.1f} ms, self CUDA {res[mode]['self_cuda_ms']:.1f} ms, "
            f"wall / kernels {res[mode]['wall_over_kernel_32']:.2f}; "
            f"steps {counted}"
        )
    # the eager mode's figures where they were before, the piecewise mode's beside them
    RESULTS["prefill_small"] = {**res["eager"], "by_mode": res}
    save()
    free(eng)


MIXED_DECODE_CONTEXTS = np.linspace(4000, 16000, 15).round().astype(int).tolist()
MIXED_PREFILL = (8000, 720)  # (cached, new): a new turn after a cached conversation


def hand_step(rows: list[tuple[int, int]], bases: list[int], tokens: list[np.ndarray], eng):
    """The StepInputs the scheduler would give for `rows` ((cached tokens, new tokens) each),
    row i's blocks consecutive from block bases[i] and its new tokens tokens[i]."""
    from agentab.engine.outputs import StepInputs

    bs = eng.executor.cache.block_size
    top = eng.executor.cache.num_blocks - 1
    cached = np.array([c for c, _ in rows], dtype=np.int64)
    new = np.array([n for _, n in rows], dtype=np.int64)
    width = int((-(-(cached + new) // bs)).max())
    tables = np.minimum(np.array([b + np.arange(width) for b in bases]), top).astype(np.int64)
    return StepInputs.of_rows(cached, new, tables, np.concatenate(tokens), bs)


def timed_forward(eng, inputs, iters: int = 7, warmup: int = 2, pieces=None):
    """Device time (ms, median) of the step through the eager standard forward, or through the
    piecewise graphs `pieces` where given, measured as the executor measures a step (events
    around inputs, forward and sampling), with the host's time to queue it (launch) and to
    see it done (wall), medians too; the last run's hidden states and ids."""
    from agentab.engine.local.cuda import greedy_cuda
    from agentab.engine.local.forward import DeviceBatch, standard_forward

    ex = eng.executor
    times, hosts, walls = [], [], []
    for k in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            start.record()
            b = DeviceBatch.of(inputs, ex.device)
            if pieces is None:
                x = standard_forward(ex.cfg, ex.w, ex.cache, b, ex.dtype, ex.grouped)
            else:
                bucket = pieces.bucket_for(b.starts[-1])
                assert bucket is not None, "the step is larger than the largest bucket"
                x = pieces.forward(b, bucket)
            ids = greedy_cuda(ex.cfg, ex.w, x)
            end.record()
        host = time.perf_counter() - t
        end.synchronize()
        wall = time.perf_counter() - t
        if k >= warmup:
            times.append(start.elapsed_time(end))
            hosts.append(host * 1e3)
            walls.append(wall * 1e3)
    timing = {"device_ms": statistics.median(times), "host_launch_ms": statistics.median(hosts),
              "wall_ms": statistics.median(walls)}  # fmt: skip
    return timing["device_ms"], x, ids, timing


def kernel_ms(eng, inputs, pieces=None) -> tuple[float, int]:
    """The profiler's sum of kernel time (ms) of one run of the step, and its aten calls:
    the device's work without the gaps a host-bound step leaves between kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_forward(eng, inputs, iters=1, warmup=0, pieces=pieces)
    events = prof.key_averages()
    calls = sum(e.count for e in events if e.key.startswith("aten::"))
    return kernel_time_ms(events), calls


def stage_mixed() -> None:
    from agentab.engine.local.build import build_local_engine

    rng = np.random.default_rng(8)
    t = time.time()
    eng = build_local_engine(
        "k2-tp8-shard",
        "auto",
        device="cuda",
        kv_blocks=16384,
        max_num_seqs=8,
        max_model_len=32768,
        prefill_graphs=prefill_graphs_on(),
    )
    log(f"mixed: built in {time.time() - t:.1f}s (prefill graphs {prefill_graphs_on()})")
    rows = [(n - 1, 1) for n in MIXED_DECODE_CONTEXTS] + [MIXED_PREFILL]
    bs = eng.executor.cache.block_size
    need = [-(-(c + n) // bs) for c, n in rows]
    bases = np.concatenate([[0], np.cumsum(need)[:-1]]).tolist()
    used = int(sum(need)) * bs
    with torch.inference_mode():  # every cached token's latent entry, in every layer
        eng.executor.cache.data[:, :used].normal_()
    tokens = [rng.integers(1, 32000, size=n) for _c, n in rows]
    dec = list(range(len(MIXED_DECODE_CONTEXTS)))
    last = len(rows) - 1

    def step(idx: list[int]):
        return hand_step([rows[i] for i in idx], [bases[i] for i in idx],
                         [tokens[i] for i in idx], eng)  # fmt: skip

    n = len(dec)
    out: dict = {"prefill": {"cached": MIXED_PREFILL[0], "new": MIXED_PREFILL[1]},
                 "decode_contexts": MIXED_DECODE_CONTEXTS}  # fmt: skip
    mixed_x: dict = {}
    for mode, pieces in forward_modes(eng.executor):
        a_ms, _, _, a_t = timed_forward(eng, step([last]), pieces=pieces)
        b_ms, x_b, ids_b, b_t = timed_forward(eng, step(dec), pieces=pieces)
        c_ms, x_c, ids_c, c_t = timed_forward(eng, step([*dec, last]), pieces=pieces)
        c_kernel_ms, c_calls = kernel_ms(eng, step([*dec, last]), pieces=pieces)
        mixed_x[mode] = (x_c, ids_c)
        diff = (x_c[:n].float() - x_b.float()).norm() / x_b.float().norm()
        agree = float((ids_c[:n] == ids_b).float().mean())
        res = {
            "prefill_alone_ms": a_ms,
            "decode_alone_ms": b_ms,
            "mixed_ms": c_ms,
            "prefill_alone": a_t,
            "decode_alone": b_t,
            "mixed": c_t,
            "mixed_kernel_ms": c_kernel_ms,
            "mixed_aten_calls": c_calls,
            "mixed_wall_over_kernel": c_t["wall_ms"] / c_kernel_ms,
            "mixed_launch_over_kernel": c_t["host_launch_ms"] / c_kernel_ms,
            "mixed_minus_prefill_per_decode_row_ms": (c_ms - a_ms) / n,
            "decode_rows_mixed_vs_alone_rel_err": float(diff),
            "decode_rows_mixed_vs_alone_ids_equal": agree,
        }
        if mode == "eager":
            out.update(res)
        out.setdefault("by_mode", {})[mode] = res
        log(
            f"mixed ({mode}): (a) prefill of {MIXED_PREFILL[1]} after {MIXED_PREFILL[0]} cached {a_ms:.1f} ms "
            f"(host launch {a_t['host_launch_ms']:.1f} ms, wall {a_t['wall_ms']:.1f} ms); "
            f"(b) {n} decode rows (contexts {min(MIXED_DECODE_CONTEXTS)}-{max(MIXED_DECODE_CONTEXTS)}) {b_ms:.1f} ms; "
            f"(c) both in one step {c_ms:.1f} ms (host launch {c_t['host_launch_ms']:.1f} ms, wall {c_t['wall_ms']:.1f} ms, "
            f"kernels {c_kernel_ms:.1f} ms, {c_calls} aten calls, wall / kernels {c_t['wall_ms'] / c_kernel_ms:.2f}); (c)-(a) per decode row {(c_ms - a_ms) / n:.2f} ms; "
            f"decode rows in (c) vs (b): rel err {float(diff):.2e}, ids equal {agree:.3f}"
        )
    if "piecewise" in mixed_x:
        (xe, ie), (xp, ip) = mixed_x["eager"], mixed_x["piecewise"]
        rel = float((xp.float() - xe.float()).norm() / xe.float().norm())
        same = float((ip == ie).float().mean())
        out["piecewise_vs_eager"] = {"rel_err": rel, "ids_equal": same}
        log(f"mixed: (c) piecewise vs eager: hidden rel err {rel:.2e}, ids equal {same:.3f}")
    RESULTS["mixed"] = out
    save()
    free(eng)


SPEC_SYNTHETIC = {"num_speculative_tokens": 7, "rejection_sample_method": "synthetic",
                  "synthetic_acceptance_length": 6.0, "draft_layers": 1}  # fmt: skip


def stage_spec() -> None:
    """Speculative decoding on the GPU: correctness at 4 layers, then the headline run
    (SPEC_PARTS: smoke, headline or both, the default)."""
    parts = os.environ.get("SPEC_PARTS", "smoke,headline").split(",")
    if "smoke" in parts:
        spec_smoke()
    if "headline" in parts:
        spec_headline()


def spec_smoke() -> None:
    from agentab.engine.local.build import build_local_engine

    rng = np.random.default_rng(8)
    prompts = [rng.integers(1, 32000, size=n) for n in (37, 300, 1200)]
    res: dict = {}
    small = {"device": "cuda", "num_layers": 4, "weight_sets": 2, "kv_blocks": 4096,
             "max_num_seqs": 8, "max_model_len": 8192}  # fmt: skip
    for backend in ("auto", "latency_specialized"):
        plain, _ = drive(build_local_engine("k2-tp8-shard", backend, **small), prompts, 40)
        row: dict = {}
        for name, spec in (
            ("greedy_1_layer", {"num_speculative_tokens": 3, "draft_layers": 1}),
            ("self_drafting", {"num_speculative_tokens": 3, "draft_layers": 4}),
            ("synthetic_6_of_7", SPEC_SYNTHETIC),
        ):
            eng = build_local_engine("k2-tp8-shard", backend, speculative_config=spec, **small)
            outs, steps = drive(eng, prompts, 40)
            m = eng.metrics()
            drafts = m["vllm:spec_decode_num_drafts_total"]
            accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
            per_pos = [v for k, v in sorted(m.items()) if "_per_pos" in k]
            same = np.mean([a == b for k in plain for a, b in zip(plain[k], outs[k], strict=True)])
            row[name] = {
                "tokens_equal_plain_greedy": float(same),
                "verify_steps": drafts,
                "mean_accepted": accepted / max(drafts, 1),
                "accepted_per_pos": per_pos,
                "graph_steps": m["agentab:graph_steps_total"],
                "eager_steps": m["agentab:eager_steps_total"],
                "specialized_steps": m["agentab:decode_steps_specialized_total"],
                "paths": sorted({s["path"] for s in steps}),
            }
            log(f"spec smoke {backend} {name}: tokens = plain greedy at {same:.3f}, "
                f"{drafts:.0f} verify rows, mean accepted {accepted / max(drafts, 1):.2f}, "
                f"per position {per_pos}, graph steps {m['agentab:graph_steps_total']:.0f}, "
                f"eager {m['agentab:eager_steps_total']:.0f}, specialized {m['agentab:decode_steps_specialized_total']:.0f}")  # fmt: skip
            free(eng)
        res[backend] = row
    RESULTS["spec_smoke"] = res
    save()


def headline_run(backend: str, spec: dict | None, out_len: int) -> dict:
    """One request of a 1-token prompt and `out_len` tokens through the engine loop."""
    import asyncio

    from agentab.engine.local.build import build_local_engine
    from agentab.engine.types import EngineRequest, TokenEvent

    eng = build_local_engine("k2-tp8-shard", backend, device="cuda", kv_blocks=4096,
                             max_num_seqs=1, max_model_len=2048,
                             speculative_config=spec)  # fmt: skip

    async def one() -> dict:
        eng.start()
        try:
            before, t_first, n = None, 0.0, 0
            async for ev in eng.generate(EngineRequest("h0", np.array([17]), out_len)):
                if isinstance(ev, TokenEvent):
                    if before is None:  # the prefill's token: count decode from here
                        before, t_first = dict(eng.metrics()), time.perf_counter()
                    else:
                        n += len(ev.token_ids)
            t_last = time.perf_counter()
            after = eng.metrics()
        finally:
            await eng.stop()
        d = {k: after[k] - before.get(k, 0.0) for k in after if isinstance(after[k], (int, float))}
        return {"decode_tokens": n, "decode_s": t_last - t_first, "delta": d}

    r = asyncio.run(one())
    d = r.pop("delta")
    steps = d["agentab:graph_steps_total"] + d["agentab:eager_steps_total"]
    r.update(
        tokens_per_s=r["decode_tokens"] / r["decode_s"],
        steps=steps,
        busy_us=d["agentab:device_busy_seconds_total"] / steps * 1e6,
        idle_us=d["agentab:device_idle_seconds_total"] / steps * 1e6,
        draft_us=d.get("agentab:draft_device_seconds_total", 0.0) / steps * 1e6,
        specialized_steps=d["agentab:decode_steps_specialized_total"],
        graph_steps=d["agentab:graph_steps_total"],
        accepted_per_step=d.get("vllm:spec_decode_num_accepted_tokens_total", 0.0) / steps,
    )
    r["lm_head_us"] = lm_head_us(eng)
    free(eng)
    return r


def spec_headline() -> None:
    bench = json.loads((ROOT / "benchmarks/results/kernels-h200.json").read_text())
    per_layer = {r["batch"]: r for r in bench["rows"]}
    repeats = int(os.environ.get("SPEC_REPEATS", "3"))
    out_len = int(os.environ.get("SPEC_OUT", "1000"))
    res: dict = {"repeats": repeats, "output_tokens": out_len}
    labels = os.environ.get("SPEC_LABELS", "spec_k7_synthetic_6,no_spec").split(",")
    for label, spec in (("spec_k7_synthetic_6", SPEC_SYNTHETIC), ("no_spec", None)):
        if label not in labels:
            continue
        # the process's first run pays one-time costs (its first pinned buffers, lazy CUDA
        # initialisation) that no later run does: one run first, not counted
        warm = headline_run("auto", spec, 100)
        log(
            f"headline {label}: warmup run (not counted) {warm['tokens_per_s']:.1f} tok/s, "
            f"idle {warm['idle_us']:.0f} us per step"
        )
        runs: dict[str, list] = {"latency_specialized": [], "auto": []}
        for rep in range(repeats):
            order = ["auto", "latency_specialized"]
            for backend in order if rep % 2 == 0 else order[::-1]:  # ABBA
                r = headline_run(backend, spec, out_len)
                runs[backend].append(r)
                log(f"headline {label} {backend} repeat {rep + 1}: {r['tokens_per_s']:.1f} tok/s, "
                    f"{r['steps']:.0f} steps, busy {r['busy_us']:.0f} us, idle {r['idle_us']:.0f} us, "
                    f"drafts {r['draft_us']:.0f} us, accepted/step {r['accepted_per_step']:.2f}, "
                    f"specialized steps {r['specialized_steps']:.0f}")  # fmt: skip
        a = np.array([r["tokens_per_s"] for r in runs["auto"]])
        b = np.array([r["tokens_per_s"] for r in runs["latency_specialized"]])
        # (the interval is the t interval over the repeats' log ratios, made where scipy is:
        # benchmarks/spec_headline.py reads this file)
        ratio = float(np.exp(np.log(b / a).mean()))
        row = {
            "auto_tokens_per_s": a.tolist(),
            "specialized_tokens_per_s": b.tolist(),
            "b_over_a": ratio,
            "runs": runs,
        }
        if spec is not None:  # the verify step (8 token rows) against the kernels x layers
            for backend, key in (
                ("latency_specialized", "specialized_us"),
                ("auto", "standard_us"),
            ):
                r = runs[backend][-1]
                pred = 61 * per_layer[8][key] + r["lm_head_us"][8] + r["draft_us"]
                # the drafts: 7 x (one standard layer at batch 1 + the LM head at batch 1)
                draft_pred = 7 * (per_layer[1]["standard_us"] + r["lm_head_us"][1])
                row[f"{backend}_verify_vs_bench"] = {
                    "step_us": r["busy_us"], "predicted_us": pred, "ratio": r["busy_us"] / pred,
                    "draft_us": r["draft_us"], "idle_frac": r["idle_us"] / r["busy_us"],
                    "draft_predicted_us": draft_pred,
                }  # fmt: skip
                log(f"headline {backend} verify step {r['busy_us']:.0f} us vs bench(8) x 61 + head + "
                    f"drafts {pred:.0f} us ({r['busy_us'] / pred:.3f}); idle "
                    f"{r['idle_us'] / r['busy_us']:.1%} of the step; drafts {r['draft_us']:.0f} us "
                    f"vs 7 x (bench(1) + head) {draft_pred:.0f} us")  # fmt: skip
        log(
            f"headline {label}: B/A {ratio:.3f}; auto {a.mean():.1f} tok/s, specialized {b.mean():.1f}"
        )
        res[label] = row
        RESULTS["spec_headline"] = res
        save()


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    RESULTS["device"] = torch.cuda.get_device_name()
    stages = os.environ.get("STAGES", "paged,smoke,timing,serve").split(",")
    rc = 0
    for name in stages:
        try:
            log(f"stage {name}")
            globals()[f"stage_{name}"]()
        except Exception:
            traceback.print_exc()
            RESULTS.setdefault("errors", []).append({name: traceback.format_exc()[-3000:]})
            save()
            rc = 1
    t = RESULTS.get("timing", {})
    print("\n| backend | batch | step us | predicted us | ratio | idle us | idle/step |")
    print("|---|---|---|---|---|---|---|")
    for backend, row in t.items():
        for batch in (1, 8):
            r = row.get(f"batch{batch}")
            if r:
                print(
                    f"| {backend} | {batch} | {r['device_us']:.0f} | {r['predicted_us']:.0f} | {r['vs_pred']:.3f} | {r['idle_us']:.0f} | {r['idle_frac']:.1%} |"
                )
    return rc


if __name__ == "__main__":
    sys.exit(main())

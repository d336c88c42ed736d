# ruff: noqa: B023  (closures are timed inside the loop iteration that defines them)
"""First device call: environment, kit import, CuTe DSL GEMVs compiled and run, standard path timed.

Run on the GPU machine:  source .gpu/setup.sh && python scripts/gpu/smoke.py
"""

from __future__ import annotations

import sys
import time
import traceback

import torch


def timed(fn, iters: int = 50) -> float:
    """Median microseconds of fn() replayed inside a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
    import cutlass

    print("cutlass dsl", cutlass.__version__ if hasattr(cutlass, "__version__") else "?")
    from agentab.kernels.cute.gemv import GemvSpec, compile_gemv

    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    # GEMV: correctness and bandwidth on decode shapes (rotating 8 weight copies against L2).
    for n, k, m, norm, resid in [
        (2112, 7168, 1, True, False),
        (7168, 2048, 1, False, True),
        (7168, 4096, 1, False, False),
        (7168, 2048, 8, False, True),
        (384, 7168, 4, True, False),
    ]:
        spec = GemvSpec(
            n=n, k=k, m=m, x_cols=k, out_cols=n, norm=norm, resid=resid, out_f32=(n == 384)
        )
        t0 = time.time()
        f = compile_gemv(spec)
        tc = time.time() - t0
        ws = [torch.randn(n, k, device=dev).mul_(k**-0.5).to(torch.bfloat16) for _ in range(8)]
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        gam = (
            (torch.rand(k, device=dev) + 0.5).to(torch.bfloat16)
            if norm
            else torch.zeros(8, device=dev, dtype=torch.bfloat16)
        )
        r = (
            torch.randn(m, n, device=dev).to(torch.bfloat16)
            if resid
            else torch.zeros(1, 8, device=dev, dtype=torch.bfloat16)
        )
        rsd = torch.zeros(m, device=dev)
        y = torch.full(
            (m, n), float("nan"), device=dev, dtype=torch.float32 if n == 384 else torch.bfloat16
        )
        f(ws[0], x, gam, r, y, rsd)
        torch.cuda.synchronize()
        xf = x.float()
        if norm:
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * gam.float()
        ref = xf @ ws[0].float().t() + (r.float() if resid else 0)
        err = ((y.float() - ref).norm() / ref.norm()).item()

        def run_all():
            for w in ws:
                f(w, x, gam, r, y, rsd)

        us = timed(run_all) / len(ws)

        def run_torch():
            for w in ws:
                torch.nn.functional.linear(x, w)

        ut = timed(run_torch) / len(ws)
        gbs = n * k * 2 / us / 1e3
        print(
            f"gemv n={n} k={k} m={m} norm={norm} resid={resid}: compile {tc:.1f}s err {err:.2e} "
            f"cute {us:.1f}us ({gbs:.0f} GB/s) cublas {ut:.1f}us ({n * k * 2 / ut / 1e3:.0f} GB/s)"
        )

    # Shared attention core: Triton vs torch.
    from agentab.kernels.attention import mla_decode_torch, mla_decode_triton
    from agentab.kernels.config import PRESETS
    from agentab.kernels.weights import init_state

    cfg = PRESETS["k2-tp8-shard"]
    for b, ctx in [(1, 4096), (64, 4096), (3, 100)]:
        st = init_state(cfg, b, ctx, 1, dev, ragged=(b == 3))
        ql = torch.randn(b, 16, 512, device=dev).to(torch.bfloat16)
        qp = torch.randn(b, 16, 64, device=dev).to(torch.bfloat16)
        o1 = mla_decode_triton(cfg, ql, qp, st.cache, st.positions)
        o2 = mla_decode_torch(cfg, ql, qp, st.cache, st.positions)
        err = ((o1.float() - o2.float()).norm() / o2.norm()).item()
        us = timed(lambda: mla_decode_triton(cfg, ql, qp, st.cache, st.positions))
        print(
            f"attention b={b} ctx={ctx}: err {err:.2e} {us:.1f}us "
            f"({b * ctx * 576 * 2 / us / 1e3:.0f} GB/s)"
        )

    # Standard path, 4 layers with their own weights, in one graph.
    from agentab.kernels.standard import StandardPath
    from agentab.kernels.weights import init_weights

    t0 = time.time()
    layers = [init_weights(cfg, 100 + i, dev) for i in range(4)]
    torch.cuda.synchronize()
    print(
        f"init 4 layers {time.time() - t0:.1f}s, mem {torch.cuda.memory_allocated() / 1e9:.1f} GB"
    )
    for b in (1, 8, 64):
        states = [init_state(cfg, b, 4096, 7 + i, dev) for i in range(4)]
        paths = [StandardPath(cfg, w, 4097) for w in layers]
        x = torch.randn(b, cfg.hidden, device=dev).to(torch.bfloat16)

        def step():
            h = x
            for p, s in zip(paths, states, strict=True):
                h = p.step(h, s).out
            return h

        try:
            us = timed(step) / 4
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                paths[0].step(x, states[0])
                torch.cuda.synchronize()
            kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            print(f"standard b={b}: {us:.1f} us/layer, {len(kern)} device ops/layer (eager)")
            names = sorted({e.name[:60] for e in kern})
            print("   ", names[:40])
        except Exception:
            traceback.print_exc()
    print("SMOKE DONE")


if __name__ == "__main__":
    sys.exit(main())

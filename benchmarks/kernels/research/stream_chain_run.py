# ruff: noqa: E501  (log lines)
"""Measure the persistent GEMV chain (benchmarks/kernels/research/cute/stream_chain.py) on the layer's bytes.

The question (NOTES.md): with the weight stream decoupled from the data (a producer
warp per SM filling a shared-memory ring with bulk copies, consumers behind grid barriers), how
close does a chain of dependent GEMVs with the batch-1 layer's 182.6 MB get to the 4.3 TB/s
roofline? The batch-1 goal is 75% (56.6 us); nine kernels of plain reads took 64-68 us, one
barrier-free read 51.8 us (NOTES.md).

Phases: the layer's tensors as GEMVs of the same bytes (absorb and the latent cache reshaped to
k >= 256), the MoE split into shared and routed halves, the routed weights gated on the router
(the producer may not stream them before routing, as in a real layer). Each phase's output is
checked against torch (fp32) on the kernel's own inputs; then 4 layers per CUDA graph (730 MB,
far above L2) are timed, median of 50 replays.

Run on the GPU machine (repo root): source .gpu/setup.sh && python3 -m benchmarks.kernels.research.stream_chain_run
Each variant runs in its own process (LIMIT_S); writes $OUT/stream_chain_<variant>.json (the
device tool returns at most 8 files: keep VARIANTS at 7). Run a reference in every call
(`BEST`: 65.92 and 66.0-66.3 us; `EF4`, the best measured: 64.80 / 64.83
us): machines differ, so compare within a call.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from agentab.kernels.harness import capture, time_replays
from benchmarks.kernels.research.cute.chain_trace import (
    CTA_STAMPS,
    PROBE,
    PROBE_SAMPLES,
    TRACE_LEN,
    TRACE_POSITIONS,
    WATCH,
)
from benchmarks.kernels.research.cute.stream_chain import (
    Phase,
    compile_chain,
    counter_words,
    w_offsets,
    y_offsets,
)

OUT = Path(os.environ.get("OUT", "out"))
LIMIT_S = 120  # per variant
PHASES = (
    Phase(2112, 7168, -1),  # 0 qkv_a (input norm would go here)
    Phase(3072, 1536, 0),  # 1 q_b
    Phase(4096, 256, 1),  # 2 absorb (2.1 MB)
    Phase(4608, 512, 2),  # 3 latent cache at context 4096 (4.7 MB)
    Phase(2048, 512, 3),  # 4 uv (2.1 MB)
    Phase(7168, 2048, 4),  # 5 o_proj
    Phase(384, 7168, 5),  # 6 router
    Phase(512, 7168, 5),  # 7 shared expert gate/up
    Phase(4096, 7168, 5, gate=6),  # 8 routed experts gate/up (8 x 512 rows), after routing
    Phase(7168, 256, 7),  # 9 shared expert down
    Phase(57344, 256, 8),  # 10 routed experts down (8 x 7168 rows)
)
# The shared expert's down projection before the routed experts: the consumers then have work
# (and the producer bytes to stream) while the router's completion reaches every CTA, instead
# of the producer idling at the routed experts' gate.
SHARED_FIRST = (
    *PHASES[:8],
    Phase(7168, 256, 7),  # 8 shared expert down
    Phase(4096, 7168, 5, gate=6),  # 9 routed experts gate/up, after routing
    Phase(57344, 256, 9),  # 10 routed experts down
)
ORDERS = {"routed first": PHASES, "shared first": SHARED_FIRST}
LAYERS = 4  # per CUDA graph (730 MB of weights, far above L2)
X_LEN = 7168


def stacked(layers: int, order: tuple[Phase, ...] = PHASES) -> tuple[Phase, ...]:
    """`layers` layers' phases as one chain, the layout and the dependencies of a launch with
    `layers=` (layer l + 1's input is layer l's last output): for the buffers and the check."""
    n = len(order)
    out = []
    for la in range(layers):
        for p, ph in enumerate(order):
            src = ph.src + n * la if ph.src >= 0 else (n * la - 1 if la else -1)
            gate = ph.gate + n * la if ph.gate >= 0 else -1
            out.append(Phase(ph.n, ph.k, src, gate))
            assert p != 0 or src < 0 or out[src].n >= ph.k
    return tuple(out)


def make_layer(dev: torch.device, phases: tuple[Phase, ...], flagged: bool) -> dict:
    w = torch.empty(w_offsets(phases)[-1], device=dev, dtype=torch.bfloat16)
    wo = w_offsets(phases)
    for i, ph in enumerate(phases):
        w[wo[i] : wo[i + 1]] = (torch.randn(ph.n * ph.k, device=dev) / ph.k**0.5).to(torch.bfloat16)
    return {
        "w": w,
        "x": torch.randn(X_LEN, device=dev).to(torch.bfloat16),
        # outputs: fp32, or {fp32 value, int32 flag} words (sync="flags")
        "y": torch.zeros(
            y_offsets(phases)[-1], device=dev, dtype=torch.int64 if flagged else torch.float32
        ),
    }


def values(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The outputs' fp32 values and (flagged words) int32 flags."""
    if y.dtype == torch.float32:
        return y, None
    pairs = y.view(torch.int32).view(-1, 2)
    return pairs[:, 0].view(torch.float32), pairs[:, 1]


def check(layer: dict, phases: tuple[Phase, ...], flag: int | None = None) -> list[float]:
    """Per phase: max |y - W x| / max |W x| on the kernel's own inputs; with `flag`, every
    output word must carry it (1.0 is returned for a phase with a stale word)."""
    wo, yo = w_offsets(phases), y_offsets(phases)
    y, flags = values(layer["y"])
    errs = []
    for i, ph in enumerate(phases):
        if flags is not None and not bool((flags[yo[i] : yo[i + 1]] == flag).all()):
            errs.append(1.0)
            continue
        x = layer["x"].float() if ph.src < 0 else y[yo[ph.src] : yo[ph.src] + ph.k]
        x = x[: ph.k].to(torch.bfloat16).float()  # the kernel stages its input as bf16
        ref = layer["w"][wo[i] : wo[i + 1]].view(ph.n, ph.k).float() @ x
        got = y[yo[i] : yo[i + 1]]
        errs.append(((got - ref).abs().max() / ref.abs().max()).item())
    return errs


MMA = dict(stages=12, warps=6, mma=True, sets=4, wait_kind="test", sync="red")
ALONE = dict(MMA, consume=False, wait=False)
DYN = dict(MMA, dynamic=True, row_sum="store")
DYN4 = dict(DYN, layers=4)
BEST = dict(DYN4, gap=100)
ALONE4 = dict(ALONE, layers=4)
BIG = dict(BEST, chunk_bytes=32768, stages=6, rolled=True)  # 32 KB stages (compiles rolled)
BIGF = dict(BIG, evict_first=True)
EF = dict(BEST, evict_first=True, rolled=True)  # 65.19 us (NOTES.md)
EF4 = dict(EF, warps=4)  # the best measured: 64.80 us
STATIC4 = dict(EF4, dynamic=False)  # units in a fixed round robin
VARIANTS = [
    # NOTES.md: at most 8 / 6 / 4 copies in flight: 74.2-74.3 us (EF4 64.73), without
    # input waits 69.8 (EF4 52.9): the boundaries cost 4.4 us instead of 11.9, but the capped
    # stream is slow. Is it the cap itself (11 of 12), or the cap with claimed units?
    ("evict-first, rolled, 4 consumer warps (dynamic, stored, 4 layers, 100 ns)", EF4),
    ("  same, at most 11 copies in flight", dict(EF4, inflight=11)),
    ("  same, static units", STATIC4),
    ("  same, static units, at most 6 in flight", dict(STATIC4, inflight=6)),
    ("  same, static units, at most 6 in flight, no input waits", dict(STATIC4, inflight=6, wait=False)),
]  # fmt: skip


def main() -> int:
    """Each variant in its own process with a time limit: a stuck grid costs one variant."""
    OUT.mkdir(parents=True, exist_ok=True)
    clocks = "clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu,pci.bus_id"
    smi = ["nvidia-smi", f"--query-gpu={clocks}", "--format=csv"]
    print(subprocess.run(smi, capture_output=True, text=True).stdout.strip(), flush=True)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"L2: {l2 / 2**20:.0f} MiB", flush=True)
    only = os.environ.get("CHAIN_VARIANTS")
    status = 0
    for vi, (label, _) in enumerate(VARIANTS):
        if only and str(vi) not in only.split(","):
            continue
        env = dict(os.environ, CHAIN_ONE=str(vi))
        try:
            r = subprocess.run(
                [sys.executable, "-m", __spec__.name],
                env=env,
                timeout=LIMIT_S,
                capture_output=True,
                text=True,
            )
            print(r.stdout.strip() or f"{label}: no output", flush=True)
            if r.returncode:
                print(f"{label}: exit {r.returncode}: {r.stderr.strip()[-600:]}", flush=True)
                status = 1
        except subprocess.TimeoutExpired:
            print(f"{label}: TIMEOUT ({LIMIT_S} s)", flush=True)
            status = 1
    return status


def one(vi: int) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    label, kw = VARIANTS[vi]
    kw = dict(kw)
    grid = kw.pop("grid", sms)
    per_launch = kw.get("layers", 1)  # the kernel's runtime loop over layers
    order_name = kw.pop("order", "routed first")
    order = ORDERS[order_name]
    phases = stacked(per_launch, order)
    launches = max(2, LAYERS // per_launch)  # even: the launches alternate counter slots
    total = w_offsets(PHASES)[-1] * 2
    doc: dict = {"device": torch.cuda.get_device_name(dev), "sms": sms, "bytes": total,
                 "variant": label, "options": kw, "layers_per_launch": per_launch,
                 "order": order_name}  # fmt: skip
    torch.manual_seed(0)
    flagged = kw.get("sync") == "flags"
    layers = [make_layer(dev, phases, flagged) for _ in range(launches)]
    words = counter_words(len(phases), kw.get("dynamic", False), kw.get("spacing", 1))
    cnt = torch.zeros(2, words, device=dev, dtype=torch.int32)  # arrivals (and claims)
    trace = torch.zeros(TRACE_LEN, device=dev, dtype=torch.int32)
    epoch = torch.zeros(2, device=dev, dtype=torch.int32)
    path = OUT / f"stream_chain_{vi}.json"
    if kw.pop("triton", False):
        triton_read(layers, total // 2, doc, label)
        path.write_text(json.dumps(doc, indent=1))
        return 0
    if kw.pop("trace", False):
        traced(layers, cnt, trace, epoch, sms, kw, doc, order)
        path.write_text(json.dumps(doc, indent=1))
        return 0
    ok = True
    t0 = time.time()
    f = compile_chain(order, grid, X_LEN, **kw)  # one layer's phases; `phases` = their layout
    doc["compile_s"] = round(time.time() - t0, 1)
    checked = kw.get("wait", True) and kw.get("consume", True)
    cnt.zero_()
    for lay in layers[:2]:
        lay["y"].zero_()
    f(layers[0]["w"], layers[0]["x"], layers[0]["y"], cnt, 0, trace, epoch)
    f(layers[1]["w"], layers[1]["x"], layers[1]["y"], cnt, 1, trace, epoch)
    torch.cuda.synchronize()
    if flagged and epoch.tolist() != [2, 0]:
        print(f"{label}: epoch {epoch.tolist()} after two launches, expected [2, 0]")
        return 1
    flags = trace[WATCH : WATCH + 16].tolist()
    if any(flags):
        print(
            f"{label}: WATCHDOG fired {flags} (codes: 0 empty, 1 full, 2 gate, 3+p phase p input; value 1 + CTA)"
        )
        doc["watchdog"] = flags
        path.write_text(json.dumps(doc, indent=1))
        return 1
    if checked:
        errs = check(layers[0], phases, 1) + check(layers[1], phases, 2)
        doc["max_rel_err"] = max(errs)
        ok = max(errs) <= 1e-3
        print(f"{label}: check max rel err {max(errs):.2e} ({'ok' if ok else 'FAIL'})")
    cnt.zero_()

    def step(f=f):
        for i, lay in enumerate(layers):
            f(lay["w"], lay["x"], lay["y"], cnt, i % 2, trace, epoch)

    g, _ = capture(step)
    t = time_replays(g, iters=50, warmup=5)
    us = t["median"] / (launches * per_launch)
    doc.update({"us_per_layer": round(us, 2), "tb_s": round(total / us / 1e6, 3),
                "roofline": round(total / us / 1e6 / 4.3, 3), "s": round(time.time() - t0, 1)})  # fmt: skip
    if checked:  # the last replay's words: launch 0 of it wrote flag epoch - launches + 1
        errs = check(layers[0], phases, int(epoch[0]) - launches + 1)
        doc["max_rel_err_after_replays"] = max(errs)
        ok = ok and max(errs) <= 1e-3
    print(
        f"{label:50s} {us:7.2f} us/layer  {doc['tb_s']:5.2f} TB/s  ({doc['roofline']:.2f} of roofline)"
    )
    path.write_text(json.dumps(doc, indent=1))
    return 0 if ok else 1


def triton_read(layers: list, per_layer: int, doc: dict, label: str) -> None:
    """The read ceiling of the same buffers: one plain Triton streaming read per launch
    buffer (the plain read kernel: each program sums a contiguous share), 2 and 8 programs/SM."""
    from benchmarks.kernels.research.read_ceiling import plain_read

    out = torch.empty(132 * 64, device="cuda", dtype=torch.float32)
    bufs = [lay["w"] for lay in layers]
    n = bufs[0].numel()
    for per_sm in (2, 8):
        reads = [plain_read(b, out, per_sm) for b in bufs]

        def step(reads=reads):
            for r in reads:
                r()

        g, _ = capture(step)
        t = time_replays(g, iters=50, warmup=5)
        # each buffer holds that variant's layers-per-launch layers (here 1: 182.6 MB)
        us = t["median"] / len(bufs) / (n // per_layer)
        tb = per_layer * 2 / us / 1e6
        doc[f"us_per_layer_{per_sm}_per_sm"] = round(us, 2)
        print(
            f"{label:50s} {per_sm}/SM {us:7.2f} us/layer  {tb:5.2f} TB/s  ({tb / 4.3:.2f} of roofline)"
        )


def traced(layers: list, cnt: torch.Tensor, trace: torch.Tensor, epoch: torch.Tensor, sms: int,
           kw: dict, doc: dict, order: tuple[Phase, ...]) -> None:  # fmt: skip
    """CTA 0's pipeline: when each copy was issued, its stage seen filled and released, and
    each phase's input ready / staged, units done, arrival (ns; all positions in the JSON)."""
    f = compile_chain(order, sms, X_LEN, trace=True, **kw)
    cnt.zero_()
    for i in range(4):  # warm: the last launch (slot 1) is the one read back
        trace.zero_()
        lay = layers[i % len(layers)]
        f(lay["w"], lay["x"], lay["y"], cnt, i % 2, trace, epoch)
    torch.cuda.synchronize()
    info = pipeline(trace.cpu().to(torch.int64), sms, len(order), kw)
    doc["trace"] = info
    long = ("issued_ns", "filled_ns", "released_ns", "cta_entry_ns", "cta_done_ns",
            "probe_start_ns", "probe_round_trip_ns")  # fmt: skip
    short = {k: v for k, v in info.items() if k not in long}
    print(json.dumps(short), flush=True)


def pipeline(t: torch.Tensor, sms: int, n_ph: int, kw: dict) -> dict:
    """The trace buffer (int64 on the host) as times relative to CTA 0's first issue."""
    t0 = int(t[0])
    P = TRACE_POSITIONS
    # positions up to the last one stamped at all: with dynamic units the end markers have no
    # issue stamp (and a consumer's held stage no release yet), so count every kind
    stamped = (t[0:P] != 0) | (t[P : 2 * P] != 0) | (t[2 * P : 3 * P] != 0)
    n = int(stamped.nonzero().max()) + 1
    raw = [t[k * P : k * P + n].tolist() for k in range(3)]
    rel = lambda v: [int(x) - t0 if x else None for x in v]  # noqa: E731 (None: no stamp)
    iss, fil, rel_ = (rel(r) for r in raw)
    lat = sorted(f - i for f, i in zip(fil, iss, strict=True) if f is not None and i is not None)
    landed = [f for f in fil if f is not None]
    gaps = sorted(b - a for a, b in itertools.pairwise(landed))
    hold = sorted(r - f for f, r in zip(fil, rel_, strict=True) if f is not None and r is not None)
    pct = lambda v, *qs: [v[len(v) * q // 100] for q in qs]  # noqa: E731
    info = {"options": kw, "positions": n, "end_ns": max(r for r in rel_ if r is not None),
            "issue_to_filled_ns_p10_p50_p90": pct(lat, 10, 50, 90),
            "filled_gap_ns_p50_p90": pct(gaps, 50, 90),
            "filled_to_released_ns_p50_p90": pct(hold, 50, 90),
            "phase_ready_ns": rel(t[3072 : 3072 + n_ph]),
            "phase_staged_ns": rel(t[3200 : 3200 + n_ph]),
            "phase_done_ns": rel(t[3264 : 3264 + n_ph]),
            "phase_arrived_ns": rel(t[3136 : 3136 + n_ph]),
            "issued_ns": iss, "filled_ns": fil, "released_ns": rel_}  # fmt: skip
    # every CTA: entry and units-done times; the spread says how unevenly the SMs stream
    cta = t[CTA_STAMPS : CTA_STAMPS + 16 * sms].view(sms, 16) - t0
    info["cta_entry_ns"] = cta[:, 15].tolist()
    info["cta_done_ns"] = cta[:, :n_ph].tolist()
    done = cta[:, :n_ph].float()
    info["cta_done_min_p50_max"] = [[int(done[:, p].min()), int(done[:, p].median()),
                                     int(done[:, p].max())] for p in range(n_ph)]  # fmt: skip
    info["cta_entry_min_max"] = [int(cta[:, 15].min()), int(cta[:, 15].max())]
    if kw.get("probe"):  # L2 round trips over the launch: (start ns, round trip ns)
        pr = t[PROBE : PROBE + 2 * PROBE_SAMPLES].view(-1, 2)
        pr = pr[pr[:, 0] != 0]
        starts, trips = (pr[:, 0] - t0).tolist(), pr[:, 1].tolist()
        info["probe_start_ns"], info["probe_round_trip_ns"] = starts, trips
        # per 5 us window of the launch: median round trip
        windows: dict[int, list[int]] = {}
        for st, rt in zip(starts, trips, strict=True):
            windows.setdefault(st // 5000 * 5, []).append(rt)
        info["probe_median_ns_per_5us"] = {
            w: sorted(v)[len(v) // 2] for w, v in sorted(windows.items())
        }
    return info


if __name__ == "__main__":
    sys.exit(one(int(os.environ["CHAIN_ONE"])) if "CHAIN_ONE" in os.environ else main())

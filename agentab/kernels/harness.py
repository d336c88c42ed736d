"""Capture a decode step in a CUDA graph, time its replays, count its kernels.

Timing: CUDA events around each replay, warm-up first, the median of many replays. The graph
holds several layers with their own weights, caches and inputs one after another (as a model's
step does), so the weights one replay reads (hundreds of MB to GB) far exceed the 60 MB L2 and
every layer's weights come from HBM.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch


def layer_chain(x: torch.Tensor, paths: list[Any], states: list[Any]) -> Callable[[], list[Any]]:
    """One step through stacked layers, each path with its own state, each layer's output the
    next one's input (the module docstring says why several); returns every layer's output."""

    def step() -> list[Any]:
        h, outs = x, []
        for p, s in zip(paths, states, strict=True):
            o = p.step(h, s)
            outs.append(o)
            h = o.out
        return outs

    return step


def warm_up(fn: Callable[[], Any], times: int = 2) -> None:
    """Run fn `times` times on a side stream, so that compiling, autotuning and first
    allocations happen outside the capture that follows (as torch's graph docs require)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture(fn: Callable[[], Any], warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run fn `warmup` times on a side stream (compiles, autotunes), then capture it."""
    warm_up(fn, warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def time_replays(graph: torch.cuda.CUDAGraph, iters: int = 100, warmup: int = 10) -> dict:
    """Microseconds per replay: median, p10, p90 over `iters` event-timed replays."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    us = sorted(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends, strict=True))
    return {
        "median": statistics.median(us),
        "p10": us[len(us) // 10],
        "p90": us[(9 * len(us)) // 10],
    }


def kernel_names(fn: Callable[[], Any]) -> list[str]:
    """The device kernels one call of fn launches (profiler, eager run; copies/memsets left out)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if ev.name.startswith(("Memcpy", "Memset")):
            continue
        names.append(ev.name)
    return names


def kernel_times(fn: Callable[[], Any], reps: int = 5) -> list[tuple[str, float, int]]:
    """(kernel name, total device us per call, launches per call), eager, largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    acc: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        acc.setdefault(ev.name[:80], []).append(ev.device_time)
    rows = [(n, sum(v) / reps, len(v) // reps) for n, v in acc.items()]
    return sorted(rows, key=lambda r: -r[1])

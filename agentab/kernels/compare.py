"""Compare one decode step of a path with the fp32 reference (used by `kernels check` and tests).

The comparison is stage-wise so that one discrete router decision cannot hide or fake an error:
1. attention stage: the path's `h1` and its new cache entry against the reference from `x`;
2. routing: the reference router (fp32) on the path's own router input; the expert sets must be
   identical except where the reference's k-th and (k+1)-th scores tie (within fp32
   accumulation-order noise, `TIE_TOL`);
3. MoE stage: the path's output against the reference MoE applied to the path's `h1` with the
   path's (checked) experts.
The end-to-end error against the reference run from `x` alone is reported too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from agentab.kernels import reference as R
from agentab.kernels.config import LayerConfig
from agentab.kernels.weights import DecodeState, LayerWeights

REL_TOL = 1e-2  # bf16 activations, fp32 accumulation
TIE_TOL = 1e-5  # biased scores closer than this are a tie (fp32 summation order differs)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (NaN if a has any non-finite value)."""
    a64, b64 = a.double(), b.double().to(a.device)
    if not torch.isfinite(a64).all():
        return float("nan")
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


@dataclass
class StepCheck:
    batch: int
    h1_err: float
    cache_err: float
    out_err: float
    weights_err: float
    e2e_err: float
    expert_mismatches: int  # tokens whose expert set differs and is not a tie
    tie_excused: int  # tokens whose set differs only across a tie
    all_written: bool  # every poisoned output element was overwritten with a finite value

    @property
    def ok(self) -> bool:
        errs = (self.h1_err, self.cache_err, self.out_err, self.weights_err)
        return (
            all(e <= REL_TOL for e in errs)  # NaN compares False
            and self.expert_mismatches == 0
            and self.all_written
        )

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "ok": self.ok}


def compare_step(
    cfg: LayerConfig,
    w: LayerWeights,
    x: torch.Tensor,
    before: DecodeState,
    out: torch.Tensor,
    h1: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    router_in: torch.Tensor,
    router_in_normed: bool,
    cache_after: torch.Tensor,
) -> StepCheck:
    """Check one step's outputs against the reference, on the weights' device (fp32, no TF32)."""
    w_cpu = w
    ids, weights = ids.long(), weights.float()
    b = x.shape[0]
    rows = torch.arange(b, device=x.device)
    written = all(bool(torch.isfinite(t.float()).all()) for t in (out, h1, weights))
    written = written and bool(((ids >= 0) & (ids < cfg.n_experts)).all())

    with torch.no_grad():
        full = R.forward(cfg, w_cpu, x, before)
        entry = cache_after[rows, before.positions.long()]
        rin = router_in.float()
        hn = rin if router_in_normed else R.rms_norm(rin, w_cpu.ffn_norm, cfg.rms_eps)
        r = R.route(cfg, hn @ w_cpu.w_gate.float().t(), w_cpu.gate_bias)
        mismatches = ties = 0
        ids_l, ref_l = ids.tolist(), r.ids.tolist()
        for t in range(b):
            if set(ids_l[t]) == set(ref_l[t]):
                continue
            top = r.masked_scores[t].topk(cfg.top_k + 1).values
            if float(top[cfg.top_k - 1] - top[cfg.top_k]) <= TIE_TOL:
                ties += 1
            else:
                mismatches += 1
        moe = R.moe_stage(cfg, w_cpu, h1.float(), ids=ids)
        order = ids.argsort(1)
        w_path = weights.gather(1, order)
        w_ref = moe.routing.weights.gather(1, order)
    return StepCheck(
        batch=b,
        h1_err=rel_err(h1, full.h1),
        cache_err=rel_err(entry, full.cache_entry),
        out_err=rel_err(out, moe.out),
        weights_err=rel_err(w_path, w_ref),
        e2e_err=rel_err(out, full.out),
        expert_mismatches=mismatches,
        tie_excused=ties,
        all_written=written,
    )

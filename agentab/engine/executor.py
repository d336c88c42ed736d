"""SimExecutor: the duration of a scheduled step, from a HardwareProfile.

Decode-only steps (every row decoding or verifying) run on the step's path:
    fixed[path] + layers * layer_time[path](padded tokens) + context tokens * kv_read + drafter.
Steps with prefill tokens run the standard path, and the mixed-step rule is additive: the decode
part priced as above at the step's total token count (clipped at the table's end, unpadded), plus
compute-bound prefill (tokens / (tokens_per_s_per_gpu * gpu_count)) plus causal attention FLOPs of
the prefill chunks over their context. The drafter's cost is added to every step that has a
decoding row when speculative decoding is on.
"""

from __future__ import annotations

import numpy as np

from agentab.engine.profile import HardwareProfile
from agentab.engine.scheduler import StepPlan, WindowPlan


class SimExecutor:
    """Prices steps; holds no state, so one profile can price any number of engines."""

    def __init__(self, profile: HardwareProfile, num_draft_tokens: int = 0) -> None:
        self.profile = profile
        self.k = num_draft_tokens
        self.kv_us = profile.kv_read_us_per_context_token()
        self.prefill_us_per_token = 1e6 / (profile.prefill_tokens_per_s_per_gpu * profile.gpu_count)
        self.attn_us_per_pair = (
            1e6
            * profile.attention_flops_per_token_pair
            / (profile.attention_flops_per_s_per_gpu * profile.gpu_count)
        )
        self._base_cache: dict[tuple[str, int], float] = {}

    def decode_base_us(self, path: str, tokens: int) -> float:
        """Fixed + per-layer cost of a decode step of `tokens` (padded) tokens on `path`."""
        key = (path, tokens)
        base = self._base_cache.get(key)
        if base is None:
            table = self.profile.table(path)
            t = min(tokens, table.max_tokens)
            base = table.step_fixed_us + self.profile.num_layers * table.layer_us(t)
            if self.k:
                base += self.profile.drafter_step_us
            self._base_cache[key] = base
        return base

    def step_seconds(self, plan: StepPlan) -> float:
        if plan.total_tokens == 0:
            return 0.0
        dec = plan.is_decode
        ctx = plan.decode_context_tokens
        if dec.all():
            return (self.decode_base_us(plan.path, plan.padded_tokens) + self.kv_us * ctx) * 1e-6
        table = self.profile.standard
        t = min(plan.total_tokens, table.max_tokens)
        us = table.step_fixed_us + self.profile.num_layers * table.layer_us(t)
        if self.k and dec.any():
            us += self.profile.drafter_step_us
        pre = ~dec
        n = plan.num_sched[pre].astype(np.float64)
        c0 = plan.computed_before[pre].astype(np.float64)
        pairs = float((n * c0 + n * (n + 1) / 2).sum())
        us += self.kv_us * ctx + self.prefill_us_per_token * float(n.sum())
        us += self.attn_us_per_pair * pairs
        return us * 1e-6

    def window_seconds(self, w: WindowPlan) -> np.ndarray:
        """Durations of each step of a pure-decode window (same formula as step_seconds)."""
        base = self.decode_base_us(w.path, w.padded_tokens)
        return (base + self.kv_us * w.context) * 1e-6

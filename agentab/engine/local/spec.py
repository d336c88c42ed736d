"""Speculative decoding on the local engine: the drafter, and the verification of its drafts.

A verify step of a row is 1 + d tokens at positions p..p+d: its last sampled token t_p and d
drafts (the scheduler plans d = k, or fewer when the token budget runs short). The scheduler
knows only counts; the drafts' values are made inside the step, where the model is:

1. **Draft** (`EarlyExitDrafter.propose`): the target's first `draft_layers` layers, then its
   final norm and LM head, run d times on one token per row (t_p, then each draft in turn),
   greedy. Why this drafter: its work is a real decoder layer per draft token (the cost of an
   MTP or EAGLE head run k times, k small GEMM-bound forwards), it needs no weights or KV cache
   of its own (its layers' KV at earlier positions is the target's, computed by the target for
   the same tokens), and at `draft_layers` = the model's depth it *is* the target, which gives
   the self-drafting check (every draft accepted). A parallel (DSpark-style) head would cost
   one forward but needs a trained head to make drafts worth verifying; a random model has none.
   The drafter writes its layers' KV at p..p+d-1; the verify step overwrites all of them.
   It runs on the standard path in both decode arms, so its work is the same in both.
2. **Verify**: the step runs the target over all rows' tokens (a verify row's queries causal
   within the step, over its cached context), on the step's path, and takes the greedy token
   after every query of a verify row: g_0..g_d.
3. **Accept** (`accept`): `standard` accepts the leading drafts equal to the target's tokens
   (draft j is accepted iff it equals g_{j-1} and every earlier one was) and emits
   g_0..g_a, exactly the tokens plain greedy decoding gives. `synthetic` accepts a drafts by
   vLLM's synthetic method (`spec_decode.SpecConfig.accepted`, the simulator's very function)
   and emits, as vLLM does, the a accepted drafts and then the target's token g_a.

The rejected drafts' KV entries stay in their slots past the row's computed tokens; the
scheduler rolls its count back, so they are never read and the next step overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from agentab.engine.local.config import ModelConfig
from agentab.engine.local.forward import SINGLE, DeviceBatch, greedy, standard_forward
from agentab.engine.local.kv_cache import PagedLatentCache
from agentab.engine.local.model import ModelWeights
from agentab.engine.local.tensor_parallel import TPGroup
from agentab.engine.outputs import StepInputs, StepPlan
from agentab.engine.spec_decode import SpecConfig
from agentab.kernels.standard import StandardPath


@dataclass
class EarlyExitDrafter:
    """The target's first `layers` layers, final norm and LM head, as a drafter."""

    cfg: ModelConfig
    w: ModelWeights
    cache: PagedLatentCache
    layers: int
    dtype: torch.dtype
    grouped: list[StandardPath] | None = None
    tp: TPGroup = field(default_factory=lambda: SINGLE)

    def propose(
        self, inputs: StepInputs, rows: np.ndarray, drafts: np.ndarray, first: torch.Tensor
    ) -> torch.Tensor:
        """(len(rows), max drafts) draft tokens of the verify rows `rows` of the step, row i
        proposing `drafts[i]` of them (its later columns are 0) from its first token `first[i]`
        (a device tensor: the token may have been sampled on the device)."""
        device = first.device
        out = torch.zeros(len(rows), int(drafts.max()), dtype=torch.int64, device=device)
        p = inputs.positions[inputs.starts[rows]]
        tables = inputs.block_tables[rows]
        token = first
        for j in range(int(drafts.max())):
            live = np.flatnonzero(drafts > j)
            one = np.ones(len(live), dtype=np.int64)
            step = StepInputs.of_rows(p[live] + j, one, tables[live], one, inputs.block_size)
            b = DeviceBatch.of(step, device)
            b.token_ids = token if j == 0 else out[torch.from_numpy(live).to(device), j - 1]
            x = standard_forward(
                self.cfg, self.w, self.cache, b, self.dtype, self.grouped, self.tp,
                num_layers=self.layers,
            )  # fmt: skip
            ids = greedy(self.cfg, self.w, x, self.tp)
            out[torch.from_numpy(live).to(device), j] = ids
        return out


@dataclass
class VerifyLayout:
    """Where a step's drafts go in its flat batch and whose hidden states it samples from."""

    rows: np.ndarray  # the verify rows (drafts > 0), in plan order
    drafts: np.ndarray  # their draft counts
    draft_slots: torch.Tensor  # flat-batch index of every draft (row-major, d_i per row)
    out_index: torch.Tensor  # tokens whose greedy token is taken: all of a verify row's
    out_starts: np.ndarray  # (rows + 1,): each row's first entry in out_index

    @staticmethod
    def of(plan: StepPlan, inputs: StepInputs, device: torch.device) -> VerifyLayout:
        d = np.where(plan.is_decode, plan.drafts, 0).astype(np.int64)
        rows = np.flatnonzero(d > 0)
        starts = inputs.starts
        count = np.where(d > 0, d + 1, 1)  # a verify row's every query; else its last token
        out_starts = np.zeros(len(d) + 1, dtype=np.int64)
        np.cumsum(count, out=out_starts[1:])
        first = np.where(d > 0, starts[:-1], starts[1:] - 1)
        within = np.arange(int(out_starts[-1])) - np.repeat(out_starts[:-1], count)
        out_index = np.repeat(first, count) + within
        dr = d[rows]
        draft_at = np.repeat(starts[rows] + 1, dr) + (
            np.arange(int(dr.sum())) - np.repeat(np.cumsum(dr) - dr, dr)
        )
        return VerifyLayout(
            rows=rows,
            drafts=dr,
            draft_slots=torch.from_numpy(draft_at).to(device),
            out_index=torch.from_numpy(out_index).to(device),
            out_starts=out_starts,
        )


def accept(
    layout: VerifyLayout,
    plan: StepPlan,
    drafted: np.ndarray,
    target: np.ndarray,
    spec: SpecConfig,
    width: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(sampled (rows, width), accepted (rows,)) of a step from its drafts (`drafted`: the
    verify rows' (rows, max drafts)) and the target's greedy tokens (`target`, in
    `layout.out_index` order), by `spec`'s rejection method (see the module)."""
    n = len(plan.slots)
    sampled = np.zeros((n, width), dtype=np.int64)
    accepted = np.zeros(n, dtype=np.int64)
    starts = layout.out_starts
    sampled[:, 0] = target[starts[1:] - 1]  # a row without drafts: its last token's
    if not len(layout.rows):
        return sampled, accepted
    rows, d = layout.rows, layout.drafts
    if spec.synthetic:
        a = spec.accepted(plan.keys[rows], plan.spec_index[rows], d)
    else:
        a = np.zeros(len(rows), dtype=np.int64)
        for i, r in enumerate(rows.tolist()):
            g = target[starts[r] : starts[r] + d[i]]
            same = drafted[i, : d[i]] == g
            a[i] = d[i] if same.all() else int(np.argmin(same))
    for i, r in enumerate(rows.tolist()):
        g = target[starts[r] : starts[r + 1]]
        sampled[r, : a[i]] = drafted[i, : a[i]]  # (equal to g[:a] under standard)
        sampled[r, a[i]] = g[a[i]]
        accepted[r] = a[i]
    return sampled, accepted

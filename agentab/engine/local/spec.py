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
    first: np.ndarray  # each verify row's first token in the flat batch (its last sampled one)
    draft_at: np.ndarray  # flat-batch index of every draft (row-major, d_i per row)
    out_index_host: np.ndarray  # tokens whose greedy token is taken: all of a verify row's
    out_starts: np.ndarray  # (rows + 1,): each row's first entry in out_index
    device: torch.device

    # The eager verify step's device forms, made when it asks (the graphs' step needs none):
    # copies from pageable memory, which must never sit on the graphs' path.
    @property
    def draft_slots(self) -> torch.Tensor:
        """`draft_at` on the device."""
        return torch.from_numpy(self.draft_at).to(self.device)

    @property
    def out_index(self) -> torch.Tensor:
        """`out_index_host` on the device."""
        return torch.from_numpy(self.out_index_host).to(self.device)

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
            first=starts[rows],
            draft_at=draft_at,
            out_index_host=out_index,
            out_starts=out_starts,
            device=device,
        )

    @property
    def draft_at_rows(self) -> np.ndarray:
        """(verify rows, most drafts): the flat-batch index of draft j of each row, -1 past the
        row's own drafts."""
        j = np.arange(int(self.drafts.max()) if len(self.drafts) else 0)
        at = self.first[:, None] + 1 + j[None, :]
        return np.where(j[None, :] < self.drafts[:, None], at, -1)


def greedy_accepted(drafted: np.ndarray, target: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """Drafts accepted per verify row under `standard` (greedy) verification: the leading
    drafts equal to the target's tokens. `drafted[i, j]` is row i's draft j; `target[i, j]`
    the target's greedy token after the row's query j (so draft j is checked against
    `target[i, j]`, the token the target would emit in its place)."""
    a = np.zeros(len(drafts), dtype=np.int64)
    for i, d in enumerate(drafts.tolist()):
        same = drafted[i, :d] == target[i, :d]
        a[i] = d if same.all() else int(np.argmin(same))
    return a


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
        width = int(d.max())
        g = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows.tolist()):
            g[i, : d[i]] = target[starts[r] : starts[r] + d[i]]
        a = greedy_accepted(drafted, g, d)
    for i, r in enumerate(rows.tolist()):
        g = target[starts[r] : starts[r + 1]]
        sampled[r, : a[i]] = drafted[i, : a[i]]  # (equal to g[:a] under standard)
        sampled[r, a[i]] = g[a[i]]
        accepted[r] = a[i]
    return sampled, accepted


def graph_accepted(
    layout: VerifyLayout, plan: StepPlan, spec: SpecConfig, src: torch.Tensor, tokens: int
) -> np.ndarray:
    """Drafts accepted per row of a verify step run in graphs (0 for rows without drafts).

    `src` is the device's `[target's greedy token after every token of the step | the token
    pool's draft entries]`, both indexed by the flat batch. `synthetic` draws from the rows'
    keys alone (no device data, so the host never waits); `standard` reads `src` back."""
    accepted = np.zeros(len(plan.slots), dtype=np.int64)
    rows, d = layout.rows, layout.drafts
    if spec.synthetic:
        accepted[rows] = spec.accepted(plan.keys[rows], plan.spec_index[rows], d)
        return accepted
    host = src.cpu().numpy()
    at = layout.draft_at_rows
    own = at >= 0
    drafted = np.where(own, host[tokens + np.where(own, at, 0)], 0)
    target = np.where(own, host[np.where(own, at - 1, 0)], 0)  # the token after query j
    accepted[rows] = greedy_accepted(drafted, target, d)
    return accepted


def sampled_index(
    starts: np.ndarray, layout: VerifyLayout, accepted: np.ndarray, width: int, tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """Where each row's emitted tokens are in `graph_accepted`'s `src`: (rows, width) (entry j
    of row i for j <= accepted[i]; later entries 0, never read) and each row's last emitted
    token (the next step's pending token). A verify row emits its a accepted drafts, then the
    target's token after its query a; a decode row the target's token after its one token."""
    n = len(starts) - 1
    index = np.zeros((n, width), dtype=np.int64)
    emit = starts[1:] - 1  # a decode row: its only token
    index[:, 0] = emit
    for i, r in enumerate(layout.rows.tolist()):
        a, first = int(accepted[r]), int(layout.first[i])
        index[r, :a] = tokens + first + 1 + np.arange(a)
        index[r, a] = first + a
        emit[r] = first + a
    return index, emit

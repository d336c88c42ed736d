"""The decoder layer's shape: a DeepSeek-V3 / Kimi-K2-shaped MLA + MoE layer, and its presets.

One `LayerConfig` drives everything in `agentab.kernels`: the weights, the fp32 reference, the
standard path, the CuTe DSL path and the byte counts that turn measured microseconds into a
fraction of the HBM roofline. It is plain Python (no torch), so the CLI can list presets and
count bytes on any machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from agentab.errors import AgentabError

BF16_BYTES = 2
HBM_ROOFLINE_BYTES_PER_S = 4.3e12  # the H200's measured copy bandwidth (docs/kernels.md)


@dataclass(frozen=True)
class LayerConfig:
    """Every size of one decoder layer, as one tensor-parallel rank holds it.

    MLA follows DeepSeek-V3: queries go through a low-rank `q_lora` bottleneck; keys and values
    live in a latent cache of `kv_lora + qk_rope` values per token, and decode runs in the
    absorbed form (the key up-projection is folded into the query, the value up-projection is
    applied after attention). The MoE has `n_shared` shared experts and `top_k` of `n_experts`
    routed experts, sigmoid scores plus a correction bias, grouped top-k (`n_group` groups, keep
    `topk_group`), renormalized weights times `routed_scaling`.
    """

    name: str
    hidden: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    n_heads: int  # heads on this rank
    n_experts: int
    top_k: int
    moe_inter: int  # routed expert intermediate size on this rank
    n_shared: int
    shared_inter: int  # shared expert intermediate size on this rank
    n_group: int
    topk_group: int
    routed_scaling: float
    rms_eps: float = 1e-6
    rope_theta: float = 50000.0

    @property
    def qk_head(self) -> int:
        """Query/key width per head before absorption (nope + rope)."""
        return self.qk_nope + self.qk_rope

    @property
    def kv_width(self) -> int:
        """Values per token in the latent cache: the compressed kv plus the shared rope key."""
        return self.kv_lora + self.qk_rope

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head): the scale of the unabsorbed attention, which absorption preserves."""
        return float(self.qk_head) ** -0.5

    def dense_weight_elems(self) -> int:
        """Weights every token reads whatever the routing: norms, MLA, router, shared expert."""
        h, nh = self.hidden, self.n_heads
        return (
            2 * h  # attention norm and ffn norm
            + 2 * self.n_experts  # router correction bias (fp32: two bf16-sized elements each)
            + self.q_lora * h  # q_a
            + self.kv_width * h  # kv_a (compressed kv + rope key)
            + self.q_lora
            + self.kv_lora  # the two low-rank norms
            + nh * self.qk_head * self.q_lora  # q_b
            + nh * self.qk_nope * self.kv_lora  # W_UK (absorbed into the query)
            + nh * self.v_head * self.kv_lora  # W_UV (applied after attention)
            + h * nh * self.v_head  # o_proj
            + self.n_experts * h  # router gate
            + self.n_shared * 3 * self.shared_inter * h  # shared expert(s)
        )

    def expert_weight_elems(self) -> int:
        """One routed expert: gate and up (2 * inter x hidden) and down (hidden x inter)."""
        return 3 * self.moe_inter * self.hidden

    def expected_touched_experts(self, tokens: int) -> float:
        """Distinct experts touched by `tokens` uniformly routed tokens: E (1 - (1 - k/E)^T)."""
        e, k = self.n_experts, self.top_k
        return e * (1.0 - (1.0 - k / e) ** tokens)

    def step_bytes(self, batch: int, context: int, touched_experts: float | None = None) -> float:
        """The fewest HBM bytes one decode step of this layer must move.

        Each weight that the step touches is read once (bf16), the latent cache of every
        sequence is read once (`context` tokens each) and the new latent entry written once;
        activations are counted too (input read, output written), though they are small.
        """
        touched = (
            self.expected_touched_experts(batch) if touched_experts is None else touched_experts
        )
        weights = (self.dense_weight_elems() + touched * self.expert_weight_elems()) * BF16_BYTES
        kv = batch * (context * self.kv_width + self.kv_width) * BF16_BYTES
        acts = 2 * batch * self.hidden * BF16_BYTES
        return float(weights + kv + acts)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


PRESETS: dict[str, LayerConfig] = {
    # Seconds on a CPU: every code path (grouped top-k with several groups included) at toy sizes.
    "tiny": LayerConfig(
        name="tiny",
        hidden=256,
        q_lora=64,
        kv_lora=64,
        qk_nope=32,
        qk_rope=16,
        v_head=32,
        n_heads=4,
        n_experts=16,
        top_k=4,
        moe_inter=32,
        n_shared=1,
        shared_inter=32,
        n_group=4,
        topk_group=2,
        routed_scaling=2.5,
    ),
    # One TP8 rank's shard of a Kimi-K2 layer: 16 of 128 heads, moe_intermediate 2048 / 8,
    # one shared expert (intermediate 2048 / 8), 384 experts top-8, n_group 1 (Kimi-K2's config),
    # routed_scaling_factor 2.827. YaRN rope scaling is left out: plain RoPE, theta 50000.
    "k2-tp8-shard": LayerConfig(
        name="k2-tp8-shard",
        hidden=7168,
        q_lora=1536,
        kv_lora=512,
        qk_nope=128,
        qk_rope=64,
        v_head=128,
        n_heads=16,
        n_experts=384,
        top_k=8,
        moe_inter=256,
        n_shared=1,
        shared_inter=256,
        n_group=1,
        topk_group=1,
        routed_scaling=2.827,
    ),
}


def get_preset(name: str) -> LayerConfig:
    """The preset called `name`, or an AgentabError that lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise AgentabError(f"--preset: unknown preset {name!r} (known: {known})") from None

"""The seed's headline configuration on our engine: B/A of decode throughput, with intervals,
beside the published figures.

Reads the H200 measurement (`scripts/gpu/local_engine.py`, stage `spec`, headline part:
k2-tp8-shard at 61 layers on one H200, one request at a time, a 1-token prompt, 1,000 tokens
out, 7 drafts by a 1-layer early-exit drafter, synthetic acceptance length 6, and the same
without drafts; three repeats per backend in ABBA order) and prints, for each configuration,
decode tokens/s after the first token per backend, B/A = latency_specialized / auto with a
95% t interval over the repeats' log ratios, and the published figure of the seed's post
(Kimi K3 on GB300, TP16: DSpark 842 vs 488 tok/s = 1.73x; non-speculative batch 1: 1.88x).
Those are another model on other hardware; ours is one tensor-parallel rank's shard of the
model on one H200, so the ratios say how our two decode paths compare, not how the post's do.

    python benchmarks/spec_headline.py [benchmarks/results/local-engine-h200/spec-headline-c1.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from agentab.analysis.intervals import t_quantile

DEFAULT = Path(__file__).parent / "results/local-engine-h200/spec-headline-c1.json"
PUBLISHED = {  # (label, the post's B/A, how the post states it)
    "spec_k7_synthetic_6": (
        "DSpark k=7, synthetic acceptance 6",
        842.0 / 488.0,
        "842 vs 488 tok/s",
    ),
    "no_spec": ("no speculative decoding, batch 1", 1.88, "1.88x"),
}


def ratio_interval(
    a: list[float], b: list[float], level: float = 0.95
) -> tuple[float, float, float]:
    """B/A as the geometric mean of the repeats' ratios, and its t interval (paired repeats)."""
    logs = np.log(np.asarray(b) / np.asarray(a))
    n = len(logs)
    half = t_quantile(0.5 + level / 2, n - 1) * logs.std(ddof=1) / np.sqrt(n)
    mid = logs.mean()
    return float(np.exp(mid)), float(np.exp(mid - half)), float(np.exp(mid + half))


def main(path: Path) -> int:
    data = json.loads(path.read_text())
    print(f"{path} ({data['device']}, {data['output_tokens']} tokens out, "
          f"{data['repeats']} repeats per backend)")  # fmt: skip
    print(
        "| configuration | auto tok/s | latency_specialized tok/s | B/A (95% CI) | published B/A |"
    )
    print("|---|---|---|---|---|")
    for key, (label, published, stated) in PUBLISHED.items():
        row = data[key]
        a, b = row["auto_tokens_per_s"], row["specialized_tokens_per_s"]
        mid, lo, hi = ratio_interval(a, b)
        print(f"| {label} | {np.mean(a):.1f} | {np.mean(b):.1f} | {mid:.3f} ({lo:.3f}-{hi:.3f}) "
              f"| {published:.2f}x ({stated}; GB300 TP16) |")  # fmt: skip
    spec, plain = data["spec_k7_synthetic_6"], data["no_spec"]
    for backend, key in (
        ("auto", "auto_tokens_per_s"),
        ("latency_specialized", "specialized_tokens_per_s"),
    ):
        gain = np.mean(spec[key]) / np.mean(plain[key])
        print(f"speculative decoding's gain on {backend}: {gain:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT))

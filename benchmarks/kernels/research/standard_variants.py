"""The compiled standard layer at three code versions, side by side in one process (GPU).

Separates what two changes to the standard path cost or gained: `old` is
`agentab/kernels/standard_compiled.py` and `triton_moe.py` of commit 0f8a626 (W_UV applied by
inductor's bmm, the register-only MoE alignment), `mid` the old layer with the current MoE
alignment, `new` the current layer. Per variant and batch size: one-layer time in a CUDA graph of
4 layers with their own weights (median of 200 replays) and the kernels' device times. Make the
two old copies next to this file first (their custom ops renamed so all three register):

    d=benchmarks/kernels/research
    git show 0f8a626:agentab/kernels/triton_moe.py | sed 's/agentab::/agentabold::/g' \
      > $d/triton_moe_old.py
    git show 0f8a626:agentab/kernels/standard_compiled.py | sed -e 's/agentab::/agentabold::/g' \
      -e 's/torch\\.ops\\.agentab\\./torch.ops.agentabold./g' \
      -e 's/import agentab.kernels.triton_moe  # noqa: F401/import triton_moe_old  # noqa: F401/' \
      > $d/standard_compiled_old.py
    git show 0f8a626:agentab/kernels/standard_compiled.py \
      | sed -e 's/agentab::mla_attention/agentabmid::mla_attention/g' \
      -e 's/torch\\.ops\\.agentab\\.mla_attention/torch.ops.agentabmid.mla_attention/g' \
      > $d/standard_compiled_mid.py
    cp -r agentab/kernels/moe_configs $d/
    source .gpu/setup.sh && python3 $d/standard_variants.py     # writes $OUT/diag.json

Measured output: benchmarks/results/kernels-h200-standard-paths/variants-diag.json.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import standard_compiled_mid as mid
import standard_compiled_old as old
import torch

from agentab.kernels import standard_torch_compile as new
from agentab.kernels.config import get_preset
from agentab.kernels.harness import capture, kernel_times, time_replays
from agentab.kernels.weights import init_state, init_weights

torch._dynamo.config.cache_size_limit = 64
cfg = get_preset("k2-tp8-shard")
dev = "cuda"
ws = [init_weights(cfg, 1 + i, dev) for i in range(4)]
out = {}
for batch in (1, 8, 64):
    x = torch.randn(batch, cfg.hidden, device=dev).bfloat16()
    for name, mod in (("old", old), ("mid", mid), ("new", new)):
        states = [init_state(cfg, batch, 4096, 7 + i, dev) for i in range(4)]
        # the class was CompiledStandardPath in the two older versions
        cls = getattr(mod, "TorchCompileStandardPath", None) or mod.CompiledStandardPath
        paths = [cls(cfg, w, max_position=4096) for w in ws]

        def step(paths=paths, states=states, x=x):
            h = x
            for p, s in zip(paths, states, strict=True):
                h = p.step(h, s).out
            return h

        g, _ = capture(step)
        # time_replays' median is in seconds per replay of 4 layers; the JSON keeps that x 1e6 / 4
        # under "us_per_layer" scaled by a further 1e6 (divide by 1e6 to read microseconds)
        t = time_replays(g, iters=200)["median"] / 4 * 1e6
        kt = kernel_times(
            lambda paths=paths, states=states, x=x: paths[0].step(x, states[0]), reps=20
        )
        out[f"{name}-{batch}"] = {
            "us_per_layer": t,
            "kernels": [(k, round(us, 2), n) for k, us, n in kt],
        }
        print(f"batch {batch:3d} {name}: {t:7.1f}, {sum(n for _, _, n in kt)} kernels", flush=True)
        for k, us, n in kt:
            if "sum" in k or "align" in k or "moe_gemm" in k or "clone" in k:
                print(f"     {us:8.2f} x{n} {k[:70]}")
with open(os.environ.get("OUT", ".") + "/diag.json", "w") as f:
    json.dump(out, f, indent=1)

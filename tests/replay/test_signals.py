"""A replay process killed or interrupted mid-run leaves a readable, honest run dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from agentab.errors import AgentabError
from agentab.replay import ReplayOptions
from agentab.replay.api import run_to_dir
from agentab.replay.targets.base import Outcome, RequestSpec
from agentab.replay.targets.recorded import RecordedTarget
from agentab.rundir import scan_records
from agentab.workloads import save
from agentab.workloads.model import Request, Session, Workload

from .fault_server import FaultServer, node_of


def _workload(path: Path, *, turns: int, out: int) -> Path:
    wl = Workload(
        tuple(
            Session(
                f"s{i}",
                16,
                tuple(
                    Request(
                        t=0.001 * k, in_tokens=50, out_tokens=out, hash_ids=(1, 2, 3), api_time=0.0
                    )
                    for k in range(turns)
                ),
            )
            for i in range(4)
        )
    )
    save(wl, path)
    return path


# `python -m agentab` in a process that was started with SIGINT ignored, as a shell script's
# background job (`agentab ... &`) or a `nohup` one is.
_SIGINT_IGNORED = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "from agentab.cli import main; main(sys.argv[1:])"
)


def _replay(
    wl: Path, url: str, out: Path, *, sigint_ignored: bool = False
) -> subprocess.Popen[str]:
    python = (
        [sys.executable, "-c", _SIGINT_IGNORED]
        if sigint_ignored
        else [sys.executable, "-m", "agentab"]
    )
    cmd = [
        *python,
        "replay",
        str(wl),
        "--url",
        url,
        "--out",
        str(out),
        "--concurrency",
        "4",
        "--start-window",
        "0",
        "0",
        "--warmup-requests",
        "0",
        "--duration",
        "0",
        "--passes",
        "1",
        "--quiet",
    ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _wait_for(cond: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


@pytest.mark.slow
def test_sigkill_leaves_every_request_finished_a_second_before(tmp_path: Path) -> None:
    wl = _workload(tmp_path / "wl.jsonl", turns=400, out=10)
    out = tmp_path / "run"
    with FaultServer(token_interval_s=0.002) as srv:
        proc = _replay(wl, srv.url, out)
        try:
            first = None

            def running_a_while() -> bool:
                nonlocal first
                if srv.finished and first is None:
                    first = time.monotonic()
                return first is not None and time.monotonic() - first > 3.0

            _wait_for(running_a_while)
            killed_at = time.monotonic()
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        finished = dict(srv.finished)
    assert proc.returncode == -signal.SIGKILL
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "running"  # it never got to write its outcome
    df = scan_records(out).collect()
    recorded = set(df["request_id"].to_list())
    due = {rid for rid, t in finished.items() if t < killed_at - 1.0}
    assert len(due) > 50
    assert due <= recorded, sorted(due - recorded)[:5]
    assert df["error_class"].null_count() == df.height
    # Analysis recognises the run as unfinished and refuses it in one line.
    report = subprocess.run(
        [sys.executable, "-m", "agentab", "report", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 2
    assert report.stderr == (
        f"agentab: error: {out} (running: never finalised (its process is gone: killed or "
        "crashed)): refusing to report on an unfinished run (pass --allow-incomplete to use it "
        "anyway)\n"
    )


def _interrupt(tmp_path: Path, sig: signal.Signals) -> None:
    # Every lane's third request (node 2) stops after HELD chunks and waits. The signal goes out
    # only once all 4 are held and the client has read every byte of them (the server's sends
    # acknowledged, the client's socket empty): the loop then queued the reader tasks' wakeups
    # before the signal existed, so each cancelled record holds exactly HELD chunks.
    held_chunks = 3
    wl = _workload(tmp_path / "wl.jsonl", turns=50, out=50)
    out = tmp_path / "run"
    with FaultServer(
        token_interval_s=0.005, hold_after=lambda rid: held_chunks if node_of(rid) == 2 else 0
    ) as srv:
        proc = _replay(wl, srv.url, out)
        try:
            _wait_for(
                lambda: len(srv.held) == 4 and all(map(srv.client_drained, srv.held.values()))
            )
            proc.send_signal(sig)
            _stdout, stderr = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
        seen = list(srv.seen)
        held = set(srv.held)
        finished = set(srv.finished)
    assert proc.returncode == 128 + sig, stderr
    assert held == {f"L{lane}-P0-N2" for lane in range(4)}
    assert len(finished) == 8 and len(seen) == 12
    df = scan_records(out).collect()
    cancelled = df.filter(pl.col("error_class") == "cancelled")
    assert set(cancelled["request_id"]) == held
    assert (
        f"agentab: error: interrupted by {sig.name}; 4 in-flight request(s) recorded as "
        "cancelled" in stderr
    )
    assert "Traceback" not in stderr
    # Every request the server saw has a record; the cancelled ones kept their partial chunks.
    assert sorted(seen) == sorted(df["request_id"].to_list())
    assert cancelled["chunk_times_s"].list.len().to_list() == [held_chunks] * 4
    done = df.filter(pl.col("error_class").is_null())
    assert set(done["request_id"]) == finished
    assert done["chunk_times_s"].list.len().to_list() == [50] * 8
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    assert manifest["stats"]["cancelled"] == 4
    assert manifest["stats"]["errors"] == 0


@pytest.mark.slow
def test_sigint_records_in_flight_as_cancelled(tmp_path: Path) -> None:
    _interrupt(tmp_path, signal.SIGINT)


@pytest.mark.slow
def test_sigterm_records_in_flight_as_cancelled(tmp_path: Path) -> None:
    _interrupt(tmp_path, signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize("gap_s", [0.0, 0.0002, 0.001, 0.05])
def test_two_sigints_in_a_row_still_finish_the_run_dir(tmp_path: Path, gap_s: float) -> None:
    """A user who presses Ctrl-C twice: the second one arrives before the loop has acted on the
    first (gaps of 0-1 ms; a repeat pending while handlers were swapped would meet Python's
    default one), while the first is being handled (records flushed, sessions closed) or after.
    The run dir must still end `interrupted`, with no traceback and no unclosed HTTP session.
    (A signal that comes after everything is written may still end the process by the default
    action: status -SIGINT.)"""
    wl = _workload(tmp_path / "wl.jsonl", turns=50, out=50)
    out = tmp_path / "run"
    with FaultServer(
        token_interval_s=0.005, hold_after=lambda rid: 3 if node_of(rid) == 2 else 0
    ) as srv:
        proc = _replay(wl, srv.url, out)
        try:
            _wait_for(lambda: len(srv.held) == 4)
            proc.send_signal(signal.SIGINT)
            time.sleep(gap_s)
            proc.send_signal(signal.SIGINT)
            _stdout, stderr = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode in (128 + signal.SIGINT, -signal.SIGINT), stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted", stderr
    assert "Traceback" not in stderr and "Unclosed client session" not in stderr
    assert "interrupted by SIGINT; 4 in-flight request(s) recorded as cancelled" in stderr


class _SignalAtTheLastAnswer(RecordedTarget):
    """Recorded timing; raises SIGINT in this thread as the last request's answer is handed
    back, so the signal is handled in the run's last loop iteration, before it has returned.
    Raised there and then, not scheduled with `call_soon` (the loop may end before running
    the callback, and no signal comes at all) nor sent with `os.kill` (a process-directed
    signal may land on the record writer's thread, and Python then runs the handler at a
    later instruction, which can fall after the run gave the handlers back)."""

    def __init__(self, requests: int) -> None:
        super().__init__()
        self.left = requests

    async def send(self, spec: RequestSpec, out: Outcome) -> None:
        await super().send(spec, out)
        self.left -= 1
        if self.left == 0:
            signal.raise_signal(signal.SIGINT)


def test_a_signal_as_the_run_ends_is_not_lost(tmp_path: Path) -> None:
    """The handler runs between two bytecodes, and the loop acts on it one iteration later; a
    signal handled in the loop's last iteration must still end the run (and so the command)
    as interrupted, and leave Python's handler as it was before the run for what comes next."""
    wl = Workload(
        (Session("s0", 16, tuple(Request(t=0.0, in_tokens=50, out_tokens=4, hash_ids=(1,),
                                         api_time=0.01) for _ in range(3))),)
    )  # fmt: skip
    started_with = signal.getsignal(signal.SIGINT)
    if started_with is signal.SIG_IGN:
        # A shell's background job starts with SIGINT ignored and a run leaves it so, as
        # test_a_process_started_with_sigint_ignored_keeps_ignoring_it checks; this test is
        # about a process that takes the signal.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    options = ReplayOptions(start_window=(0.0, 0.0), warmup_requests=0, duration_s=None, passes=1)
    with pytest.raises(AgentabError, match="interrupted by SIGINT; 0 in-flight") as err:
        run_to_dir(
            wl, _SignalAtTheLastAnswer(3), replay=options, out_dir=tmp_path / "run",
            virtual=True, progress=False,
        )  # fmt: skip
    assert err.value.exit_code == 128 + signal.SIGINT
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    assert manifest["stats"]["finished"] == 3 and manifest["stats"]["cancelled"] == 0
    # A signalled run keeps its handler (the run dir is written under it); it only notes repeats.
    assert signal.getsignal(signal.SIGINT) is not before[signal.SIGINT]
    for sig, handler in before.items():
        signal.signal(sig, handler)
    signal.signal(signal.SIGINT, started_with)


def test_an_unsignalled_run_gives_the_handlers_back(tmp_path: Path) -> None:
    request = Request(t=0.0, in_tokens=50, out_tokens=4, hash_ids=(1,))
    wl = Workload((Session("s0", 16, (request,)),))
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    options = ReplayOptions(start_window=(0.0, 0.0), warmup_requests=0, duration_s=None, passes=1)
    run_to_dir(wl, RecordedTarget(), replay=options, out_dir=tmp_path / "run", virtual=True,
               progress=False)  # fmt: skip
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@pytest.mark.slow
def test_a_process_started_with_sigint_ignored_keeps_ignoring_it(tmp_path: Path) -> None:
    """The terminal's Ctrl-C is not meant for a background job: it does not stop the run, and
    SIGTERM still does, with the run dir finished as for any interrupt."""
    wl = _workload(tmp_path / "wl.jsonl", turns=50, out=50)
    out = tmp_path / "run"
    with FaultServer(
        token_interval_s=0.005, hold_after=lambda rid: 3 if node_of(rid) == 2 else 0
    ) as srv:
        proc = _replay(wl, srv.url, out, sigint_ignored=True)
        try:
            _wait_for(lambda: len(srv.held) == 4)
            proc.send_signal(signal.SIGINT)
            time.sleep(1.0)
            assert proc.poll() is None
            proc.send_signal(signal.SIGTERM)
            _stdout, stderr = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted by SIGTERM; 4 in-flight request(s) recorded as cancelled" in stderr
    assert json.loads((out / "manifest.json").read_text())["status"] == "interrupted"

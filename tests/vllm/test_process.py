"""Process-group lifecycle with a small real server (fast; the vLLM-marked tests repeat the
important cases against the real vLLM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agentab.engine.vllm import attached_server
from agentab.engine.vllm.process import ServerProcess, free_port, group_members, port_is_free
from agentab.errors import AgentabError

TINY = str(Path(__file__).with_name("tiny_server.py"))
REPO = Path(__file__).resolve().parents[2]


def start(tmp_path: Path, *flags: str, grace: float = 10.0) -> ServerProcess:
    port = free_port()
    return ServerProcess(
        [sys.executable, TINY, str(port), *flags],
        env={},
        log_path=tmp_path / "server.log",
        host="127.0.0.1",
        port=port,
        stop_grace_s=grace,
    )


def wait_until(predicate, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_start_healthy_stop_leaves_nothing(tmp_path: Path) -> None:
    server = start(tmp_path, "--child")
    server.wait_healthy(30)
    assert wait_until(lambda: len(group_members(server.pgid)) == 2, 10)  # leader + grandchild
    assert not port_is_free("127.0.0.1", server.port)
    server.stop()
    assert group_members(server.pgid) == []
    assert port_is_free("127.0.0.1", server.port)
    assert server.guard.returncode == 0
    assert "listening on" in (tmp_path / "server.log").read_text()


def test_sigterm_ignored_gets_sigkill_after_grace(tmp_path: Path) -> None:
    server = start(tmp_path, "--child", "--ignore-term", grace=1.0)
    server.wait_healthy(30)
    assert wait_until(lambda: len(group_members(server.pgid)) == 2, 10)
    t0 = time.monotonic()
    server.stop()
    took = time.monotonic() - t0
    assert group_members(server.pgid) == []
    assert server.proc.returncode == -signal.SIGKILL
    assert took >= 1.0
    assert port_is_free("127.0.0.1", server.port)


def test_failed_start_reports_the_last_20_log_lines(tmp_path: Path) -> None:
    server = start(tmp_path, "--fail")
    with pytest.raises(AgentabError) as err:
        server.wait_healthy(30)
    server.stop()
    lines = str(err.value).splitlines()
    assert lines[0] == (
        f"vLLM server exited with status 3 before it was healthy; last 20 lines of "
        f"{tmp_path / 'server.log'}:"
    )
    assert lines[1:] == [f"  | startup line {i}" for i in range(11, 30)] + [
        "  | ValueError: no such model"
    ]


def test_a_server_that_died_in_use_is_named_with_its_log(tmp_path: Path) -> None:
    server = start(tmp_path)
    server.wait_healthy(30)
    cause = AgentabError("calibration request r-1 failed: broken_stream: Server disconnected")
    assert server.death(cause) is None  # alive: the caller's own error stands
    os.killpg(server.pgid, signal.SIGKILL)
    server.proc.wait(10)
    died = server.death(cause)
    server.stop()
    assert died is not None
    lines = str(died).splitlines()
    assert lines[0] == (
        f"vLLM server exited with status -9 while in use (calibration request r-1 failed: "
        f"broken_stream: Server disconnected); last 1 lines of {tmp_path / 'server.log'}:"
    )
    assert lines[1:] == [f"  | listening on {server.port}"]


def test_unhealthy_server_times_out_and_is_stopped(tmp_path: Path) -> None:
    server = start(tmp_path, "--never-healthy")
    t0 = time.monotonic()
    with pytest.raises(AgentabError, match=r"not healthy within 1.5 s \(startup_timeout_s\)"):
        server.wait_healthy(1.5)
    assert time.monotonic() - t0 < 5
    server.stop()
    assert group_members(server.pgid) == []


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from agentab.engine.vllm.process import ServerProcess, free_port
    port = free_port()
    server = ServerProcess([sys.executable, sys.argv[1], str(port), "--child"], env={},
                           log_path=Path(sys.argv[2]), host="127.0.0.1", port=port,
                           stop_grace_s=5.0)
    try:
        server.wait_healthy(30)
        print(server.pgid, port, flush=True)
        time.sleep(600)
    finally:
        server.stop()
    """
)


def holder(tmp_path: Path) -> tuple[subprocess.Popen[str], int, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, TINY, str(tmp_path / "server.log")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert proc.stdout is not None
    pgid, port = map(int, proc.stdout.readline().split())
    assert wait_until(lambda: len(group_members(pgid)) == 2, 10)
    return proc, pgid, port


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signal_to_the_holder_leaves_no_server(tmp_path: Path, sig: signal.Signals) -> None:
    proc, pgid, port = holder(tmp_path)
    os.kill(proc.pid, sig)
    code = proc.wait(timeout=30)
    expected = {signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGINT: -2, signal.SIGKILL: -9}
    assert code == expected[sig]
    # SIGINT: KeyboardInterrupt ran the finally, then Python re-raised the signal (-2).
    # SIGKILL: the guard process notices the closed pipe and stops the group.
    assert wait_until(lambda: group_members(pgid) == [], 15)
    assert wait_until(lambda: port_is_free("127.0.0.1", port), 10)


def test_attach_to_nothing_is_one_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with (
        pytest.raises(AgentabError, match=f"vllm attach: {url}/health does not answer"),
        attached_server(url, 1),
    ):
        pass

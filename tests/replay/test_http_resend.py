"""A request whose pooled connection the server closes before answering is sent again on a new
connection, flagged `resent`; anywhere else such a close stays a `broken_stream` (a real aiohttp
server in a thread: tests/replay/fault_server.py)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from agentab.calibrate.client import CalibrationTarget, LoadRequest
from agentab.replay.targets.base import WARNING_CLASSES, Outcome

from .fault_server import DROP, FaultServer


def _dropping(times: int, when: Callable[[str], bool]) -> tuple[Callable[[str], str], Counter[str]]:
    """A mode function that drops the first `times` arrivals of each request id `when` picks."""
    arrivals: Counter[str] = Counter()

    def mode_for(rid: str) -> str:
        arrivals[rid] += 1
        return DROP if when(rid) and arrivals[rid] <= times else "ok"

    return mode_for, arrivals


async def _send_all(url: str, ids: list[str], *, pause_s: float = 0.0) -> list[Outcome]:
    """Send `ids` one after another on one client: each reuses the connection the one before
    it (or the start's model discovery) left, unless `pause_s` outlasts the 0.2 s keep-alive."""
    target = CalibrationTarget(url, keepalive_s=0.2)
    await target.start()
    outs = []
    try:
        for rid in ids:
            await asyncio.sleep(pause_s)
            out = Outcome()
            await target.send(LoadRequest(rid, [1, 2, 3], 4), out)
            outs.append(out)
    finally:
        await target.close()
    return outs


def _summary(outs: list[Outcome]) -> list[tuple[str | None, str | None, int]]:
    return [(o.error_class, o.warning_class, len(o.chunk_times)) for o in outs]


def test_a_request_dropped_on_a_pooled_connection_is_sent_again_on_a_new_one() -> None:
    # N0 takes the connection the start's model discovery left (a whole JSON body, so it is
    # always pooled); a streamed response's connection is pooled only if its end was read
    mode_for, arrivals = _dropping(1, lambda rid: rid == "N0")
    with FaultServer(mode_for) as srv:
        outs = asyncio.run(_send_all(srv.url, ["N0", "N1"]))
    assert _summary(outs) == [(None, "resent", 4), (None, None, 4)]
    assert arrivals == Counter({"N0": 2, "N1": 1})
    message = outs[0].warning_message
    assert message is not None and message.startswith(
        "the server closed the pooled connection before answering (ServerDisconnectedError"
    )
    assert message.endswith("; sent again on a new one")
    assert "resent" in WARNING_CLASSES


def test_a_drop_on_a_new_connection_is_a_broken_stream() -> None:
    mode_for, arrivals = _dropping(1, lambda rid: rid == "N0")
    with FaultServer(mode_for) as srv:
        outs = asyncio.run(_send_all(srv.url, ["N0", "N1"], pause_s=0.4))
    assert _summary(outs) == [("broken_stream", None, 0), (None, None, 4)]
    assert outs[0].error_message == "ServerDisconnectedError: Server disconnected"
    assert arrivals == Counter({"N0": 1, "N1": 1})  # never sent twice


def test_a_resend_dropped_too_is_a_broken_stream_and_not_sent_a_third_time() -> None:
    mode_for, arrivals = _dropping(2, lambda rid: rid == "N0")
    with FaultServer(mode_for) as srv:
        outs = asyncio.run(_send_all(srv.url, ["N0", "N1"]))
    assert _summary(outs) == [("broken_stream", "resent", 0), (None, None, 4)]
    assert arrivals == Counter({"N0": 2, "N1": 1})


def test_a_pooled_connection_reset_after_the_head_is_not_sent_again() -> None:
    with FaultServer(lambda rid: "reset" if rid == "N0" else "ok") as srv:
        outs = asyncio.run(_send_all(srv.url, ["N0", "N1"]))
        seen = list(srv.seen)
    assert [(o.error_class, o.warning_class) for o in outs] == [
        ("broken_stream", None),
        (None, None),
    ]
    assert seen == ["N0", "N1"]

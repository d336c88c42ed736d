"""A request's lifecycle: its status, the transitions between statuses, and what it carries.

Why: the scheduler used to say where a request was by implication (a slot number >= 0, a
string set on finish); a reader had to know every place that changed one of them. Here a
request's status is one enum, as in vLLM's v1 `RequestStatus`, and `Request.move_to` is the
only way to change it: it refuses a transition the lifecycle does not have, so a scheduler bug
shows up where it happens rather than as a request that never finishes. The scheduler makes
each transition in one method (docs/engine.md, "Request lifecycle"):

    WAITING ---admit---> RUNNING ---finish---> FINISHED_LENGTH (or FINISHED_STOPPED)
       ^                  |   ^
       |                  |   +---admit---+
       |               preempt            |
       |                  v               |
       |              PREEMPTED ----------+
       +--- any unfinished status ---abort---> FINISHED_ABORTED

A preempted request waits at the head of the waiting queue (recompute preemption) and keeps
its progress (`num_output`, its verify counter); a finished request has left the scheduler.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import numpy as np

from agentab.engine.spec_decode import request_key
from agentab.errors import AgentabError

if TYPE_CHECKING:
    from agentab.engine.types import PromptPrefix


class RequestStatus(enum.IntEnum):
    """Where a request is in its lifecycle (the FINISHED_* ones say why it ended)."""

    WAITING = 0  # queued, never admitted
    RUNNING = 1  # holds a slot of the running set and KV blocks
    PREEMPTED = 2  # was running; its blocks were freed, it waits to be admitted again
    FINISHED_LENGTH = 3  # generated max_tokens
    FINISHED_STOPPED = 4  # the model ended it (a stop token); no engine here stops early yet
    FINISHED_ABORTED = 5  # the client aborted it, or the engine stopped

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_LENGTH

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish reason of a finished status ("length", "stop", "abort")."""
        return _REASONS.get(self)


_REASONS = {
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_ABORTED: "abort",
}

_FINISHED = frozenset(s for s in RequestStatus if s.is_finished)
TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED}),
    RequestStatus.RUNNING: frozenset({RequestStatus.PREEMPTED}) | _FINISHED,
    RequestStatus.PREEMPTED: frozenset({RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED}),
    **{s: frozenset() for s in _FINISHED},
}


class InvalidTransition(RuntimeError):
    """A status change the lifecycle does not have (a scheduler bug, never user input)."""


class Request:
    """One request's identity, its status and the state that survives preemption.

    While RUNNING, the request's progress lives in the scheduler's slot arrays (row `slot` of
    `slots.SlotState`); it is copied back here when the request leaves its slot.
    """

    __slots__ = (
        "_head",
        "_tokens",
        "cached_tokens",
        "chunk_parts",
        "hashes",
        "id",
        "key",
        "known",
        "max_tokens",
        "num_output",
        "num_preemptions",
        "pending_row",
        "pending_step",
        "prompt_len",
        "raw_hash",
        "since",
        "sink",
        "slot",
        "spec_index",
        "status",
    )

    def __init__(
        self,
        request_id: str,
        tokens: np.ndarray,
        prompt_len: int,
        max_tokens: int,
        draw_id: str | None = None,
    ):
        self.id = request_id
        self.key = request_key(request_id if draw_id is None else draw_id)
        self.status = RequestStatus.WAITING
        self._tokens = tokens  # prompt, then the output (synthetic ids, or as sampled)
        self._head: np.ndarray | None = None  # the prompt's first ids, kept apart (defer_prompt)
        self.hashes: np.ndarray = np.zeros(0, dtype=np.uint64)  # keys of the full blocks known
        self.raw_hash = 0  # the chained hash value after the last hashed block
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.num_output = 0
        self.known = prompt_len  # tokens whose values are known (a real model's sampled output)
        self.cached_tokens = -1
        self.num_preemptions = 0
        self.slot = -1  # its row of the slot arrays while RUNNING, else -1
        self.since = 0  # the first logged step of its current slot (EmissionLog)
        self.chunk_parts: list[tuple[np.ndarray, np.ndarray]] = []  # chunks of earlier slots
        self.spec_index = 0
        self.pending_row = -1  # row of the step in flight whose sampled token is this one's last
        self.pending_step = -1  # that step's number (Advance.step)
        self.sink: object = None  # the engine's event channel

    @property
    def tokens(self) -> np.ndarray:
        """The prompt's ids, then the output's (synthetic ids, or as sampled)."""
        head = self._head
        if head is not None:
            self._head = None
            rest = self._tokens
            tokens = np.empty(len(head) + len(rest), dtype=rest.dtype)
            tokens[: len(head)] = head
            tokens[len(head) :] = rest
            self._tokens = tokens
        return self._tokens

    @property
    def capacity(self) -> int:
        """len(tokens), without filling in a deferred prompt."""
        head = self._head
        return len(self._tokens) if head is None else len(head) + len(self._tokens)

    def defer_prompt(self, head: np.ndarray) -> None:
        """The request's ids are the prompt's first ids (`head`, its full blocks), then those
        of the buffer it was made with; `tokens` joins the two only when first read.

        Why: in the simulator nothing reads a request's prompt ids back once its block keys
        and synthetic output are computed (only a streamed client reads the output ids), so
        the buffer holds only the ids after `head` (the prompt's last few, then the output)
        instead of the whole ~30k-token context: no O(context) copy or allocation a request.
        `head` must not change afterwards (engine.types.PromptPrefix's contract)."""
        self._head = head

    @property
    def is_running(self) -> bool:
        return self.status is RequestStatus.RUNNING

    @property
    def finish_reason(self) -> str | None:
        """ "length", "stop" or "abort" once finished; None before."""
        return self.status.finish_reason

    def move_to(self, status: RequestStatus) -> None:
        """Change the status; raises InvalidTransition for one the lifecycle does not have."""
        if status not in TRANSITIONS[self.status]:
            raise InvalidTransition(
                f"request {self.id!r}: {self.status.name} -> {status.name} is not a transition"
            )
        self.status = status

    def __repr__(self) -> str:
        return f"Request({self.id!r}, {self.status.name}, output {self.num_output})"


def checked_request(request_id: str, prompt: object, max_tokens: object) -> tuple[np.ndarray, int]:
    """A request's prompt as an integer array and its max_tokens as an int, or a one-line
    AgentabError naming the request and what is wrong."""
    ids = np.asarray(prompt)
    if ids.ndim != 1 or len(ids) == 0:
        raise AgentabError(f"request {request_id!r}: prompt must be a non-empty 1-d array")
    if ids.dtype.kind not in "iu":  # np.issubdtype costs ~1 us a call
        raise AgentabError(f"request {request_id!r}: prompt token ids must be integers")
    if not isinstance(max_tokens, int | np.integer) or max_tokens < 1:
        raise AgentabError(f"request {request_id!r}: max_tokens {max_tokens!r} must be >= 1")
    return ids, int(max_tokens)


def stable_head(prefix: PromptPrefix | None, prompt_len: int, block_size: int) -> int:
    """How many leading ids of a prompt the client leaves unchanged, in whole blocks
    (PromptPrefix.stable_tokens); 0 without a prefix."""
    if prefix is None:
        return 0
    stable = prompt_len if prefix.stable_tokens is None else min(prefix.stable_tokens, prompt_len)
    return stable - stable % block_size

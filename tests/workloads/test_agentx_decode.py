"""The fast AgentX reader against the validating one: equal sessions, or it steps aside.

`agentx_decode.decode_session` must give exactly what `agentx.parse_session` gives for every
input it accepts, and return None (leaving the verdict, warning or error to the validating
reader) for anything irregular. Checked on a generated corpus exported as AgentX, on the
hand-written traces, on one case per irregularity, and on random mutations of a session.
"""

from __future__ import annotations

import copy
import json
import random
import warnings
from pathlib import Path
from typing import Any

import orjson
import pytest

from agentab.errors import AgentabError
from agentab.workloads import load, save
from agentab.workloads.agentx import parse_session
from agentab.workloads.agentx_decode import decode_session
from agentab.workloads.checks import Ctx
from agentab.workloads.generator import generate, load_config
from agentab.workloads.model import Session
from agentab.workloads.source import jsonl_lines

from .conftest import DATA


def dumps(obj: Any) -> bytes:
    """Compact JSON (the stdlib's: orjson cannot write integers beyond 64 bits)."""
    return json.dumps(obj, separators=(",", ":")).encode()


def validating(data: bytes) -> Session:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fast reader must never accept what warns
        return parse_session(orjson.loads(data), Ctx("x"))


def test_generated_corpus_decodes_fast_and_equal(tmp_path: Path) -> None:
    wl = generate(load_config("agentx-coding"), 24, 7)
    path = tmp_path / "wl.jsonl"
    save(wl, path, "agentx")
    lines = [line for _, line in jsonl_lines(path.read_bytes())]
    assert len(lines) == 24
    for line in lines:
        fast = decode_session(line)
        assert fast is not None
        assert fast == validating(line)
    # Both readers rebuild the generated workload exactly (ids, times, subagent trees).
    assert load(path).content_hash == wl.content_hash


@pytest.mark.parametrize("name", ["joins.json", "bg-reset.json"])
def test_hand_written_traces_decode_fast_and_equal(name: str) -> None:
    data = (DATA / "agentx" / name).read_bytes()
    fast = decode_session(data)
    assert fast is not None and fast == validating(data)


def session(**extra: Any) -> dict[str, Any]:
    """A small valid session: two parent turns around a subagent (block size 4)."""
    s: dict[str, Any] = {
        "id": "s1",
        "block_size": 4,
        "requests": [
            {"t": 0, "type": "n", "in": 9, "out": 2, "hash_ids": [1, 2, 90]},
            {
                "t": 1.5,
                "type": "subagent",
                "agent_id": "a1",
                "duration_ms": 1500,
                "requests": [{"t": 2.0, "type": "s", "in": 8, "out": 1, "hash_ids": [7, 8]}],
            },
            {"t": 4, "type": "s", "in": 17, "out": 3, "hash_ids": [1, 2, 3, 4, 91]},
        ],
    }
    s.update(extra)
    return s


def test_shared_prefix_partial_ids_and_spacing() -> None:
    """Arrays that extend the previous one byte for byte reuse its ids; spaced or diverging
    arrays are parsed whole: the ids are the same either way."""
    compact = dumps(session())
    spaced = compact.replace(b"[1,2,3,4,91]", b"[ 1, 2,3 , 4,91 ]").replace(
        b"[1,2,90]", b"[1,2 ,90]"
    )
    for data in (compact, spaced):
        s = decode_session(data)
        assert s is not None and s == validating(data)
        r0, _a, r2 = s.items
        assert r0.hash_ids == (1, 2) and r2.hash_ids == (1, 2, 3, 4)  # partial ids dropped
    # 12 is not 1 followed by more ids: a byte prefix must end at a separator.
    s = decode_session(compact.replace(b"[1,2,3,4,91]", b"[1,23,4,5,91]"))
    assert s is not None and s.items[2].hash_ids == (1, 23, 4, 5)


IRREGULAR: dict[str, Any] = {
    "unknown session field": lambda s: s.update(extra=1),
    "unknown request field": lambda s: s["requests"][0].update(foo=1),
    "unknown subagent field": lambda s: s["requests"][1].update(foo=1),
    "in as integral float": lambda s: s["requests"][0].update({"in": 9.0}),
    "negative out": lambda s: s["requests"][0].update(out=-1),
    "in beyond MAX_TOKENS": lambda s: s["requests"][0].update({"in": 10_000_001}),
    "t as bool": lambda s: s["requests"][0].update(t=True),
    "t goes backwards": lambda s: s["requests"][2].update(t=0.5) or s["requests"][0].update(t=1),
    "huge integer time": lambda s: s["requests"][0].update(t=2**70),
    "hash id negative": lambda s: s["requests"][2].update(hash_ids=[1, 2, -3]),
    "hash id float": lambda s: s["requests"][2].update(hash_ids=[1, 2, 3.0]),
    "hash id beyond 64 bits": lambda s: s["requests"][2].update(hash_ids=[1, 2, 2**65]),
    "too many hash ids": lambda s: s["requests"][0].update(hash_ids=[1, 2, 3, 4]),
    "hash_ids not an array": lambda s: s["requests"][0].update(hash_ids="1,2"),
    "missing type": lambda s: s["requests"][0].pop("type"),
    "unknown type": lambda s: s["requests"][0].update(type="x"),
    "null scope": lambda s: s.update(hash_id_scope=None),
    "bad scope": lambda s: s.update(hash_id_scope="shared"),
    "empty id": lambda s: s.update(id=""),
    "no requests": lambda s: s.update(requests=[]),
    "block size 0": lambda s: s.update(block_size=0),
    "system tokens too large": lambda s: s.update(system_tokens=2**31),
    "models not strings": lambda s: s.update(models=[1]),
    "subagent without agent_id": lambda s: s["requests"][1].pop("agent_id"),
}


@pytest.mark.parametrize("name", list(IRREGULAR))
def test_irregular_input_goes_to_the_validating_reader(name: str) -> None:
    s = session()
    IRREGULAR[name](s)
    data = dumps(s)
    assert decode_session(data) is None


def test_duplicate_keys_and_deep_nesting_step_aside() -> None:
    dup = dumps(session()).replace(b'"type":"n"', b'"type":"n","type":"s"', 1)
    assert decode_session(dup) is None
    deep = session()
    node = deep["requests"][1]
    for _ in range(40):  # MAX_SUBAGENT_DEPTH is 32
        child = {"t": 2, "type": "subagent", "agent_id": "d", "duration_ms": 1, "requests": []}
        node["requests"].append(child)
        node = child
    assert decode_session(dumps(deep)) is None


JSON_VALUES: list[Any] = [None, True, -1, 0, 3, 2.5, -0.5, 1e300, 2**63, "x", "", [], [1], {}]


def mutate(s: dict[str, Any], rng: random.Random) -> None:
    """Replace one value, drop one key or add one, somewhere in the session tree."""
    nodes: list[dict[str, Any]] = []
    stack: list[Any] = [s]
    while stack:
        d = stack.pop()
        if isinstance(d, dict):
            nodes.append(d)
            inner = d.get("requests")
            stack.extend(inner if isinstance(inner, list) else [])
    d = rng.choice(nodes)
    key = rng.choice([*d.keys(), "extra"])
    op = rng.random()
    if op < 0.15:
        d.pop(key, None)
    elif key == "hash_ids" and op < 0.5:
        ids = list(d.get("hash_ids") or [1])
        ids.insert(rng.randrange(len(ids) + 1), rng.choice([0, 5, 2**64, -2, 9.5]))
        d["hash_ids"] = ids
    else:
        d[key] = copy.deepcopy(rng.choice(JSON_VALUES))


def test_random_mutations_agree_with_the_validating_reader() -> None:
    """Whatever the fast reader accepts, the validating reader accepts without a warning and
    reads the same; what the validating reader refuses or warns about, the fast one leaves."""
    rng = random.Random(3)
    accepted = refused = 0
    for _ in range(3000):
        s = session(system_tokens=1, models=["m"], hash_id_scope="local")
        for _ in range(rng.randint(1, 2)):
            mutate(s, rng)
        data = dumps(s)
        fast = decode_session(data)
        try:
            slow: Session | None = validating(data)
        except (AgentabError, UserWarning):
            slow = None
        if fast is not None:
            accepted += 1
            assert fast == slow, data
        if slow is None:
            refused += 1
            assert fast is None, data
    assert accepted > 200 and refused > 2000  # both sides of the property were exercised

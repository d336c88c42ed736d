"""RoutedTarget: one replay over several replicas of one server, each lane pinned to one URL.

Why lanes: a deployment past one engine runs data-parallel replicas behind a load balancer, and
one with session affinity keeps every turn of an agent session on the replica that holds its
prefix cache. A lane plays one session tree at a time (closed loop; open loop: one arrival), so
routing by lane, lane k to URL k mod R, keeps each session on one replica, spreads the lanes
evenly, and is the same in every run of one plan (whatever the client count: `--clients N`
splits lanes, not sessions). Each request's record says which URL served it (`target`, an index
into the manifest's `targets`); each replica's scraped metrics carry the label
`agentab_target`, so counters are summed over replicas by the analysis (every series counts on
its own) and a replica that misses a scrape costs no other replica's counts.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentab.errors import AgentabError
from agentab.replay.targets.base import Outcome, RequestSpec
from agentab.replay.targets.http import HttpTarget, redact_url

TARGET_LABEL = "agentab_target"
"""The label each replica's scraped samples get (its index in the manifest's `targets`)."""

SAME_SERVER_FACTS = ("engine", "profile", "decode_backend", "preset", "tp")
"""Facts every replica must agree on: one run measures one system, however many replicas."""


def route(lane: int, targets: int) -> int:
    """The target index serving `lane` (lane k: URL k mod R)."""
    return lane % targets


class RoutedTarget:
    """Several `HttpTarget`s, one per replica URL; requests go by lane (module doc)."""

    def __init__(self, targets: list[HttpTarget]) -> None:
        if not targets:
            raise AgentabError("--url: give at least one server URL")
        urls = [t.url for t in targets]
        twice = sorted({redact_url(u) for u in urls if urls.count(u) > 1})
        if twice:
            raise AgentabError(
                f"--url {twice[0]}: given more than once (each replica is one URL, once)"
            )
        self.targets = targets

    async def start(self) -> None:
        """Start every replica's client; an unreachable URL fails the run before it begins, in
        one line naming it."""
        several = len(self.targets) > 1
        await asyncio.gather(*(_start_one(t, probe=several) for t in self.targets))
        first = self.targets[0]
        for other in self.targets[1:]:
            if other.model != first.model:
                raise AgentabError(
                    f"--url {redact_url(other.url)} serves model {other.model!r}, --url "
                    f"{redact_url(first.url)} {first.model!r}: replicas serve one model"
                )
            mine, theirs = first.describe().get("server", {}), other.describe().get("server", {})
            for key in SAME_SERVER_FACTS:
                if mine.get(key) != theirs.get(key):
                    raise AgentabError(
                        f"--url {redact_url(other.url)} runs {key} {theirs.get(key)!r}, --url "
                        f"{redact_url(first.url)} {mine.get(key)!r}: replicas run one system"
                    )

    async def close(self) -> None:
        await asyncio.gather(*(t.close() for t in self.targets))

    def describe(self) -> dict[str, Any]:
        """The first replica's facts (all agree on the system), the URLs in `targets`, and
        `replicas` when there are several."""
        facts = self.targets[0].describe()
        facts["targets"] = [redact_url(t.url) for t in self.targets]
        if len(self.targets) > 1:
            facts["replicas"] = len(self.targets)
        return facts

    def warm(self, spec: RequestSpec) -> None:
        self.targets[0].warm(spec)

    async def send(self, spec: RequestSpec, out: Outcome) -> None:
        i = route(spec.lane, len(self.targets))
        out.target = i
        await self.targets[i].send(spec, out)

    async def scrape(self) -> list[tuple[str, dict[str, str], float]]:
        """Every replica's samples; with several, each labelled with its replica's index."""
        if len(self.targets) == 1:
            return await self.targets[0].scrape()
        scraped = await asyncio.gather(*(t.scrape() for t in self.targets))
        return [
            (name, {**labels, TARGET_LABEL: str(i)}, value)
            for i, samples in enumerate(scraped)
            for name, labels, value in samples
        ]


async def _start_one(target: HttpTarget, *, probe: bool) -> None:
    """Start one replica's client; with several replicas also check that it answers (with
    --model there is no model discovery to find a dead URL, and one dead replica among live
    ones would otherwise only show as its lanes' connect errors)."""
    await target.start()
    if probe:
        await target.probe()


def routed_target(
    urls: list[str] | tuple[str, ...],
    *,
    model: str | None,
    endpoint: str,
    api_key: str | None,
    timeout_s: float,
) -> RoutedTarget:
    """A RoutedTarget over `urls` (one URL: one replica), each an `HttpTarget`."""
    return RoutedTarget(
        [
            HttpTarget(u, model=model, endpoint=endpoint, api_key=api_key, timeout_s=timeout_s)
            for u in urls
        ]
    )

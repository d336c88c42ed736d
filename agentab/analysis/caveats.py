"""What a report must say about where its runs came from, read from the runs' manifests.

A report on simulated runs reads like one on hardware unless it says otherwise, and a reader
quotes the headline, not the experiment file. So the caveat is derived from what each run
recorded (the engine, its hardware profile and that profile's status, the spec-decode
configuration), never from notes someone remembered to write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

SIMULATED_ENGINES = frozenset({"agentab-sim"})
_PROFILE_STATUS: dict[str, str] = {
    "published-derived": "derived from published figures, not measured",
    "measured": "its decode tables measured on hardware",
    "unmeasured-placeholder": "a placeholder: its figures are not measured",
}


def _profile_name(manifest: Mapping[str, Any]) -> str:
    profile = manifest.get("profile")
    if isinstance(profile, Mapping):
        return str(profile.get("name", "?"))
    return str(profile) if profile is not None else "?"


def _spec(manifest: Mapping[str, Any]) -> str | None:
    spec = manifest.get("spec")
    if not isinstance(spec, Mapping) or spec.get("method") != "simulated":
        return None
    drafts = spec.get("num_draft_tokens")
    if spec.get("acceptance_length") is not None:
        how = f"mean acceptance length {spec['acceptance_length']}"
    else:
        probs = [float(p) for p in spec.get("acceptance_probs") or ()]
        how = "per-position acceptance " + ", ".join(f"{p:.2f}" for p in probs)
    return f"{drafts} draft tokens, {how}"


def simulator_caveats(manifests: Iterable[Mapping[str, Any]]) -> list[str]:
    """One line per distinct simulated setup among `manifests` ([] when none is simulated)."""
    lines: list[str] = []
    for m in manifests:
        if m.get("engine") not in SIMULATED_ENGINES:
            continue
        status = m.get("profile_status")
        said = _PROFILE_STATUS.get(str(status), "of unknown status")
        line = (
            f"**Simulated, not measured**: engine {m.get('engine')}, hardware profile "
            f"{_profile_name(m)} (status {status or 'unknown'}: {said})"
        )
        spec = _spec(m)
        if spec is not None:
            line += f"; spec-decode acceptance is configured ({spec}), not measured"
        line += ". Measure your own traffic on your own engine before deciding."
        if line not in lines:
            lines.append(line)
    return lines


def synthetic_acceptance_caveats(manifests: Iterable[Mapping[str, Any]]) -> list[str]:
    """One line per distinct setup of a real engine whose drafts are accepted by the synthetic
    method (the local engine's `rejection_sample_method = "synthetic"`), not verified."""
    lines: list[str] = []
    for m in manifests:
        spec = m.get("spec")
        if not isinstance(spec, Mapping) or spec.get("rejection_sample_method") != "synthetic":
            continue
        rates = [float(p) for p in spec.get("synthetic_rates_resolved") or ()]
        line = (
            f"**Synthetic acceptance**: engine {m.get('engine')} accepts drafts by vLLM's "
            f"synthetic method ({spec.get('num_speculative_tokens')} draft tokens, per-position "
            "rates " + ", ".join(f"{p:.2f}" for p in rates) + "), not by verifying them: the "
            "A/B measures the decode paths at this acceptance, not whether a drafter reaches "
            "it on your prompts."
        )
        if line not in lines:
            lines.append(line)
    return lines

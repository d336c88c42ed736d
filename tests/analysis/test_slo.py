"""Service-level objectives: parsing, which requests meet them, goodput in a comparison."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from agentab.analysis.compare import compare_runs
from agentab.analysis.load import load_run
from agentab.analysis.markdown import comparison_markdown
from agentab.analysis.slo import Slo, parse_slo
from agentab.errors import AgentabError

from .rundirs import manifest, synthetic_records, write_run
from .test_cli import agentab

LS = {"decode_backend": "latency_specialized", "arm": "latency_specialized"}


def test_terms_parse_to_seconds_with_units_and_aliases() -> None:
    slo = parse_slo(["ttft:2s", "TPOT:50ms", "e2el:1500us"])
    assert slo == Slo(ttft_s=2.0, itl_s=0.05, e2e_s=0.0015)
    assert slo.describe() == "TTFT <= 2 s, ITL <= 50 ms, E2E <= 1.5 ms"
    assert parse_slo(slo.terms()) == slo  # the recorded form reads back
    assert parse_slo([]) is None


@pytest.mark.parametrize(
    ("term", "message"),
    [
        ("ttft", "--slo: 'ttft' is not NAME:VALUE with a unit"),
        ("ttft:2", "--slo: 'ttft:2' is not NAME:VALUE with a unit"),
        ("queue:2s", "--slo: 'queue:2s': unknown objective 'queue' (one of ttft, itl, e2e, tpot"),
        ("itl:5min", "--slo: 'itl:5min': unit 'min' is not one of s, ms, us"),
        ("itl:0ms", "--slo: 'itl:0ms': the limit must be positive"),
    ],
)
def test_a_bad_term_is_one_line_naming_the_flag(term: str, message: str) -> None:
    with pytest.raises(AgentabError) as err:
        parse_slo([term])
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_a_term_given_twice_is_refused() -> None:
    with pytest.raises(AgentabError, match="itl is given twice"):
        parse_slo(["itl:5ms", "tpot:6ms"])


def test_a_request_meets_the_objectives_only_when_it_succeeded_within_every_limit() -> None:
    frame = pl.DataFrame(
        {
            "ok": [True, True, True, False, True],
            "ttft_s": [1.0, 2.0, 2.5, 0.1, 0.5],
            "itl_s": [0.01, 0.05, 0.01, 0.01, None],  # a one-token answer has no ITL
            "e2e_s": [3.0, 3.0, 3.0, 1.0, 0.5],
        }
    )
    met = frame.select(parse_slo(["ttft:2s", "itl:50ms"]).met()).to_series().to_list()  # type: ignore[union-attr]
    assert met == [True, True, False, False, True]  # limits are inclusive


def _itl(records: list[dict]) -> np.ndarray:
    """ITL_i of every request, computed here from the chunk times (first to last chunk)."""
    return np.array(
        [(r["chunk_times_s"][-1] - r["chunk_times_s"][0]) / (r["osl"] - 1) for r in records]
    )


def test_goodput_and_attainment_in_a_paired_comparison(tmp_path: Path) -> None:
    seeds = (5, 6)
    limit = 0.02  # between the two arms' typical ITL: B (half the ITL) meets it more often
    a, b, good_a, good_b, total = [], [], 0, 0, 0
    for k, seed in enumerate(seeds):
        ra = synthetic_records(seed)
        rb = synthetic_records(seed, itl_scale=0.5)
        a.append(write_run(tmp_path / "a" / f"run-{k + 1}", ra, manifest(repeat=k)))
        b.append(write_run(tmp_path / "b" / f"run-{k + 1}", rb, manifest(repeat=k, **LS)))
        good_a += int((_itl(ra) <= limit).sum())
        good_b += int((_itl(rb) <= limit).sum())
        total += len(ra)
    assert 0 < good_a < good_b < total
    slo = parse_slo([f"itl:{limit * 1e3:g}ms"])
    result = compare_runs(
        [load_run(p) for p in a], [load_run(p) for p in b], resamples=1000, seed=1, slo=slo
    )
    att = result.metrics["slo_attainment"]
    assert att.a == pytest.approx(good_a / total, rel=1e-12)
    assert att.b == pytest.approx(good_b / total, rel=1e-12)
    assert att.ratio == pytest.approx(good_b / good_a, rel=1e-12)
    assert att.ci_low is not None and att.ci_low > 1.0 and att.verdict == "better"
    wall = sum(s.values["phase_wall_s"] for s in result.runs_a)
    assert result.metrics["goodput_req_s"].a == pytest.approx(good_a / wall, rel=1e-12)
    assert len(att.runs_a) == 2 and all(v is not None for v in att.runs_a)
    doc = result.to_json()
    assert doc["slo"] == {"terms": ["itl:20ms"], "limits_s": {"itl": 0.02}}
    text = comparison_markdown(result)
    assert "- Service-level objectives: ITL <= 20 ms per request;" in text
    assert "| goodput (requests meeting the SLOs) (req/s) | higher |" in text
    assert "| SLO attainment (share of requests meeting the SLOs) | higher |" in text
    # without objectives there are no goodput rows at all
    plain = compare_runs([load_run(p) for p in a], [load_run(p) for p in b], resamples=200)
    assert "slo_attainment" not in plain.metrics and plain.to_json()["slo"] is None
    assert "goodput" not in comparison_markdown(plain)


def test_compare_cli_takes_slo_flags_and_refuses_a_bad_one(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", synthetic_records(5), manifest())
    b = write_run(tmp_path / "b", synthetic_records(5, itl_scale=0.5), manifest(**LS))
    ok = agentab("compare", a, b, "--slo", "ttft:2s", "--slo", "itl:20ms", "--json")
    assert ok.returncode == 0, ok.stderr
    assert '"terms": [\n      "ttft:2s",\n      "itl:20ms"\n    ]' in ok.stdout
    bad = agentab("compare", a, b, "--slo", "itl:fast")
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "agentab: error: --slo: 'itl:fast' is not NAME:VALUE with a unit "
        "(e.g. ttft:2s, itl:50ms, e2e:30s)"
    )

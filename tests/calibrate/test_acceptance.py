"""`agentab acceptance`: a speculative-decoding server's per-position counters as the rates the
local engine and the simulator replay, end to end on real processes.

`agentab serve` runs the local engine (tiny preset, CPU) with a one-layer drafter verified
greedily, so acceptance is real and partial; `agentab replay` records its counters; the command
reads them from the run dir and from the live /metrics, and its rates must be exactly the
server's accepted-per-position / drafts. Then the written file is fed back: to a local engine
(`--speculative-config FILE`) and to the simulator (`--acceptance-probs FILE`), whose manifests
must hold exactly those rates and whose own counters must measure them again.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest

from tests.serving import served

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

GENERATOR = """\
system_tokens_median = 120
tool_tokens_median = 200
first_message_median = 40
suffix_median = 20
suffix_max = 200
output_median = 12
output_max = 64
parent_turns_median = 6
parent_turns_max = 12
subagent_turns_median = 3
subagent_turns_max = 4
subagent_system_tokens_median = 100
subagent_tool_tokens_median = 100
subagent_task_median = 40
summary_median = 100
context_cap = 2048
tool_pause_median_s = 0.05
human_pause_median_s = 0.2
pause_max_s = 1.0
"""
LOCAL = ("--engine", "local", "--preset", "tiny", "--device", "cpu", "--kv-blocks", "2048")
GREEDY = '{"num_speculative_tokens": 3, "draft_layers": 3}'
REPLAY = ("--concurrency", "2", "--duration", "10", "--warmup-requests", "0")
SCRAPE = ("--scrape-metrics", "--scrape-interval", "0.5", "--quiet")
SERIES = re.compile(r"^(vllm:spec_decode_num_[a-z_]+_total)\{([^}]*)\} (\S+)$", re.MULTILINE)


def agentab(*args: str | Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "agentab", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result


def server_counters(url: str) -> tuple[float, list[float]]:
    """(drafts, accepted per position) as the server's /metrics text states them."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    drafts, per_pos = 0.0, {}
    for name, labels, value in SERIES.findall(text):
        if name == "vllm:spec_decode_num_drafts_total":
            drafts += float(value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            position = int(re.search(r'position="(\d+)"', labels)[1])  # type: ignore[index]
            per_pos[position] = float(value)
    return drafts, [per_pos[i] for i in range(len(per_pos))]


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("acceptance")
    (root / "gen.toml").write_text(GENERATOR)
    workload = root / "w.jsonl"
    agentab("workload", "generate", "--sessions", "4", "--seed", "7", "--config",
            root / "gen.toml", "-o", workload)  # fmt: skip
    with served(*LOCAL, "--speculative-config", GREEDY) as url:
        agentab("replay", workload, "--url", url, "--out", root / "run", *REPLAY, *SCRAPE)
        counters = server_counters(url)
        from_url = agentab("acceptance", "--url", url, "-o", root / "url.toml")
    from_run = agentab("acceptance", root / "run", "-o", root / "run.toml")
    return {
        "root": root,
        "workload": workload,
        "counters": counters,
        "url": (from_url.stdout, tomllib.loads((root / "url.toml").read_text())),
        "run": (from_run.stdout, tomllib.loads((root / "run.toml").read_text())),
    }


def test_the_rates_are_the_servers_accepted_per_position_over_drafts(measured: dict) -> None:
    drafts, accepted = measured["counters"]
    assert len(accepted) == 3 and drafts >= 50
    assert accepted[0] > 0 and accepted[0] < drafts  # real, partial acceptance
    rates = [a / drafts for a in accepted]
    # without warmup the profiling phase starts before the first draft and the last scrape
    # follows the last one: the run dir's window holds every draft the server counted
    for source in ("url", "run"):
        _, written = measured[source]
        assert written["measured"]["drafts"] == drafts
        assert written["measured"]["accepted_per_position"] == accepted
        assert written["measured"]["mean_acceptance_length"] == 1 + sum(accepted) / drafts
        assert written["speculative_config"] == {
            "num_speculative_tokens": 3,
            "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": rates,
        }
        assert written["simulator"] == {"num_draft_tokens": 3, "acceptance_probs": rates}
    printed = measured["run"][0].splitlines()
    assert printed[0].endswith(f"(profiling phase): {drafts:,.0f} drafts of 3 tokens verified")
    assert printed[1].startswith(f"  mean acceptance length {1 + sum(accepted) / drafts:.3f} ")
    assert printed[2].endswith(", ".join(f"{i + 1}: {r:.3f}" for i, r in enumerate(rates)))


def within(measured_rates: list[float], rates: list[float], drafts: float) -> bool:
    """Each measured rate within 4 binomial standard deviations (and 0.01) of the rate fed."""
    return all(
        abs(m - r) <= 4 * (r * (1 - r) / drafts) ** 0.5 + 0.01
        for m, r in zip(measured_rates, rates, strict=True)
    )


def test_the_local_engine_replays_the_written_rates(measured: dict) -> None:
    root, rates = measured["root"], measured["run"][1]["speculative_config"]
    rates = rates["synthetic_acceptance_rates"]
    with served(*LOCAL, "--speculative-config", str(root / "run.toml")) as url:
        agentab("replay", measured["workload"], "--url", url, "--out", root / "again", *REPLAY,
                *SCRAPE)  # fmt: skip
    spec = json.loads((root / "again" / "manifest.json").read_text())["spec"]
    assert spec["rejection_sample_method"] == "synthetic"
    assert spec["synthetic_acceptance_rates"] == rates  # the exact floats, through TOML
    agentab("acceptance", root / "again", "-o", root / "again.toml")
    again = tomllib.loads((root / "again.toml").read_text())["measured"]
    assert within([a / again["drafts"] for a in again["accepted_per_position"]], rates,
                  again["drafts"])  # fmt: skip


def test_the_simulator_replays_the_written_rates(measured: dict) -> None:
    root, rates = measured["root"], measured["run"][1]["simulator"]["acceptance_probs"]
    agentab("simulate", measured["workload"], "--profile", "gb300-tp16-kimi-k3",
            "--num-draft-tokens", "3", "--acceptance-probs", root / "run.toml",
            "--out", root / "sim", "--concurrency", "2", "--duration", "600", *SCRAPE)  # fmt: skip
    manifest = json.loads((root / "sim" / "manifest.json").read_text())
    assert manifest["spec"]["acceptance_probs"] == rates
    agentab("acceptance", root / "sim", "-o", root / "sim.toml")
    sim = tomllib.loads((root / "sim.toml").read_text())["measured"]
    assert within([a / sim["drafts"] for a in sim["accepted_per_position"]], rates, sim["drafts"])


def test_a_file_without_the_table_is_refused_naming_the_flag(measured: dict) -> None:
    path = measured["root"] / "empty.toml"
    path.write_text("[measured]\ndrafts = 1\n")
    result = subprocess.run(
        [sys.executable, "-m", "agentab", "simulate", str(measured["workload"]), "--profile",
         "gb300-tp16-kimi-k3", "--num-draft-tokens", "3", "--acceptance-probs", str(path),
         "--out", str(measured["root"] / "nosim")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (
        2,
        f"agentab: error: --acceptance-probs {path}: no [simulator] table "
        "(`agentab acceptance -o FILE` writes one)\n",
    )


def test_a_run_without_speculative_decoding_is_refused_in_one_line(measured: dict) -> None:
    root = measured["root"]
    agentab("simulate", measured["workload"], "--profile", "gb300-tp16-kimi-k3", "--out",
            root / "plain", "--duration", "60", *SCRAPE)  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "agentab", "acceptance", str(root / "plain")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"agentab: error: {root / 'plain'}: no speculative-decoding counters "
        "(vllm:spec_decode_num_drafts_total and "
        "vllm:spec_decode_num_accepted_tokens_per_pos_total); the server must run speculative "
        "decoding, and the run must scrape them ([replay] scrape_metrics = true)\n"
    )


@pytest.mark.parametrize(
    ("drafts", "accepted", "message"),
    [
        (0.0, (0.0, 0.0), "s: no drafts verified (w)"),
        (10.0, (11.0, 0.0), "s: accepted per position [11.0, 0.0] outside [0, 10 drafts]"),
        (
            10.0,
            (2.0, 3.0),
            "s: accepted per position [2.0, 3.0] rises with the position; per-position counts "
            "of one server never do",
        ),
    ],
)
def test_counts_no_rate_model_holds_are_refused(
    drafts: float, accepted: tuple[float, ...], message: str
) -> None:
    from agentab.calibrate.acceptance import Acceptance
    from agentab.errors import AgentabError

    with pytest.raises(AgentabError) as caught:
        Acceptance("s", "w", drafts, accepted).check()
    assert str(caught.value) == message


def test_the_metrics_address_of_a_server_url() -> None:
    from agentab.calibrate.acceptance import metrics_url

    assert metrics_url("http://h:8000") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/v1/") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/metrics") == "http://h:8000/metrics"


def test_a_url_that_is_not_a_server_is_refused_before_reading_it() -> None:
    from agentab.calibrate.acceptance import from_url
    from agentab.errors import AgentabError

    with pytest.raises(AgentabError) as caught:
        from_url("file:///etc/hostname")
    assert str(caught.value) == (
        "--url file:///etc/hostname/metrics: expected an http:// or https:// server address"
    )


def test_a_missing_rates_file_is_named_as_such(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agentab", "serve", "--engine", "local", "--preset", "tiny",
         "--speculative-config", str(tmp_path / "acceptance.toml")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (
        2,
        f"agentab: error: --speculative-config {tmp_path / 'acceptance.toml'}: no such file\n",
    )

"""An experiment dir that can be completed in several sittings.

A run counts as done when its manifest status is `completed`; a run dir in any other state
(killed, interrupted, stopped by its error rate) is removed and run again, so its records never
mix two attempts. The dir keeps a copy of the experiment file and the prompt salt its runs
share, and a dir holding a different experiment is refused, so a resume never mixes two
configurations.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import orjson

from agentab.dir_lock import LOCK_NAME, lock_dir
from agentab.errors import AgentabError
from agentab.experiments.experiment import Experiment
from agentab.redact import redact_text, redact_value
from agentab.replay.options import new_prompt_salt
from agentab.rundir import MANIFEST

COPY = "experiment.toml"
SALT_FILE = "prompt_salt"


def is_complete(path: Path) -> bool:
    """A run is done when its manifest says `completed`; anything else is run again."""
    try:
        manifest = orjson.loads((path / MANIFEST).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return False
    return isinstance(manifest, dict) and manifest.get("status") == "completed"


def is_fresh(out_dir: Path) -> bool:
    """Whether `out_dir` holds nothing of an experiment yet (absent, empty, or only a lock).

    A fresh start loads and checks everything it can before it creates the dir, so a start that
    fails (a trace that does not parse) leaves no dir that a later run would take for a resume.
    """
    try:
        return all(p.name == LOCK_NAME for p in out_dir.iterdir())
    except FileNotFoundError:
        return True
    except NotADirectoryError:
        return False  # prepare_dir refuses it in its own words


def prepare_dir(experiment: Experiment, out_dir: Path) -> bool:
    """Create and lock the experiment dir (for this process's lifetime: a second `ab` on it is
    refused), or accept it for a resume when it holds this experiment.

    Returns whether it is a resume. The copy is compared as parsed TOML, so a comment edited in
    the file does not block a resume, while any changed value does.
    """
    lock_dir(out_dir, "agentab ab")  # before anything in the dir is read or written
    if any(p.name != LOCK_NAME for p in out_dir.iterdir()):
        copied = out_dir / COPY
        try:
            text = copied.read_text(encoding="utf-8")
            data = tomllib.loads(text)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            raise AgentabError(
                f"{out_dir}: exists and is not a dir of this experiment (no readable {COPY}); "
                "use -o NEW_DIR"
            ) from None
        # the copy holds no URL credentials: compared without them (a changed password is the
        # same experiment)
        if redact_value(data) != redact_value(experiment.raw):
            raise AgentabError(
                f"{out_dir}: holds a different experiment ({copied} differs from "
                f"{experiment.path}); resume only with the same file, or use -o NEW_DIR"
            )
        if redact_text(text) != text:  # a copy written before copies were redacted
            copied.write_text(redact_text(text), encoding="utf-8")
        return True
    write_copy(experiment, out_dir / COPY)
    return False


def write_copy(experiment: Experiment, target: Path) -> None:
    """The experiment file as it was run, comments included, with the credentials of every URL
    in it redacted: the dir is shared with its reports, and an arm's `http://user:key@host`
    must not travel with it."""
    try:
        text = experiment.path.read_text(encoding="utf-8")
    except OSError as exc:
        raise AgentabError(f"{experiment.path}: cannot read ({exc.strerror or exc})") from None
    target.write_text(redact_text(text), encoding="utf-8")


def check_same_engine_code(experiment: Experiment, kept: list[Path]) -> None:
    """Refuse to add runs to completed ones that ran other engine code.

    The simulator and the local engine are this package's code, and every run's manifest
    records its digest (`engine_source`). Resuming after that code changed would mix two
    engines in one A/B, which the comparison guard refuses only after the missing runs have
    spent their time; this check refuses before the first of them. Engines outside the package
    (vLLM, any HTTP server) are compared by the guard from their own manifests.
    """
    if experiment.engine_kind not in ("simulator", "local") or not kept:
        return
    from agentab.engine.source import engine_source_digest

    current = engine_source_digest()
    for run in kept:
        try:
            recorded = orjson.loads((run / MANIFEST).read_bytes()).get("engine_source")
        except (OSError, orjson.JSONDecodeError, AttributeError):
            continue  # not a completed run: it is run again anyway
        if recorded != current:
            raise AgentabError(
                f"{run}: ran engine code {recorded or '(not recorded)'}, this install's is "
                f"{current}; resuming would mix two engines in one A/B: run the code that ran "
                "the completed runs, or start a new dir with -o NEW_DIR"
            )


def check_same_window(kept: list[Path], window_s: float | None) -> None:
    """Refuse to add runs to completed runs of another profiling window.

    Repeats (and the blocks of `--until-decided`) are treated as draws of one distribution;
    runs of two lengths have two variances (and, with a window-dependent share of long
    requests, two means), so a resume with another `--block-seconds`, or a fixed-design resume
    of a sequential dir, would mix them. Each run's manifest records its window
    (`replay.duration_s`).
    """
    for run in kept:
        try:
            replay = orjson.loads((run / MANIFEST).read_bytes()).get("replay") or {}
        except (OSError, orjson.JSONDecodeError, AttributeError):
            continue  # not a completed run: it is run again anyway
        recorded = replay.get("duration_s")
        if recorded != window_s:
            ran = "no window" if recorded is None else f"a {recorded:g} s window"
            want = "no window" if window_s is None else f"{window_s:g} s windows"
            raise AgentabError(
                f"{run}: ran {ran}, this invocation runs {want}; runs of two lengths do not "
                "pool: resume with the --block-seconds (and --until-decided) its runs ran, or "
                "start a new dir with -o NEW_DIR"
            )


def clear_unfinished(path: Path) -> None:
    """Remove a run dir left unfinished before it is run again."""
    if path.exists():
        shutil.rmtree(path)


def experiment_salt(out_dir: Path) -> str:
    """The experiment's prompt salt, drawn once and kept in the dir, so that a resumed run gets
    the salt of the other arm of its repeat (a sweep appends the point per run)."""
    path = out_dir / SALT_FILE
    try:
        salt = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        salt = ""
    if not salt:
        salt = new_prompt_salt()
        path.write_text(salt + "\n", encoding="utf-8")
    return salt

"""The README's two set-up commands are what a new user runs; CI must run the same test command."""

from __future__ import annotations

import re

from conftest import REPO_ROOT


def readme_commands() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    head = text.split("Python >= 3.11", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", head)


def test_readme_starts_with_exactly_two_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2
    assert all("\n" not in c for c in commands)


def test_ci_runs_the_readme_test_command() -> None:
    test_command = readme_commands()[1]
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert f'TEST_COMMAND="{test_command}"' in ci
    assert 'eval "$TEST_COMMAND"' in ci

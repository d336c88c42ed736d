"""`agentab kernels` argument errors are one line and exit 2 (no GPU needed to see them)."""

from __future__ import annotations

import pytest

from agentab.errors import AgentabError
from agentab.kernels.check import parse_batches


def test_parse_batches_ranges_and_lists() -> None:
    assert parse_batches("1-4,8,6-6") == [1, 2, 3, 4, 6, 8]
    with pytest.raises(AgentabError, match="--batch: 'x' is not a number"):
        parse_batches("1,x")
    with pytest.raises(AgentabError, match=">= 1"):
        parse_batches("0")


def test_bad_batch_exits_2(capsys) -> None:
    from agentab.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["kernels", "check", "--batch", "1-x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("agentab: error: --batch") and err.count("\n") == 1

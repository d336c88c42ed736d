"""Kernel versions: the environment switch and the attention split plans each version uses."""

from __future__ import annotations

import pytest

from agentab.errors import AgentabError
from agentab.kernels import attention
from agentab.kernels.config import DEFAULT_KERNEL_VERSION, VERSION_ENV, kernels_version


def test_version_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VERSION_ENV, raising=False)
    assert kernels_version() == DEFAULT_KERNEL_VERSION
    monkeypatch.setenv(VERSION_ENV, "9")
    assert kernels_version() == 9
    monkeypatch.setenv(VERSION_ENV, "7")
    with pytest.raises(AgentabError, match="AGENTAB_KERNELS_VERSION"):
        kernels_version()


def test_split_plans_at_context_4096() -> None:
    # 4097 cache rows = 129 blocks of 32 tokens.
    assert attention.split_plan(1, 4097, version=8) == (43, 96)
    assert attention.split_plan(1, 4097, version=9) == (129, 32)
    assert attention.split_plan(2, 4097, version=9) == (129, 32)
    assert attention.split_plan(4, 4097, version=9) == (65, 64)
    for b in (5, 8, 64):  # batch >= 5 plans as before
        assert attention.split_plan(b, 4097, version=9) == attention.split_plan(b, 4097, version=8)


def test_combine_tiles() -> None:
    assert attention.combine_tile(1, 16, 512, version=8) == 128
    assert attention.combine_tile(1, 16, 512, version=9) == 32  # 256 programs
    assert attention.combine_tile(4, 16, 512, version=9) == 64
    assert attention.combine_tile(5, 16, 512, version=9) == 128


def test_versions_13_to_16_plan_the_attention_as_version_8() -> None:
    # versions 13, 14 and 16 changed only the MoE kernels (NOTES.md)
    for v in (13, 14, 16):
        assert attention.split_plan(1, 4097, version=v) == (43, 96)
        assert attention.combine_tile(1, 16, 512, version=v) == 128


def test_version_17_plans_64_token_tiles() -> None:
    # 4097 cache rows = 65 tiles of 64: one per split at batch 1, five splits of 13 at batch 64
    assert attention.split_config(17) == (64, 1, 4, 2)
    assert attention.split_plan(1, 4097, version=17) == (65, 64)
    assert attention.split_plan(64, 4097, version=17) == (5, 832)
    assert attention.split_config(16) == (32, 2, 8, 2)
    assert attention.split_config(18) == attention.split_config(17)
    # version 18 narrows the combine's channel tiles at batch 1-4 (256 programs at batch 1)
    assert attention.combine_tile(1, 16, 512, version=17) == 128
    assert attention.combine_tile(1, 16, 512, version=18) == 32
    assert attention.combine_tile(5, 16, 512, version=18) == 128


def test_every_kernel_version_has_a_moe_plan() -> None:
    from agentab.kernels.config import KERNEL_VERSIONS
    from agentab.kernels.specialized import MOE_PLANS, prenorm_tokens

    assert set(MOE_PLANS) == set(KERNEL_VERSIONS)
    for plan in MOE_PLANS.values():
        assert plan.prenorm or not plan.mma  # the tensor-core moe_up reads normalized tokens
    assert not prenorm_tokens(17, 4) and prenorm_tokens(17, 5) and not prenorm_tokens(9, 64)

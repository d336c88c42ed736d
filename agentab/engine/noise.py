"""Engine timing noise for the simulator: what makes two runs of one plan differ on a real GPU.

The simulator prices a step exactly, so two arms that replay the same plan on it differ only by
the decode path: an A/A comparison there is exactly 1.000 and says nothing about how often a
verdict on a real engine is wrong. A real engine's step times vary from step to step (host
scheduling, clocks, memory traffic of other work) and from run to run (a server's start,
thermal state, a neighbour). This module multiplies each priced step by

    exp(step_sigma * z_step) * exp(run_sigma * z_run)

with z_step drawn per step and z_run once per engine (one run), both standard normal, from a
seeded generator: the same seed gives the same noise, and the two arms of an A/B draw their own.
Both sigmas are on the log scale (0.02 is about 2% per step). docs/analysis.md says how the
values used in benchmarks/bench_verdicts.py were measured on real engines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepNoise:
    """Log-normal step-time noise: per step (`step_sigma`) and per run (`run_sigma`).

    The sigmas and seed come checked from `SimulatorOptions` (`step_noise`, `run_noise`,
    `noise_seed`: sigmas in [0, 1]).
    """

    step_sigma: float = 0.0
    run_sigma: float = 0.0
    seed: int = 0

    @property
    def active(self) -> bool:
        return self.step_sigma > 0.0 or self.run_sigma > 0.0

    def describe(self) -> dict[str, float]:
        """What the manifest records (the seed is recorded apart, as every seed is)."""
        return {"step_sigma": self.step_sigma, "run_sigma": self.run_sigma}

    def sampler(self) -> NoiseSampler:
        return NoiseSampler(self)


class NoiseSampler:
    """One run's noise: its run factor, drawn once, and a stream of per-step factors."""

    def __init__(self, noise: StepNoise) -> None:
        self._rng = np.random.default_rng(noise.seed)
        self._sigma = noise.step_sigma
        self.run_factor = math.exp(noise.run_sigma * float(self._rng.standard_normal()))

    def one(self) -> float:
        """The factor of one step."""
        return self.run_factor * math.exp(self._sigma * float(self._rng.standard_normal()))

    def many(self, n: int) -> np.ndarray:
        """The factors of `n` consecutive steps (a window priced at once)."""
        return self.run_factor * np.exp(self._sigma * self._rng.standard_normal(n))

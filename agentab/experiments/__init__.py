"""agentab.experiments: experiment files and the runs they call for.

- `experiment`: the experiment file (workload, GPUs, engine, two arms, repeats, sweep), checked
  strictly before anything runs.
- `ab`: `agentab ab`, the two arms run interleaved repeat by repeat, then compared and reported.
- `sweep`, `sweep_report`: the same at every load point of a `[sweep]`, and its recommendation.
- `experiment_dir`: the experiment dir (resume, the shared prompt salt, engine-code checks).

It sits above replay, engine and analysis: it runs engines and replays, and hands the run dirs
to analysis, which only reads run dirs and computes. See docs/analysis.md.
"""

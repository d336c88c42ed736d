"""agentab.analysis: what a run (or an A/B of runs) means.

- `load`: open a run dir (manifest, request records, scraped metrics) lazily.
- `metrics`: per-request metrics as polars expressions (TTFT, TTFO, E2E, ITL, OSL, ...).
- `summary`: per-run summary (`summary.json`): the P90-interactivity headline and the rest.
- `guard`: refuse comparisons whose manifests differ in anything but the decode backend.
- `sample`, `bootstrap`, `intervals`, `compare`: pooled B/A ratios with session-bootstrap and
  run-level confidence intervals, and verdicts.
- `markdown`, `html`: the reports. Experiment files and `agentab ab` live in agentab.experiments.
See docs/analysis.md.
"""

"""Kernel research: probes, read ceilings and designs the production kernels did not adopt.

Nothing in `agentab.kernels` imports from here; these modules import from it. Each is run on
the GPU machine from the repository root as a module (`python3 -m
benchmarks.kernels.research.<name>`), and what each measured is in benchmarks/kernels/NOTES.md.
"""

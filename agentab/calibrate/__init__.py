"""Calibration and fidelity: fit a HardwareProfile from a real engine, then measure how well
the simulator with that profile predicts a held-out replay (`agentab calibrate`, `agentab
fidelity`; docs/engine.md, "Calibration and fidelity").

- `load.py`: the calibration load (which requests, in which phases);
- `facts.py`: what the engine says about itself (block size, KV capacity, scheduler limits);
- `client.py`: sends the load over HTTP and times it, client side and from the engine's own
  step counters where it exports them;
- `fit.py`: least-squares fits of the step-time model to the measurements;
- `write.py`: the profile TOML with its provenance, and the fit report beside it;
- `fidelity.py`: one workload on the real engine and on the simulator, side by side.
"""

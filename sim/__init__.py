"""Engine simulator: an OpenAI-compatible server that behaves like vLLM's, without a GPU.

Public API: `config.SimConfig`, `profiles.PROFILES`, `app.create_app(cfg, clock=None)` (a
Starlette app; `app.state.sim` is the `simulator.Simulator`; `clock.VirtualClock()` runs
its engine in model time), `cli.main(argv)`. docs/simulator.md describes the step model.
Run it: `python -m sim --profile fast --port 8100` (`--replicas N`: N engines).
"""

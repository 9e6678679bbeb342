"""Engine simulator: an OpenAI-compatible server that behaves like vLLM's, without a GPU.

Public API: `config.SimConfig`, `profiles.PROFILES`, `app.create_app(cfg)` (a Starlette
app; `app.state.sim` is the `simulator.Simulator`), `cli.main(argv)`.
Run it: `python -m sim --profile fast --port 8100`.
"""

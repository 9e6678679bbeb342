"""The simulator's TGI and Triton surfaces, served by the same engine as its OpenAI one.

- TGI (:mod:`sim.dialects.tgi`): ``POST /generate_stream`` (SSE token events),
  ``POST /generate``, ``GET /info``; errors ``{"error", "error_type"}`` (422
  validation, 429 overloaded, 5xx generation). Like TGI, output keeps a matched stop
  string; ``parameters.grammar`` of type ``json`` makes an unscripted reply a JSON
  value of the schema.
- Triton (:mod:`sim.dialects.triton`; vLLM backend, generate extension):
  ``POST /v2/models/{m}/generate_stream``, ``POST /v2/models/{m}/generate``,
  ``GET /v2/health/ready``, ``GET /v2/health/live``, ``GET /v2/models/{m}/ready``;
  errors ``{"error"}``. A full queue (the ``429`` fault) is Triton's 503 "Exceeds
  maximum queue size"; stop strings are cut, as vLLM does.

Both honour ``X-Sim-Fault`` (status faults, drop, stall, slow, malformed) and scripts
(``X-Sim-Script`` or ``/sim/scripts`` rules); a scripted tool call is rendered as the
Hermes ``<tool_call>{...}</tool_call>`` text a tool-calling model would write
(:mod:`sim.dialects.generation`).
"""

from __future__ import annotations

from prometheus_client import Gauge
from starlette.routing import BaseRoute

from sim.dialects import tgi, triton
from sim.simulator import Simulator


def dialect_routes(sim: Simulator) -> list[BaseRoute]:
    """TGI's and Triton's routes, and TGI's queue gauges next to the vLLM ones."""
    registry = sim.metrics.registry
    Gauge("tgi_queue_size", "Current queue size", registry=registry).set_function(
        lambda: len(sim.engine.waiting)
    )
    Gauge("tgi_batch_current_size", "Current batch size", registry=registry).set_function(
        lambda: len(sim.engine.running)
    )
    return [*tgi.ROUTES, *triton.ROUTES]

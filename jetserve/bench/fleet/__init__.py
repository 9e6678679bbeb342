"""Fleet-based benchmarks: real jetserve fleets on loopback.

- ``scenarios``: ``jetserve bench fleet``, the fleet-routing scenarios (affinity,
  saturation, failover, hedging), each with its own baseline;
- ``client``: their open-loop streaming client, run summaries and the ledger check;
- ``plots``: one PNG per scenario;
- ``targets``: ``jetserve bench run --fleet``, a fleet (and LiteLLM) as targets.
"""

"""`jetserve bench`: open-loop benchmarks of OpenAI-compatible targets, side by side.

The pieces, in the order a run meets them:

- ``units``, ``dists``: parsing of durations, rates and length distributions;
- ``arrivals``: Poisson / gamma (burstiness) arrival times;
- ``workload``, ``prompts``, ``trace``: the request schedule (classes, lengths, shared
  prefixes, cancellations), its prompts, and JSONL trace replay;
- ``targets``, ``peer_litellm``, ``fleet.targets``: what is measured;
- ``client``, ``timeline``, ``openloop``, ``loadgen``: the streaming client that
  records per-request timelines, driven open-loop (the one driver, ``openloop``) in
  a process of its own;
- ``slo``, ``metrics``: vLLM's metric definitions (and the one ``percentile``),
  goodput, added latency;
- ``cpu``: CPU time of the fleet's processes (and everyone else's) around each run;
- ``sweep``, ``report``, ``summary``, ``plots``, ``progress``, ``plan``: orchestration
  and output;
- ``closedloop``, ``capacity``, ``capacity_stats``, ``capacity_report``: `jetserve bench
  capacity`, a closed loop per concurrency level: max req/s and CPU-ms per request by
  component;
- ``cli``, ``commands``: the flags and the commands (run, plan, report, fleet, capacity);
- ``fleet/``: ``jetserve bench fleet``, the fleet-routing scenarios on real fleets.

Nothing here is imported by the gateway or the workers.
"""

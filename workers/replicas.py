"""One probe for the replicas one worker process drives (``jetserve worker
--engine A --engine B``): a replica is an engine with its own worker id,
admission and lanes, so each keeps its own metrics registry; the process serves
them on one port, each series labelled ``replica`` (its worker id), and is
ready when every replica is."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from workers.probe import Checks

REPLICA_LABEL = "replica"


class ReplicaCollector(Collector):
    def __init__(self, replicas: Sequence[tuple[str, CollectorRegistry]]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for n, (replica, registry) in enumerate(self._replicas):
            for family in registry.collect():
                process = family.name.startswith("process_")
                if process and n:
                    continue  # one process: its CPU and memory once, unlabelled
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for sample in family.samples:
                    labels = sample.labels if process else {**sample.labels, REPLICA_LABEL: replica}
                    out.samples.append(sample._replace(labels=labels))
        return merged.values()


def replica_registry(replicas: Sequence[tuple[str, CollectorRegistry]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReplicaCollector(replicas))
    return registry


def all_ready(checks: Sequence[Checks]) -> Checks:
    def check() -> dict[str, bool]:
        out: dict[str, bool] = {}
        for one in checks:
            for name, ok in one().items():
                out[name] = out.get(name, True) and ok
        return out

    return check

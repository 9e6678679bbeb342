"""``jetserve scale``: per request class, the queue lag KEDA's NATS JetStream scaler
reads and the worker count it will ask for.

What KEDA does (``pkg/scalers/nats_jetstream_scaler.go`` in kedacore/keda):

- it GETs ``http://<natsServerMonitoringEndpoint>/jsz?acc=<account>&consumers=true&config=true``
  and, for the trigger's ``stream`` and ``consumer``, reads
  ``lag = num_pending + num_ack_pending`` (a consumer it cannot find reads as the
  stream's ``last_seq``);
- the trigger is *active* while ``lag > activationLagThreshold``: that alone moves a
  deployment between 0 and 1 replicas (``minReplicaCount: 0`` only);
- otherwise the HPA scales on the lag as an external metric with an ``AverageValue``
  target of ``lagThreshold``: ``ceil(lag / lagThreshold)``, bounded by
  ``[max(minReplicaCount, 1), maxReplicaCount]``, and left alone while it is within
  the HPA's 10 % tolerance of the current replicas.

jetserve's workers ack a request at its first token, so the lag counts requests
waiting in the queue plus those a worker has fetched but not yet started streaming;
requests already streaming are not in it.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import msgspec
import nats
import nats.errors
from nats.js.errors import NotFoundError

from streams.connect import OPEN, BusAuth
from streams.definitions import Topology
from streams.depth import ClassDepth, queue_key, read_depths
from streams.pools import pool_token
from streams.provision import recorded_stream

HPA_TOLERANCE = 0.1  # kube-controller-manager --horizontal-pod-autoscaler-tolerance
FORMULA = (
    "lag = num_pending + num_ack_pending; "
    "desired = 0 if minReplicaCount == 0 and lag <= activationLagThreshold, "
    "else clamp(ceil(lag / lagThreshold), max(minReplicaCount, 1), maxReplicaCount)"
)
# KEDA's defaults for a ScaledObject and its nats-jetstream trigger.
KEDA_MIN_REPLICAS = 0
KEDA_MAX_REPLICAS = 100
KEDA_ACTIVATION_LAG = 0
WORKER_MAX_INFLIGHT = 16  # `jetserve worker --max-inflight` default


class ScaleError(RuntimeError):
    """NATS or its monitoring endpoint did not answer as expected (exit status 1)."""


class OptionError(ScaleError):
    """A bad option value (exit status 2, like argparse)."""


@dataclass(frozen=True)
class Policy:
    """One class's ScaledObject, as far as the replica count depends on it."""

    max_inflight: int  # the worker's --max-inflight: its concurrency
    lag_threshold: int  # trigger metadata lagThreshold
    activation_lag_threshold: int = KEDA_ACTIVATION_LAG
    min_replicas: int = KEDA_MIN_REPLICAS
    max_replicas: int = KEDA_MAX_REPLICAS
    current_replicas: int | None = None  # for the HPA tolerance, when known


@dataclass(frozen=True)
class Lag:
    cls: str
    consumer: str
    num_pending: int
    num_ack_pending: int
    num_waiting: int  # pull requests parked on the consumer: idle worker slots
    found: bool = True
    stream_last_seq: int = 0  # what KEDA reads when the consumer is missing

    @property
    def lag(self) -> int:
        if not self.found:
            return self.stream_last_seq
        return self.num_pending + self.num_ack_pending


def desired_replicas(lag: int, policy: Policy) -> tuple[int, bool, str]:
    """The replica count KEDA + the HPA converge on for ``lag``: (desired, active, why)."""
    if policy.lag_threshold <= 0:
        raise OptionError("lagThreshold must be a positive integer")
    active = lag > policy.activation_lag_threshold
    if policy.min_replicas == 0 and not active:
        why = (
            f"lag {lag} <= activationLagThreshold {policy.activation_lag_threshold} "
            "and minReplicaCount 0: scale to zero (after cooldownPeriod)"
        )
        return 0, active, why
    floor = max(policy.min_replicas, 1)
    raw = math.ceil(lag / policy.lag_threshold)
    why = f"ceil({lag} / {policy.lag_threshold}) = {raw}"
    current = policy.current_replicas
    if current:  # the HPA keeps the current count while the ratio is within tolerance
        ratio = lag / (policy.lag_threshold * current)
        if abs(1.0 - ratio) <= HPA_TOLERANCE:
            raw = current
            why += f", within the HPA's 10% tolerance of the current {current}: {current}"
    desired = min(max(raw, floor), policy.max_replicas)
    why += f", clamp to [{floor}, {policy.max_replicas}] = {desired}"
    return desired, active, why


# -- per-class option values ----------------------------------------------------


def per_class(
    values: list[str], default: int | None, classes: tuple[str, ...], option: str
) -> dict[str, int | None]:
    """``N`` or ``CLS=N``, comma-separated and repeatable: a bare ``N`` sets every
    class; later values win. Unknown classes and negative numbers are errors."""
    out: dict[str, int | None] = dict.fromkeys(classes, default)
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            name, sep, num = item.rpartition("=")
            try:
                n = int(num)
            except ValueError:
                raise OptionError(f"{option}: expected N or CLASS=N, got {item!r}") from None
            if n < 0:
                raise OptionError(f"{option}: {item!r} is negative")
            if not sep:
                out = dict.fromkeys(classes, n)
                continue
            if name not in classes:
                raise OptionError(f"{option}: unknown class {name!r} (classes: {classes})")
            out[name] = n
    return out


def policies(args: argparse.Namespace, classes: tuple[str, ...]) -> dict[str, Policy]:
    inflight = per_class(args.max_inflight, WORKER_MAX_INFLIGHT, classes, "--max-inflight")
    target = per_class(args.target_per_worker, None, classes, "--target-per-worker")
    activation = per_class(args.activation_lag, KEDA_ACTIVATION_LAG, classes, "--activation-lag")
    low = per_class(args.min_replicas, KEDA_MIN_REPLICAS, classes, "--min-replicas")
    high = per_class(args.max_replicas, KEDA_MAX_REPLICAS, classes, "--max-replicas")
    current = per_class(args.replicas, None, classes, "--replicas")
    out: dict[str, Policy] = {}
    for cls in classes:
        concurrency = inflight[cls] or 0
        threshold = target[cls] if target[cls] is not None else concurrency
        lo, hi = low[cls] or 0, high[cls] or 0
        if not concurrency:
            raise OptionError(f"--max-inflight for {cls} must be at least 1")
        if not threshold:
            raise OptionError(f"--target-per-worker for {cls} must be at least 1")
        if hi < max(lo, 1):
            raise OptionError(f"{cls}: --max-replicas {hi} is below --min-replicas {max(lo, 1)}")
        out[cls] = Policy(
            max_inflight=concurrency,
            lag_threshold=threshold,
            activation_lag_threshold=activation[cls] or 0,
            min_replicas=lo,
            max_replicas=hi,
            current_replicas=current[cls],
        )
    return out


# -- reading the lag -------------------------------------------------------------


async def lags_from_nats(
    url: str,
    topo: Topology,
    classes: tuple[str, ...],
    auth: BusAuth = OPEN,
    deployment: str = "",
) -> list[Lag]:
    """The consumers' state through the JetStream API (the numbers /jsz shows).
    ``deployment``: the workers' own; its pool's backlog of each class counts too
    (their routed requests: only they take them)."""

    async def quiet(_: Exception) -> None:
        pass

    try:
        nc = await nats.connect(
            url,
            name="jetserve-scale",
            allow_reconnect=False,
            connect_timeout=3,
            # nats-py reads 0 as "retry forever" here: 1 means two tries, then fail.
            max_reconnect_attempts=1,
            reconnect_time_wait=0.2,
            error_cb=quiet,
            **auth.options(),
        )
    except (nats.errors.Error, OSError) as exc:
        raise ScaleError(f"cannot connect to NATS at {url}: {exc}") from exc
    try:
        js = nc.jetstream(timeout=3)
        try:
            stream = await recorded_stream(js, topo)  # one stream, or one per class
        except NotFoundError:
            raise ScaleError(f"stream {topo.stream} not found at {url}") from None
        # One consumer list for every class: its plain subject, its lanes (as
        # many as the stream records) and its excess hold its work (docs/routing.md).
        topo = topo.with_stream_lanes(stream.config.metadata)
        depths = await read_depths(js, topo)
        out = []
        for cls in classes:
            name = topo.consumer_name(cls)
            d = depths.get(cls, ClassDepth())
            if deployment:
                own = depths.get(queue_key(cls, pool_token(deployment)), ClassDepth())
                d = msgspec.structs.replace(
                    d, pending=d.pending + own.pending, ack_pending=d.ack_pending + own.ack_pending
                )
            if not d.found:
                last = stream.state.last_seq or 0
                out.append(Lag(cls, name, 0, 0, 0, found=False, stream_last_seq=last))
            else:
                out.append(Lag(cls, name, d.pending, d.ack_pending, d.waiting))
        return out
    except (nats.errors.Error, TimeoutError) as exc:
        raise ScaleError(f"JetStream API at {url}: {exc!r}") from exc
    finally:
        await nc.close()


def jsz_url(endpoint: str, account: str) -> str:
    """KEDA's URL: ``natsServerMonitoringEndpoint`` is host:port; a scheme is allowed."""
    base = endpoint if "://" in endpoint else f"http://{endpoint}"
    return f"{base.rstrip('/')}/jsz?acc={account}&consumers=true&config=true"


def lags_from_jsz(
    doc: dict[str, Any], account: str, topo: Topology, classes: tuple[str, ...]
) -> list[Lag]:
    """Exactly KEDA's reading of a ``/jsz`` document."""
    for acc in doc.get("account_details") or []:
        if acc.get("name") != account:
            continue
        streams = {s.get("name"): s for s in acc.get("stream_detail") or []}
        split = topo.split(True)
        if topo.stream not in streams and split.request_streams[0] in streams:
            topo = split  # one stream per class (gateway --class-streams)
        if topo.stream_of(classes[0] if classes else topo.classes[0]) in streams:
            out = []
            for cls in classes:
                stream = streams.get(topo.stream_of(cls)) or {}
                consumers = {c.get("name"): c for c in stream.get("consumer_detail") or []}
                last = int((stream.get("state") or {}).get("last_seq") or 0)
                name = topo.consumer_name(cls)
                c = consumers.get(name)
                if c is None:
                    out.append(Lag(cls, name, 0, 0, 0, found=False, stream_last_seq=last))
                else:
                    out.append(
                        Lag(
                            cls,
                            name,
                            int(c.get("num_pending") or 0),
                            int(c.get("num_ack_pending") or 0),
                            int(c.get("num_waiting") or 0),
                        )
                    )
            return out
    raise ScaleError(f"stream {topo.stream} not found in account {account!r} (KEDA: no metric)")


async def lags_from_monitoring(
    endpoint: str, account: str, topo: Topology, classes: tuple[str, ...]
) -> list[Lag]:
    url = jsz_url(endpoint, account)
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            response = await client.get(url)
            response.raise_for_status()
            doc = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise ScaleError(f"GET {url}: {exc!r}") from exc
    return lags_from_jsz(doc, account, topo, classes)


# -- the report ------------------------------------------------------------------


def report(lags: list[Lag], pols: dict[str, Policy], source: str, stream: str) -> dict[str, Any]:
    rows = []
    for item in lags:
        pol = pols[item.cls]
        desired, active, why = desired_replicas(item.lag, pol)
        rows.append(
            {
                "class": item.cls,
                "consumer": item.consumer,
                "consumer_found": item.found,
                "num_pending": item.num_pending,
                "num_ack_pending": item.num_ack_pending,
                "num_waiting": item.num_waiting,
                "lag": item.lag,
                **asdict(pol),
                "active": active,
                "desired_replicas": desired,
                "explain": why,
            }
        )
    return {
        "time": round(time.time(), 3),
        "source": source,
        "stream": stream,
        "formula": FORMULA,
        "classes": rows,
    }

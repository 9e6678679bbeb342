"""Fault injection: parse fault specs and pick one per request, by header or by seeded rate."""

from __future__ import annotations

import random
from enum import StrEnum

import msgspec


class FaultKind(StrEnum):
    RATE_LIMIT = "429"  # OpenAI-shaped rate limit error with Retry-After
    UNAVAILABLE = "503"
    INTERNAL = "500"
    DROP = "drop"  # drop:N  close the connection abruptly after N tokens
    STALL = "stall"  # stall: hang after the first token; stall:MS: delay the first token
    SLOW = "slow"  # slow:MS  every inter-token latency forced to MS
    MALFORMED = "malformed"  # malformed:N  stream event N (0-based) is not JSON
    # inband:STATUS  the stream's first event is the engine's error event (200 and
    # the headers already sent): vLLM's {"error": {..., "code"}}, TGI's
    # {"error", "error_type"} (429: overloaded, 4xx: validation, else generation)
    INBAND = "inband"


STATUS_FAULTS = {FaultKind.RATE_LIMIT: 429, FaultKind.UNAVAILABLE: 503, FaultKind.INTERNAL: 500}


class Fault(msgspec.Struct, frozen=True):
    kind: FaultKind
    arg: int | None = None

    @property
    def spec(self) -> str:
        return self.kind.value if self.arg is None else f"{self.kind.value}:{self.arg}"

    @property
    def status(self) -> int | None:
        return STATUS_FAULTS.get(self.kind)


def parse_fault(spec: str) -> Fault:
    """`429`, `503`, `500`, `drop:N`, `stall`, `stall:MS`, `slow:MS`, `malformed:N`,
    `inband:STATUS`."""
    head, _, tail = spec.strip().partition(":")
    try:
        kind = FaultKind(head.lower())
    except ValueError:
        raise ValueError(f"unknown fault {spec!r}") from None
    arg: int | None = None
    if tail:
        if kind in STATUS_FAULTS:
            raise ValueError(f"fault {head} takes no argument: {spec!r}")
        try:
            arg = int(tail)
        except ValueError:
            raise ValueError(f"fault argument must be an integer: {spec!r}") from None
        if arg < 0:
            raise ValueError(f"fault argument must be >= 0: {spec!r}")
    elif kind in (FaultKind.DROP, FaultKind.MALFORMED):
        arg = 0
    elif kind is FaultKind.INBAND:
        arg = 500
    elif kind is FaultKind.SLOW:
        raise ValueError(f"slow needs milliseconds, e.g. slow:50: {spec!r}")
    if kind is FaultKind.INBAND and not 400 <= (arg or 0) <= 599:
        raise ValueError(f"inband takes an error status, e.g. inband:400: {spec!r}")
    return Fault(kind, arg)


class FaultPicker:
    """One draw per request; the rates are mutually exclusive slices of [0, 1)."""

    def __init__(self, rates: dict[str, float], seed: int) -> None:
        # Sorted so the same config and seed give the same fault sequence.
        self._slices = [(parse_fault(spec), rate) for spec, rate in sorted(rates.items())]
        self._rng = random.Random(seed ^ 0x5EED_FA17)

    def pick(self, header: str | None) -> Fault | None:
        """The request header wins; `X-Sim-Fault: none` opts a request out of rate faults."""
        if header is not None:
            if header.strip().lower() in ("", "none"):
                return None
            return parse_fault(header)
        if not self._slices:
            return None
        u = self._rng.random()
        for fault, rate in self._slices:
            if u < rate:
                return fault
            u -= rate
        return None

"""The sessions of the request path: an admitted request, a resumed stream,
and an idempotent replay. Each admitted or resumed one ends in exactly one
recorded outcome (gateway/inference/service.py, ``finish``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gateway.inference.dispatch import FrameStream
from gateway.inference.openai_types import Parsed, choices_of
from gateway.tenancy.accounting import Reservation, Scope
from gateway.tenancy.idempotency import Claim
from gateway.tenancy.keys import KeyRecord
from gateway.tracing import Span
from streams.wire import Meta, Op


@dataclass
class Admitted:
    """An accepted request: from here on it must end in one recorded outcome."""

    op: Op
    parsed: Parsed
    key: KeyRecord
    stream: FrameStream
    reservation: Reservation
    raw: bytes
    claim: Claim | None = None
    span: Span | None = None
    started: float = field(default_factory=time.monotonic)
    outcome: str | None = None
    tokens_seen: int = 0  # token frames relayed, for a charge when no usage arrives
    # An Idempotency-Key retry following the first run's frames (the first run,
    # or the orphan sweep, may settle it instead: whoever reaches Redis first).
    attached: bool = False
    lingering: bool = False  # its client left; a resume may still pick it up

    @property
    def request_id(self) -> str:
        return self.stream.req.id

    @property
    def last_event_id(self) -> int:
        return 0  # a fresh stream: the client has no chunk yet

    @property
    def created(self) -> float:
        """When the request was accepted: every rendering's ``created``."""
        return self.stream.req.created

    @property
    def wants_stream(self) -> bool:
        return bool(getattr(self.parsed, "stream", False))

    @property
    def include_usage(self) -> bool:
        opts = getattr(self.parsed, "stream_options", None)
        return bool(opts and opts.include_usage)

    @property
    def choices(self) -> int:
        """The choices the reply has (each gets its finish reason)."""
        return choices_of(self.parsed)

    @property
    def model(self) -> str:
        return self.parsed.model

    @property
    def scope(self) -> Scope:
        return Scope.of(self.key)

    @property
    def reserved_micros(self) -> int:
        return self.reservation.cost_micros


@dataclass
class Resumed:
    """A client picking up a stream from the frames capture, on any replica."""

    stream: FrameStream
    include_usage: bool = False
    # The client has every chunk through this event id (gateway/inference/event_ids.py).
    last_event_id: int = 0
    started: float = field(default_factory=time.monotonic)
    outcome: str | None = None
    tokens_seen: int = 0
    # The request body is not in the capture: choices past 0 are known by their tokens.
    choices: int = 1

    @property
    def meta(self) -> Meta:
        assert self.stream.meta is not None
        return self.stream.meta

    @property
    def op(self) -> Op:
        return self.meta.op

    @property
    def request_id(self) -> str:
        return self.stream.req.id

    @property
    def model(self) -> str:
        return self.meta.model

    @property
    def created(self) -> float:
        return self.meta.created

    @property
    def scope(self) -> Scope:
        return Scope(self.meta.org, self.meta.tenant, self.meta.key_id)

    @property
    def reserved_micros(self) -> int:
        return self.meta.reserved_micros


Session = Admitted | Resumed


@dataclass
class Replayed:
    """An Idempotency-Key retry: the stored response, nothing run or charged."""

    status: int
    response: dict[str, Any]
    request_id: str

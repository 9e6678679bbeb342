"""W3C trace context, and optional OpenTelemetry spans.

Without configuration (the default) only ids travel: each hop takes the caller's
``traceparent``, starts its own span id under the same trace, and passes that on.
With an exporter configured (``otlp+http://host:4318`` or ``file:///path.jsonl``)
and the ``otel`` extra installed, the same hops become real OpenTelemetry spans
(one per gateway request, one per worker attempt) whose ids are the ones that
travel. Never prompt or completion text in span attributes.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def parse_traceparent(value: str | None) -> tuple[str, str, str] | None:
    """(trace id, parent span id, flags) of a valid header, else None."""
    if not value:
        return None
    m = _TRACEPARENT.match(value.strip().lower())
    if not m or m.group(1) == "0" * 32 or m.group(2) == "0" * 16:
        return None
    return m.group(1), m.group(2), m.group(3)


def child_traceparent(incoming: str | None) -> str:
    """A new span under the caller's trace (or a new trace for a missing or
    malformed header)."""
    parsed = parse_traceparent(incoming)
    trace_id, flags = (parsed[0], parsed[2]) if parsed else (secrets.token_hex(16), "01")
    return f"00-{trace_id}-{secrets.token_hex(8)}-{flags}"


@dataclass
class Span:
    """A started span: ``traceparent`` is what the next hop must receive."""

    traceparent: str
    _otel: Any = None
    attributes: dict[str, Any] = field(default_factory=dict)

    def set(self, key: str, value: str | int | float | bool) -> None:
        if self._otel is not None:
            self._otel.set_attribute(key, value)

    def event(self, name: str) -> None:
        """A timestamped point inside the span (the hops of a request: held,
        queued, final; the engine call's start and end)."""
        if self._otel is not None:
            self._otel.add_event(name)

    def end(self, outcome: str = "ok", at_ns: int | None = None) -> None:
        """End the span, now or at ``at_ns`` (epoch nanoseconds, already past)."""
        if self._otel is None:
            return
        from opentelemetry.trace import Status, StatusCode

        self._otel.set_attribute("jetserve.outcome", outcome)
        if outcome not in ("ok", "stop", "length", "tool_calls"):
            self._otel.set_status(Status(StatusCode.ERROR, outcome))
        self._otel.end(end_time=at_ns)


class Tracer:
    """Spans for one process. Disabled: ids only, no dependency needed."""

    def __init__(self, service: str, exporter: str | None = None) -> None:
        self.enabled = bool(exporter)
        self._provider: Any = None
        self._tracer: Any = None
        if not exporter:
            return
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError as exc:  # configured, but the extra is missing: say so
            raise RuntimeError(
                "tracing export needs the extra: pip install 'jetserve[otel]'"
            ) from exc
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if exporter.startswith("file://"):
            # Simple (synchronous) for the file exporter: every span is on disk
            # the moment it ends, which is what a test or a debug session wants.
            provider.add_span_processor(SimpleSpanProcessor(_json_lines_exporter(exporter[7:])))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            endpoint = exporter.removeprefix("otlp+")
            provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces"))
            )
        self._provider = provider
        self._tracer = provider.get_tracer("jetserve")

    def start(self, name: str, parent: str | None, attributes: Mapping[str, Any]) -> Span:
        if self._tracer is None:
            return Span(child_traceparent(parent))
        from opentelemetry.trace import (
            NonRecordingSpan,
            SpanContext,
            TraceFlags,
            set_span_in_context,
        )

        parsed = parse_traceparent(parent)
        context = None
        if parsed:
            parent_ctx = SpanContext(
                trace_id=int(parsed[0], 16),
                span_id=int(parsed[1], 16),
                is_remote=True,
                trace_flags=TraceFlags(int(parsed[2], 16)),
            )
            context = set_span_in_context(NonRecordingSpan(parent_ctx))
        span = self._tracer.start_span(name, context=context, attributes=dict(attributes))
        ctx = span.get_span_context()
        tp = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
        return Span(tp, span)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


def _json_lines_exporter(path: str) -> Any:
    """One JSON object per finished span, appended to a file (tests, debugging).
    Defined on demand: the SDK is an optional extra."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class JsonLinesExporter(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            with open(path, "a") as fh:
                for s in spans:
                    ctx = s.get_span_context()
                    fh.write(
                        json.dumps(
                            {
                                "name": s.name,
                                "trace_id": f"{ctx.trace_id:032x}",
                                "span_id": f"{ctx.span_id:016x}",
                                "parent_id": f"{s.parent.span_id:016x}" if s.parent else None,
                                # Unix ns, one clock for every process of a host:
                                # where a request's time went, hop by hop.
                                "start_ns": s.start_time,
                                "end_ns": s.end_time,
                                "events": {e.name: e.timestamp for e in s.events},
                                "attributes": dict(s.attributes or {}),
                                "status": s.status.status_code.name,
                                "service": s.resource.attributes.get("service.name"),
                            }
                        )
                        + "\n"
                    )
            return SpanExportResult.SUCCESS

    return JsonLinesExporter()

"""Trace context for the gateway: the one implementation lives in the shared
kernel (``streams.tracing``), so every hop speaks the same W3C ids."""

from streams.tracing import Span, Tracer, child_traceparent, parse_traceparent

__all__ = ["Span", "Tracer", "child_traceparent", "parse_traceparent"]

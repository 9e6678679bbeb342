"""The protocol-independent request path, shared by the HTTP, WebSocket and
NATS ingresses: authenticate, validate, classify, publish; then collect or
relay the frames. Every accepted request ends in exactly one recorded outcome.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher, FrameStream, error_from_frame
from gateway.errors import BadRequest, GatewayError, NotFound
from gateway.keys import KeyRecord, KeyStore
from gateway.metrics import GatewayMetrics
from gateway.openai_types import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    Parsed,
    ParsedType,
    completion_response,
    embeddings_response,
    estimate_prompt_tokens,
    merge_tool_calls,
    parse_body,
)
from streams.subjects import RequestClass
from streams.wire import ErrorFrame, Final, InferenceRequest, Op, Token

_KINDS: dict[Op, ParsedType] = {
    "chat": ChatRequest,
    "completion": CompletionRequest,
    "embedding": EmbeddingRequest,
}
CLASS_HEADER = "x-jetserve-class"
TIMEOUT_HEADER = "x-jetserve-timeout"


@dataclass
class Admitted:
    """An accepted request: from here on it must end in one recorded outcome."""

    op: Op
    parsed: Parsed
    key: KeyRecord
    stream: FrameStream
    started: float = field(default_factory=time.monotonic)
    outcome: str | None = None

    @property
    def request_id(self) -> str:
        return self.stream.req.id

    @property
    def wants_stream(self) -> bool:
        return bool(getattr(self.parsed, "stream", False))

    @property
    def include_usage(self) -> bool:
        opts = getattr(self.parsed, "stream_options", None)
        return bool(opts and opts.include_usage)


@dataclass
class Result:
    text: str
    tool_calls: list[dict[str, Any]]
    final: Final


class Gateway:
    def __init__(
        self, cfg: GatewayConfig, keys: KeyStore, dispatcher: Dispatcher, metrics: GatewayMetrics
    ) -> None:
        self.cfg = cfg
        self.keys = keys
        self.dispatcher = dispatcher
        self.metrics = metrics

    def models(self) -> list[str]:
        return [*self.cfg.models, *self.cfg.embedding_models]

    async def admit(self, op: Op, raw: bytes, headers: Mapping[str, str]) -> Admitted:
        try:
            key = await self.keys.authenticate(headers.get("authorization"))
            parsed, body = parse_body(raw, _KINDS[op])
            req = self._build(op, parsed, body, key, headers)
            stream = await self.dispatcher.submit(req)
        except GatewayError as exc:
            self.metrics.rejected.labels(exc.code).inc()
            raise
        self.metrics.inflight.inc()
        return Admitted(op, parsed, key, stream)

    def _build(
        self,
        op: Op,
        parsed: Parsed,
        body: dict[str, Any],
        key: KeyRecord,
        headers: Mapping[str, str],
    ) -> InferenceRequest:
        served = self.cfg.embedding_models if op == "embedding" else self.cfg.models
        if parsed.model not in served:
            raise NotFound(f"The model '{parsed.model}' does not exist.", param="model")
        if op == "embedding":
            cls = RequestClass.EMBED
        else:
            wanted = headers.get(CLASS_HEADER, RequestClass.INTERACTIVE.value)
            if wanted not in (RequestClass.INTERACTIVE.value, RequestClass.BATCH.value):
                raise BadRequest(f"Unknown request class '{wanted}'.", param=CLASS_HEADER)
            cls = RequestClass(wanted)
        timeout = self.cfg.default_timeout_s
        if TIMEOUT_HEADER in headers:
            try:
                timeout = float(headers[TIMEOUT_HEADER])
            except ValueError:
                raise BadRequest(
                    "X-Jetserve-Timeout must be seconds.", param=TIMEOUT_HEADER
                ) from None
            if not 0 < timeout <= self.cfg.max_timeout_s:
                raise BadRequest(
                    f"X-Jetserve-Timeout must be in (0, {self.cfg.max_timeout_s}].",
                    param=TIMEOUT_HEADER,
                )
        max_tokens = 0
        if isinstance(parsed, ChatRequest | CompletionRequest):
            max_tokens = parsed.max_tokens or self.cfg.default_max_tokens
            if isinstance(parsed, ChatRequest) and parsed.max_completion_tokens:
                max_tokens = parsed.max_completion_tokens
        forwarded = {
            k: v
            for k, v in headers.items()
            if any(k.lower().startswith(p) for p in self.cfg.forward_header_prefixes)
        }
        now = time.time()
        request_id = uuid.uuid4().hex
        return InferenceRequest(
            id=request_id,
            op=op,
            cls=cls.value,
            model=parsed.model,
            body=body,
            reply=self.dispatcher.reply_for(request_id),
            deadline=now + timeout,
            tenant=key.tenant,
            key_id=key.key_id,
            traceparent=headers.get("traceparent", ""),
            prompt_tokens_est=estimate_prompt_tokens(parsed),
            max_tokens=max_tokens,
            created=now,
            headers=forwarded,
        )

    def record(self, adm: Admitted, outcome: str, final: Final | None = None) -> None:
        """The one terminal outcome of an accepted request (idempotent)."""
        if adm.outcome is not None:
            return
        adm.outcome = outcome
        adm.stream.close()
        cls = adm.stream.req.cls
        m = self.metrics
        m.inflight.dec()
        m.requests.labels(adm.op, cls, outcome).inc()
        m.e2e.labels(adm.op, cls).observe(time.monotonic() - adm.started)
        if adm.stream.first_token_at is not None:
            m.ttft.labels(cls).observe(adm.stream.first_token_at - adm.started)
        if final is not None:
            m.tokens.labels(cls, "input").inc(final.usage.prompt_tokens)
            m.tokens.labels(cls, "output").inc(final.usage.completion_tokens)

    def fail(self, adm: Admitted, exc: GatewayError) -> None:
        self.record(adm, exc.code)

    async def abandon(self, adm: Admitted, reason: str = "client_disconnected") -> None:
        """The client went away: cancel upstream so the engine stops at once."""
        await adm.stream.cancel(reason)
        self.record(adm, "cancelled")

    async def collect(self, adm: Admitted) -> Result:
        """Wait for the whole result (non-streaming clients)."""
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        try:
            async for event in adm.stream.events(self.cfg.heartbeat_timeout_s):
                if isinstance(event, Token):
                    text.append(event.text)
                    if event.tool_calls:
                        merge_tool_calls(calls, event.tool_calls)
                elif isinstance(event, ErrorFrame):
                    raise error_from_frame(event)
                else:
                    self.record(adm, "ok", event)
                    return Result("".join(text), calls, event)
        except GatewayError as exc:
            self.fail(adm, exc)
            raise
        raise AssertionError("frame stream ended without a terminal frame")

    def render(self, adm: Admitted, result: Result) -> dict[str, Any]:
        model = result.final.model or adm.parsed.model
        if isinstance(adm.parsed, EmbeddingRequest):
            return embeddings_response(
                model,
                result.final.embeddings or [],
                result.final.usage,
                adm.parsed.encoding_format,
            )
        return completion_response(
            adm.op,
            adm.request_id,
            model,
            result.text,
            result.tool_calls,
            result.final.finish_reason,
            result.final.usage,
        )

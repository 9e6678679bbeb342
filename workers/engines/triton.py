"""Adapter for NVIDIA Triton's generate extension (``/v2/models/{model}/generate_stream``),
as served by Triton's vLLM backend.

Request: ``{"text_input": prompt, "parameters": {"stream": true, "max_tokens", ...},
"return_num_input_tokens": true, "return_num_output_tokens": true,
"return_finish_reason": true}`` (the ``return_*`` keys are the vLLM backend's optional
inputs). Response: SSE ``data: {"model_name", "model_version", "text_output", ...}`` one
per step, ``text_output`` being the new text. Errors are ``{"error": "..."}`` with 400 /
500 / 503, mid-stream too. Triton has neither a grammar nor a tool parser on this path,
so tools and response_format are rejected (see :data:`TRITON_TRANSLATIONS`).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote

import httpx
import msgspec

from streams.wire import Op, Usage
from workers.engines import prompted
from workers.engines import translation as t
from workers.engines.base import Delta, Done, Embeddings, EngineAdapter, EngineLoad
from workers.engines.http import engine_client, open_stream, probe, raise_for_status, scrape
from workers.engines.translation import FieldStatus, Translated
from workers.engines.vllm_metrics import parse_vllm_metrics
from workers.errors import (
    EngineRateLimited,
    EngineRejected,
    EngineStreamBroken,
)

T, R, P, NA = (
    FieldStatus.TRANSFORMED,
    FieldStatus.REJECTED,
    FieldStatus.PASSED,
    FieldStatus.NOT_APPLICABLE,
)
_UNMAPPED = "not mapped to the generate extension's parameters: 400 unsupported_parameter"
_NO_TOOLS = "no tool parser or grammar on the generate path: EngineRejected"
TRITON_TRANSLATIONS: Mapping[str, Translated] = {
    t.MESSAGES: Translated(T, "rendered to text_input with the ChatML template"),
    t.CONTENT_PARTS: Translated(R, "one text_input string: only text parts (400 otherwise)"),
    t.MAX_TOKENS: Translated(P, "-> parameters.max_tokens"),
    t.MAX_COMPLETION_TOKENS: Translated(T, "-> parameters.max_tokens"),
    t.FINISH_REASON: Translated(P, "return_finish_reason: vLLM's own"),
    t.TOOLS: Translated(R, _NO_TOOLS),
    t.TOOL_CHOICE: Translated(R, _NO_TOOLS),
    t.PARALLEL_TOOL_CALLS: Translated(R, _NO_TOOLS),
    t.RESPONSE_FORMAT: Translated(R, "no guided decoding on the generate path: EngineRejected"),
    t.STOP: Translated(P, "-> parameters.stop (the vLLM backend cuts it)"),
    t.SEED: Translated(P, "-> parameters.seed"),
    t.TEMPERATURE: Translated(P, "-> parameters.temperature"),
    t.PENALTIES: Translated(R, _UNMAPPED),
    t.LOGIT_BIAS: Translated(R, _UNMAPPED),
    t.LOGPROBS: Translated(R, _UNMAPPED),
    t.N: Translated(R, "one text_output stream per request: n > 1 is 400 unsupported_parameter"),
    t.ECHO: Translated(R, _UNMAPPED),
    t.BEST_OF: Translated(R, _UNMAPPED),
    t.TOP_K: Translated(R, _UNMAPPED),
    t.MIN_P: Translated(R, _UNMAPPED),
    t.MIN_TOKENS: Translated(R, _UNMAPPED),
    t.REPETITION_PENALTY: Translated(R, _UNMAPPED),
    t.IGNORE_EOS: Translated(R, _UNMAPPED),
    t.STRUCTURED_OUTPUTS: Translated(R, "no guided decoding on the generate path: EngineRejected"),
    t.USAGE: Translated(
        T, "return_num_input_tokens / return_num_output_tokens, summed over the stream"
    ),
    t.CACHED_TOKENS: Translated(NA, "the generate extension reports no prefix-cache hits"),
    t.CANCELLATION: Translated(P, "closing the SSE connection cancels the request"),
    t.ERR_CONTEXT: Translated(
        T, "400 (or a 500 that names the context length) -> EngineRejected (400)"
    ),
    t.ERR_MODEL: Translated(
        NA,
        "the URL names the deployment's model, the body's is not sent; the gateway "
        "answers 404 for a model it does not route",
    ),
    t.ERR_INVALID: Translated(R, "presence_penalty is not mapped: 400 unsupported_parameter"),
    t.ERR_429: Translated(
        T, "Triton has no 429: a 503 'Exceeds maximum queue size' -> EngineRateLimited"
    ),
    t.ERR_5XX: Translated(P, "5xx -> EngineUnavailable"),
    t.ERR_MALFORMED: Translated(P, "undecodable SSE event -> EngineStreamBroken"),
}

_CARRIED = (
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
)
_CONTEXT = re.compile(r"context length|maximum model length|max_model_len", re.IGNORECASE)
_QUEUE_FULL = re.compile(r"exceeds maximum queue size", re.IGNORECASE)
_PENDING = re.compile(r"^nv_inference_pending_request_count(\{[^}]*\})?\s+([0-9.eE+-]+)$")


class _Chunk(msgspec.Struct):
    text_output: str = ""
    model_name: str = ""
    finish_reason: str | list[str] | None = None
    num_input_tokens: int | list[int] | None = None
    num_output_tokens: int | list[int] | None = None
    error: str | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_encoder = msgspec.json.Encoder()


def _scalar(value: Any) -> Any:
    """Triton may render a one-element output tensor as a list."""
    if isinstance(value, list):
        return value[0] if value else None
    return value


def _raise(status: int, body: bytes) -> None:
    text = body.decode("utf-8", "replace")
    if _QUEUE_FULL.search(text):
        raise EngineRateLimited("Triton: exceeds maximum queue size")
    if _CONTEXT.search(text):
        raise_for_status(400, body)
    raise_for_status(status, body)


def _payload(op: Op, body: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    for field, reason in (("tools", "tools"), ("response_format", "response_format")):
        if body.get(field) is not None:
            raise EngineRejected(
                f"the Triton adapter cannot carry {reason}: the generate extension has no "
                "tool parser or guided decoding; route to an OpenAI-compatible engine"
            )
    if body.get("tool_choice") not in (None, "none"):
        raise EngineRejected("the Triton adapter cannot carry tool_choice")
    prompted.check_fields(body, (*_CARRIED, "tool_choice"), "Triton")
    if op == "chat":
        prompt = prompted.render_chatml(list(body.get("messages") or []))
    elif isinstance(body.get("prompt"), str):
        prompt = str(body["prompt"])
    else:
        raise EngineRejected("the Triton adapter takes one prompt string")
    params: dict[str, Any] = {"stream": True}
    limit = prompted.max_tokens(body)
    if limit is not None:
        params["max_tokens"] = limit
    for key in ("temperature", "top_p", "seed"):
        if body.get(key) is not None:
            params[key] = body[key]
    stops = prompted.stop_list(body)
    if stops:
        params["stop"] = stops
    payload = {
        "text_input": prompt,
        "parameters": params,
        "exclude_input_in_output": True,
        "return_finish_reason": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
    }
    return payload, stops


class TritonAdapter(EngineAdapter):
    name = "triton"
    translations = TRITON_TRANSLATIONS

    def __init__(
        self,
        base_url: str,
        *,
        model: str,
        api_key: str | None = None,
        metrics_url: str | None = None,
        max_connections: int = 256,
        connect_timeout: float = 5.0,
    ) -> None:
        if not model:
            raise ValueError("the Triton adapter needs a model name (the URL names it)")
        self.model = model
        self._path = f"/v2/models/{quote(model, safe='')}/generate_stream"
        # Triton serves metrics on their own port (8002 by default).
        self._metrics_url = metrics_url or base_url.rstrip("/") + "/metrics"
        self._client = engine_client(
            base_url, api_key, max_connections=max_connections, connect_timeout=connect_timeout
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def generate(
        self, op: Op, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> AsyncIterator[Delta | Done]:
        if op not in ("chat", "completion"):
            raise EngineRejected(f"operation {op!r} does not stream")
        payload, _ = _payload(op, body)
        payload["id"] = request_id
        hdrs = {"X-Request-Id": request_id, "Content-Type": "application/json", **headers}
        request = self._client.build_request(
            "POST", self._path, content=_encoder.encode(payload), headers=hdrs
        )
        async with open_stream(self._client, request, _raise) as response:
            async for event in self._events(response):
                yield event

    async def _events(self, response: httpx.Response) -> AsyncIterator[Delta | Done]:
        finish: str | None = None
        prompt_tokens = 0
        completion_tokens = 0
        model = self.model
        async for data in prompted.sse_data(response):
            try:
                chunk = _chunk_decoder.decode(data)
            except msgspec.DecodeError as exc:
                raise EngineStreamBroken(f"malformed chunk from engine: {exc}") from exc
            if chunk.error is not None:
                raise EngineStreamBroken(f"engine failed mid-stream: {chunk.error}")
            model = chunk.model_name or model
            prompt_tokens = _scalar(chunk.num_input_tokens) or prompt_tokens
            completion_tokens += _scalar(chunk.num_output_tokens) or 0
            reason = _scalar(chunk.finish_reason)
            if reason:
                finish = str(reason)
            if chunk.text_output or reason:
                yield Delta(chunk.text_output, None, finish)
        if finish is None:
            raise EngineStreamBroken("engine stream ended without a finish reason")
        yield Done(
            finish, Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens), model
        )

    async def embed(
        self, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> Embeddings:
        raise EngineRejected("the Triton adapter serves generation only")

    async def healthy(self) -> bool:
        return await probe(self._client, "/v2/health/ready")

    async def load(self) -> EngineLoad:
        """The vLLM backend's vllm:* gauges, else Triton's pending-request count."""
        text = await scrape(self._client, self._metrics_url)
        if text is None:
            return EngineLoad()
        load = parse_vllm_metrics(text)
        if load.waiting is None:
            pending = [
                float(m.group(2))
                for line in text.splitlines()
                if (m := _PENDING.match(line)) is not None
            ]
            if pending:
                return EngineLoad(waiting=sum(pending), running=load.running)
        return load

"""Adapter for NVIDIA Triton's generate extension (``/v2/models/{model}/generate_stream``),
as served by Triton's vLLM backend.

Request (:mod:`workers.engines.triton_request`): ``{"text_input": prompt, "stream": true,
"sampling_parameters": "<vLLM SamplingParams as JSON>", "exclude_input_in_output": true,
"return_finish_reason": true, "return_num_input_tokens": true,
"return_num_output_tokens": true}`` (+ ``return_logprobs``,
``return_cumulative_logprob``). Response: SSE ``data: {"model_name", "model_version",
"text_output", ...}`` one per step, ``text_output`` being the new text; with ``n`` > 1
each output holds one element per sequence (``"None"`` for an unfinished one's finish
reason). Errors are ``{"error": "..."}`` with 400 / 500 / 503, mid-stream too. The
translation of each field is declared in :data:`TRITON_TRANSLATIONS`.
"""

from __future__ import annotations

import json
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
from workers.engines.http import (
    engine_client,
    open_stream,
    probe,
    raise_for_status,
    read_version,
    scrape,
)
from workers.engines.token_logprobs import TokenLogprob, Track
from workers.engines.tool_emulation import ToolPlan
from workers.engines.translation import FieldStatus, Translated
from workers.engines.triton_request import TritonRequest
from workers.engines.vllm_metrics import parse_vllm_metrics
from workers.errors import (
    EngineRateLimited,
    EngineRejected,
    EngineStreamBroken,
)

T, E, R, P, NA = (
    FieldStatus.TRANSFORMED,
    FieldStatus.EMULATED,
    FieldStatus.REJECTED,
    FieldStatus.PASSED,
    FieldStatus.NOT_APPLICABLE,
)
_SAMPLED = "-> sampling_parameters.{} (vLLM's own)"
TRITON_TRANSLATIONS: Mapping[str, Translated] = {
    t.MESSAGES: Translated(T, "rendered to text_input with the ChatML template"),
    t.CONTENT_PARTS: Translated(R, "one text_input string: only text parts (400 otherwise)"),
    t.MAX_TOKENS: Translated(P, _SAMPLED.format("max_tokens")),
    t.MAX_COMPLETION_TOKENS: Translated(T, "-> sampling_parameters.max_tokens"),
    t.FINISH_REASON: Translated(P, "return_finish_reason: vLLM's own"),
    t.TOOLS: Translated(
        E,
        "the generate extension has no tool parser: Hermes <tools> in the system turn, "
        "<tool_call> blocks parsed from the reply, which arrives in one piece at the end",
    ),
    t.TOOL_CHOICE: Translated(
        E,
        "none: the tools are left out of the prompt; required or a named function: "
        "sampling_parameters.structured_outputs forces the call; auto: the model decides",
    ),
    t.PARALLEL_TOOL_CALLS: Translated(E, "false: the first parsed call is kept"),
    t.RESPONSE_FORMAT: Translated(
        T, "json_schema / json_object -> sampling_parameters.structured_outputs {json}"
    ),
    t.STOP: Translated(P, "-> sampling_parameters.stop (vLLM cuts it)"),
    t.SEED: Translated(P, _SAMPLED.format("seed")),
    t.TEMPERATURE: Translated(P, _SAMPLED.format("temperature")),
    t.PRESENCE_PENALTY: Translated(P, _SAMPLED.format("presence_penalty")),
    t.FREQUENCY_PENALTY: Translated(P, _SAMPLED.format("frequency_penalty")),
    t.LOGIT_BIAS: Translated(
        R,
        "JSON gives the backend string token ids, which it hands to vLLM unconverted: "
        "400 unsupported_parameter",
    ),
    t.LOGPROBS: Translated(
        T,
        "return_logprobs + sampling_parameters.logprobs; the backend's per-token "
        "{token_id: {logprob, rank, decoded_token}} re-shaped into OpenAI's logprobs",
    ),
    t.N: Translated(P, "-> sampling_parameters.n; one output element per choice"),
    t.ECHO: Translated(
        E,
        "the adapter sends the prompt ahead (the backend refuses exclude_input_in_output"
        "=false when streaming); not with logprobs",
    ),
    t.BEST_OF: Translated(
        E,
        "vLLM V1 has no best_of: n = best_of with return_cumulative_logprob, the n "
        "likeliest returned (the reply arrives whole)",
    ),
    t.TOP_K: Translated(P, _SAMPLED.format("top_k")),
    t.MIN_P: Translated(P, _SAMPLED.format("min_p")),
    t.MIN_TOKENS: Translated(P, _SAMPLED.format("min_tokens")),
    t.REPETITION_PENALTY: Translated(P, _SAMPLED.format("repetition_penalty")),
    t.IGNORE_EOS: Translated(P, _SAMPLED.format("ignore_eos")),
    t.STRUCTURED_OUTPUTS: Translated(
        T,
        "guided_json / guided_choice / structured_outputs -> sampling_parameters."
        "structured_outputs (a JSON string)",
    ),
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
    t.ERR_INVALID: Translated(
        T,
        "vLLM's range checks, made by the adapter in vLLM's words (the backend logs "
        "vLLM's own refusal and fails the request without them): EngineRejected (400)",
    ),
    t.ERR_429: Translated(
        T, "Triton has no 429: a 503 'Exceeds maximum queue size' -> EngineRateLimited"
    ),
    t.ERR_5XX: Translated(P, "5xx -> EngineUnavailable"),
    t.ERR_MALFORMED: Translated(P, "undecodable SSE event -> EngineStreamBroken"),
}

_CONTEXT = re.compile(r"context length|maximum model length|max_model_len", re.IGNORECASE)
_QUEUE_FULL = re.compile(r"exceeds maximum queue size", re.IGNORECASE)
_PENDING = re.compile(r"^nv_inference_pending_request_count(\{[^}]*\})?\s+([0-9.eE+-]+)$")


class _Chunk(msgspec.Struct, frozen=True):
    text_output: str | list[str] = ""
    model_name: str = ""
    finish_reason: str | list[str] | None = None
    num_input_tokens: int | list[int] | None = None
    num_output_tokens: int | list[int] | None = None
    logprobs: str | list[str] | None = None
    cumulative_logprob: float | list[float] | None = None
    error: str | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_encoder = msgspec.json.Encoder()


def _each(value: Any) -> list[Any]:
    """An output tensor's elements (Triton renders a one-element tensor as a scalar)."""
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _at(values: list[Any], j: int) -> Any:
    return values[j] if j < len(values) else None


def _raise(status: int, body: bytes) -> None:
    text = body.decode("utf-8", "replace")
    if _QUEUE_FULL.search(text):
        raise EngineRateLimited("Triton: exceeds maximum queue size")
    if _CONTEXT.search(text):
        raise_for_status(400, body)
    raise_for_status(status, body)


def _entries(raw: str, top: int) -> list[TokenLogprob]:
    """The backend's logprobs of one output: per new token, ``{token_id: {logprob, rank,
    decoded_token}}`` with the sampled token first (as vLLM builds it), then the top ones."""
    try:
        steps = json.loads(raw)
    except ValueError as exc:
        raise EngineStreamBroken(f"malformed logprobs from engine: {exc}") from exc
    out = []
    for step in steps or []:
        items = list(step.values())
        if not items:
            continue
        alts = sorted((x for x in items if x.get("rank", top + 1) <= top), key=lambda x: x["rank"])
        sampled = items[0]
        out.append(
            TokenLogprob(
                str(sampled.get("decoded_token") or ""),
                float(sampled.get("logprob", 0.0)),
                tuple((str(x.get("decoded_token") or ""), float(x["logprob"])) for x in alts),
            )
        )
    return out


class _Output:
    """One sequence of the request: its text, finish reason, logprobs and score."""

    def __init__(self, req: TritonRequest, index: int) -> None:
        self.index = index
        # Tool calls come from the whole reply; best_of's choices are known at the end.
        self.buffered = bool(req.tool_plan.tools) or req.best_of is not None
        self.top = req.top
        self.track = Track(req.op, len(req.echo)) if req.top is not None else None
        self.text = ""
        self.finish: str | None = None
        self.cumulative = 0.0

    def add(self, text: str, reason: Any, logprobs: Any, cumulative: Any) -> Delta | None:
        self.text += text
        if reason not in (None, "", "None"):
            self.finish = str(reason)
        if cumulative is not None:
            self.cumulative = float(cumulative)
        if self.track is not None and isinstance(logprobs, str):
            for entry in _entries(logprobs, self.top or 0):
                self.track.push(entry)
        if self.buffered:
            return None
        lps = self.track.take(len(self.text)) if self.track is not None else None
        if text or lps or self.finish:
            return Delta(text, None, self.finish, lps, self.index)
        return None

    def whole(self, index: int, echo: str) -> Delta:
        lps = self.track.take(len(self.text)) if self.track is not None else None
        return Delta(echo + self.text, None, self.finish or "stop", lps, index)

    def tool_reply(self, plan: ToolPlan) -> list[Delta]:
        lps = self.track.take(len(self.text)) if self.track is not None else None
        deltas, self.finish = plan.reply(self.text, self.index, self.finish or "stop", lps)
        return deltas


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
        req = TritonRequest(op, body)
        payload = {**req.payload(), "id": request_id}
        hdrs = {"X-Request-Id": request_id, "Content-Type": "application/json", **headers}
        request = self._client.build_request(
            "POST", self._path, content=_encoder.encode(payload), headers=hdrs
        )
        async with open_stream(self._client, request, _raise) as response:
            async for event in self._events(response, req):
                yield event

    async def _events(
        self, response: httpx.Response, req: TritonRequest
    ) -> AsyncIterator[Delta | Done]:
        whole = req.best_of is not None  # the n likeliest are known at the end only
        outs: dict[int, _Output] = {}
        prompt_tokens = 0
        completion_tokens = 0
        model = self.model
        async for chunk in prompted.sse_events(response, _chunk_decoder):
            model = chunk.model_name or model
            prompt_tokens = (_each(chunk.num_input_tokens) or [prompt_tokens])[0]
            completion_tokens += sum(_each(chunk.num_output_tokens))
            reasons, lps = _each(chunk.finish_reason), _each(chunk.logprobs)
            scores = _each(chunk.cumulative_logprob)
            for j, text in enumerate(_each(chunk.text_output)):
                out = outs.get(j)
                if out is None:
                    out = outs[j] = _Output(req, j)
                    if req.echo and not whole:
                        yield Delta(req.echo, None, None, None, j)
                delta = out.add(str(text), _at(reasons, j), _at(lps, j), _at(scores, j))
                if delta is not None and not whole:
                    yield delta
        if not outs or any(o.finish is None for o in outs.values()):
            raise EngineStreamBroken("engine stream ended without a finish reason")
        ranked = sorted(outs.values(), key=lambda o: (-o.cumulative, o.index))
        if req.tool_plan.tools and not whole:
            for out in outs.values():
                for delta in out.tool_reply(req.tool_plan):
                    yield delta
        if whole:
            for i, out in enumerate(ranked[: req.n]):
                yield out.whole(i, req.echo)
        first = outs[0] if not whole else ranked[0]
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        yield Done(first.finish or "stop", usage, model)

    async def embed(
        self, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> Embeddings:
        raise EngineRejected("the Triton adapter serves generation only")

    async def version(self) -> str:
        return await read_version(self._client, "/v2", "triton")

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

"""Adapter for OpenAI-compatible engines (vLLM's server, the simulator, others).

Always streams from the engine, even for a client's non-streaming request: a
stream can be aborted mid-generation (closing the connection stops vLLM's work)
and lets the worker emit heartbeats and frames as tokens arrive.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

import httpx
import msgspec

from streams.vectors import Vector, check_packed
from streams.wire import Op, Usage
from workers.engines.base import Delta, Done, Embeddings, EngineAdapter, EngineLoad
from workers.engines.http import (
    MAX_BODY,
    PROBE_TIMEOUT_S,
    engine_client,
    lines,
    open_stream,
    probe,
    raise_for_status,
    read_body,
    read_version,
    scrape,
)
from workers.engines.lean_http import LeanClient, lean_probe, lean_scrape
from workers.engines.served import Served, read_served
from workers.engines.translation import STRUCTURED_OUTPUTS, FieldStatus, Translated
from workers.engines.vllm_metrics import parse_vllm_metrics
from workers.errors import (
    EngineError,
    EngineRejected,
    EngineStreamBroken,
    EngineUnsupported,
)

# The simulator's /version (sim/app.py): an engine that runs each embedding call alone.
SIM_VERSION_SUFFIX = "+jetserve.sim"


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: _PromptDetails | None = None

    def to_wire(self) -> Usage:
        details = self.prompt_tokens_details
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens or 0,
            cached_tokens=(details.cached_tokens or 0) if details else 0,
        )


def _status_of(error: Mapping[str, Any]) -> int | None:
    """An in-band error's HTTP status: its ``code`` (vLLM's int; a proxy's "400"),
    else what its OpenAI ``type`` names; None when it says none."""
    code = error.get("code")
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if isinstance(code, int) and 400 <= code <= 599:
        return code
    return _TYPE_STATUS.get(str(error.get("type", "")))


_TYPE_STATUS = {"invalid_request_error": 400, "rate_limit_error": 429}


# vLLM's options for how base64 vectors are packed: the defaults only.
_PACKING: dict[str, tuple[object, ...]] = {
    "embed_dtype": (None, "float32"),
    "endianness": (None, "native", "little"),
}


class _DeltaIn(msgspec.Struct):
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # A reasoning parser's output: vLLM's ``reasoning_content`` (``reasoning`` in
    # its later versions). Dropped, a reasoning model's answer came back empty
    # when its whole budget went on thinking.
    reasoning_content: str | None = None
    reasoning: str | None = None


class _ChoiceIn(msgspec.Struct):
    index: int = 0
    delta: _DeltaIn | None = None  # chat
    text: str | None = None  # completions
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class _Chunk(msgspec.Struct):
    choices: list[_ChoiceIn] = []
    usage: _Usage | None = None
    model: str = ""
    # vLLM's in-band failure (the headers were sent 200): {"message", "type", "code"}.
    error: dict[str, Any] | None = None


class _EmbeddingItem(msgspec.Struct):
    embedding: list[float] | str  # str: base64 of little-endian float32
    index: int = 0

    def vector(self) -> Vector:
        if isinstance(self.embedding, list):
            return self.embedding  # the engine ignored encoding_format: kept as it came
        try:
            return check_packed(base64.b64decode(self.embedding, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise EngineError(f"malformed base64 embedding: {exc}") from exc


class _EmbeddingResponse(msgspec.Struct):
    data: list[_EmbeddingItem]
    usage: _Usage | None = None
    model: str = ""


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_embedding_decoder = msgspec.json.Decoder(_EmbeddingResponse)


class _TokenizeResponse(msgspec.Struct):
    count: int


_tokenize_decoder = msgspec.json.Decoder(_TokenizeResponse)
_encoder = msgspec.json.Encoder()
_PATHS: dict[Op, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


async def _sse_data(response: httpx.Response) -> AsyncGenerator[str, None]:
    """httpx's lines as the lean client's ``sse_data`` gives them: the ``data:``
    payloads until ``[DONE]``; a transport failure is a broken stream."""
    async for line in lines(response):
        if not line.startswith("data:"):
            continue  # comments, blank separators
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield data


# vLLM's older structured-output fields, which vLLM 0.32 takes and ignores (measured
# in the real-vLLM tier): sent as the structured_outputs options they stand for.
_GUIDED = {"guided_json": "json", "guided_choice": "choice", "guided_regex": "regex",
           "guided_grammar": "grammar"}  # fmt: skip


def structured_outputs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body with vLLM's ``guided_*`` fields moved into ``structured_outputs``."""
    payload = dict(body)
    moved = {_GUIDED[k]: payload.pop(k) for k in list(payload) if k in _GUIDED}
    moved = {k: v for k, v in moved.items() if v is not None}
    if moved:
        payload["structured_outputs"] = {**moved, **(payload.get("structured_outputs") or {})}
    return payload


class OpenAIAdapter(EngineAdapter):
    name = "openai"
    salts_cache = True  # vLLM's cache_salt (0.9 on); the simulator's too
    translations: Mapping[str, Translated] = {
        STRUCTURED_OUTPUTS: Translated(
            FieldStatus.TRANSFORMED,
            "guided_json / guided_choice / guided_regex / guided_grammar -> "
            "structured_outputs (vLLM 0.32 ignores the guided_ fields); "
            "structured_outputs as is",
        )
    }

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        max_connections: int = 256,
        connect_timeout: float = 5.0,
        lean_streams: bool = True,
    ) -> None:
        self._client = engine_client(
            base_url, api_key, max_connections=max_connections, connect_timeout=connect_timeout
        )
        # The hot paths (streams, embeddings, the load poll) skip httpx over plain
        # http (issues 14, 17); https and every other call stay on httpx.
        self._lean: LeanClient | None = None
        if lean_streams and base_url.startswith("http://"):
            self._lean = LeanClient(
                base_url,
                headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
                max_connections=max_connections,
                connect_timeout=connect_timeout,
            )
        # Vectors are asked for packed (streams/vectors.py); False once the engine
        # refused the encoding_format, so it is asked for floats from then on.
        self._packed: bool | None = None

    async def aclose(self) -> None:
        if self._lean is not None:
            await self._lean.aclose()
        await self._client.aclose()

    async def generate(
        self, op: Op, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> AsyncIterator[Delta | Done]:
        if op not in _PATHS:
            raise EngineRejected(f"operation {op!r} does not stream")
        payload = structured_outputs(body)
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
        hdrs = {
            "X-Request-Id": self.engine_request_id(request_id),
            "Content-Type": "application/json",
            **headers,
        }
        content = _encoder.encode(payload)
        if self._lean is not None:
            async with (
                self._lean.stream(_PATHS[op], content, hdrs, self.status_check) as lean,
                contextlib.aclosing(self._events(lean.sse_data())) as events,
            ):
                async for event in events:
                    yield event
            return
        request = self._client.build_request("POST", _PATHS[op], content=content, headers=hdrs)
        async with (
            open_stream(self._client, request, self.status_check) as response,
            contextlib.aclosing(_sse_data(response)) as payloads,
            contextlib.aclosing(self._events(payloads)) as events,
        ):
            async for event in events:
                yield event

    def status_check(self, status: int, body: bytes) -> None:
        """An error status of a stream's response, raised as its EngineError."""
        raise_for_status(status, body)

    def engine_request_id(self, request_id: str) -> str:
        """The ``X-Request-Id`` the engine gets (vLLM takes any string)."""
        return request_id

    async def _events(
        self, payloads: AsyncIterator[bytes | str]
    ) -> AsyncGenerator[Delta | Done, None]:
        """Deltas from the stream's ``data:`` payloads, then one Done."""
        finish: str | None = None
        usage: Usage | None = None
        model = ""
        async for data in payloads:
            try:
                chunk = _chunk_decoder.decode(data)
            except msgspec.DecodeError as exc:
                raise EngineStreamBroken(f"malformed chunk from engine: {exc}") from exc
            if chunk.error is not None:
                # Its status is the event's code: a 400 stays the caller's, with
                # the engine's message; a 5xx before a token is retried elsewhere.
                # (Read as a chunk without choices, it ended "without a finish
                # reason": a 502, the message and the status lost.)
                status = _status_of(chunk.error)
                if status is not None:
                    raise_for_status(status, msgspec.json.encode({"error": chunk.error}))
                # A code that is no status (an OpenAI-style name: another gateway's,
                # jetserve's own mid-stream error): the stream broke, in its words.
                message = chunk.error.get("message")
                raise EngineStreamBroken(str(message or "engine failed mid-stream"))
            model = chunk.model or model
            if chunk.usage is not None:
                usage = chunk.usage.to_wire()
            for choice in chunk.choices:
                text = choice.text or ""
                calls = thought = None
                if choice.delta is not None:
                    text = choice.delta.content or text
                    calls = choice.delta.tool_calls
                    thought = choice.delta.reasoning_content or choice.delta.reasoning
                if choice.finish_reason:
                    finish = choice.finish_reason
                if text or calls or thought or choice.finish_reason or choice.logprobs:
                    yield Delta(
                        text, calls, choice.finish_reason, choice.logprobs, choice.index, thought
                    )
        if finish is None:
            raise EngineStreamBroken("engine stream ended without a finish reason")
        yield Done(finish, usage or Usage(), model)

    async def embed(
        self, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> Embeddings:
        hdrs = {"X-Request-Id": request_id, "Content-Type": "application/json", **headers}
        odd = {f: body[f] for f, ok in _PACKING.items() if body.get(f) not in ok}
        if odd:
            # vLLM packs base64 vectors by these, and the frames carry float32 as
            # the engine packed them: passed on, a float client got half-length or
            # byte-swapped vectors, with no error.
            raise EngineUnsupported(
                f"the relay carries float32 little-endian vectors only: {odd} is not "
                "carried; remove it (the client's own encoding_format applies)"
            )
        if self._packed is not False:
            try:
                found = await self._embed(body, hdrs, "base64")
            except EngineRejected as exc:
                if self._packed or "encoding_format" not in str(exc):
                    raise
                self._packed = False  # an engine that takes floats only
            else:
                self._packed = True
                return found
        return await self._embed(body, hdrs, "float")

    async def _embed(
        self, body: Mapping[str, Any], hdrs: Mapping[str, str], encoding: str
    ) -> Embeddings:
        # The engine's encoding, not the client's: the ingress encodes for its client.
        content = _encoder.encode({**body, "encoding_format": encoding})
        if self._lean is not None:
            # httpx's send path was ~40% of an embedding worker's CPU, on a box
            # where the engine wants every core (issue 17).
            async with self._lean.stream("/v1/embeddings", content, hdrs) as lean:
                data = await lean.read(MAX_BODY)
        else:
            request = self._client.build_request(
                "POST", "/v1/embeddings", content=content, headers=hdrs
            )
            async with open_stream(self._client, request) as response:
                data = await read_body(response, MAX_BODY)
        try:
            parsed = _embedding_decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise EngineError(f"malformed embeddings response: {exc}") from exc
        vectors = [item.vector() for item in sorted(parsed.data, key=lambda d: d.index)]
        usage = parsed.usage.to_wire() if parsed.usage else Usage()
        return Embeddings(vectors, usage, parsed.model)

    async def count_tokens(
        self, model: str, texts: Sequence[str], headers: Mapping[str, str]
    ) -> list[int] | None:
        """vLLM's ``/tokenize``, one text per call (it takes one prompt), concurrently.
        None when the server has no such endpoint or it fails: callers fall back."""
        hdrs = {"Content-Type": "application/json", **headers}

        async def one(text: str) -> int | None:
            payload = _encoder.encode({"model": model, "prompt": text})
            try:
                response = await self._client.post("/tokenize", content=payload, headers=hdrs)
            except httpx.TransportError:
                return None
            if response.status_code != 200:
                return None
            try:
                return _tokenize_decoder.decode(response.content).count
            except msgspec.DecodeError:
                return None

        counts = await asyncio.gather(*(one(t) for t in texts))
        return None if any(c is None for c in counts) else [c for c in counts if c is not None]

    async def version(self) -> str:
        return await read_version(self._client, "/version", "vllm")

    async def served(self) -> Served | None:
        return await read_served(self._client)

    async def batches_embeddings(self) -> bool | None:
        """vLLM schedules concurrent pooling requests into one forward pass; the
        simulator (its ``/version`` ends ``+jetserve.sim``) runs each call alone.
        Any other server is assumed to batch."""
        try:
            response = await self._client.get("/version", timeout=PROBE_TIMEOUT_S)
        except httpx.TransportError:
            return None
        if response.status_code != 200:
            return True
        try:
            version = msgspec.json.decode(response.content).get("version", "")
        except (msgspec.DecodeError, AttributeError):
            return True
        return not (isinstance(version, str) and version.endswith(SIM_VERSION_SUFFIX))

    async def healthy(self) -> bool:
        if self._lean is not None:
            return await lean_probe(self._lean, "/health")
        return await probe(self._client, "/health")

    async def load(self) -> EngineLoad:
        if self._lean is not None:
            text = await lean_scrape(self._lean, "/metrics")
        else:
            text = await scrape(self._client, "/metrics")
        return EngineLoad() if text is None else parse_vllm_metrics(text)

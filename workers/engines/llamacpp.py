"""Adapter for llama.cpp's OpenAI-compatible server (``python -m llama_cpp.server``,
from ``llama-cpp-python[server]``).

The wire is OpenAI's, so streaming is the OpenAI adapter's; what differs is what the
server does with the body (workers/engines/llamacpp_request.py) and what its stream
leaves out:

- no usage in the stream: completion tokens are counted from the stream (one chunk
  per token), prompt tokens asked of ``/extras/tokenize/count``;
- no 404 for an unknown model (it serves its default model under any name): the
  adapter checks the name against ``/v1/models``;
- an error found once the stream has started (a prompt over the context) closes the
  stream without a word: the adapter asks again without streaming and one token
  long, which fails before any generation, for the server's own 400 and message;
- ``max_tokens`` beyond the context is clipped silently: with ``context_length``
  known (the server's ``--n_ctx``) the adapter refuses it as vLLM does;
- ``X-Request-Id`` must be a UUID (else an empty 400): ours is sent as a UUID;
- no ``/health`` or ``/metrics``: readiness is ``GET /v1/models``, load is unknown.

The server runs one request at a time; start it with ``--interrupt_requests false``,
or a second request cuts the first one's stream short.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import msgspec

from streams.wire import Op, Usage
from workers.engines import translation as t
from workers.engines.base import Delta, Done, EngineLoad, closing
from workers.engines.fanout import merged
from workers.engines.http import error_message, raise_for_status
from workers.engines.llamacpp_request import LlamaCppRequest
from workers.engines.openai import OpenAIAdapter
from workers.engines.translation import FieldStatus, Translated
from workers.errors import EngineRejected, EngineStreamBroken, EngineUnreachable

P, T, E, R, NA = (
    FieldStatus.PASSED,
    FieldStatus.TRANSFORMED,
    FieldStatus.EMULATED,
    FieldStatus.REJECTED,
    FieldStatus.NOT_APPLICABLE,
)
LLAMACPP_TRANSLATIONS: Mapping[str, Translated] = {
    t.CONTENT_PARTS: Translated(
        R, "the server's chat handler renders text only: text parts joined, an image 400"
    ),
    t.MAX_COMPLETION_TOKENS: Translated(T, "-> max_tokens (the server ignores the new name)"),
    t.TOOLS: Translated(
        P, "a named tool_choice: the server forces the call with a grammar from its parameters"
    ),
    t.TOOL_CHOICE: Translated(
        T,
        "named: passed; required with one tool -> that tool named (several: 400); auto "
        "and none: the tools reach the chat template, the server parses no call from text",
    ),
    t.PARALLEL_TOOL_CALLS: Translated(T, "at most one call per reply: false holds as is"),
    t.RESPONSE_FORMAT: Translated(
        T, 'json_schema -> {"type": "json_object", "schema"}, the server\'s JSON grammar'
    ),
    t.STRUCTURED_OUTPUTS: Translated(
        T,
        "guided_json / structured_outputs.json -> response_format json_object with the "
        "schema (chat only); guided_choice -> a GBNF grammar; guided_regex: 400",
    ),
    t.REPETITION_PENALTY: Translated(T, "-> repeat_penalty"),
    t.LOGPROBS: Translated(
        T, "chat: logprobs true alone -> top_logprobs 0 (else the server gives none)"
    ),
    t.ECHO: Translated(
        E, "the server streams no echo: the adapter sends the prompt ahead (not with logprobs)"
    ),
    t.IGNORE_EOS: Translated(R, "the server has no ignore_eos: 400 unsupported_parameter"),
    t.N: Translated(
        E,
        "the server ignores n: n requests (seeds seed + i), merged as indexed choices; "
        "it runs them one after another",
    ),
    t.BEST_OF: Translated(R, "the server takes best_of and ignores it: 400 unsupported_parameter"),
    t.USAGE: Translated(
        E,
        "the stream carries no usage: completion tokens counted from the stream, prompt "
        "tokens from /extras/tokenize/count (chat: the messages' text, without the "
        "template's own tokens)",
    ),
    t.CACHED_TOKENS: Translated(NA, "the server reports no prefix-cache hits"),
    t.CANCELLATION: Translated(P, "closing the SSE connection stops the server's generation loop"),
    t.ERR_CONTEXT: Translated(
        T,
        "a prompt over the context breaks the stream silently: asked again unstreamed "
        "for the server's 400; max_tokens over it (clipped by the server) refused "
        "by the adapter when context_length is known",
    ),
    t.ERR_MODEL: Translated(
        E, "the server answers any model name with its own: the adapter checks /v1/models"
    ),
    t.ERR_INVALID: Translated(
        T,
        "the server answers its validation error as a 500 with a traceback: a 400, the error alone",
    ),
}


class _Model(msgspec.Struct):
    id: str


class _Models(msgspec.Struct):
    data: list[_Model]


class _Count(msgspec.Struct):
    count: int


_models = msgspec.json.Decoder(_Models)
_count = msgspec.json.Decoder(_Count)
_MODELS_TTL_S = 30.0


class LlamaCppAdapter(OpenAIAdapter):
    name = "llamacpp"
    translations = LLAMACPP_TRANSLATIONS

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        context_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(base_url, api_key=api_key, **kwargs)
        self.context_length = context_length
        self._served: tuple[float, frozenset[str]] | None = None

    async def generate(
        self, op: Op, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> AsyncIterator[Delta | Done]:
        req = LlamaCppRequest(op, body)
        await self._check_model(req.model, headers)
        prompt_tokens = await self._prompt_tokens(op, req.base, headers)
        self._check_context(req.base, prompt_tokens)

        def one(i: int) -> AsyncIterator[Delta | Done]:
            rid = request_id if req.n == 1 else f"{request_id}-{i}"
            return self._one(op, req.payload(i), rid, headers, prompt_tokens, i, req.echo)

        events = one(0) if req.n == 1 else merged(one, req.n)
        async with closing(events) as stream:
            async for ev in stream:
                yield ev

    async def _one(
        self,
        op: Op,
        payload: dict[str, Any],
        request_id: str,
        headers: Mapping[str, str],
        prompt_tokens: int,
        index: int,
        echo: str,
    ) -> AsyncIterator[Delta | Done]:
        tokens = 0
        if echo:
            yield Delta(echo, index=index)
        try:
            async with closing(super().generate(op, payload, request_id, headers)) as events:
                async for ev in events:
                    if isinstance(ev, Done):
                        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=tokens)
                        # The server names the model by its file path: the alias asked for.
                        yield Done(ev.finish_reason, usage, str(payload.get("model") or ev.model))
                        continue
                    tokens += bool(ev.text or ev.tool_calls)
                    yield dataclasses.replace(ev, index=index) if index else ev
        except EngineStreamBroken:
            if tokens == 0:
                await self._engine_error(op, payload, headers)
            raise

    def status_check(self, status: int, body: bytes) -> None:
        """The server answers a request its pydantic models refuse (a value out of
        range) with 500 ``internal_server_error``, the validation error and a
        traceback in the message: a 400 with the validation error alone."""
        message = error_message(body)
        if status == 500 and "validation error" in message:
            raise EngineRejected(message.split("\n\n")[0].strip())
        raise_for_status(status, body)

    def engine_request_id(self, request_id: str) -> str:
        """The server's request-id middleware refuses any X-Request-Id that is not a
        UUID (an empty 400): the UUID this id names, the same for the same id."""
        return str(uuid.uuid5(uuid.NAMESPACE_URL, request_id))

    async def _engine_error(
        self, op: Op, payload: dict[str, Any], headers: Mapping[str, str]
    ) -> None:
        """The same request unstreamed and one token long: the server's own refusal
        (a prompt over the context fails before any generation), raised."""
        path = "/v1/chat/completions" if op == "chat" else "/v1/completions"
        probe = {**payload, "stream": False, "max_tokens": 1}
        try:
            r = await self._client.post(path, json=probe, headers=dict(headers))
        except httpx.TransportError:
            return
        self.status_check(r.status_code, r.content)

    async def _check_model(self, model: str, headers: Mapping[str, str]) -> None:
        if not model:
            return
        now = time.monotonic()
        if self._served is None or now - self._served[0] > _MODELS_TTL_S:
            try:
                r = await self._client.get("/v1/models", headers=dict(headers))
            except httpx.TransportError as exc:
                raise EngineUnreachable(f"engine unreachable: {exc!r}") from exc
            raise_for_status(r.status_code, r.content)
            self._served = (now, frozenset(m.id for m in _models.decode(r.content).data))
        if model not in self._served[1]:
            raise EngineRejected(f"The model `{model}` does not exist.", status=404)

    async def _prompt_tokens(
        self, op: Op, payload: Mapping[str, Any], headers: Mapping[str, str]
    ) -> int:
        if op == "chat":
            text = "\n".join(str(m.get("content") or "") for m in payload.get("messages") or [])
        else:
            text = str(payload.get("prompt") or "")
        body = {"input": text}
        try:
            r = await self._client.post("/extras/tokenize/count", json=body, headers=dict(headers))
        except httpx.TransportError as exc:
            raise EngineUnreachable(f"engine unreachable: {exc!r}") from exc
        raise_for_status(r.status_code, r.content)
        return _count.decode(r.content).count

    def _check_context(self, payload: Mapping[str, Any], prompt_tokens: int) -> None:
        n_ctx = self.context_length
        limit = payload.get("max_tokens")
        if n_ctx is None or limit is None:
            return
        if int(limit) + prompt_tokens > n_ctx:
            raise EngineRejected(
                f"This model's maximum context length is {n_ctx} tokens. However, you "
                f"requested {int(limit) + prompt_tokens} tokens ({prompt_tokens} in the "
                f"messages, {int(limit)} in the completion)."
            )

    async def healthy(self) -> bool:
        try:
            r = await self._client.get("/v1/models", timeout=2.0)
        except httpx.TransportError:
            return False
        return r.status_code == 200

    async def load(self) -> EngineLoad:
        return EngineLoad()  # the server exposes no metrics

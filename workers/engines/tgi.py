"""Adapter for Hugging Face Text Generation Inference's native API (``/generate_stream``).

TGI takes one prompt string (``inputs``) and ``parameters``; it streams SSE events
``{"token": {...}, "generated_text": null | str, "details": null | {...}}``, the last
one with ``details.finish_reason`` (length | eos_token | stop_sequence),
``generated_tokens`` and ``input_length``. Errors are ``{"error", "error_type"}``
(422 validation, 429 overloaded, 424/500 generation), also as an SSE event mid-stream.
The translation of each OpenAI field is declared in :data:`TGI_TRANSLATIONS`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import msgspec

from streams.wire import Op, Usage
from workers.engines import prompted
from workers.engines import translation as t
from workers.engines.base import Delta, Done, Embeddings, EngineAdapter, EngineLoad, closing
from workers.engines.fanout import merged
from workers.engines.http import (
    MAX_BODY,
    engine_client,
    open_stream,
    probe,
    raise_for_status,
    read_body,
    read_version,
    scrape,
)
from workers.engines.tgi_request import TgiRequest
from workers.engines.token_logprobs import TokenLogprob, Track
from workers.engines.translation import FieldStatus, Translated
from workers.errors import EngineRejected, EngineStreamBroken

T, E, R, P, NA = (
    FieldStatus.TRANSFORMED,
    FieldStatus.EMULATED,
    FieldStatus.REJECTED,
    FieldStatus.PASSED,
    FieldStatus.NOT_APPLICABLE,
)
TGI_TRANSLATIONS: Mapping[str, Translated] = {
    t.MESSAGES: Translated(T, "rendered to one prompt with the ChatML template"),
    t.CONTENT_PARTS: Translated(R, "one prompt string: only text parts (400 otherwise)"),
    t.MAX_TOKENS: Translated(T, "max_tokens -> parameters.max_new_tokens"),
    t.MAX_COMPLETION_TOKENS: Translated(T, "-> parameters.max_new_tokens"),
    t.FINISH_REASON: Translated(T, "eos_token / stop_sequence -> stop, length -> length"),
    t.TOOLS: Translated(
        E,
        "Hermes <tools> in the system turn, <tool_call> blocks parsed from the reply; "
        "replies of tool-enabled requests arrive in one piece at the end",
    ),
    t.TOOL_CHOICE: Translated(
        E,
        "none: the tools are left out of the prompt; required or a named function: "
        "a JSON grammar forces the call; auto: the model decides",
    ),
    t.PARALLEL_TOOL_CALLS: Translated(E, "false: the first parsed call is kept"),
    t.RESPONSE_FORMAT: Translated(
        T, 'json_schema/json_object -> parameters.grammar {"type": "json"}'
    ),
    t.STOP: Translated(
        T, "-> parameters.stop; TGI keeps the stop string in its output, the adapter cuts it"
    ),
    t.SEED: Translated(T, "-> parameters.seed"),
    t.TEMPERATURE: Translated(
        T,
        "0 -> greedy (TGI's default): temperature and seed are left out; otherwise (and "
        "when absent, OpenAI's default being 1) parameters.do_sample",
    ),
    t.PRESENCE_PENALTY: Translated(
        R,
        "TGI has no presence penalty (frequency and repetition penalties only): 400 "
        "unsupported_parameter",
    ),
    t.FREQUENCY_PENALTY: Translated(P, "-> parameters.frequency_penalty"),
    t.LOGIT_BIAS: Translated(R, "TGI has no logit bias: 400 unsupported_parameter"),
    t.LOGPROBS: Translated(
        T,
        "-> parameters.top_n_tokens; each token's logprob and top_tokens re-shaped into "
        "OpenAI's logprobs (chat content entries, or the completions lists)",
    ),
    t.N: Translated(
        E,
        "TGI makes one sequence per request: n requests side by side (seeds seed + i), "
        "merged as indexed choices",
    ),
    t.ECHO: Translated(E, "the adapter sends the prompt ahead of the text (not with logprobs)"),
    t.BEST_OF: Translated(
        T,
        "-> parameters.best_of on /generate (TGI refuses it when streaming: the reply "
        "arrives whole); n must be 1",
    ),
    t.TOP_K: Translated(P, "-> parameters.top_k"),
    t.MIN_P: Translated(R, "TGI has no min_p: 400 unsupported_parameter"),
    t.MIN_TOKENS: Translated(R, "TGI has no min_tokens: 400 unsupported_parameter"),
    t.REPETITION_PENALTY: Translated(P, "-> parameters.repetition_penalty"),
    t.IGNORE_EOS: Translated(R, "TGI has no ignore_eos: 400 unsupported_parameter"),
    t.STRUCTURED_OUTPUTS: Translated(
        T,
        'guided_json / structured_outputs.json -> parameters.grammar {"type": "json"}; '
        'guided_choice / guided_regex -> {"type": "regex"}',
    ),
    t.USAGE: Translated(
        T, "details.input_length / details.generated_tokens (usage is always returned)"
    ),
    t.CACHED_TOKENS: Translated(NA, "TGI reports no prefix-cache hits: cached_tokens is 0"),
    t.CANCELLATION: Translated(P, "closing the SSE connection stops TGI's generation"),
    t.ERR_CONTEXT: Translated(T, "422 validation error -> EngineRejected (400)"),
    t.ERR_MODEL: Translated(
        NA,
        "TGI serves one model and its API names none; the gateway answers 404 for a "
        "model it does not route",
    ),
    t.ERR_INVALID: Translated(R, "presence_penalty: TGI has none, 400 unsupported_parameter"),
    t.ERR_429: Translated(T, "429 overloaded -> EngineRateLimited"),
    t.ERR_5XX: Translated(P, "5xx -> EngineUnavailable"),
    t.ERR_MALFORMED: Translated(P, "undecodable SSE event -> EngineStreamBroken"),
}

_FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}
_METRIC = re.compile(r"^(tgi_[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$")


class _Token(msgspec.Struct, frozen=True):
    text: str = ""
    logprob: float | None = None
    special: bool = False


class _Details(msgspec.Struct, frozen=True):
    finish_reason: str = ""
    generated_tokens: int = 0
    input_length: int | None = None
    prefill: list[_Token] = []
    tokens: list[_Token] = []
    top_tokens: list[list[_Token]] = []


class _Event(msgspec.Struct, frozen=True):
    token: _Token | None = None
    top_tokens: list[_Token] | None = None
    details: _Details | None = None
    error: str | None = None
    error_type: str | None = None


class _Whole(msgspec.Struct, frozen=True):
    generated_text: str = ""
    details: _Details | None = None


_event_decoder = msgspec.json.Decoder(_Event)
_whole_decoder = msgspec.json.Decoder(_Whole)
_encoder = msgspec.json.Encoder()


def _raise(status: int, body: bytes) -> None:
    if status == 422:  # TGI's validation errors (context length, bad parameters)
        raise_for_status(400, body)
    raise_for_status(status, body)


def _entry(token: _Token, tops: list[_Token] | None) -> TokenLogprob:
    return TokenLogprob(
        token.text,
        token.logprob if token.logprob is not None else 0.0,
        tuple((x.text, x.logprob if x.logprob is not None else 0.0) for x in tops or []),
    )


class _Choice:
    """One choice's text as it streams: stop strings cut, logprobs released with the
    text they spell, tool calls parsed from the whole reply."""

    def __init__(self, req: TgiRequest, index: int) -> None:
        self.req, self.index = req, index
        self.trimmer = prompted.StopTrimmer(req.stops)
        self.track = Track(req.op, len(req.echo)) if req.top is not None else None
        self.buffered = bool(req.tools)
        self.text = ""  # what is cut and released so far (or buffered)
        self.final = "stop"  # the choice's finish reason, once finished

    def push(self, token: _Token, tops: list[_Token] | None) -> Delta | None:
        if self.track is not None:
            self.track.push(_entry(token, tops))
        return self._out(self.trimmer.push(token.text))

    def push_text(self, text: str) -> Delta | None:
        return self._out(self.trimmer.push(text))

    def _out(self, piece: str, finish: str | None = None) -> Delta | None:
        self.text += piece
        if self.buffered:
            return None
        lps = self.track.take(len(self.text)) if self.track is not None else None
        if piece or lps or finish:
            return Delta(piece, None, finish, lps, self.index)
        return None

    def finish(self, reason: str) -> list[Delta]:
        tail = self.trimmer.flush()
        finish = self.final = _FINISH.get(reason, reason or "stop")
        if not self.buffered:
            last = self._out(tail, finish)
            return [last] if last is not None else []
        text = self.text + tail
        lps = self.track.take(len(text)) if self.track is not None else None
        deltas, self.final = self.req.tool_plan.reply(text, self.index, finish, lps)
        return deltas


class TGIAdapter(EngineAdapter):
    name = "tgi"
    translations = TGI_TRANSLATIONS

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str = "",
        max_connections: int = 256,
        connect_timeout: float = 5.0,
    ) -> None:
        self.model = model
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
        req = TgiRequest(op, body)
        if req.best_of is not None:
            events = self._whole(req, request_id, headers)
        elif req.n > 1:
            events = merged(lambda i: self._stream(req, i, request_id, headers), req.n)
        else:
            events = self._stream(req, 0, request_id, headers)
        async with closing(events) as stream:
            async for event in stream:
                yield event

    def _request(
        self, path: str, req: TgiRequest, i: int, request_id: str, headers: Mapping[str, str]
    ) -> httpx.Request:
        hdrs = {"X-Request-Id": request_id, "Content-Type": "application/json", **headers}
        payload = _encoder.encode(req.payload(i))
        return self._client.build_request("POST", path, content=payload, headers=hdrs)

    async def _stream(
        self, req: TgiRequest, i: int, request_id: str, headers: Mapping[str, str]
    ) -> AsyncIterator[Delta | Done]:
        request = self._request("/generate_stream", req, i, request_id, headers)
        async with open_stream(self._client, request, _raise) as response:
            choice = _Choice(req, i)
            if req.echo:
                yield Delta(req.echo, None, None, None, i)
            details: _Details | None = None
            async for event in prompted.sse_events(response, _event_decoder):
                if event.token is not None and not event.token.special:
                    delta = choice.push(event.token, event.top_tokens)
                    if delta is not None:
                        yield delta
                if event.details is not None:
                    details = event.details
                    break
            if details is None:
                raise EngineStreamBroken("engine stream ended without a finish reason")
            for delta in choice.finish(details.finish_reason):
                yield delta
            yield self._done(choice, details, details.input_length or 0)

    async def _whole(
        self, req: TgiRequest, request_id: str, headers: Mapping[str, str]
    ) -> AsyncIterator[Delta | Done]:
        """best_of: TGI's /generate, whose reply is the best sequence (whole)."""
        request = self._request("/generate", req, 0, request_id, headers)
        async with open_stream(self._client, request, _raise) as response:
            try:
                reply = _whole_decoder.decode(await read_body(response, MAX_BODY))
            except msgspec.DecodeError as exc:
                raise EngineStreamBroken(f"malformed reply from engine: {exc!r}") from exc
        details = reply.details
        if details is None:
            raise EngineStreamBroken("engine reply without details")
        choice = _Choice(req, 0)
        if req.echo:
            yield Delta(req.echo)
        tokens = [x for x in details.tokens if not x.special]
        if tokens:
            tops = details.top_tokens or [[] for _ in tokens]
            for token, top in zip(tokens, tops, strict=False):
                delta = choice.push(token, top)
                if delta is not None:
                    yield delta
        else:  # no per-token details: the text alone
            delta = choice.push_text(reply.generated_text)
            if delta is not None:
                yield delta
        for delta in choice.finish(details.finish_reason):
            yield delta
        yield self._done(choice, details, len(details.prefill))

    def _done(self, choice: _Choice, details: _Details, prompt_tokens: int) -> Done:
        finish = choice.final
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=details.generated_tokens)
        return Done(finish, usage, self.model)

    async def embed(
        self, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> Embeddings:
        raise EngineRejected("TGI serves generation only; embeddings need an embedding engine")

    async def version(self) -> str:
        return await read_version(self._client, "/info", "tgi")

    async def healthy(self) -> bool:
        return await probe(self._client, "/health")

    async def load(self) -> EngineLoad:
        text = await scrape(self._client, "/metrics")
        return EngineLoad() if text is None else parse_tgi_metrics(text)


def parse_tgi_metrics(text: str) -> EngineLoad:
    """TGI's queue and batch gauges; it exposes no KV-cache usage."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m is not None:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
    return EngineLoad(
        waiting=values.get("tgi_queue_size"),
        running=values.get("tgi_batch_current_size"),
    )

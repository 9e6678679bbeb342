"""Wire messages: frozen, tagged msgspec Structs, JSON on the wire.

Each subject space carries one type or one tagged union:

- ``jetserve.req.<class>`` (JetStream work queue): :class:`InferenceRequest`
- the live twin of a request's reply subject (``jetserve.live...``, core NATS,
  not stored): :data:`Frame` = :class:`Token` | :class:`Heartbeat` |
  :class:`Final` | :class:`ErrorFrame` | :class:`Meta`
- the reply subject named in a request (``jetserve.reply...``, kept by the
  frames capture): :class:`Meta`, :class:`Tokens` (the tokens of a quarter
  second in one message), :class:`Final` | :class:`ErrorFrame`; read back with
  :func:`decode_frames`, which unpacks a :class:`Tokens` into its tokens
- ``jetserve.cancel.<id>``: :class:`Cancel`

Schema evolution: a new field must have a default, so older peers keep decoding.
Encoders and decoders are built once, here.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from streams.kv_index import PrefixKey
from streams.vectors import Vector

Op = Literal["chat", "completion", "embedding"]


class Usage(msgspec.Struct, frozen=True, omit_defaults=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class InferenceRequest(msgspec.Struct, frozen=True, tag="request", omit_defaults=True):
    """One inference request as published by an ingress onto a class subject.

    ``body`` is the OpenAI request body the client sent (validated by the ingress);
    the worker hands it to its engine adapter. ``deadline`` is absolute (unix
    seconds) and never refreshed by a retry.
    """

    id: str
    op: Op
    cls: str
    model: str
    body: dict[str, Any]
    reply: str
    deadline: float
    tenant: str = ""
    key_id: str = ""
    traceparent: str = ""  # W3C: the ingress's span; workers and engines continue it
    tracestate: str = ""
    prompt_tokens_est: int = 0  # the ingress' estimate, for KV admission
    max_tokens: int = 0  # worst-case output tokens, all choices together (KV admission, holds)
    created: float = 0.0
    # Engine-facing headers the route allows through (e.g. simulator fault hooks).
    headers: dict[str, str] = {}
    # Added to the delivery count to number this copy's attempts: a hedge copy
    # starts at HEDGE_ATTEMPT_BASE so its frames never pass for the original's.
    attempt_base: int = 0
    # The route contract (streams.routes) this request runs under; empty: none.
    route: str = ""
    route_revision: int = 0
    # Deployment names allowed to serve it, in preference order; empty: any
    # worker. A worker outside the list hands the message back unserved.
    candidates: list[str] = []
    retry_max: int = 0  # attempts, the first included; 0: the topology's max_attempts
    retry_on: list[str] = []  # worker error codes that may be retried; empty: the worker's own
    # The route's rollout arm ("stable" | "canary"; "": outside any canary's
    # scope), decided by the gateway (gateway/inference/rollout.py) and kept
    # for the ledger; workers read only ``candidates``.
    rollout_arm: str = ""
    # Its routing text's prefix keys (streams/kv_index.py), when the gateway
    # routes by the KV index: the worker ties them to the blocks it stores.
    prefix_keys: list[PrefixKey] = []
    # The LoRA adapter ``model`` names (empty: a base model): the request sits in
    # an adapter pool (streams.pools.adapter_pool), and a fallback goes to the
    # next candidate's pool of the same adapter.
    adapter: str = ""
    # The sender reads packed float32 vectors in ``Final.embeddings``
    # (streams/vectors.py); a sender that does not say so gets floats.
    packed_vectors: bool = False
    # Whose prefix cache the engine may reuse for it: the tenant's ("" : anyone's,
    # a route that marks prefixes shared, or a gateway of before this field). A
    # worker whose engine salts its cache (vLLM's ``cache_salt``) salts it by this.
    cache_scope: str = ""


HEDGE_ATTEMPT_BASE = 100


class Token(msgspec.Struct, frozen=True, tag="token", omit_defaults=True):
    """A delta of generated output. ``seq`` starts at 1 and has no gaps."""

    seq: int
    text: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    # Set on the delta that ends a choice, as vLLM does; the Final frame repeats it.
    finish_reason: str | None = None
    # Delivery number of the request message that produced this frame: after a
    # redelivery the receiver keeps to the attempt that emitted the first token.
    attempt: int = 1
    # The choice's ``logprobs`` as the engine sent it with this delta (chat's
    # ``{"content": [...]}`` or the completions lists), relayed untouched.
    logprobs: dict[str, Any] | None = None
    index: int = 0  # the choice this delta belongs to (``n`` > 1, or a batch of prompts)
    reasoning: str | None = None  # a reasoning model's thinking, relayed as ``reasoning_content``


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat", omit_defaults=True):
    """Sent while a request is alive but quiet; ``seq`` is the last token's seq.
    ``moved``: this attempt failed before its first token and the request was
    handed on to the next candidate's pool, where it is now stored (stream,
    sequence): a reader watching the queue for a lost answer looks there."""

    seq: int
    at: float
    attempt: int = 1
    moved: tuple[str, int] | None = None


class Final(msgspec.Struct, frozen=True, tag="final", omit_defaults=True):
    """The last frame of a successful request."""

    seq: int
    finish_reason: str
    usage: Usage
    model: str = ""
    worker: str = ""
    # op == "embedding": floats, or float32 bytes where the request has packed_vectors
    embeddings: list[Vector] | None = None
    attempt: int = 1  # delivery number of the request message (1 = first try)
    ttft_ms: float = 0.0
    engine_ms: float = 0.0
    deployment: str = ""  # the deployment name the worker serves (its route candidate)
    fingerprint: str = ""


class ErrorFrame(msgspec.Struct, frozen=True, tag="error", omit_defaults=True):
    """The last frame of a failed request.

    ``status`` is the HTTP status the gateway should answer with (before the
    first token); ``retryable`` tells a caller whether sending again may succeed.
    """

    seq: int
    code: str
    message: str
    retryable: bool = False
    status: int = 500
    attempt: int = 1


class Meta(msgspec.Struct, frozen=True, tag="meta", omit_defaults=True):
    """Published by the ingress on the reply subject before the request is queued,
    so a replica resuming the stream from the frames capture knows what it is."""

    op: Op
    model: str
    cls: str
    tenant: str
    deadline: float
    created: float
    key_id: str = ""
    org: str = ""
    reserved_micros: int = 0
    price_version: str = ""
    gateway: str = ""
    # For a charge from the capture when its gateway died (a prompt's tokens).
    prompt_tokens_est: int = 0


Frame = Token | Heartbeat | Final | ErrorFrame | Meta


class Extra(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a token inside :class:`Tokens` carries besides its text (rare but
    for logprobs): kept apart, so a plain token costs its text and a comma."""

    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None
    index: int = 0
    reasoning: str | None = None  # a reasoning token's thinking (its text is "")


class Tokens(msgspec.Struct, frozen=True, tag="tokens", omit_defaults=True):
    """Consecutive tokens of one attempt, as the frames capture keeps them:
    one stored message per quarter second of a stream instead of one per token
    (workers/inference/relay.py). ``seq`` is the first token's; ``extras`` is
    keyed by a token's offset in ``texts``."""

    seq: int
    texts: list[str]
    extras: dict[int, Extra] = {}
    attempt: int = 1

    @classmethod
    def of(cls, tokens: list[Token]) -> Tokens:
        """``tokens``: consecutive, of one attempt."""
        extras = {
            i: Extra(t.tool_calls, t.finish_reason, t.logprobs, t.index, t.reasoning)
            for i, t in enumerate(tokens)
            if t.tool_calls is not None
            or t.finish_reason
            or t.logprobs is not None
            or t.index
            or t.reasoning is not None
        }
        return cls(tokens[0].seq, [t.text for t in tokens], extras, tokens[0].attempt)

    def tokens(self) -> list[Token]:
        plain = Extra()
        out = []
        for i, text in enumerate(self.texts):
            x = self.extras.get(i, plain)
            out.append(
                Token(
                    self.seq + i,
                    text,
                    x.tool_calls,
                    x.finish_reason,
                    self.attempt,
                    x.logprobs,
                    x.index,
                    x.reasoning,
                )
            )
        return out

    @property
    def last_seq(self) -> int:
        return self.seq + len(self.texts) - 1


Captured = Frame | Tokens


class Cancel(msgspec.Struct, frozen=True, tag="cancel", omit_defaults=True):
    id: str
    reason: str = "client_disconnected"
    # A hedge race: the attempt that won keeps going, every other one stops.
    keep_attempt: int = 0


_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(InferenceRequest)
_frame_decoder = msgspec.json.Decoder(Frame)
_captured_decoder = msgspec.json.Decoder(Captured)
_cancel_decoder = msgspec.json.Decoder(Cancel)


def encode(
    msg: InferenceRequest | Token | Tokens | Heartbeat | Final | ErrorFrame | Meta | Cancel,
) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes) -> InferenceRequest:
    return _request_decoder.decode(data)


def decode_frame(data: bytes) -> Frame:
    return _frame_decoder.decode(data)


def decode_captured(data: bytes) -> Frame | Tokens:
    return _captured_decoder.decode(data)


def decode_frames(data: bytes) -> list[Frame]:
    """A message of the reply subject (the frames capture) as the frames it holds."""
    frame = _captured_decoder.decode(data)
    if isinstance(frame, Tokens):
        return list(frame.tokens())
    return [frame]


def decode_cancel(data: bytes) -> Cancel:
    return _cancel_decoder.decode(data)

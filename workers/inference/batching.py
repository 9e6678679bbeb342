"""Embedding micro-batching: concurrent embedding requests that would reach the
engine with the same model and parameters become one engine call.

An embedding request is small; one HTTP call per request spends most of its
time on per-call overhead (parse, schedule, pooling launch), and a batch of 32
inputs costs the engine little more than one. The :class:`EmbedBatcher` holds
a request for at most ``max_delay_s`` (or until ``max_batch`` inputs are
waiting), sends the concatenated ``input`` list once, and hands each request
its own vectors and its own exact usage.

Where it pays: an engine that schedules concurrent calls together (vLLM)
gains nothing from merging and loses the wait, so in ``auto`` mode batching is
on only when the adapter says its engine runs each call alone
(:meth:`EngineAdapter.batches_embeddings`: the simulator); ``on``/``off``
override it.

Usage split: an OpenAI-shaped engine reports one ``prompt_tokens`` total for
the call. Token-id inputs count themselves; text inputs are counted by the
model's own tokenizer in-process (:class:`LocalTokenCounter`, ``--tokenizer``)
or, when none is configured, by the engine's (:meth:`EngineAdapter.count_tokens`,
vLLM's ``/tokenize``: one HTTP call per input, concurrently with the embedding
call). The counts are checked against the engine's total. Only an engine that
cannot count (or a count that disagrees) falls back to a proportional split of
the total (largest remainder, so the parts still sum to it), with a warning.

Rules: an expired request never enters a batch; a request whose deadline falls
before its batch would fire makes the batch fire now. A batch failure fails
every member with the same error (an unexpected exception, a bug, as a
non-retryable ``internal_error``) (each worker handler then takes its own
retry/redelivery path), except a 4xx rejection of a multi-request batch: that
is one member's bad input, so the members are re-run alone and only the bad one
fails. When every member has gone (cancelled, timed out) the engine call is
aborted, so GPU time stops as it does for a single request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from streams.logs import frames_of, log_event
from streams.wire import Usage
from workers.engines.base import Embeddings, EngineAdapter
from workers.errors import EngineError, EngineRejected, EngineUnavailable, WorkerError
from workers.inference.token_count import LocalTokenCounter

log = logging.getLogger(__name__)

Item = str | list[int]
BatchingMode = Literal["auto", "on", "off"]
# Headers that differ per request without changing what the engine computes.
_PER_REQUEST_HEADERS = frozenset({"traceparent", "tracestate", "x-request-id"})


def split_inputs(value: object) -> tuple[str, list[Item]] | None:
    """The inputs of one embedding body as ``(kind, items)``, kind "text" or
    "tokens"; None for a shape that cannot be merged (it goes to the engine
    alone, unchanged, and gets the engine's own answer)."""
    if isinstance(value, str):
        return "text", [value]
    if not isinstance(value, list) or not value:
        return None
    if all(_is_int(t) for t in value):
        return "tokens", [list(value)]
    if all(isinstance(t, str) for t in value):
        return "text", list(value)
    if all(isinstance(t, list) and t and all(_is_int(x) for x in t) for t in value):
        return "tokens", [list(t) for t in value]
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def batch_key(body: Mapping[str, Any], kind: str, headers: Mapping[str, str]) -> bytes:
    """Requests merge only when everything the engine sees, bar the inputs, is equal."""
    params = {k: v for k, v in body.items() if k != "input"}
    hdrs = {k.lower(): v for k, v in headers.items() if k.lower() not in _PER_REQUEST_HEADERS}
    return msgspec.json.encode({"kind": kind, "params": params, "headers": hdrs}, order="sorted")


def split_total(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainder: sums exactly)."""
    if not weights:
        return []
    wsum = sum(weights)
    if wsum <= 0:
        weights, wsum = [1] * len(weights), len(weights)
    shares = [total * w // wsum for w in weights]
    order = sorted(range(len(weights)), key=lambda i: -((total * weights[i]) % wsum))
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    return shares


@dataclass(eq=False)
class _Member:
    body: Mapping[str, Any]
    items: list[Item]
    request_id: str
    headers: Mapping[str, str]
    deadline: float
    future: asyncio.Future[Embeddings]


@dataclass(eq=False)
class _Batch:
    key: bytes
    fire_at: float  # loop time
    fire: asyncio.Event = field(default_factory=asyncio.Event)
    members: list[_Member] = field(default_factory=list)
    size: int = 0  # inputs, not requests


class EmbedBatcher:
    """Owned by one worker; :meth:`aclose` after its handlers have drained."""

    def __init__(
        self,
        engine: EngineAdapter,
        max_batch: int = 32,
        max_delay_s: float = 0.005,
        observe: Callable[[int], None] | None = None,
        *,
        mode: BatchingMode = "on",
        counter: LocalTokenCounter | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if max_delay_s < 0:
            raise ValueError("max_delay_s must be >= 0")
        self.engine = engine
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.mode = mode
        self.counter = counter
        # Settled on the first request ("auto" asks the engine then); None: not yet.
        self.batching: bool | None = None if mode == "auto" else mode == "on"
        self._observe = observe  # requests per engine call (the batch-size histogram)
        self._pending: dict[bytes, _Batch] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # one per batch, owned here
        self._asking: asyncio.Future[bool | None] | None = None  # auto: the engine, asked
        self._closed = False
        self.engine_calls = 0

    async def embed(
        self,
        body: Mapping[str, Any],
        request_id: str,
        headers: Mapping[str, str],
        deadline: float,
    ) -> Embeddings:
        """One request's embeddings, served alone or as part of a batch."""
        if self._closed:
            raise EngineUnavailable("the embedding batcher is closed")
        if time.time() >= deadline:
            # As if the caller's own asyncio.timeout had fired: its deadline path.
            raise TimeoutError("request deadline passed before it was batched")
        split = split_inputs(body.get("input"))
        if (
            self.max_batch == 1
            or split is None
            or len(split[1]) >= self.max_batch
            or not await self._batching()
        ):
            return await self._alone(body, request_id, headers)
        kind, items = split
        loop = asyncio.get_running_loop()
        member = _Member(body, items, request_id, headers, deadline, loop.create_future())
        key = batch_key(body, kind, headers)
        batch = self._pending.get(key)
        if batch is not None and batch.size + len(items) > self.max_batch:
            self._fire(batch)  # full: it goes now, this request starts the next one
            batch = None
        if batch is None:
            batch = self._pending[key] = _Batch(key, loop.time() + self.max_delay_s)
            task = loop.create_task(self._run(batch), name=f"embed-batch-{request_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            # A task cancelled before it first ran (aclose() right after this)
            # never enters _run: whoever it would have served is told here.
            task.add_done_callback(functools.partial(_unserved, batch))
        batch.members.append(member)
        batch.size += len(items)
        due_in = batch.fire_at - loop.time()
        if batch.size >= self.max_batch or deadline - time.time() <= due_in:
            self._fire(batch)
        return await member.future  # cancelling the caller cancels the future: it leaves

    async def _batching(self) -> bool:
        """Whether to merge; in ``auto`` mode the engine's answer, asked once (again
        on the next request while the engine cannot say). Requests that arrive while
        it is asked share the one question: they all resume at its answer, so they
        can still meet in one batch (one probe each would answer them apart)."""
        if self.batching is None:
            asking = self._asking
            if asking is None:
                probe = self.engine.batches_embeddings()
                asking = self._asking = asyncio.ensure_future(probe)
            try:
                merges = await asyncio.shield(asking)  # a caller that leaves, leaves it
            finally:
                if asking.done() and self._asking is asking:
                    self._asking = None
            if merges is None:
                return False
            if self.batching is not None:  # another sharer settled it already
                return self.batching
            self.batching = not merges
            log.info(
                "embedding micro-batching %s: the engine %s",
                "on" if self.batching else "off",
                "batches concurrent calls itself" if merges else "runs each call alone",
            )
        return self.batching

    async def _alone(
        self, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> Embeddings:
        self._count_call(1)
        return await self.engine.embed(body, request_id, headers)

    def _count_call(self, requests: int) -> None:
        self.engine_calls += 1
        if self._observe is not None:
            self._observe(requests)

    def _fire(self, batch: _Batch) -> None:
        if self._pending.get(batch.key) is batch:
            del self._pending[batch.key]  # later arrivals start a new batch
        batch.fire.set()

    async def _run(self, batch: _Batch) -> None:
        try:
            await self._serve(batch)
        except asyncio.CancelledError:
            # Closing: whoever still waits gets a retryable error, never a hang.
            _settle(batch.members, EngineUnavailable("worker stopping: embedding batch aborted"))
            raise
        except Exception as exc:  # noqa: BLE001 - not swallowed: each member gets it
            # A bug below (an adapter's, a counter's): every member ends now, not
            # at its deadline; where it was raised goes to the log, its message not.
            cause: BaseException = exc
            while isinstance(cause, BaseExceptionGroup):  # the call's task group's
                cause = cause.exceptions[0]
            name = type(cause).__name__
            log_event(log, "internal_error", logging.ERROR, error=name, frames=frames_of(cause))
            _settle(batch.members, WorkerError(f"embedding batch failed ({name})"))

    async def _serve(self, batch: _Batch) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(batch.fire.wait(), max(0.0, batch.fire_at - loop.time()))
        self._fire(batch)
        live = [m for m in batch.members if not m.future.done()]
        if not live:
            return
        call = asyncio.ensure_future(self._call(live))
        left = len(live)

        def gone(_: asyncio.Future[Embeddings]) -> None:
            nonlocal left
            left -= 1
            if left == 0:
                call.cancel()  # nobody waits any more: abort the engine call

        for m in live:
            m.future.add_done_callback(gone)
        try:
            results = await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            return  # every member left
        for m, result in zip(live, results, strict=True):
            _settle([m], result)

    async def _call(self, live: list[_Member]) -> list[Embeddings | EngineError]:
        if len(live) == 1:
            m = live[0]
            try:
                return [await self._alone(m.body, m.request_id, m.headers)]
            except EngineError as exc:
                return [exc]
        first = live[0]
        body = {**first.body, "input": [item for m in live for item in m.items]}
        batch_id = f"embb-{uuid.uuid4().hex[:16]}"
        self._count_call(len(live))
        failure: EngineError | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                embedded = tg.create_task(self.engine.embed(body, batch_id, first.headers))
                counted = tg.create_task(self._counts(first.body, live, first.headers))
        except* EngineError as group:
            found = group.exceptions[0]
            assert isinstance(found, EngineError)
            failure = found
        if isinstance(failure, EngineRejected):
            # One member's input is bad (too long, bad ids): the rest must not
            # fail with it. Each goes alone and gets its own answer.
            log.info("embedding batch of %d rejected; serving its members alone", len(live))
            return [r for rs in await asyncio.gather(*(self._call([m]) for m in live)) for r in rs]
        if failure is not None:
            return [failure] * len(live)
        return self._split(live, embedded.result(), counted.result())

    async def _counts(
        self, body: Mapping[str, Any], live: list[_Member], headers: Mapping[str, str]
    ) -> list[int] | None:
        """Token count per input, in batch order; None if the engine cannot say."""
        texts = [i for m in live for i in m.items if isinstance(i, str)]
        text_counts: list[int] = []
        if texts and self.counter is not None:
            special = body.get("add_special_tokens", True)
            text_counts = await self.counter.count(
                texts, special if isinstance(special, bool) else True
            )
        elif texts:
            model = str(body.get("model", ""))
            found = await self.engine.count_tokens(model, texts, headers)
            if found is None or len(found) != len(texts):
                return None
            text_counts = list(found)
        it = iter(text_counts)
        counts = [next(it) if isinstance(i, str) else len(i) for m in live for i in m.items]
        keep = body.get("truncate_prompt_tokens")
        if isinstance(keep, int) and not isinstance(keep, bool) and keep > 0:
            # The engine cuts each input to K tokens (its special ones within
            # them): counted whole, a batch's usage disagreed with the engine's
            # total and was split by length instead of exactly.
            counts = [min(c, keep) for c in counts]
        return counts

    def _split(
        self, live: list[_Member], result: Embeddings, counts: list[int] | None
    ) -> list[Embeddings | EngineError]:
        n_items = sum(len(m.items) for m in live)
        if len(result.vectors) != n_items:
            err = EngineError(f"engine returned {len(result.vectors)} vectors for {n_items} inputs")
            return [err] * len(live)
        total = result.usage.prompt_tokens
        if counts is None or sum(counts) != total:
            log.warning(
                "embedding batch: per-input token counts %s the engine's total; "
                "splitting usage in proportion",
                "unavailable for" if counts is None else "disagree with",
            )
            weights = [len(i) for m in live for i in m.items]
            counts = split_total(total, weights)
        out: list[Embeddings | EngineError] = []
        at = 0
        for m in live:
            n = len(m.items)
            tokens = sum(counts[at : at + n])
            out.append(
                Embeddings(result.vectors[at : at + n], Usage(prompt_tokens=tokens), result.model)
            )
            at += n
        return out

    async def aclose(self) -> None:
        """Stop taking requests and end every batch task (none is orphaned). Called
        after the worker's handlers have drained, so no member is still waiting;
        on an error path any that is gets ``EngineUnavailable`` (retryable)."""
        self._closed = True
        self._pending.clear()
        tasks: set[asyncio.Future[Any]] = set(self._tasks)
        if self._asking is not None:
            tasks.add(self._asking)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


def _unserved(batch: _Batch, _: asyncio.Task[None]) -> None:
    """The batch's task ended: a member it left waiting gets a retryable error."""
    _settle(batch.members, EngineUnavailable("worker stopping: embedding batch aborted"))


def _settle(members: list[_Member], outcome: Embeddings | BaseException) -> None:
    for m in members:
        if m.future.done():
            continue
        if isinstance(outcome, BaseException):
            m.future.set_exception(outcome)
        else:
            m.future.set_result(outcome)

"""The engine adapter interface: one small async class per engine dialect.

An adapter turns an OpenAI-shaped request body into a stream of
:class:`Delta` events ending in one :class:`Done`, and raises
``workers.errors.EngineError`` subclasses for failures. Cancelling the
consuming task must abort the engine call (close the connection), so GPU time
stops: consume a stream inside :func:`closing`, which closes the generator (and
so its connection) on any exit, not whenever it is garbage collected.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from streams.vectors import Vector
from streams.wire import Op, Usage
from workers.engines.served import Served


@dataclass(frozen=True, slots=True)
class Delta:
    text: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None  # the engine's, for this delta
    index: int = 0  # its choice
    reasoning: str | None = None  # a reasoning model's thinking (``reasoning_content``)


@dataclass(frozen=True, slots=True)
class Done:
    finish_reason: str
    usage: Usage
    model: str = ""


@dataclass(frozen=True, slots=True)
class Embeddings:
    vectors: list[Vector]  # floats, or packed float32 (streams/vectors.py)
    usage: Usage
    model: str = ""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the engine says about itself (vLLM metric names), for admission."""

    kv_usage: float | None = None  # vllm:kv_cache_usage_perc, 0..1
    waiting: float | None = None  # vllm:num_requests_waiting
    running: float | None = None  # vllm:num_requests_running
    num_gpu_blocks: int | None = None  # vllm:cache_config_info
    block_size: int | None = None
    extra: dict[str, float] = field(default_factory=dict)


@contextlib.asynccontextmanager
async def closing(
    events: AsyncIterator[Delta | Done],
) -> AsyncIterator[AsyncIterator[Delta | Done]]:
    """``events``, closed when the block ends however it ends."""
    try:
        yield events
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


class EngineAdapter(abc.ABC):
    name = "base"
    # Whether the engine keys its prefix cache by the request's ``cache_salt``
    # (vLLM's): the worker then salts it by the request's cache scope.
    salts_cache = False

    @abc.abstractmethod
    def generate(
        self, op: Op, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> AsyncIterator[Delta | Done]:
        """Stream one chat or completion request."""

    @abc.abstractmethod
    async def embed(
        self, body: Mapping[str, Any], request_id: str, headers: Mapping[str, str]
    ) -> Embeddings: ...

    @abc.abstractmethod
    async def load(self) -> EngineLoad:
        """Current engine load; fields it cannot tell are None."""

    async def count_tokens(
        self, model: str, texts: Sequence[str], headers: Mapping[str, str]
    ) -> list[int] | None:
        """Token count of each text as the engine's embedding call would count it
        (for splitting a batched call's usage per request); None: cannot say."""
        return None

    async def version(self) -> str:
        """The engine's name and version as it reports them (workers advertise it;
        a change fires the route evidence's ``engine_version_changed``); "": it
        does not say."""
        return ""

    async def served(self) -> Served | None:
        """The base models and LoRA adapters the engine serves now (its
        ``/v1/models``); None: it cannot say (no such listing, or unreachable)."""
        return None

    async def batches_embeddings(self) -> bool | None:
        """Whether the engine runs concurrent embedding calls together by itself
        (then the worker's micro-batching only adds its wait); None: cannot say
        now (unreachable). Unknown engines are assumed to: batching is turned on
        only where it is known to pay."""
        return True

    async def healthy(self) -> bool:
        """Whether the engine answers its health probe (readiness)."""
        load = await self.load()
        return load.running is not None or load.kv_usage is not None

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        pass

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

"""One request inside the engine: its tokens, KV blocks and scheduling state."""

from __future__ import annotations

import asyncio
from enum import StrEnum

from sim.kv import ROOT_HASH
from sim.records import RequestRecord


class SeqStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


DONE = (SeqStatus.FINISHED, SeqStatus.ABORTED, SeqStatus.FAILED)


class Sequence:
    """A request's state. `token_ids` is the prompt, then every generated token (the
    tokens of all ``n`` choices, interleaved: their KV grows together). The KV of the
    first `num_computed` tokens is in `blocks`; a step computes the rest, or a chunk of
    it, and when it reaches the end it emits the tokens the client waits for."""

    __slots__ = (
        "admit_order",
        "arrived",
        "blocks",
        "enqueued",
        "first_at",
        "first_token_delay",
        "future",
        "generated",
        "hashes",
        "itl_override",
        "last_token",
        "not_before",
        "num_computed",
        "num_prompt",
        "parked",
        "pending",
        "queued",
        "record",
        "root",
        "rounds",
        "stall_after_first",
        "status",
        "token_ids",
    )

    def __init__(
        self, record: RequestRecord, prompt_ids: list[int], now: float, root: int = ROOT_HASH
    ) -> None:
        self.record = record
        self.root = root  # the first block's parent: its cache salt's (sim/kv.py)
        self.token_ids = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.status = SeqStatus.WAITING
        self.blocks: list[int] = []
        self.hashes: list[int] = []  # chained hashes of the full blocks of token_ids
        self.num_computed = 0  # tokens whose KV is in `blocks`
        self.generated = 0
        self.rounds = 0  # emissions: one token per live choice each
        self.admit_order = 0
        self.arrived = now  # engine clock
        self.enqueued = now  # into the scheduler's waiting queue (after the API server)
        self.first_at: float | None = None  # engine clock, first token
        self.last_token = now
        # The client's request for its next tokens (one per live choice) and the future
        # it waits on; None while the client is busy with the last ones.
        self.pending: list[int] | None = None
        self.future: asyncio.Future[None] | None = None
        self.not_before = now  # not scheduled before this (stall:MS, slow:MS)
        self.parked = False  # stall: never scheduled again (until the client leaves)
        self.queued = True  # first admission not yet done
        self.first_token_delay = 0.0
        self.itl_override: float | None = None
        self.stall_after_first = False

    @property
    def id(self) -> str:
        return self.record.id

    def ready(self, now: float) -> bool:
        """Whether a step may run for it now: the client waits and no fault holds it."""
        return self.pending is not None and not self.parked and self.not_before <= now

    def width(self) -> int:
        """Sequences it stands for in a batch (``n`` choices decode side by side)."""
        return len(self.pending) if self.pending else 1

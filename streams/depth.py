"""Queue depth per request class, read once a look.

A class's work sits on several consumers: its plain subject, its affinity lanes
(hundreds of them), its excess and each deployment pool's. One ``CONSUMER.LIST`` request returns the
numbers of up to 256 consumers, so a look at every class costs a request or
three, not one ``consumer_info`` per lane.

At fleet scale even that is one list per gateway per look: one gateway, elected
by lease, reads and publishes each look on ``DEPTH_SUBJECT`` (a :class:`DepthLook`),
and the others take it from there (gateway/inference/shedding.py). Workers take
from it too: each non-lane consumer's pending count, which their pullers would
otherwise ask the server for (``CONSUMER.INFO``) before taking a slot
(:class:`LookFollower`, streams/consumer.py)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo
from nats.js.errors import APIError, ServiceUnavailableError

from streams.definitions import Topology
from streams.pools import pool_consumer_name, pool_of_consumer
from streams.subjects import PREFIX

log = logging.getLogger(__name__)

LIST_PAGE = 256  # the server's page of a consumer list (JSApiListLimit)


# The elected reader's looks, and a follower's nudge that its own publish may
# have ended an idle spell (the reader then looks at once, as for its own).
DEPTH_SUBJECT = f"{PREFIX}.depth.look"
DEPTH_POKE_SUBJECT = f"{PREFIX}.depth.poke"


class ClassDepth(msgspec.Struct, frozen=True):
    pending: int = 0  # published, not yet handed to a worker
    ack_pending: int = 0  # handed to a worker, not yet acknowledged (its first token)
    delivered: int = 0  # deliveries so far, summed over the class's consumers
    waiting: int = 0  # pull requests waiting on the class's plain consumer
    found: bool = False  # the class's plain consumer exists

    @property
    def lag(self) -> int:
        """KEDA's lag: what waits for a worker or for its first token."""
        return self.pending + self.ack_pending


class Delivered(msgspec.Struct, frozen=True):
    consumer_seq: int = 0


class ConsumerNumbers(msgspec.Struct, frozen=True):
    """What a look uses of one consumer's info; the rest of it (its config, its
    cluster) is skipped unread."""

    name: str
    num_pending: int = 0
    num_ack_pending: int = 0
    num_waiting: int = 0
    delivered: Delivered | None = None


class _ApiError(msgspec.Struct, frozen=True):
    code: int
    err_code: int | None = None
    description: str | None = None


class _ConsumerPage(msgspec.Struct, frozen=True):
    consumers: list[ConsumerNumbers] = []
    error: _ApiError | None = None


_PAGE = msgspec.json.Decoder(_ConsumerPage)


async def consumer_infos(js: JetStreamContext, stream: str) -> list[ConsumerInfo]:
    """Every consumer of ``stream``, config and all, a page a request (provisioning
    compares configs; a look needs only :func:`consumer_numbers`)."""
    out: list[ConsumerInfo] = []
    while True:
        page = await js.consumers_info(stream, offset=len(out))
        out += page
        if len(page) < LIST_PAGE:
            return out


async def consumer_numbers(js: JetStreamContext, stream: str) -> list[ConsumerNumbers]:
    """Every consumer of ``stream`` with its numbers, a page a request.

    The list is asked on the context's own connection and decoded by msgspec:
    nats-py's ``consumers_info`` builds a full ``ConsumerInfo`` per consumer from
    ``json.loads`` (2.0 ms of CPU a look at 71 consumers, against 0.37 ms), and
    an elected reader does this twice a second over hundreds of lanes. nats-py
    offers no raw API request, hence its connection and prefix here."""
    nc, prefix, timeout = js._nc, js._prefix, js._timeout
    out: list[ConsumerNumbers] = []
    while True:
        try:
            msg = await nc.request(
                f"{prefix}.CONSUMER.LIST.{stream}",
                msgspec.json.encode({"offset": len(out)}),
                timeout=timeout,
            )
        except nats.errors.NoRespondersError:
            raise ServiceUnavailableError from None  # as nats-py's own call raises
        page = _PAGE.decode(msg.data)
        if page.error is not None:  # raises nats-py's error for it, as its own call does
            APIError.from_error(msgspec.structs.asdict(page.error))
        out += page.consumers
        if len(page.consumers) < LIST_PAGE:
            return out


def queue_key(cls: str, pool: str = "") -> str:
    """A queue's key in a look: a class's shared queue (``cls``), or one deployment
    pool's of it (``cls@<pool token>``; a token never holds ``@``)."""
    return f"{cls}@{pool}" if pool else cls


def class_depths(topo: Topology, infos: list[ConsumerNumbers]) -> dict[str, ClassDepth]:
    """Each queue's numbers, summed over the consumers that serve it: a class's
    shared queue (its plain consumer, lanes, excess), keyed by the class, and each
    deployment pool's queue of it (streams/pools.py), keyed apart (:func:`queue_key`).
    Only a pool's own workers take from its queue: summed into the class, a pool
    with no worker (a route's candidate not started, a typo) held back and scaled
    the class's shared workers for work they cannot pull."""
    sums = {cls.value: [0, 0, 0, 0, False] for cls in topo.classes}
    for info in infos:
        cls, lane = topo.consumer_class(info.name)
        if cls is None:
            continue
        pool = pool_of_consumer(info.name, cls, lane)
        row = sums.setdefault(queue_key(cls, pool), [0, 0, 0, 0, False])
        row[0] += info.num_pending or 0
        row[1] += info.num_ack_pending or 0
        row[2] += info.delivered.consumer_seq if info.delivered else 0
        plain = pool_consumer_name(pool, cls) if pool else topo.consumer_name(cls)
        if info.name == plain:
            row[3], row[4] = info.num_waiting or 0, True
    return {
        key: ClassDepth(int(p), int(a), int(d), int(w), bool(f))
        for key, (p, a, d, w, f) in sums.items()
    }


class DepthLook(msgspec.Struct, frozen=True, tag="depth_look"):
    """One look at every class, as the elected reader published it."""

    reader: str  # the gateway that looked
    classes: dict[str, ClassDepth] = {}
    at: float = 0.0  # unix time of the look (a heartbeat republishes it unchanged)
    # num_pending of every non-lane consumer (plain, excess, pools' plain) that
    # has any: what a worker's pending peek asks (absent: 0).
    plain: dict[str, int] = {}


LOOK_ENCODER = msgspec.json.Encoder()
LOOK_DECODER = msgspec.json.Decoder(DepthLook)


def decode_look(data: bytes) -> DepthLook | None:
    """A published look; None (logged) when it cannot be read."""
    try:
        return LOOK_DECODER.decode(data)
    except msgspec.DecodeError:
        log.warning("undecodable depth look dropped")
        return None


async def _all_infos(js: JetStreamContext, topo: Topology) -> list[ConsumerNumbers]:
    infos: list[ConsumerNumbers] = []
    for stream in topo.request_streams:  # one, one per class, or per shard
        infos += await consumer_numbers(js, stream)
    return infos


async def read_depths(js: JetStreamContext, topo: Topology) -> dict[str, ClassDepth]:
    return class_depths(topo, await _all_infos(js, topo))


async def read_look(js: JetStreamContext, topo: Topology, reader: str) -> DepthLook:
    """One look at every work-queue consumer: the class sums and the non-lane
    consumers' pending counts."""
    infos = await _all_infos(js, topo)
    plain = {
        i.name: int(i.num_pending)
        for i in infos
        if i.num_pending and not topo.is_lane_consumer(i.name)
    }
    return DepthLook(reader, class_depths(topo, infos), time.time(), plain)


class LookFollower:
    """A worker's copy of the fleet reader's latest look: a consumer's pending
    count without a ``CONSUMER.INFO`` (the pending peeks, streams/consumer.py).
    A look older than ``fresh_s`` (the reader idle, gone, or a clock apart) says
    nothing: the caller asks the server."""

    def __init__(
        self, nc: Client, fresh_s: float = 1.5, clock: Callable[[], float] = time.time
    ) -> None:
        self._nc = nc
        self.fresh_s = fresh_s
        self._clock = clock
        self._look: DepthLook | None = None
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(DEPTH_SUBJECT, cb=self._heard)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()

    async def _heard(self, msg: Msg) -> None:
        look = decode_look(msg.data)
        if look is None:
            return
        if self._look is None or look.at >= self._look.at:
            self._look = look

    def pending(self, consumer: str) -> int | None:
        """``consumer``'s pending count as of the latest fresh look; None: no
        fresh look (ask the server)."""
        look = self._look
        if look is None or self._clock() - look.at > self.fresh_s:
            return None
        return look.plain.get(consumer, 0)

"""Queue depth per request class, read once a look.

A class's work sits on several consumers: its plain subject, its affinity lanes
(hundreds of them), its excess and each deployment pool's. One ``CONSUMER.LIST`` request returns the
numbers of up to 256 consumers, so a look at every class costs a request or
three, not one ``consumer_info`` per lane.

At fleet scale even that is one list per gateway per look: one gateway, elected
by lease, reads and publishes each look on ``DEPTH_SUBJECT`` (a :class:`DepthLook`),
and the others take it from there (gateway/inference/shedding.py)."""

from __future__ import annotations

import msgspec
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo

from streams.definitions import Topology
from streams.subjects import PREFIX

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


async def consumer_infos(js: JetStreamContext, stream: str) -> list[ConsumerInfo]:
    """Every consumer of ``stream`` with its numbers, a page a request."""
    out: list[ConsumerInfo] = []
    while True:
        page = await js.consumers_info(stream, offset=len(out))
        out += page
        if len(page) < LIST_PAGE:
            return out


def class_depths(topo: Topology, infos: list[ConsumerInfo]) -> dict[str, ClassDepth]:
    """Each class's numbers, summed over the consumers that serve it: the shared
    ones (plain, lanes, excess) and every deployment pool's (streams/pools.py)."""
    plain = {topo.consumer_name(cls): cls.value for cls in topo.classes}
    sums = {cls.value: [0, 0, 0, 0, False] for cls in topo.classes}
    for info in infos:
        cls, _ = topo.consumer_class(info.name)
        if cls is None:
            continue
        row = sums[cls]
        row[0] += info.num_pending or 0
        row[1] += info.num_ack_pending or 0
        row[2] += info.delivered.consumer_seq if info.delivered else 0
        if info.name in plain:
            row[3], row[4] = info.num_waiting or 0, True
    return {
        cls: ClassDepth(int(p), int(a), int(d), int(w), bool(f))
        for cls, (p, a, d, w, f) in sums.items()
    }


class DepthLook(msgspec.Struct, frozen=True, tag="depth_look"):
    """One look at every class, as the elected reader published it."""

    reader: str  # the gateway that looked
    classes: dict[str, ClassDepth] = {}


LOOK_ENCODER = msgspec.json.Encoder()
LOOK_DECODER = msgspec.json.Decoder(DepthLook)


async def read_depths(js: JetStreamContext, topo: Topology) -> dict[str, ClassDepth]:
    infos: list[ConsumerInfo] = []
    for stream in topo.request_streams:  # one, or one per class
        infos += await consumer_infos(js, stream)
    return class_depths(topo, infos)

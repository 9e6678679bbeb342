"""Queue depths by queue (streams/depth.py): a class's shared queue, and each
deployment pool's queue of it, apart."""

from __future__ import annotations

from streams.definitions import DEFAULT_TOPOLOGY
from streams.depth import ClassDepth, ConsumerNumbers, Delivered, class_depths, queue_key
from streams.pools import pool_consumer_name, pool_lane_consumer_name, pool_token


def test_a_pools_backlog_is_its_own_not_its_classs() -> None:
    """Summed into the class, a pool with no worker (a route's candidate not
    started, a typo) held back the fair gate and shedding of every tenant of the
    class, and scaled the class's shared workers for work they cannot pull."""
    topo = DEFAULT_TOPOLOGY
    cold, dotted = pool_token("dep-cold"), pool_token("dep.v2@lora-a")
    infos = [
        ConsumerNumbers(topo.consumer_name("interactive"), 2, 1, 5, Delivered(10)),
        ConsumerNumbers(topo.lane_consumer_name("interactive", 3), 1, 0, 0, Delivered(4)),
        ConsumerNumbers(topo.excess_consumer_name("interactive"), 1, 0, 0, Delivered(1)),
        ConsumerNumbers(pool_consumer_name(cold, "interactive"), 190, 0, 0, Delivered(0)),
        ConsumerNumbers(pool_lane_consumer_name(cold, "interactive", 7), 2, 0, 0, None),
        ConsumerNumbers(pool_consumer_name(dotted, "batch"), 3, 1, 2, Delivered(6)),
        ConsumerNumbers("not-ours", 99, 99, 99, None),
    ]
    depths = class_depths(topo, infos)
    assert depths["interactive"] == ClassDepth(4, 1, 15, 5, True)  # shared: plain, lane, excess
    assert depths[queue_key("interactive", cold)] == ClassDepth(192, 0, 0, 0, True)
    assert depths[queue_key("batch", dotted)] == ClassDepth(3, 1, 6, 2, True)
    assert depths["batch"] == ClassDepth()  # no shared consumer seen
    assert "@" not in dotted  # the key's separator never occurs in a token

"""What a worker owes the message it was delivered: a confirmed ack, and an
honest count of its attempts.

- **Confirmed ack (a double ack).** ``msg.ack()`` is fire-and-forget: a lost
  ack lets the request run again after ``ack_wait``, tokens and all. The first
  token's ack waits for the server's confirmation instead. It runs beside the
  stream (the stream never waits for it); until it is confirmed, the message
  is kept ours with ``in_progress`` and the ack is tried again, so the request
  is not redelivered while this attempt still streams.
- **Attempts.** JetStream's ``num_delivered`` also counts deliveries handed
  back unstarted. A retry decision counts the failures in
  ``streams.marks.FailureCounts``; the consumer's own ``max_deliver`` still
  bounds deliveries (a worker that crashes every time), so a retry is only
  offered while a delivery is left to carry it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import nats.errors
from nats.aio.msg import Msg
from nats.errors import MsgAlreadyAckdError

from streams.definitions import Topology

log = logging.getLogger(__name__)

ACK_TIMEOUT_S = 2.0  # one confirmation wait


async def confirm_ack(
    msg: Msg, keep_alive_s: float, done: asyncio.Event, unconfirmed: Callable[[], None]
) -> bool:
    """Ack ``msg`` and wait for the server to confirm it; retry (keeping the
    message with ``in_progress``) until confirmed or, once ``done`` is set, one
    last time. ``unconfirmed`` is called once, at the first failure."""
    warned = False
    while True:
        try:
            await msg.ack_sync(timeout=min(ACK_TIMEOUT_S, keep_alive_s))
            return True
        except MsgAlreadyAckdError:
            return True
        except (nats.errors.Error, TimeoutError) as exc:
            if not warned:
                warned = True
                unconfirmed()
                log.warning("ack of %s not confirmed (%r): retrying", msg.reply, exc)
        if done.is_set():
            log.error("ack of %s never confirmed: it may run again after ack_wait", msg.reply)
            return False
        with contextlib.suppress(nats.errors.Error):
            await msg.in_progress()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(keep_alive_s):
                await done.wait()


def delivery_limit(topo: Topology, msg: Msg) -> int:
    """The ``max_deliver`` of the consumer that delivered ``msg``."""
    consumer = msg.metadata.consumer or ""
    if topo.is_lane_consumer(consumer):
        return topo.lane_max_deliver
    for cls in topo.classes:
        if consumer in (topo.consumer_name(cls), topo.excess_consumer_name(cls)):
            return topo.consumer_config(cls).max_deliver or topo.limits.max_deliver
    return topo.limits.max_deliver

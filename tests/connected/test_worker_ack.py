"""The first-token ack waits for the server's confirmation (a double ack); one
that is not confirmed is tried again while the stream goes on, and the message
is kept ours meanwhile (``in_progress``), so it is not redelivered under a
running attempt. The acker here is a real NATS responder that drops the first
confirmations, as a lost ack would look."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from jetserve.services import Service
from streams.connect import connect
from workers.inference.delivery import confirm_ack

pytestmark = pytest.mark.connected


async def delivered(nc: Client, subject: str, reply: str) -> Msg:
    """A message whose ack subject is ``reply`` (as JetStream's is $JS.ACK...)."""
    box: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        await box.put(msg)

    sub = await nc.subscribe(subject, cb=on_msg)
    await nc.publish(subject, b"work", reply=reply)
    msg = await asyncio.wait_for(box.get(), 5)
    await sub.unsubscribe()
    return msg


class Acker:
    """Records what the worker sends to a message's ack subject; confirms the
    ``confirm_at``-th ack (0: never)."""

    def __init__(self, confirm_at: int) -> None:
        self.confirm_at = confirm_at
        self.seen: list[bytes] = []
        self.acks = 0
        self.second_ack = asyncio.Event()

    async def on_note(self, note: Msg) -> None:
        self.seen.append(note.data)
        if note.data not in (b"", b"+ACK"):  # ack_sync sends the empty ack
            return
        self.acks += 1
        if self.acks == 2:
            self.second_ack.set()
        if self.acks == self.confirm_at:
            await note.respond(b"")


async def test_an_unconfirmed_ack_is_retried_and_the_message_kept(nats_server: Service) -> None:
    nc = await connect(f"nats://127.0.0.1:{nats_server.port}", "t", nats_server.bus_auth())
    try:
        acker = Acker(confirm_at=3)
        await nc.subscribe("acks.>", cb=acker.on_note)
        msg = await delivered(nc, "work.one", "acks.one")
        misses: list[int] = []
        ok = await asyncio.wait_for(
            confirm_ack(msg, 0.2, asyncio.Event(), lambda: misses.append(1)), 20
        )
        assert ok
        assert acker.acks == 3  # the third try was confirmed
        assert misses == [1]  # told once, at the first miss
        assert acker.seen.count(b"+WPI") >= 2  # kept ours between the tries
    finally:
        await nc.close()


async def test_an_ack_never_confirmed_gives_up_when_the_attempt_ends(
    nats_server: Service,
) -> None:
    nc = await connect(f"nats://127.0.0.1:{nats_server.port}", "t", nats_server.bus_auth())
    try:
        acker = Acker(confirm_at=0)
        await nc.subscribe("acks.>", cb=acker.on_note)
        msg = await delivered(nc, "work.two", "acks.two")
        done = asyncio.Event()
        confirming = asyncio.create_task(confirm_ack(msg, 0.2, done, lambda: None))
        await asyncio.wait_for(acker.second_ack.wait(), 20)  # it retries while the stream runs
        assert not confirming.done()
        done.set()  # the stream ended: one last try, then it gives up
        assert await asyncio.wait_for(confirming, 20) is False
    finally:
        await nc.close()

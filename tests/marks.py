"""Waiting for a request's durable cancel mark (streams/marks.py), read as an
operator would: with the admin credential, from the fleet's own bucket."""

from __future__ import annotations

import nats.js.errors

from jetserve.fleet import Fleet
from streams.definitions import DEFAULT_TOPOLOGY
from streams.marks import CancelMarks
from tests.waits import until


async def until_marked(fleet: Fleet, request_id: str, what: str) -> None:
    nc = await fleet.connect()
    try:
        marks = await CancelMarks(nc.jetstream(), DEFAULT_TOPOLOGY).open()

        async def marked() -> bool:
            try:
                return (await marks.get(request_id)).value is not None
            except nats.js.errors.KeyNotFoundError:
                return False

        await until(marked, what)
    finally:
        await nc.close()

"""Removing one stored message without erasing it.

nats-py's ``delete_msg`` asks the server for a secure erase (the API's
``no_erase`` left false): the server overwrites the message's bytes and
rewrites its whole block file through a temp file, with an fsync. Nothing
jetserve deletes needs that (a settlement already applied and in the ledger, a
cancelled request, a dead-lettered one), and on the settlement path it was the
largest single cost of the bus: 15-17 % of nats-server's CPU in a profile of
embeddings against the simulator. A plain removal writes a tombstone.

Erasing would not keep a prompt off the disk either: every served request's
message leaves the work queue by its ack, which removes it the same plain way:
its bytes stay in the block file until nats-server compacts or drops the block.
"""

from __future__ import annotations

import msgspec
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.errors import APIError, ServiceUnavailableError

_ENCODE = msgspec.json.Encoder()
_DECODE = msgspec.json.Decoder()


async def remove_msg(js: JetStreamContext, stream: str, seq: int, timeout_s: float = 5.0) -> None:
    """Remove message ``seq`` of ``stream``. Raises as nats-py's delete_msg
    does: NotFoundError (or APIError 10057) when it is already gone, the bus's
    errors otherwise."""
    subject = f"{js._prefix}.STREAM.MSG.DELETE.{stream}"
    payload = _ENCODE.encode({"seq": seq, "no_erase": True})
    try:
        reply = await js._nc.request(subject, payload, timeout=timeout_s)
    except NoRespondersError as exc:
        raise ServiceUnavailableError from exc
    answer = _DECODE.decode(reply.data)
    if "error" in answer:
        APIError.from_error(answer["error"])  # raises

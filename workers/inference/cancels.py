"""The worker's view of cancels: every one, from before the request was pulled.

A cancel is a core NATS publish on ``jetserve.cancel.<id>`` (then a durable
mark, then the publish again: streams/marks.py). The worker subscribes to all
of them once, at start, and then reads the marks already stored: any cancel
of any request is seen, whenever it was sent, from before the worker pulled
the request to mid-stream, and checking a request costs no round trip. After a
reconnect (cancels may have been missed meanwhile) the marks are read again
before the next request starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KV_DEL, KV_PURGE

from streams.connect import when_reconnected
from streams.marks import CancelMarks
from streams.subjects import PREFIX
from streams.tasks import stop_task
from streams.wire import decode_cancel

log = logging.getLogger(__name__)
MAX_NOTES = 100_000  # ~25 MB of notes; past it the marks are read per request


def stops(note: bytes, attempt: int) -> bool:
    """Whether a cancel note stops this attempt (a hedge race's winner goes on)."""
    with contextlib.suppress(msgspec.DecodeError):
        return decode_cancel(note).keep_attempt != attempt
    return True


class CancelWatch:
    def __init__(
        self, nc: Client, marks: CancelMarks, keep_s: float, max_notes: int = MAX_NOTES
    ) -> None:
        self._nc = nc
        self._marks = marks
        self._keep_s = keep_s  # as long as a mark lives (a request's longest wait)
        self._notes: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # id -> (until, note)
        self._max_notes = max_notes
        self._spilled_until = 0.0  # until then a note let go could still matter
        self._live: dict[str, list[tuple[int, asyncio.Event]]] = {}
        self._sub: Subscription | None = None
        self._loaded_at = -1  # the connection's reconnect count when the marks were read
        self._lock = asyncio.Lock()
        self._rereads: asyncio.Task[None] | None = None  # the read after a reconnect
        self._unhook: Callable[[], None] | None = None

    async def start(self) -> None:
        """Subscribe first, read the marks second: no cancel falls between."""
        self._sub = await self._nc.subscribe(f"{PREFIX}.cancel.>", cb=self._on_cancel)
        self._unhook = when_reconnected(self._nc, self._reconnected)
        await self.fresh()

    async def stop(self) -> None:
        if self._unhook is not None:
            self._unhook()
        if self._rereads is not None:
            await stop_task(self._rereads)
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()

    def _reconnected(self) -> None:
        """Read the marks now: a cancel sent while this worker was away stops the
        requests it is running (not only the next one it starts)."""
        if self._rereads is None or self._rereads.done():
            self._rereads = asyncio.create_task(self._reread(), name="cancel-marks-reread")

    async def _reread(self) -> None:
        # Until read under the latest reconnect (another may come during a read).
        while self._loaded_at != self._nc.stats["reconnects"]:
            if not await self.fresh():
                return  # the next request's start tries again

    async def fresh(self) -> bool:
        """Read the stored marks if not read since the last (re)connect; False
        when they could not be read (live cancels only, until the next try)."""
        if self._loaded_at == self._nc.stats["reconnects"]:
            return True
        async with self._lock:
            count = self._nc.stats["reconnects"]
            if self._loaded_at == count:
                return True
            try:
                kv = await self._marks.open()
                watcher = await kv.watchall()
                async for entry in watcher:
                    if entry is None:  # the end of the current values
                        break
                    if entry.operation not in (KV_DEL, KV_PURGE) and entry.value:
                        self._note(entry.key, entry.value)
                await watcher.stop()  # type: ignore[no-untyped-call]
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("cancel marks not read (%r): live cancels only", exc)
                return False
            self._loaded_at = count
            return True

    async def check(self, request_id: str) -> None:
        """Before ``request_id`` starts: when the notes here may lack its cancel (the
        marks not read since the last reconnect, or notes that could still matter
        let go: ``max_notes``), its own mark is read: one KV get. The full read
        goes on in the background; a request waiting for it (it took 10 s for
        300,000 marks, with nothing telling the server the message was still
        ours) was delivered again to another worker and run twice."""
        complete = self._loaded_at == self._nc.stats["reconnects"]
        if not complete:
            self._reconnected()  # the full read, if none is under way
        if (complete and time.monotonic() >= self._spilled_until) or request_id in self._notes:
            return
        try:
            kv = await self._marks.open()
            entry = await kv.get(request_id)
        except KeyNotFoundError:
            return
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("cancel mark of %s not read (%r): live cancels only", request_id, exc)
            return
        if entry.value:
            self._note(request_id, entry.value)

    async def _on_cancel(self, msg: Msg) -> None:
        self._note(msg.subject.rsplit(".", 1)[-1], msg.data)

    def _note(self, request_id: str, note: bytes) -> None:
        now = time.monotonic()
        self._notes.pop(request_id, None)
        self._notes[request_id] = (now + self._keep_s, note)
        while self._notes:  # oldest first: the same keep for all
            _, (until, _) = next(iter(self._notes.items()))
            if until > now and len(self._notes) <= self._max_notes:
                break
            self._notes.popitem(last=False)
            if until > now:
                self._spilled_until = until
        for attempt, event in self._live.get(request_id, ()):
            if stops(note, attempt):
                event.set()

    @contextlib.contextmanager
    def watch(self, request_id: str, attempt: int) -> Iterator[asyncio.Event]:
        """An event set when this attempt is cancelled: already set if a cancel
        came before it started."""
        event = asyncio.Event()
        known = self._notes.get(request_id)
        if known is not None and stops(known[1], attempt):
            event.set()
        watchers = self._live.setdefault(request_id, [])
        watchers.append((attempt, event))
        try:
            yield event
        finally:
            watchers.remove((attempt, event))
            if not watchers:
                del self._live[request_id]

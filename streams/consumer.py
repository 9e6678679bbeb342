"""One lifecycle for every JetStream work queue we consume (the inference
worker, the agent executor, run settlement): pull while there is room, run
each message as an owned handler task, and on shutdown stop pulling, hand the
strays back and drain.

As with temporalio's worker, :meth:`PullConsumer.run` serves until
:meth:`PullConsumer.shutdown`; then the handlers in flight get
``graceful_timeout_s`` to finish and the rest are cancelled (a cancelled
handler leaves its message unacked: it is redelivered).

Strays: a pull request outlives a cancelled fetch until it expires at the
server, and a message it hands over meanwhile would sit unseen until its
ack_wait ran out. So a pull is waited for until the server says it ended (its
batch, or the expiry note), not until a client-side timer fires first; and on
shutdown each source takes its interest off the pull's reply subject (the
server drops a waiting pull with no interest instead of delivering to it),
flushes, and hands back (naks) what the server sent before, so another
consumer starts it now. Only when that round trip fails does it listen until
its last pull has expired.

Idle cost: an empty queue costs one pull per expiry. While the owner is quiet
(nothing in flight) and pulls keep coming back empty, each expiry doubles, up
to ``idle_poll_s``; the first message, or any work in flight, brings it back
to ``poll_s``. Most of an idle fleet's CPU was these pulls (issue 14).

A polling pull holds a slot. Under load (the owner not quiet), or while its
slot would be the owner's last free one, a puller with ``peek`` whose last pull
was empty asks the consumer's pending count (one API call, no slot) every
``poll_s`` instead, and takes a slot only once something waits: a lower
class's empty queue then keeps no slot from interactive work under
saturation, and its floor goes to the class that has work (issue 15); nor does
its idle poll (up to a quarter of ``idle_poll_s``) hold a one-slot worker's
only slot while interactive requests pass it by. The count leaves out messages
waiting to be delivered again (handed back, nak'd, their ack_wait run out), so a
peeking puller with slots to spare pulls for real every ``PEEK_PULL_EVERY_S``.

A source is anything with ``run()`` (pull and start messages until cancelled,
or until its slots close) and ``hand_back()``: :class:`PullLoop` fetches from
a pull subscription; the worker's prefix lanes (``workers/inference/affinity.py``)
pull on priority groups through the raw JetStream API instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Protocol

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from streams.tasks import stop_task

log = logging.getLogger(__name__)

PEEK_PULL_EVERY_S = 2.0  # a peeking puller pulls for real at least this often

Handle = Callable[[Msg], Coroutine[None, None, None]]
_EXPIRY_MARGIN_S = 0.2  # the server's expiry runs a little after our clock's
_NOTE_WAIT_S = 2.0  # past its expiry, a pull whose note never came is given up


class Slots(Protocol):
    """Room for messages in flight. A slot is taken before the message is
    pulled (never over-fetch: a buffered, unstarted message ages towards its
    redelivery); a pull that brings fewer gives the rest back, and the handler
    gives its own back when it ends."""

    async def acquire(self, idle: bool = False) -> bool:
        """Wait for one slot; False: closed, stop pulling. ``idle``: the puller's
        last pull found its queue empty (a slot to poll with, likely unused)."""
        ...

    def try_acquire(self, idle: bool = False) -> bool: ...

    async def release(self) -> None: ...


class Source(Protocol):
    async def run(self) -> None: ...

    async def hand_back(self) -> None: ...


class Limit:
    """At most ``n`` messages in flight."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._room = asyncio.Event()
        if n > 0:
            self._room.set()

    async def acquire(self, idle: bool = False) -> bool:
        while self._free <= 0:
            self._room.clear()
            await self._room.wait()
        self._free -= 1
        return True

    def try_acquire(self, idle: bool = False) -> bool:
        if self._free <= 0:
            return False
        self._free -= 1
        return True

    async def release(self) -> None:
        self._free += 1
        self._room.set()


def idle_expiry(
    poll_s: float, idle_poll_s: float | None, empty: int, quiet: Callable[[], bool]
) -> float:
    """A pull's expiry after ``empty`` empty pulls in a row: ``poll_s``, doubled per
    empty pull while ``quiet()``, up to ``idle_poll_s`` (None: never longer)."""
    if idle_poll_s is None or empty <= 0 or not quiet():
        return poll_s
    return max(poll_s, min(idle_poll_s, poll_s * float(2 ** min(empty, 16))))


async def stop_interest(nc: Client, sub: Subscription, *more: Subscription) -> bool:
    """Tell the server to stop delivering to ``sub`` (and ``more``: UNSUB each),
    and wait until what it sent before has arrived (one PING round trip for
    all), keeping the subscriptions open here so those messages can still be
    read. False when that failed."""
    try:
        # nats-py's own drain() does this, then waits for a callback to consume
        # the queue, which a pull inbox read with next_msg does not have.
        for one in (sub, *more):
            await nc._send_unsubscribe(one._id)
        await nc.flush(timeout=5)
    except (nats.errors.Error, TimeoutError) as exc:
        log.warning("could not withdraw a pull's interest (%r): waiting out its expiry", exc)
        return False
    return True


class PullLoop:
    """Fetches from one pull subscription: up to ``batch`` messages a pull, as
    many as it holds slots for (one waited for, the rest free now). ``more``:
    after a pull brings something, take up to this many already waiting at once
    (they may share work with it, e.g. an embedding batch), never lingering.
    ``rest_s``: after a pull that brought nothing, wait this long (doubling per
    empty pull while ``quiet``, up to ``idle_poll_s``) before taking a slot for the next, instead
    of long polls that hold one: for a queue that is mostly empty and must not
    keep slots from busier ones while it is (a class's excess)."""

    def __init__(
        self,
        sub: JetStreamContext.PullSubscription,
        start: Callable[[Msg], None],
        *,
        slots: Slots | None = None,
        batch: int = 1,
        poll_s: float = 1.0,
        more: int = 0,
        error_backoff_s: float = 0.5,
        idle_poll_s: float | None = None,
        quiet: Callable[[], bool] = lambda: True,
        rest_s: float | None = None,
        peek: bool = False,
        scarce: Callable[[], bool] = lambda: False,
        known_pending: Callable[[], int | None] = lambda: None,
        on_peek: Callable[[str], None] = lambda source: None,
    ) -> None:
        self._sub = sub
        self._rest = rest_s
        self._peek = peek
        self._scarce = scarce  # whether a slot taken now would be the last free one
        # The consumer's pending count as the fleet's depth reader last saw it
        # (streams/depth.py LookFollower); None: ask the server.
        self._known_pending = known_pending
        self._on_peek = on_peek  # "look" or "server": where a peek's answer came from
        self._start = start
        self._slots = slots
        self._batch = batch
        self._poll = poll_s
        self._more = more
        self._backoff = error_backoff_s
        self._pull_until = 0.0  # when the newest pull expires at the server
        self._idle_poll = idle_poll_s
        self._quiet = quiet
        self._empty = 0  # pulls in a row that brought nothing

    def expiry(self) -> float:
        """The next pull's expiry (see the module docstring: idle cost)."""
        if self._rest is not None:
            return self._poll  # short: the rests between pulls grow instead
        return idle_expiry(self._poll, self._idle_poll, self._empty, self._quiet)

    async def run(self) -> None:
        while held := await self._take(self._batch, wait=True):
            msgs = await self._fetch(held, self.expiry())
            if msgs is None:
                await asyncio.sleep(self._backoff)
                continue
            self._empty = 0 if msgs else self._empty + 1
            if not msgs and self._rest is not None:
                # Growing only while the worker is quiet: a flood's pause must not
                # leave its excess unpulled for long.
                await asyncio.sleep(
                    idle_expiry(self._rest, self._idle_poll, self._empty, self._quiet)
                )
            for msg in msgs:
                self._start(msg)
            if msgs and self._more:
                for msg in await self._fetch(await self._take(self._more), 0.01) or ():
                    self._start(msg)

    async def _take(self, n: int, *, wait: bool = False) -> int:
        """Slots for up to ``n`` messages (waiting for the first if ``wait``)."""
        if self._slots is None:
            return n
        held = 0
        idle = self._empty > 0
        if wait:
            if idle and self._peek:
                # Quiet, with slots to spare: a polling slot keeps no one out.
                peeking_since = time.monotonic()
                while not self._quiet() or self._scarce():
                    if await self._pending():
                        idle = False  # work in sight: a waiter like any other
                        break
                    if time.monotonic() - peeking_since >= PEEK_PULL_EVERY_S and not self._scarce():
                        # num_pending leaves out a message waiting to be delivered
                        # again (handed back, nak'd, its ack_wait run out): a worker
                        # busy with other classes saw none, and it waited for a new
                        # message of its class or its deadline, slots free.
                        break
                    await asyncio.sleep(self._poll)
            if not await self._slots.acquire(idle):
                return 0
            held = 1
        while held < n and self._slots.try_acquire(idle):
            held += 1
        return held

    async def _pending(self) -> bool:
        """Whether the consumer has messages for us (True when it cannot say)."""
        known = self._known_pending()
        if known is not None:
            self._on_peek("look")
            return known > 0
        self._on_peek("server")
        try:
            info = await self._sub.consumer_info()
        except (nats.errors.Error, TimeoutError) as exc:
            log.debug("consumer info failed (%r): pull instead", exc)
            return True
        return bool(info.num_pending)

    async def _fetch(self, held: int, poll_s: float) -> list[Msg] | None:
        """Up to ``held`` messages, waiting up to ``poll_s`` (0: only those
        waiting now); the slots they did not use go back. None: the pull failed
        (logged), try again after the backoff."""
        if not held:
            return []
        msgs: list[Msg] = []
        failed = False
        try:
            await self._pull(held, poll_s, msgs)
        except nats.errors.Error as exc:
            log.warning("fetch failed: %s", exc)
            failed = True
        except asyncio.CancelledError:
            for msg in msgs:  # stopping mid-batch: what came goes back now
                with contextlib.suppress(nats.errors.Error):
                    await msg.nak()
            msgs.clear()
            raise
        finally:
            if self._slots is not None:
                for _ in range(held - len(msgs)):
                    await self._slots.release()
        return None if failed and not msgs else msgs

    async def _pull(self, n: int, poll_s: float, msgs: list[Msg]) -> None:
        """Up to ``n`` messages appended to ``msgs``, asked for as nats-py's
        ``fetch`` asks (a batch takes what is there, waiting up to ``poll_s``
        for some), but each pull is waited for until its batch is full or the
        server's note says it ended, never until a client-side timer fires first."""
        inbox = self._sub._sub  # the core subscription behind the pull (nats-py has no public one)
        while len(msgs) < n and inbox.pending_msgs:
            # A message an earlier pull brought after we stopped waiting for it.
            msg = await inbox.next_msg(timeout=0.001)
            if not (msg.headers and msg.headers.get("Status")):
                msgs.append(msg)
        if len(msgs) >= n:
            return
        request: dict[str, object] = {"batch": n - len(msgs)}
        if n > 1 or poll_s <= 0:
            request["no_wait"] = True  # with expires: wait for the first only
        if not msgs and poll_s > 0:
            request["expires"] = int(poll_s * 1e9)
        await self._one_pull(request, poll_s if not msgs else 0.0, msgs)

    async def _one_pull(self, request: dict[str, object], poll_s: float, msgs: list[Msg]) -> None:
        inbox = self._sub._sub
        n = int(str(request["batch"])) + len(msgs)
        end = time.monotonic() + poll_s + _NOTE_WAIT_S
        self._pull_until = max(self._pull_until, time.monotonic() + poll_s)
        await self._sub._nc.publish(
            self._sub._nms, json.dumps(request).encode(), reply=self._sub._deliver
        )
        while len(msgs) < n:
            try:
                msg = await inbox.next_msg(timeout=max(end - time.monotonic(), 0.001))
            except (nats.errors.TimeoutError, TimeoutError):
                log.warning("a pull's end was never signalled; later arrivals are served next")
                return
            status = msg.headers.get("Status") if msg.headers else None
            if status == "100":
                continue  # an idle heartbeat
            if status in ("404", "408"):
                return  # 404: nothing waiting now; 408: expired
            if status:
                desc = msg.headers.get("Description", "") if msg.headers else ""
                raise nats.errors.Error(f"pull refused: {status} {desc}")
            msgs.append(msg)

    async def hand_back(self) -> None:
        """Nak what the last pull still delivers (and what arrived unfetched),
        then drop the subscription."""
        inbox = self._sub._sub  # the core subscription behind the pull (nats-py has no public one)
        end = time.monotonic()
        if not await stop_interest(self._sub._nc, inbox):
            end = self._pull_until + _EXPIRY_MARGIN_S  # unsure: listen until the pulls expire
        while (left := end - time.monotonic()) > 0 or inbox.pending_msgs:
            try:
                msg = await inbox.next_msg(timeout=max(left, 0.001))
            except (nats.errors.TimeoutError, TimeoutError):
                break
            if msg.headers and msg.headers.get("Status"):
                continue  # the server's note that a pull request expired or ended
            with contextlib.suppress(nats.errors.Error):
                await msg.nak()
        # Else the connection's drain would wait on the pull's inbox.
        with contextlib.suppress(nats.errors.Error):
            await self._sub.unsubscribe()


class PullConsumer:
    """Owns the handler tasks of its sources; see the module docstring."""

    def __init__(self, handle: Handle, *, graceful_timeout_s: float, name: str) -> None:
        self._handle = handle
        self._grace = graceful_timeout_s
        self._name = name
        self._sources: list[Source] = []
        self._handlers: set[asyncio.Task[None]] = set()  # owned: awaited by _drain
        self._stopping = asyncio.Event()
        # While running: the task group the pulls run in, and each source's task.
        self._group: asyncio.TaskGroup | None = None
        self._pulls: dict[Source, asyncio.Task[None]] = {}

    @property
    def inflight(self) -> int:
        return len(self._handlers)

    def add(self, source: Source) -> None:
        """A source to pull from; one added while running starts at once (a
        LoRA adapter its engine loaded: its pool, workers/inference/worker.py)."""
        self._sources.append(source)
        if self._group is not None and not self._stopping.is_set():
            self._pulls[source] = self._group.create_task(source.run())

    async def remove(self, source: Source) -> None:
        """Stop pulling from ``source`` and hand back what it holds unstarted;
        what it started is served (the handlers are not this source's)."""
        if source not in self._sources:
            return
        self._sources.remove(source)
        task = self._pulls.pop(source, None)
        if task is not None:
            await stop_task(task)
        await source.hand_back()

    def start(self, msg: Msg) -> None:
        """Handle one message in a task of its own (its slot is already held)."""
        task = asyncio.create_task(self._handle(msg))
        self._handlers.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._handlers.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("%s: handler failed", self._name, exc_info=exc)

    def shutdown(self) -> None:
        """Stop pulling and drain (sync: a signal handler may call it)."""
        self._stopping.set()

    async def run(self) -> None:
        """Serve until :meth:`shutdown`; returns once drained."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._group = tg
                self._pulls = {source: tg.create_task(source.run()) for source in self._sources}
                await self._stopping.wait()
                self._group = None
                await asyncio.gather(*(stop_task(task) for task in self._pulls.values()))
        finally:
            self._group = None
            await asyncio.gather(*(source.hand_back() for source in self._sources))
            await self._drain()

    async def _drain(self) -> None:
        pending = set(self._handlers)
        if not pending:
            return
        log.info("%s: draining %d in flight", self._name, len(pending))
        _, still = await asyncio.wait(pending, timeout=self._grace)
        for task in still:
            task.cancel()  # not acked: redelivered
        if still:
            await asyncio.wait(still)

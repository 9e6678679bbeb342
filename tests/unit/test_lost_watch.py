"""The frame reader's lost-answer watch (streams/inference/frames.py): what it
asks, and when it gives up, driven by the answers of its queue check. The
check against a real work queue, and the gateway's and the agent's use of it,
are tested through nats-server (tests/connected/test_answer_lost.py,
test_model_call_lost.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from streams.errors import AnswerLostError, DeadlineExceededError, StreamInterruptedError
from streams.inference.frames import DEADLINE_GRACE_S, FrameBuffer, FrameReader, Item, QueuedAt
from streams.wire import HEDGE_ATTEMPT_BASE, Final, Heartbeat, Token, Usage

HB = 0.02  # the heartbeat timeout: short, nothing here waits on wall-clock bounds


class Queue:
    """A scripted queue check: each call takes the next answer (the last repeats)
    and records where it was asked."""

    def __init__(self, *answers: bool | None) -> None:
        self.answers = list(answers)
        self.asked: list[QueuedAt] = []

    async def __call__(self, at: QueuedAt) -> bool | None:
        self.asked.append(at)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return answer


def reader(check: Queue, queued: QueuedAt | None = ("REQ", 7)) -> tuple[FrameReader, FrameBuffer]:
    frames = FrameBuffer()
    return FrameReader(frames, time.time() + 600, queued, check), frames


async def test_gone_and_silent_one_heartbeat_timeout_more_is_lost() -> None:
    check = Queue(False)
    r, _ = reader(check)
    with pytest.raises(AnswerLostError) as lost:
        await r.next_event(HB)
    assert lost.value.retryable
    assert lost.value.code == "answer_lost"
    assert check.asked == [("REQ", 7)]  # one check found it gone; the next period ended it


async def test_queued_is_waited_for_until_the_answer_comes() -> None:
    check = Queue(True)
    r, frames = reader(check)

    async def answering(at: QueuedAt) -> bool | None:
        out = await Queue.__call__(check, at)
        if len(check.asked) == 3:
            frames.offer(Final(seq=1, finish_reason="stop", usage=Usage(3, 1)))
        return out

    r.still_queued = answering
    event = await r.next_event(HB)
    assert isinstance(event, Final)
    assert len(check.asked) == 3


async def test_unknown_is_not_gone() -> None:
    check = Queue(None, None, False)
    r, _ = reader(check)
    with pytest.raises(AnswerLostError):
        await r.next_event(HB)
    assert len(check.asked) == 3  # two unknowns, then gone, then one silent period


async def test_a_frame_after_a_gone_check_starts_the_silence_over() -> None:
    check = Queue(False)
    r, frames = reader(check)

    async def gone_then_heard(at: QueuedAt) -> bool | None:
        out = await Queue.__call__(check, at)
        if len(check.asked) == 1:
            frames.offer(Heartbeat(seq=0, at=time.time()))  # a worker is on it after all
        return out

    r.still_queued = gone_then_heard
    with pytest.raises(AnswerLostError):
        await r.next_event(HB)
    assert len(check.asked) == 2  # the heartbeat undid the first "gone"


async def test_a_hedged_copy_still_queued_keeps_it_waiting() -> None:
    asked: list[QueuedAt] = []
    r, frames = reader(Queue(False))

    async def per_copy(at: QueuedAt) -> bool | None:
        asked.append(at)
        if len(asked) == 4:
            frames.offer(Final(seq=1, finish_reason="stop", usage=Usage(3, 1)))
        return at == ("REQ", 9)  # the first copy taken, the hedge still queued

    r.still_queued = per_copy
    r.hedge_queued = ("REQ", 9)
    assert isinstance(await r.next_event(HB), Final)
    assert asked[:2] == [("REQ", 7), ("REQ", 9)]


async def test_a_copy_handed_on_is_checked_where_the_heartbeat_says() -> None:
    check = Queue(True, False)
    r, frames = reader(check)
    frames.offer(Heartbeat(seq=0, at=time.time(), attempt=1, moved=("REQ", 42)))
    hedge = Heartbeat(seq=0, at=time.time(), attempt=HEDGE_ATTEMPT_BASE + 1, moved=("REQ", 43))
    frames.offer(hedge)
    with pytest.raises(AnswerLostError):
        await r.next_event(HB)
    assert (r.queued, r.hedge_queued) == (("REQ", 42), ("REQ", 43))
    assert check.asked[0] == ("REQ", 42)


async def test_a_caller_tick_shorter_than_the_check_still_reaches_it() -> None:
    check = Queue(False)
    r, _ = reader(check)
    ticks = 0

    async def ticking() -> None:
        nonlocal ticks
        while True:
            try:
                await r.next_event(HB, wait_limit=HB / 4)  # an SSE keep-alive, say
            except TimeoutError:
                ticks += 1

    with pytest.raises(AnswerLostError):
        await ticking()
    assert ticks >= 1
    assert check.asked == [("REQ", 7)]


async def test_without_a_queue_position_only_the_deadline_ends_the_wait() -> None:
    check = Queue(False)
    frames = FrameBuffer()
    r = FrameReader(frames, time.time() + 600, None, check)  # a resumed stream: no position
    with pytest.raises(TimeoutError):
        await r.next_event(HB, wait_limit=HB * 5)
    assert check.asked == []


async def test_a_hedge_copy_sent_after_a_gone_check_is_looked_at_again() -> None:
    asked: list[QueuedAt] = []
    r, frames = reader(Queue(False))

    async def first_gone(at: QueuedAt) -> bool | None:
        asked.append(at)
        if len(asked) == 1:
            r.hedge_queued = ("REQ", 9)  # the hedge timer's copy, stored meanwhile
        if len(asked) == 3:
            frames.offer(Final(seq=1, finish_reason="stop", usage=Usage(3, 1)))
        return at == ("REQ", 9)

    r.still_queued = first_gone
    assert isinstance(await r.next_event(HB), Final)
    assert asked == [("REQ", 7), ("REQ", 7), ("REQ", 9)]  # not given up at the second


async def test_a_hand_over_note_from_an_earlier_hop_arriving_late_is_ignored() -> None:
    check = Queue(False)
    r, frames = reader(check)
    frames.offer(Heartbeat(seq=0, at=time.time(), attempt=3, moved=("REQ", 50)))  # B -> C
    frames.offer(Heartbeat(seq=0, at=time.time(), attempt=1, moved=("REQ", 42)))  # A -> B
    with pytest.raises(AnswerLostError):
        await r.next_event(HB)
    assert r.queued == ("REQ", 50)
    assert check.asked == [("REQ", 50)]


async def test_the_deadline_before_a_check_ends_the_wait_unchecked() -> None:
    check = Queue(True)
    frames = FrameBuffer()
    r = FrameReader(frames, time.time() + HB / 2 - DEADLINE_GRACE_S, ("REQ", 7), check)
    with pytest.raises(DeadlineExceededError):
        await r.next_event(HB)
    assert check.asked == []


async def test_after_the_first_token_silence_is_an_interruption_not_a_check() -> None:
    check = Queue(False)
    r, frames = reader(check)
    frames.offer(Token(seq=1, text="hi"))
    assert isinstance(await r.next_event(HB), Token)
    with pytest.raises(StreamInterruptedError):
        await r.next_event(HB)
    assert check.asked == []


async def test_a_caller_tick_runs_out_even_while_heartbeats_come() -> None:
    """``wait_limit`` bounds the whole call: heartbeats (which the reader drops)
    used to start it over, so an SSE keep-alive or a commit timer waited as long
    as a worker sent heartbeats during a long prefill."""

    class Beating(FrameBuffer):
        """A worker that never stops sending heartbeats: the next one comes on
        the loop's next turn after the reader took the last."""

        async def get(self) -> Item:
            item = await super().get()
            asyncio.get_running_loop().call_soon(self.offer, Heartbeat(seq=0, at=time.time()))
            return item

    frames = Beating()
    frames.offer(Heartbeat(seq=0, at=time.time()))
    r = FrameReader(frames, time.time() + 600, ("REQ", 7), Queue(True))
    with pytest.raises(TimeoutError):
        await r.next_event(HB * 100, wait_limit=HB)


async def test_the_last_look_relays_an_answer_found_elsewhere() -> None:
    class Looking(FrameReader):
        looks = 0

        async def last_look(self) -> bool:
            self.looks += 1
            self._queue.offer(Final(seq=1, finish_reason="stop", usage=Usage(3, 1)))
            return True

    check = Queue(False)
    r = Looking(FrameBuffer(), time.time() + 600, ("REQ", 7), check)
    assert isinstance(await r.next_event(HB), Final)
    assert r.looks == 1

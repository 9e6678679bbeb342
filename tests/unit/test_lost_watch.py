"""The frame reader's lost-answer watch (streams/inference/frames.py): what it
asks, and when it gives up, driven by the answers of its queue check. The
check against a real work queue, and the gateway's and the agent's use of it,
are tested through nats-server (tests/connected/test_answer_lost.py,
test_model_call_lost.py)."""

from __future__ import annotations

import time

import pytest

from streams.errors import AnswerLostError
from streams.inference.frames import FrameBuffer, FrameReader, QueuedAt
from streams.wire import HEDGE_ATTEMPT_BASE, Final, Heartbeat, Usage

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

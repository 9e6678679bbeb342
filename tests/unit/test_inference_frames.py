"""The inference client's frame reader (streams/inference/frames.py): the
waiting rule, attempt and sequence de-duplication, gaps, overflow; and the
publish headers and tool-call merging beside it."""

from __future__ import annotations

import time

import pytest

from streams.errors import (
    DeadlineExceededError,
    FramesLostError,
    ReaderTooSlowError,
    StreamInterruptedError,
)
from streams.headers import Header
from streams.inference.client import request_headers
from streams.inference.frames import FrameBuffer, FrameReader, InOrder
from streams.inference.tool_calls import ToolCalls
from streams.wire import ErrorFrame, Final, Frame, Heartbeat, InferenceRequest, Meta, Token, Usage


def reader(*frames: Frame, deadline_in: float = 5.0, limit: int | None = None) -> FrameReader:
    buf = FrameBuffer(limit)
    for f in frames:
        buf.offer(f)
    return FrameReader(buf, time.time() + deadline_in)


async def read_all(r: FrameReader) -> list[Token | Final | ErrorFrame]:
    return [e async for e in r.events(1.0)]


async def test_first_token_locks_the_attempt_and_tokens_come_in_sequence() -> None:
    meta = Meta(op="chat", model="m", cls="c", tenant="t", deadline=0.0, created=0.0)
    r = reader(
        meta,
        Token(1, "a", attempt=2),
        Token(1, "x", attempt=3),  # a redelivery racing the one we relay
        Token(1, "a", attempt=2),  # a duplicate
        Heartbeat(1, 0.0, 2),
        Token(2, "b", attempt=2),
        Final(3, "stop", Usage(1, 2), attempt=2),
    )
    events = await read_all(r)
    assert [e.text for e in events if isinstance(e, Token)] == ["a", "b"]
    assert isinstance(events[-1], Final)
    assert r.attempt == 2
    assert r.done
    assert r.first_token_at is not None


async def test_before_the_first_token_only_the_deadline_ends_the_wait() -> None:
    r = reader(deadline_in=-0.4)  # the grace past the deadline is 0.5 s
    with pytest.raises(DeadlineExceededError):
        await r.next_event(heartbeat_timeout=0.01)


async def test_after_the_first_token_silence_means_the_worker_is_gone() -> None:
    r = reader(Token(1, "a"))
    await r.next_event(heartbeat_timeout=0.05)
    with pytest.raises(StreamInterruptedError):
        await r.next_event(heartbeat_timeout=0.05)


async def test_a_wait_limit_raises_timeout_error_and_keeps_the_stream() -> None:
    r = reader(Token(1, "a"))
    await r.next_event(5.0)
    with pytest.raises(TimeoutError):
        await r.next_event(5.0, wait_limit=0.01)
    assert not r.done


async def test_a_gap_is_recovered_or_ends_the_stream() -> None:
    class Healing(FrameReader):
        async def recover(self, attempt: int, after: int, through: int) -> list[Token] | None:
            return [Token(s, f"r{s}", attempt=attempt) for s in range(after + 1, through + 1)]

    buf = FrameBuffer(None)
    for f in (Token(1, "a"), Token(4, "d"), Final(5, "stop", Usage())):
        buf.offer(f)
    events = await read_all(Healing(buf, time.time() + 5))
    assert [e.text for e in events if isinstance(e, Token)] == ["a", "r2", "r3", "d"]
    r = reader(Token(1, "a"), Heartbeat(3, 0.0, 1))
    await r.next_event(1.0)
    with pytest.raises(FramesLostError):
        await r.next_event(1.0)


async def test_a_resumed_reader_skips_what_it_has() -> None:
    r = reader(Token(1, "a"), Token(2, "b"), Token(3, "c"), Final(4, "stop", Usage()))
    r.skip_through = 2
    events = await read_all(r)
    assert [e.text for e in events if isinstance(e, Token)] == ["c"]


async def test_drain_takes_buffered_tokens_in_sequence_only() -> None:
    r = reader(Token(1, "a"), Token(2, "b"), Token(3, "c"), Token(5, "e"), Token(6, "f"))
    await r.next_event(1.0)
    assert [t.text for t in r.drain_tokens()] == ["b", "c"]
    assert r.drain_tokens() == []  # the gap is next_event's to judge


async def test_overflow_fails_the_reader_and_hedged_copies_may_fail_once() -> None:
    buf = FrameBuffer(2)
    assert not buf.offer(Token(1, "a"))
    assert not buf.offer(Token(2, "b"))
    assert buf.offer(Token(3, "c"))  # the bound: the caller stops the producer
    assert not buf.offer(Token(4, "d"))  # dropped behind the mark
    r = FrameReader(buf, time.time() + 5)
    await r.next_event(1.0)
    await r.next_event(1.0)
    with pytest.raises(ReaderTooSlowError):
        await r.next_event(1.0)
    r = reader(ErrorFrame(1, "engine_error", "x", attempt=1), Token(1, "a", attempt=100))
    r.copies = 2
    event = await r.next_event(1.0)
    assert isinstance(event, Token)
    assert event.attempt == 100


def test_publish_headers_carry_the_dedupe_key_deadline_and_trace() -> None:
    req = InferenceRequest(
        id="r1", op="chat", cls="c", model="m", body={}, reply="", deadline=12.5,
        traceparent="00-ab-cd-01",
    )  # fmt: skip
    assert request_headers(req) == {
        Header.MSG_ID.value: "r1",
        Header.DEADLINE.value: "12.500",
        Header.TRACEPARENT.value: "00-ab-cd-01",
    }
    assert request_headers(req, "r1.hedge")[Header.MSG_ID.value] == "r1.hedge"


def test_tool_call_deltas_merge_by_index() -> None:
    calls = ToolCalls()
    assert not calls
    calls.add([{"index": 1, "id": "c2", "function": {"name": "b", "arguments": "{}"}}])
    calls.add([{"index": 0, "id": "c1", "type": "function", "function": {"name": "a"}}])
    calls.add(
        [
            {"index": 0, "function": {"arguments": '{"x":'}},
            {"index": 0, "function": {"arguments": "1}"}},
        ]
    )
    assert [c["id"] for c in calls.merged()] == ["c1", "c2"]
    assert calls.merged()[0]["function"] == {"name": "a", "arguments": '{"x":1}'}


def merged(*sources: list[Frame]) -> list[Frame]:
    """What InOrder passes on when the sources' frames arrive interleaved."""
    buf = FrameBuffer(None)
    merge = InOrder(buf)
    longest = max(len(s) for s in sources)
    for i in range(longest):
        for source in sources:
            if i < len(source):
                merge.offer(source[i])
    out = []
    while not buf.empty():
        item = buf.get_nowait()
        assert isinstance(item, Token | Final | ErrorFrame | Heartbeat | Meta)
        out.append(item)
    return out


def test_in_order_fills_one_sources_losses_from_the_other() -> None:
    meta = Meta(op="chat", model="m", cls="c", tenant="t", deadline=0.0, created=0.0)
    final = Final(4, "stop", Usage(1, 3))
    tokens: list[Frame] = [Token(1, "a"), Token(2, "b"), Token(3, "c")]
    # Live lost token 2 (its server died); the capture replays everything, later.
    live: list[Frame] = [meta, tokens[0], tokens[2], Heartbeat(3, 0.0), final]
    capture: list[Frame] = [meta, *tokens, final]
    assert merged(live, capture) == [meta, *tokens, Heartbeat(3, 0.0), final]
    # The capture stored nothing (its leader was elected meanwhile): live alone.
    assert merged([*live[:2], tokens[1], *live[2:]], []) == [
        meta,
        *tokens,
        Heartbeat(3, 0.0),
        final,
    ]
    # Attempts are sequenced apart: a redelivery starts again at seq 1.
    again: list[Frame] = [Token(1, "a", attempt=2), ErrorFrame(2, "engine_error", "x", attempt=2)]
    assert merged([tokens[0]], again) == [tokens[0], *again]


def test_in_order_holds_a_heartbeat_until_the_tokens_it_vouches_for() -> None:
    assert merged([Heartbeat(2, 0.0), Token(1, "a")]) == [Token(1, "a")]
    assert merged([Token(1, "a"), Heartbeat(1, 0.0)]) == [Token(1, "a"), Heartbeat(1, 0.0)]

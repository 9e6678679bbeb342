"""Stream event ids (gateway/inference/event_ids.py): every chunk a unique,
increasing id, and resuming after any of them yields exactly the chunks after it
(gateway/ingress/sse.py, ``client_events``), whatever the batching."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gateway.inference.event_ids import tokens_through
from gateway.ingress.sse import ClientEvent, client_events, sse_body
from streams.inference.frames import FrameBuffer, FrameReader
from streams.wire import Final, Frame, Token, Usage


class OneAtATime(FrameReader):
    """A reader that never coalesces: one chunk per token, as on a slow stream."""

    def drain_tokens(self) -> list[Token]:
        return []


@dataclass
class FakeSession:
    op: str
    stream: FrameReader
    last_event_id: int = 0
    include_usage: bool = True
    request_id: str = "r1"
    model: str = "m"
    tokens_seen: int = 0
    choices: int = 1
    created: float = 1_796_000_000.0


async def _noop(*_: object) -> None:
    return None


def _decided(*_: object) -> None:
    return None  # the outcome decided before: nothing to await


GW = SimpleNamespace(
    cfg=SimpleNamespace(heartbeat_timeout_s=1.0, keepalive_s=1.0),
    finish=_noop,
    fail=_noop,
    decide=_decided,
)


def frames(texts: list[str], finish_on_last_token: bool) -> list[Frame]:
    out: list[Frame] = [
        Token(i, t, finish_reason="length" if finish_on_last_token and i == len(texts) else None)
        for i, t in enumerate(texts, 1)
    ]
    out.append(Final(len(texts) + 1, "length", Usage(prompt_tokens=3, completion_tokens=4)))
    return out


async def run(
    op: str, fs: list[Frame], after: int = 0, *, coalesce: bool
) -> list[tuple[int, dict[str, Any]]]:
    """(event id, chunk without its timestamp) of every chunk, resuming after ``after``."""
    buf = FrameBuffer(None)
    for f in fs:
        buf.offer(f)
    reader = (FrameReader if coalesce else OneAtATime)(buf, time.time() + 5)
    reader.skip_through = tokens_through(after)
    session = FakeSession(op, reader, last_event_id=after)
    out: list[tuple[int, dict[str, Any]]] = []
    kinds: list[str] = []
    async for ev in client_events(cast(Any, GW), cast(Any, session), None):
        kinds.append(ev.kind)
        if ev.kind == "chunk":
            assert ev.payload is not None
            out.append((ev.event_id, {k: v for k, v in ev.payload.items() if k != "created"}))
    assert kinds[-1] == "done"
    return out


def text(chunks: list[tuple[int, dict[str, Any]]]) -> str:
    return "".join(
        ch.get("text") or ch.get("delta", {}).get("content") or ""
        for _, chunk in chunks
        for ch in chunk["choices"]
    )


@pytest.mark.parametrize("op", ["chat", "completion"])
@pytest.mark.parametrize("finish_on_last_token", [False, True])
async def test_resuming_after_any_event_yields_exactly_the_rest(
    op: str, finish_on_last_token: bool
) -> None:
    fs = frames(["Once", " upon", " a", " time"], finish_on_last_token)
    full = await run(op, fs, coalesce=False)
    ids = [i for i, _ in full]
    assert ids == sorted(set(ids))  # unique and increasing
    assert ids[0] > 0
    expected = 4 + (op == "chat") + (not finish_on_last_token) + 1  # + role, closing, usage
    assert len(full) == expected
    for cut in [0, *ids]:
        assert await run(op, fs, cut, coalesce=False) == [c for c in full if c[0] > cut]
        # Replayed from the capture, the rest may come coalesced: the same text,
        # at the same ids, ending where the stream ends.
        rest = await run(op, fs, cut, coalesce=True)
        got = [i for i, _ in rest]
        assert got == sorted(set(got))
        assert all(i > cut and i in ids for i in got)
        assert got[-1:] == [i for i in ids[-1:] if i > cut]  # nothing past the end
        before = [c for c in full if c[0] <= cut]
        assert text(before) + text(rest) == text(full)
        for n, (i, _) in enumerate(rest):
            assert text(before) + text(rest[: n + 1]) == text([c for c in full if c[0] <= i])


async def test_the_role_chunk_and_the_first_token_have_their_own_ids() -> None:
    # The bug this numbering fixes: both were "id: 1", so a client resuming after
    # the role chunk never got the first token.
    full = await run("chat", frames(["a", "b"], False), coalesce=True)
    assert [i for i, _ in full] == [1, 3, 4, 5]  # role, tokens 1-2 coalesced, closing, usage
    assert full[0][1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert text(await run("chat", frames(["a", "b"], False), 1, coalesce=True)) == "ab"


async def test_a_resume_past_every_chunk_gets_done_alone() -> None:
    assert await run("chat", frames(["a"], False), 100, coalesce=True) == []


async def test_sse_writes_the_id_before_its_data() -> None:
    async def events() -> Any:
        yield ClientEvent("chunk", {"x": 1}, event_id=7)
        yield ClientEvent("done")

    body = b"".join([b async for b in sse_body(events())])
    assert body == b'id: 7\ndata: {"x":1}\n\ndata: [DONE]\n\n'

"""The frames capture's batched tokens (streams/wire.py Tokens): compact on the
wire, and read back as exactly the tokens that went live."""

from __future__ import annotations

from streams.wire import Final, Meta, Token, Tokens, Usage, decode_frames, encode


def test_a_batch_reads_back_as_the_tokens_it_holds() -> None:
    live = [
        Token(5, "Hel", attempt=2),
        Token(6, "lo", attempt=2, logprobs={"content": [{"token": "lo", "logprob": -0.1}]}),
        Token(7, "", attempt=2, tool_calls=[{"index": 0, "id": "c1"}], index=1),
        Token(8, "!", attempt=2, finish_reason="stop"),
    ]
    batch = Tokens.of(live)
    assert decode_frames(encode(batch)) == live
    assert batch.last_seq == 8


def test_a_plain_token_costs_its_text_and_a_comma() -> None:
    live = [Token(i, w) for i, w in enumerate("abc", 1)]
    batch = encode(Tokens.of(live))
    assert batch == b'{"type":"tokens","seq":1,"texts":["a","b","c"]}'
    assert len(batch) < sum(len(encode(t)) for t in live)


def test_other_frames_read_back_alone() -> None:
    meta = Meta(op="chat", model="m", cls="interactive", tenant="t", deadline=1.0, created=0.5)
    final = Final(seq=3, finish_reason="stop", usage=Usage(1, 2))
    assert decode_frames(encode(meta)) == [meta]
    assert decode_frames(encode(final)) == [final]

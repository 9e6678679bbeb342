"""The wire contract: round trips, tags, and schema evolution."""

from __future__ import annotations

import struct
from array import array

import msgspec
import pytest

from streams.definitions import DEFAULT_TOPOLOGY
from streams.subjects import RequestClass, reply_subject, request_subject
from streams.vectors import check_packed, floats, packed
from streams.wire import (
    Cancel,
    ErrorFrame,
    Final,
    Heartbeat,
    InferenceRequest,
    Token,
    Usage,
    decode_cancel,
    decode_frame,
    decode_request,
    encode,
)


def test_request_round_trip() -> None:
    req = InferenceRequest(
        id="r1",
        op="chat",
        cls="interactive",
        model="m",
        body={"messages": []},
        reply=reply_subject("acme", "gw1", "r1"),
        deadline=123.5,
        traceparent="00-ab-cd-01",
        headers={"x-sim-fault": "429"},
    )
    assert decode_request(encode(req)) == req


@pytest.mark.parametrize(
    "frame",
    [
        Token(1, "hi"),
        Token(2, "", [{"index": 0, "id": "c"}], "tool_calls", attempt=2),
        Heartbeat(3, 1.5),
        Final(4, "stop", Usage(10, 3, 8), model="m", embeddings=[[0.1, 0.2]]),
        Final(4, "stop", Usage(2), embeddings=[packed([0.5, -1.25]), packed([3.0])]),
        ErrorFrame(1, "engine_rate_limited", "slow down", True, 429),
    ],
)
def test_frames_are_a_tagged_union(frame: object) -> None:
    data = encode(frame)  # type: ignore[arg-type]
    assert decode_frame(data) == frame
    assert msgspec.json.decode(data)["type"] in {"token", "heartbeat", "final", "error"}


def test_older_peer_payload_still_decodes() -> None:
    # A frame from a peer that predates the `attempt` field: defaults fill in.
    assert decode_frame(b'{"type":"token","seq":1,"text":"a"}') == Token(1, "a")
    assert decode_cancel(encode(Cancel("x"))).reason == "client_disconnected"


def test_unknown_tag_is_rejected() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_frame(b'{"type":"bogus","seq":1}')


def test_subjects_do_not_overlap_between_consumers() -> None:
    filters = [DEFAULT_TOPOLOGY.consumer_config(c).filter_subject for c in RequestClass]
    assert len(set(filters)) == len(filters)
    assert request_subject("batch") == "jetserve.req.batch"
    cfg = DEFAULT_TOPOLOGY.stream_config()
    assert cfg.discard is not None
    assert cfg.discard.value == "new"
    assert cfg.duplicate_window
    assert cfg.duplicate_window > 0


def test_packed_vectors_widen_to_the_float32_values() -> None:
    values = [0.1, -2.5, 1e-30, 3.4e38]
    as_f32 = array("f", values).tolist()  # what a float32 engine holds
    data = packed(values)
    assert len(data) == 16
    assert floats(data) == as_f32
    assert packed(floats(data)) == data  # exact both ways once float32
    assert floats(as_f32) is as_f32  # floats are carried as they came
    assert data == struct.pack("<4f", *values)  # little-endian, as OpenAI's base64
    assert check_packed(data) is data
    with pytest.raises(ValueError, match="float32"):
        check_packed(data[:-1])

"""Property tests of the wire codecs (streams/wire.py, streams/request_ledger.py).

- every message type round-trips through encode/decode, and the Frame union
  dispatches on the tag;
- a decoder given another type's payload, a wrong or missing tag, a wrong field
  type, or junk bytes raises msgspec.DecodeError (ValidationError is one) and
  nothing else;
- schema evolution: an older peer's payload, without some defaulted fields,
  decodes with the defaults; a newer peer's extra fields are ignored.

Floats are finite: JSON has no NaN or infinity (msgspec writes them as null).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streams.request_ledger import LedgerRecord, decode_record, encode_record
from streams.wire import (
    Cancel,
    ErrorFrame,
    Final,
    Heartbeat,
    InferenceRequest,
    Meta,
    Token,
    Usage,
    decode_cancel,
    decode_frame,
    decode_request,
    encode,
)

# Deterministic, bounded, and no example database left in the work tree.
PROFILE = settings(
    max_examples=100,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# -- strategies ------------------------------------------------------------------

floats = st.floats(allow_nan=False, allow_infinity=False)
text = st.text(max_size=40)
ops = st.sampled_from(["chat", "completion", "embedding"])
json_scalars = st.none() | st.booleans() | st.integers() | floats | text
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(text, json_values, max_size=5)

usages = st.builds(
    Usage,
    prompt_tokens=st.integers(0, 2**40),
    completion_tokens=st.integers(0, 2**40),
    cached_tokens=st.integers(0, 2**40),
)
requests = st.builds(
    InferenceRequest,
    id=text,
    op=ops,
    cls=text,
    model=text,
    body=json_objects,
    reply=text,
    deadline=floats,
    tenant=text,
    key_id=text,
    traceparent=text,
    tracestate=text,
    prompt_tokens_est=st.integers(),
    max_tokens=st.integers(),
    created=floats,
    headers=st.dictionaries(text, text, max_size=4),
)
tokens = st.builds(
    Token,
    seq=st.integers(),
    text=text,
    tool_calls=st.none() | st.lists(json_objects, max_size=3),
    finish_reason=st.none() | text,
    attempt=st.integers(),
)
heartbeats = st.builds(Heartbeat, seq=st.integers(), at=floats, attempt=st.integers())
finals = st.builds(
    Final,
    seq=st.integers(),
    finish_reason=text,
    usage=usages,
    model=text,
    worker=text,
    embeddings=st.none() | st.lists(st.lists(floats, max_size=8), max_size=3),
    attempt=st.integers(),
    ttft_ms=floats,
    engine_ms=floats,
)
errors = st.builds(
    ErrorFrame,
    seq=st.integers(),
    code=text,
    message=text,
    retryable=st.booleans(),
    status=st.integers(),
    attempt=st.integers(),
)
metas = st.builds(
    Meta,
    op=ops,
    model=text,
    cls=text,
    tenant=text,
    deadline=floats,
    created=floats,
    key_id=text,
    org=text,
    reserved_micros=st.integers(),
    price_version=text,
    gateway=text,
)
cancels = st.builds(Cancel, id=text, reason=text)
records = st.builds(
    LedgerRecord,
    request_id=text,
    tenant=text,
    org=text,
    key_id=text,
    op=ops,
    cls=text,
    model=text,
    route=text,
    route_revision=st.integers(),
    deployment=text,
    attempts=st.integers(),
    policy=text,
    usage=usages,
    price_version=text,
    charge_micros=st.integers(),
    reserved_micros=st.integers(),
    outcome=text,
    status=st.integers(),
    idempotency_key_hash=text,
    created=floats,
    first_token_ms=st.none() | floats,
    duration_ms=floats,
    gateway=text,
)

frames = tokens | heartbeats | finals | errors | metas
Message = InferenceRequest | Token | Heartbeat | Final | ErrorFrame | Meta | Cancel | LedgerRecord


def encode_any(msg: Message) -> bytes:
    return encode_record(msg) if isinstance(msg, LedgerRecord) else encode(msg)


# Each message type, the strategy for it, and the decoder of its subject space.
CODECS: list[tuple[type[Any], st.SearchStrategy[Any], Callable[[bytes], Any]]] = [
    (InferenceRequest, requests, decode_request),
    (Token, tokens, decode_frame),
    (Heartbeat, heartbeats, decode_frame),
    (Final, finals, decode_frame),
    (ErrorFrame, errors, decode_frame),
    (Meta, metas, decode_frame),
    (Cancel, cancels, decode_cancel),
    (LedgerRecord, records, decode_record),
]
DECODERS: list[Callable[[bytes], Any]] = [
    decode_request,
    decode_frame,
    decode_cancel,
    decode_record,
]
IDS = [cls.__name__ for cls, _, _ in CODECS]
any_message = st.one_of([strategy for _, strategy, _ in CODECS])


def tag_of(cls: type[Any]) -> str:
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    tag = info.tag
    assert isinstance(tag, str)
    return tag


def decoder_accepts(decoder: Callable[[bytes], Any], cls: type[Any]) -> bool:
    return any(d is decoder and c is cls for c, _, d in CODECS)


# -- round trips -------------------------------------------------------------------


@pytest.mark.parametrize(("cls", "strategy", "decoder"), CODECS, ids=IDS)
def test_round_trip(
    cls: type[Any], strategy: st.SearchStrategy[Any], decoder: Callable[[bytes], Any]
) -> None:
    @PROFILE
    @given(strategy)
    def check(msg: Any) -> None:
        data = encode_any(msg)
        decoded = decoder(data)
        assert type(decoded) is cls
        assert decoded == msg
        assert msgspec.json.decode(data)["type"] == tag_of(cls)

    check()


@PROFILE
@given(frames)
def test_the_frame_union_dispatches_on_the_tag(frame: Any) -> None:
    decoded = decode_frame(encode(frame))
    assert type(decoded) is type(frame)
    assert decoded == frame


def test_every_frame_type_has_its_own_tag() -> None:
    tags = [tag_of(cls) for cls, _, _ in CODECS]
    assert len(set(tags)) == len(tags)


@PROFILE
@given(records)
def test_a_ledger_line_shows_every_column(record: LedgerRecord) -> None:
    line = msgspec.json.decode(encode_record(record))
    assert set(line) == {"type", *(f.encode_name for f in msgspec.structs.fields(LedgerRecord))}


# -- refusals: only msgspec.DecodeError ------------------------------------------------


@PROFILE
@given(any_message, st.sampled_from(DECODERS))
def test_another_types_payload_is_refused(msg: Any, decoder: Callable[[bytes], Any]) -> None:
    data = encode_any(msg)
    if decoder_accepts(decoder, type(msg)):
        assert decoder(data) == msg
    else:
        with pytest.raises(msgspec.ValidationError):
            decoder(data)


@PROFILE
@given(any_message, st.sampled_from(DECODERS), text | st.integers() | st.booleans() | st.none())
def test_a_wrong_tag_is_refused(msg: Any, decoder: Callable[[bytes], Any], tag: Any) -> None:
    obj = msgspec.json.decode(encode_any(msg))
    if tag in {tag_of(cls) for cls, _, d in CODECS if d is decoder}:
        return  # a valid tag for this decoder (another frame type's, say)
    obj["type"] = tag
    with pytest.raises(msgspec.ValidationError):
        decoder(msgspec.json.encode(obj))


@PROFILE
@given(any_message, st.sampled_from(DECODERS))
def test_a_missing_tag(msg: Any, decoder: Callable[[bytes], Any]) -> None:
    """The Frame union needs the tag to dispatch. A one-type decoder does not check
    a missing tag (msgspec): it takes an untagged payload of its own type, and of
    another type whose fields cover its required ones (an untagged request reads
    as a Cancel of that id): payloads must keep their tag, as ``encode`` writes it."""
    obj = msgspec.json.decode(encode_any(msg))
    del obj["type"]
    data = msgspec.json.encode(obj)
    if decoder is decode_frame:
        with pytest.raises(msgspec.ValidationError):
            decoder(data)
    elif decoder_accepts(decoder, type(msg)):
        assert decoder(data) == msg
    else:
        with contextlib.suppress(msgspec.ValidationError):
            decoder(data)


def test_an_untagged_request_reads_as_a_cancel() -> None:
    """Pins the leniency above, so a change in it is noticed."""
    req = InferenceRequest(id="r1", op="chat", cls="c", model="m", body={}, reply="x", deadline=1)
    obj = msgspec.json.decode(encode(req))
    with pytest.raises(msgspec.ValidationError):
        decode_cancel(msgspec.json.encode(obj))
    del obj["type"]
    assert decode_cancel(msgspec.json.encode(obj)) == Cancel("r1")


@PROFILE
@given(any_message, st.data())
def test_a_field_of_the_wrong_type_is_refused(msg: Any, data: st.DataObject) -> None:
    obj = msgspec.json.decode(encode_any(msg))
    name = data.draw(st.sampled_from(sorted(k for k in obj if k != "type")))
    # A JSON array fits no scalar field and no struct or dict field.
    fields = {f.encode_name: f for f in msgspec.structs.fields(type(msg))}
    if "list" in str(fields[name].type):
        obj[name] = {"not": "a list"}
    else:
        obj[name] = [obj[name]]
    decoder = next(d for c, _, d in CODECS if c is type(msg))
    with pytest.raises(msgspec.ValidationError):
        decoder(msgspec.json.encode(obj))


@PROFILE
@given(st.binary(max_size=200), st.sampled_from(DECODERS))
def test_junk_bytes_raise_only_decode_errors(junk: bytes, decoder: Callable[[bytes], Any]) -> None:
    with contextlib.suppress(msgspec.DecodeError):
        decoder(junk)


@PROFILE
@given(json_values, st.sampled_from(DECODERS))
def test_junk_json_raises_only_decode_errors(value: Any, decoder: Callable[[bytes], Any]) -> None:
    with pytest.raises(msgspec.DecodeError):
        decoder(msgspec.json.encode(value))


@PROFILE
@given(any_message, st.integers(0, 400), st.sampled_from([b"", b"{", b"}", b"\x00", b'"', b"\xff"]))
def test_a_corrupted_payload_raises_only_decode_errors(msg: Any, at: int, junk: bytes) -> None:
    data = encode_any(msg)
    at = min(at, len(data))
    decoder = next(d for c, _, d in CODECS if c is type(msg))
    for corrupted in (data[:at], data[:at] + junk + data[at:]):
        with contextlib.suppress(msgspec.DecodeError):
            decoder(corrupted)


# -- schema evolution ------------------------------------------------------------------


def defaulted_fields(cls: type[Any]) -> list[msgspec.structs.FieldInfo]:
    return [f for f in msgspec.structs.fields(cls) if not f.required]


def default_of(field: msgspec.structs.FieldInfo) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    return field.default_factory()


@pytest.mark.parametrize(("cls", "strategy", "decoder"), CODECS, ids=IDS)
def test_an_older_payload_without_defaulted_fields_decodes(
    cls: type[Any], strategy: st.SearchStrategy[Any], decoder: Callable[[bytes], Any]
) -> None:
    """A peer that predates a field does not send it: the default fills in."""
    optional = defaulted_fields(cls)
    assert optional, f"{cls.__name__} has no defaulted field"

    @PROFILE
    @given(strategy, st.lists(st.sampled_from(optional), unique_by=lambda f: f.name))
    def check(msg: Any, missing: list[msgspec.structs.FieldInfo]) -> None:
        obj = msgspec.json.decode(encode_any(msg))
        for f in missing:
            obj.pop(f.encode_name, None)
        expected = msgspec.structs.replace(msg, **{f.name: default_of(f) for f in missing})
        assert decoder(msgspec.json.encode(obj)) == expected

    check()


@PROFILE
@given(any_message, st.dictionaries(text, json_values, min_size=1, max_size=3))
def test_a_newer_payload_with_extra_fields_decodes(msg: Any, extra: dict[str, Any]) -> None:
    """A newer peer's fields are ignored, so it can be deployed first."""
    obj = msgspec.json.decode(encode_any(msg))
    known = {"type", *(f.encode_name for f in msgspec.structs.fields(type(msg)))}
    obj.update({f"new_{k}": v for k, v in extra.items() if f"new_{k}" not in known})
    decoder = next(d for c, _, d in CODECS if c is type(msg))
    assert decoder(msgspec.json.encode(obj)) == msg


@pytest.mark.parametrize(("cls", "strategy", "decoder"), CODECS, ids=IDS)
def test_required_fields_are_required(
    cls: type[Any], strategy: st.SearchStrategy[Any], decoder: Callable[[bytes], Any]
) -> None:
    """The fields without a default are the contract: every peer sends them."""
    assert any(f.required for f in msgspec.structs.fields(cls))
    with pytest.raises(msgspec.ValidationError, match="missing required field"):
        decoder(msgspec.json.encode({"type": tag_of(cls)}))

"""Which requests may share one execution (gateway/inference/coalesce.py)."""

from __future__ import annotations

import msgspec

from gateway.inference.coalesce import coalesce_key
from streams.routes import CoalescePolicy
from streams.wire import InferenceRequest

POLICY = CoalescePolicy(enabled=True)
BODY = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}


def req(**kw: object) -> InferenceRequest:
    base = InferenceRequest(
        id="r1", op="chat", cls="interactive", model="m", body=BODY, reply="x", deadline=1.0,
        tenant="t", route="r", route_revision=1, candidates=["dep-a"],
    )  # fmt: skip
    return msgspec.structs.replace(base, **kw)


def test_only_requests_that_may_run_in_the_same_place_share() -> None:
    """A request under a route's new revision (rolled back from dep-a to dep-b)
    joined one in flight under the old and got dep-a's answer, the one the
    rollback was meant to stop; its record named revision 2 and dep-a."""
    key = coalesce_key(req(), POLICY)
    assert key is not None
    assert coalesce_key(req(id="r2"), POLICY) == key  # another request, the same run
    assert coalesce_key(req(route_revision=2), POLICY) != key
    assert coalesce_key(req(candidates=["dep-b"]), POLICY) != key
    assert coalesce_key(req(route="other"), POLICY) != key
    assert coalesce_key(req(adapter="lora-a"), POLICY) != key

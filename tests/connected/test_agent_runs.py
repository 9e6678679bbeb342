"""Agent runs through a real fleet (gateway, workers, simulator, executors): the
run API, SSE events resumed with Last-Event-ID, settlement into the ledger,
tool authority, schema-invalid arguments, budget and deadline halts, stuck
steps, an approval gate surviving an executor restart, sub-agents (budget
carving, a tool the parent lacks, a cancel cascading to a running grandchild),
tenant isolation and the NATS API. The simulator's scripted tool calls drive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from gateway.runs.service import MAX_EVENT_FOLLOWERS
from jetserve.fleet import Fleet, FleetSpec
from streams.auth import Role
from streams.subjects import INGRESS_RUNS
from tests.refusals import checked_fleet
from tests.waits import until_streamed

pytestmark = pytest.mark.connected

TERMINAL = {"completed", "failed", "cancelled", "ambiguous", "budget_exceeded", "deadline_exceeded"}


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    spec = FleetSpec(
        workers=2,
        agents=2,
        profile="fast",
        agent_args=["--step-timeout", "5", "--lease", "2", "--ack-wait", "2"],
    )
    with checked_fleet(request, spec) as f:
        yield f


@pytest.fixture
def api(fleet: Fleet) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {fleet.api_key}"}
    with httpx.Client(base_url=fleet.base_url, headers=headers, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def approver_key(fleet: Fleet) -> str:
    """Another key of the tenant, with the approve scope: the creator of a run
    may not decide its gated calls (tests/security/test_approvals.py)."""
    with fleet.admin() as admin:
        created = admin.create_key(fleet.spec.tenant, "approver", {"actions": ["approve"]})
    key: str = created["api_key"]
    return key


@pytest.fixture
def approver(fleet: Fleet, approver_key: str) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {approver_key}"}
    with httpx.Client(base_url=fleet.base_url, headers=headers, timeout=30) as client:
        yield client


def marker() -> str:
    return "M" + uuid.uuid4().hex[:10]


def call(name: str, args: dict[str, Any], call_id: str = "call_1") -> dict[str, Any]:
    fn = {"name": name, "arguments": json.dumps(args)}
    return {"tool_calls": [{"id": call_id, "type": "function", "function": fn}]}


def script(fleet: Fleet, *rules: tuple[str, str, dict[str, Any]]) -> None:
    """(last_role, contains, response) rules, appended to the simulator's book."""
    body = [{"match": {"last_role": r, "contains": c}, "response": resp} for r, c, resp in rules]
    httpx.post(f"{fleet.sim_url}/sim/scripts?append=1", json=body).raise_for_status()


def create(api: httpx.Client, text: str, tools: list[str], **extra: Any) -> dict[str, Any]:
    body = {"model": "sim-8b", "messages": [{"role": "user", "content": text}], "tools": tools}
    r = api.post("/v1/runs", json={**body, **extra})
    assert r.status_code == 201, r.text
    run: dict[str, Any] = r.json()
    return run


def wait(
    api: httpx.Client, run_id: str, statuses: set[str] = TERMINAL, timeout: float = 15.0
) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        run: dict[str, Any] = api.get(f"/v1/runs/{run_id}").json()
        if run["status"] in statuses or time.monotonic() > end:
            return run
        time.sleep(0.05)


def bank_effects(fleet: Fleet, run_id: str) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(fleet.redis_url)
    try:
        log = [json.loads(e) for e in client.lrange("demobank:{bank}:log", 0, -1)]
    finally:
        client.close()
    return [e for e in log if e["key"].startswith(f"{run_id}/")]


def tool_messages(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in run["messages"] if m["role"] == "tool"]


def sse_events(response: httpx.Response) -> list[tuple[int, str, dict[str, Any]]]:
    out = []
    for block in response.text.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":")
        )
        if "data" in fields:
            out.append((int(fields["id"]), fields["event"], json.loads(fields["data"])))
    return out


# -- the happy path -------------------------------------------------------------------


def test_run_transfers_once_streams_events_and_is_settled(fleet: Fleet, api: httpx.Client) -> None:
    m = marker()
    script(
        fleet,
        ("user", m, call("transfer", {"from": "alice", "to": "bob", "amount": 5})),
        ("tool", m, {"content": "Sent 5 to bob."}),
    )
    created = create(api, f"{m}: send 5 to bob", ["transfer"])
    assert created["status"] == "queued"
    assert created["tools"] == ["transfer"]
    run = wait(api, created["id"])
    assert run["status"] == "completed", run
    assert run["result"] == "Sent 5 to bob."
    assert [x["role"] for x in run["messages"]] == ["user", "assistant", "tool", "assistant"]
    (receipt,) = tool_messages(run)
    assert json.loads(receipt["content"])["key"] == f"{run['id']}/0/call_1"
    assert len(bank_effects(fleet, run["id"])) == 1
    assert run["usage"]["steps"] == 2
    assert run["usage"]["cost_micros"] > 0

    # SSE: every event of the run, ending with the terminal status ...
    events = sse_events(api.get(f"/v1/runs/{run['id']}/events"))
    ids = [i for i, _, _ in events]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    kinds = [(k, e.get("status"), e.get("index")) for _, k, e in events]
    assert kinds[0] == ("status", "queued", None)
    assert kinds[-1] == ("status", "completed", None)
    assert [e["index"] for _, k, e in events if k == "message"] == [0, 1, 2, 3]
    # ... and resumed after any of them with Last-Event-ID.
    resumed = sse_events(
        api.get(f"/v1/runs/{run['id']}/events", headers={"Last-Event-ID": str(ids[2])})
    )
    assert resumed == events[3:]
    after_end = api.get(f"/v1/runs/{run['id']}/events", headers={"Last-Event-ID": str(ids[-1])})
    assert after_end.status_code == 200
    assert sse_events(after_end) == []

    # The tenant is charged once, for the run's actual usage, in one ledger record.
    end = time.monotonic() + 10
    while time.monotonic() < end:
        records = [json.loads(x) for x in api.get("/v1/ledger").text.splitlines()]
        mine = [r for r in records if r["request_id"] == run["id"]]
        if mine:
            break
        time.sleep(0.1)
    (record,) = mine
    assert record["cls"] == "agent"
    assert record["outcome"] == "completed"
    assert record["charge_micros"] == run["usage"]["cost_micros"]
    assert record["usage"]["completion_tokens"] == run["usage"]["completion_tokens"]
    assert record["reserved_micros"] == run["budget"]["max_cost_micros"]


def test_idempotency_key_returns_the_same_run(fleet: Fleet, api: httpx.Client) -> None:
    m = marker()
    script(fleet, ("user", m, {"content": "hello"}))
    body = {"model": "sim-8b", "messages": [{"role": "user", "content": m}]}
    key = {"Idempotency-Key": m}
    first = api.post("/v1/runs", json=body, headers=key)
    again = api.post("/v1/runs", json=body, headers=key)
    assert first.status_code == 201
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert first.json()["id"] == again.json()["id"]


@pytest.mark.parametrize(
    "budget",
    [{"max_cost_micros": 2**63 - 1}, {"max_cost_micros": 10**12 + 1}, {"max_cost": 1e300}],
)
def test_a_run_budget_past_the_cap_is_refused_before_any_hold(
    fleet: Fleet, api: httpx.Client, budget: dict[str, float]
) -> None:
    # Held at every level of the org, 2**63 - 1 used to be accepted (201) and
    # then overflow every later hold of the org: 503 for all its tenants.
    body = {"model": "sim-8b", "messages": [{"role": "user", "content": marker()}]}
    r = api.post("/v1/runs", json={**body, "budget": budget})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "budget"
    chat = api.post("/v1/chat/completions", json={**body, "max_tokens": 3})
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize(
    ("calls", "said"),
    [
        ([{"type": "function", "function": {"name": "balance", "arguments": "{}"}}], ".id must"),
        ([{"id": None, "function": {"name": "balance", "arguments": "{}"}}], ".id must"),
        ([{"id": 5, "function": {"name": "balance", "arguments": "{}"}}], ".id must"),
        (
            [
                {"id": "c1", "function": {"name": "balance", "arguments": "{}"}},
                {"id": "c1", "function": {"name": "balance", "arguments": "{}"}},
            ],
            "repeats",
        ),
        ([{"id": "c1", "function": {"name": "balance", "arguments": {"a": 1}}}], "JSON string"),
        ([{"id": "c1"}], "function.name"),
        ({"id": "c1"}, "must be a list"),
    ],
)
def test_tool_calls_a_client_sends_are_checked_before_any_hold(
    fleet: Fleet, api: httpx.Client, calls: object, said: str
) -> None:
    """A call the client sent without an id (or with a number) was answered under
    another id ("None"), so the executor saw it unanswered and ran it again at every
    pass: 4,050 messages in 20 s, the run record rewritten at each; a spawn_agent
    call carved the child's budget twice and charged it twice."""
    messages = [
        {"role": "user", "content": marker()},
        {"role": "assistant", "content": None, "tool_calls": calls},
    ]
    r = api.post("/v1/runs", json={"model": "sim-8b", "messages": messages, "tools": ["balance"]})
    assert r.status_code == 400, r.text
    assert said in r.json()["error"]["message"]
    bad_answer = [*messages[:1], {"role": "tool", "tool_call_id": 7, "content": "x"}]
    r = api.post("/v1/runs", json={"model": "sim-8b", "messages": bad_answer})
    assert r.status_code == 400, r.text


def test_a_run_too_large_to_store_is_refused_before_any_hold(
    fleet: Fleet, api: httpx.Client
) -> None:
    """The gateway takes 4 MiB bodies and a run record holds 1 MiB: the hold was
    taken, the store refused the record, and the client got a retryable 503; each
    retry (SDKs retry 503s) held the run's max_cost until its deadline and more."""

    def reserved() -> int:
        with fleet.admin() as admin:
            return int(admin.get_limits("tenant", fleet.spec.tenant)["reserved_micros"])

    before = reserved()
    big = [{"role": "user", "content": marker() + "x" * 1_100_000}]
    for _ in range(2):
        r = api.post("/v1/runs", json={"model": "sim-8b", "messages": big})
        assert r.status_code == 400, r.text[:400]
        assert r.json()["error"]["code"] == "run_too_large"
    assert reserved() == before


def test_two_calls_of_one_turn_under_one_id_both_run(fleet: Fleet, api: httpx.Client) -> None:
    # Some engines repeat tool call ids within a turn: the second call used to
    # count as answered with the first's answer, and never ran.
    m = marker()
    first = call("transfer", {"from": "alice", "to": "bob", "amount": 1}, "call_0")
    second = call("transfer", {"from": "alice", "to": "bob", "amount": 2}, "call_0")
    both = {"tool_calls": first["tool_calls"] + second["tool_calls"]}
    script(fleet, ("user", m, both), ("tool", m, {"content": "Sent 1 and 2."}))
    run = wait(api, create(api, f"{m}: send 1, then 2", ["transfer"])["id"])
    assert run["status"] == "completed", run
    answers = tool_messages(run)
    assert len(answers) == 2
    assert len({a["tool_call_id"] for a in answers}) == 2
    effects = bank_effects(fleet, run["id"])
    assert len(effects) == 2  # both transfers, each under its own key
    assert len({e["key"] for e in effects}) == 2


# -- authority and arguments ----------------------------------------------------------


def test_tool_outside_the_runs_authority_is_refused_to_the_model(
    fleet: Fleet, api: httpx.Client
) -> None:
    m = marker()
    script(
        fleet,
        ("user", m, call("transfer", {"from": "alice", "to": "eve", "amount": 1})),
        ("tool", m, {"content": "I may not transfer."}),
    )
    run = wait(api, create(api, m, ["balance"])["id"])
    assert run["status"] == "completed"
    (refusal,) = tool_messages(run)
    assert json.loads(refusal["content"]) == {
        "error": "tool not permitted for this run: transfer",
        "retryable": False,
    }
    assert bank_effects(fleet, run["id"]) == []


def test_schema_invalid_arguments_never_reach_the_tool(fleet: Fleet, api: httpx.Client) -> None:
    m = marker()
    script(
        fleet,
        ("user", m, call("transfer", {"from": "alice", "to": "bob", "amount": -5})),
        ("tool", m, {"content": "Bad amount."}),
    )
    run = wait(api, create(api, m, ["transfer"])["id"])
    assert run["status"] == "completed"
    (error,) = tool_messages(run)
    content = json.loads(error["content"])
    assert content["error"].startswith("invalid arguments: $.amount")
    assert content["retryable"] is True
    assert bank_effects(fleet, run["id"]) == []


def test_key_scopes_bound_the_tools_a_run_may_ask_for(fleet: Fleet, api: httpx.Client) -> None:
    with fleet.admin() as admin:
        key = admin.create_key(fleet.spec.tenant, "balance-only", {"tools": ["balance"]})
    headers = {"Authorization": f"Bearer {key['api_key']}"}
    body = {"model": "sim-8b", "messages": [{"role": "user", "content": "x"}]}
    r = api.post("/v1/runs", json={**body, "tools": ["transfer"]}, headers=headers)
    assert r.status_code == 403
    assert r.json()["error"]["param"] == "tools"
    r = api.post("/v1/runs", json={**body, "tools": ["balance"]}, headers=headers)
    assert r.status_code == 201
    api.post(f"/v1/runs/{r.json()['id']}/cancel")


# -- halts ------------------------------------------------------------------------------


def test_max_steps_halts_the_run(fleet: Fleet, api: httpx.Client) -> None:
    m = marker()
    again = call("balance", {"account": "alice"})
    script(fleet, ("user", m, again), ("tool", m, again))  # it never stops asking
    run = wait(api, create(api, m, ["balance"], budget={"max_steps": 3})["id"])
    assert run["status"] == "budget_exceeded"
    assert run["reason"] == "max_steps reached (3)"
    assert run["usage"]["steps"] == 3
    assert len(tool_messages(run)) == 3


def test_deadline_halts_the_run(fleet: Fleet, api: httpx.Client) -> None:
    m = marker()
    script(fleet, ("user", m, call("sleep", {"seconds": 30})))
    # Halted by its 1.5 s deadline, the 30 s sleep cut short: the status and the
    # tool's timeout say so (wait's own bound only stops a hang).
    run = wait(api, create(api, m, ["sleep"], timeout=1.5)["id"])
    assert run["status"] == "deadline_exceeded", run
    (cut,) = tool_messages(run)
    assert json.loads(cut["content"])["error"] == "timeout"


def test_deadline_halts_a_run_parked_on_an_approval(fleet: Fleet, api: httpx.Client) -> None:
    m = marker()
    script(fleet, ("user", m, call("payout", {"to": "x", "amount": 1})))
    run = create(api, m, ["payout"], timeout=1.5)
    assert wait(api, run["id"], {"awaiting_approval"})["status"] == "awaiting_approval"
    halted = wait(api, run["id"])
    assert halted["status"] == "deadline_exceeded", halted
    assert halted["pending_approval"] is None
    assert bank_effects(fleet, run["id"]) == []


def test_a_stuck_step_fails_the_run_with_the_reason(fleet: Fleet, api: httpx.Client) -> None:
    m = marker()
    script(fleet, ("user", m, call("sleep", {"seconds": 60})))
    run = wait(api, create(api, m, ["sleep"], timeout=120)["id"], timeout=20)
    assert run["status"] == "failed"
    assert run["reason"] == "step 0 stuck: no outcome after 5s"


# -- approvals ----------------------------------------------------------------------------


def test_approval_gate_survives_an_executor_restart(
    fleet: Fleet, api: httpx.Client, approver: httpx.Client
) -> None:
    m = marker()
    script(
        fleet,
        ("user", m, call("payout", {"to": "carol", "amount": 7})),
        ("tool", m, {"content": "Paid carol."}),
    )
    run = wait(api, create(api, m, ["payout"])["id"], {"awaiting_approval"})
    assert run["status"] == "awaiting_approval"
    pending = run["pending_approval"]
    assert pending["call_id"] == "call_1"
    assert pending["tool"] == "payout"
    assert pending["arguments"] == {"to": "carol", "amount": 7}
    assert bank_effects(fleet, run["id"]) == []
    wrong = approver.post(f"/v1/runs/{run['id']}/approvals/call_9", json={"approve": True})
    assert wrong.status_code == 409

    # Every executor dies; new ones come up; the approval arrives after the restart.
    live = [a for a in fleet.agents if a.proc.poll() is None]
    for agent in live:
        agent.kill()
    for _ in live:
        fleet.start_agent(wait=False)
    fleet.wait_agents(len(live))
    r = approver.post(f"/v1/runs/{run['id']}/approvals/call_1", json={"approve": True})
    assert r.status_code == 202
    assert r.json()["approve"] is True
    done = wait(api, run["id"])
    assert done["status"] == "completed"
    assert done["result"] == "Paid carol."
    (effect,) = bank_effects(fleet, run["id"])  # the tool ran once
    assert effect["kind"] == "payout"
    assert effect["amount"] == 7
    # A decision stands: denying it now is a conflict.
    r = approver.post(f"/v1/runs/{run['id']}/approvals/call_1", json={"approve": False})
    assert r.status_code == 409


def test_a_denied_call_never_runs(fleet: Fleet, api: httpx.Client, approver: httpx.Client) -> None:
    m = marker()
    script(
        fleet,
        ("user", m, call("payout", {"to": "mallory", "amount": 900})),
        ("tool", m, {"content": "Not paid."}),
    )
    run = wait(api, create(api, m, ["payout"])["id"], {"awaiting_approval"})
    r = approver.post(
        f"/v1/runs/{run['id']}/approvals/call_1", json={"approve": False, "reason": "fraud"}
    )
    assert r.status_code == 202
    done = wait(api, run["id"])
    assert done["status"] == "completed"
    (denied,) = tool_messages(done)
    assert json.loads(denied["content"])["error"] == "denied by the approver: fraud"
    assert bank_effects(fleet, run["id"]) == []


# -- sub-agents -----------------------------------------------------------------------------


def test_subagent_gets_a_carved_budget_and_returns_its_result(
    fleet: Fleet, api: httpx.Client
) -> None:
    parent_m, child_m = marker(), marker()
    spawn = call(
        "spawn_agent",
        {
            "task": f"{child_m}: what is alice's balance?",
            "tools": ["balance"],
            "budget": {"max_steps": 2, "max_cost_micros": 400},
        },
    )
    script(
        fleet,
        ("user", parent_m, spawn),
        ("tool", parent_m, {"content": "The sub-agent says 42."}),
        ("user", child_m, call("balance", {"account": "alice"})),
        ("tool", child_m, {"content": "42"}),
    )
    created = create(
        api,
        parent_m,
        ["spawn_agent", "balance", "transfer"],
        budget={"max_steps": 6, "max_cost_micros": 2000},
    )
    parent = wait(api, created["id"])
    assert parent["status"] == "completed"
    assert parent["result"] == "The sub-agent says 42."
    (child_id,) = parent["children"]
    child = api.get(f"/v1/runs/{child_id}").json()
    assert child["status"] == "completed"
    assert child["result"] == "42"
    assert child["parent"] == parent["id"]
    assert child["root"] == parent["id"]
    assert child["tools"] == ["balance"]  # a subset, as asked
    assert child["budget"]["max_steps"] == 2
    assert child["budget"]["max_cost_micros"] == 400
    assert child["budget"]["max_tokens"] <= 16000  # half the parent's remainder by default
    assert child["traceparent"].split("-")[1] == parent["traceparent"].split("-")[1]
    assert child["deadline"] <= parent["deadline"]
    # Only the child's result comes back to the parent, and its spend is the parent's.
    (result,) = tool_messages(parent)
    assert json.loads(result["content"]) == {"result": "42"}
    assert parent["usage"]["steps"] == 2 + child["usage"]["steps"]
    assert parent["usage"]["cost_micros"] > child["usage"]["cost_micros"] > 0
    assert parent["remaining"]["max_cost_micros"] == 2000 - parent["usage"]["cost_micros"]


def test_subagent_may_not_exceed_its_parent(fleet: Fleet, api: httpx.Client) -> None:
    m = marker()
    script(
        fleet,
        ("user", m, call("spawn_agent", {"task": "pay", "tools": ["transfer"]})),
        ("tool", m, call("spawn_agent", {"task": "x", "budget": {"max_cost_micros": 10**6}}, "c2")),
    )
    run = wait(
        api,
        create(api, m, ["spawn_agent", "balance"], budget={"max_steps": 2, "max_cost_micros": 900})[
            "id"
        ],
    )
    first, second = tool_messages(run)
    assert json.loads(first["content"])["error"].startswith(
        "denied: tools ['transfer'] are not held by this run"
    )
    assert json.loads(second["content"])["error"].startswith(
        "denied: the budget asked for exceeds this run's remainder"
    )
    assert run["children"] == []
    assert run["status"] == "budget_exceeded"  # two steps, both spent on refused spawns


def test_cancelling_a_parent_stops_a_running_grandchild_in_its_tool_call(
    fleet: Fleet, api: httpx.Client
) -> None:
    p, c, g = marker(), marker(), marker()
    script(
        fleet,
        ("user", p, call("spawn_agent", {"task": c, "tools": ["spawn_agent", "sleep"]})),
        ("user", c, call("spawn_agent", {"task": g, "tools": ["sleep"]})),
        ("user", g, call("sleep", {"seconds": 30})),
    )
    parent = create(api, p, ["spawn_agent", "sleep"])
    child_id = wait(api, parent["id"], {"awaiting_child"})["children"][0]
    grandchild_id = wait(api, child_id, {"awaiting_child"})["children"][0]
    end = time.monotonic() + 10
    while time.monotonic() < end:  # until the grandchild is inside its sleep
        grandchild = api.get(f"/v1/runs/{grandchild_id}").json()
        if len(grandchild["messages"]) == 2:
            break
        time.sleep(0.02)
    assert grandchild["status"] == "running"
    assert grandchild["depth"] == 2
    t0 = time.monotonic()
    r = api.post(f"/v1/runs/{parent['id']}/cancel")
    assert r.status_code == 202
    assert r.json()["cancel_requested"] is True
    # Interrupted, not waited out: the wait's bound is a third of the 30 s sleep
    # (not timed tighter: a loaded box is no measure of how fast).
    stopped = wait(api, grandchild_id, timeout=10.0)
    assert stopped["status"] == "cancelled", stopped
    print(f"\ngrandchild cancelled {time.monotonic() - t0:.2f} s after its ancestor's cancel")
    assert stopped["reason"] == f"cancelled by the client (run {parent['id']})"
    for run_id in (parent["id"], child_id):
        assert wait(api, run_id, timeout=3)["status"] == "cancelled"


# -- tenancy and the NATS API -------------------------------------------------------------


def test_another_tenants_key_gets_404(fleet: Fleet, api: httpx.Client) -> None:
    m = marker()
    script(fleet, ("user", m, call("payout", {"to": "x", "amount": 1})))
    run = wait(api, create(api, m, ["payout"])["id"], {"awaiting_approval"})
    with fleet.admin() as admin:
        admin.create_tenant("intruder")
        # It may even approve: another tenant's run is still not there for it.
        scopes = {"actions": ["inference", "approve"]}
        other = admin.create_key("intruder", "k", scopes)["api_key"]
    headers = {"Authorization": f"Bearer {other}"}
    base = f"/v1/runs/{run['id']}"
    for method, path, body in (
        ("GET", base, None),
        ("GET", f"{base}/events", None),
        ("POST", f"{base}/cancel", None),
        ("POST", f"{base}/approvals/call_1", {"approve": True}),
    ):
        r = api.request(method, path, json=body, headers=headers)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["error"]["code"] == "run_not_found"
    assert api.get(base).json()["status"] == "awaiting_approval"  # untouched
    api.post(f"{base}/cancel")


async def test_runs_over_nats(fleet: Fleet) -> None:
    m = marker()
    script(fleet, ("user", m, {"content": "over nats"}))
    nc = await fleet.connect(Role.SERVICE, fleet.spec.tenant, "service")
    try:
        headers = {"Authorization": f"Bearer {fleet.api_key}"}
        body = {"model": "sim-8b", "messages": [{"role": "user", "content": m}]}
        r = await nc.request(
            f"{INGRESS_RUNS}.create", json.dumps(body).encode(), timeout=5, headers=headers
        )
        assert r.headers is not None
        assert r.headers["Jetserve-Status"] == "201"
        run_id = json.loads(r.data)["id"]
        status = ""
        for _ in range(100):
            r = await nc.request(
                f"{INGRESS_RUNS}.get", json.dumps({"run_id": run_id}).encode(), headers=headers
            )
            status = json.loads(r.data)["status"]
            if status == "completed":
                break
            await asyncio.sleep(0.05)
        assert status == "completed"
        assert json.loads(r.data)["result"] == "over nats"
        r = await nc.request(
            f"{INGRESS_RUNS}.get", json.dumps({"run_id": "run_nope"}).encode(), headers=headers
        )
        assert r.headers is not None
        assert r.headers["Jetserve-Status"] == "404"
    finally:
        await nc.close()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/runs"),
        ("GET", "/v1/runs/r1"),
        ("GET", "/v1/runs/r1/events"),
        ("POST", "/v1/runs/r1/approvals/c1"),
        ("POST", "/v1/runs/r1/cancel"),
    ],
)
@pytest.mark.parametrize("credential", [None, "Bearer sk-wrong"])
def test_run_routes_need_a_valid_key(
    fleet: Fleet, method: str, path: str, credential: str | None
) -> None:
    headers = {"Authorization": credential} if credential else {}
    r = httpx.request(method, f"{fleet.base_url}{path}", json={}, headers=headers, timeout=10)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


async def test_a_tenant_follows_a_bounded_number_of_run_event_streams(
    fleet: Fleet, api: httpx.Client
) -> None:
    """Each followed run event stream is an ordered consumer on the bus and a queue
    in the gateway, free of charge: a tenant opened any number. It holds at most
    MAX_EVENT_FOLLOWERS on a replica; the next is a 429 until one ends."""
    m = marker()
    script(fleet, ("user", m, call("payout", {"to": "x", "amount": 1})))
    run = wait(api, create(api, m, ["payout"])["id"], {"awaiting_approval"})  # parked: live
    url = f"{fleet.base_url}/v1/runs/{run['id']}/events"
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    limits = httpx.Limits(max_connections=MAX_EVENT_FOLLOWERS + 4)
    try:
        async with httpx.AsyncClient(timeout=30, limits=limits) as c:
            async with contextlib.AsyncExitStack() as held:
                for _ in range(MAX_EVENT_FOLLOWERS):
                    followed = await held.enter_async_context(c.stream("GET", url, headers=auth))
                    assert followed.status_code == 200
                over = await c.get(url, headers=auth)
                assert over.status_code == 429, over.text
                assert over.json()["error"]["code"] == "too_many_followers"

            # All of them closed: followed again once the gateway saw them end.
            await until_streamed(c, url, auth, "the closed event streams counted out")
    finally:
        await asyncio.to_thread(api.post, f"/v1/runs/{run['id']}/cancel")

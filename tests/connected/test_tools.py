"""The tool runtime against a real nats-server: the effect ledger (once per key,
concurrent duplicates, crashes between intent and outcome, reconcile, ambiguous),
side-effecting timeouts, and remote tools served by another process."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js.api import StorageType

from jetserve.services import Service
from streams.auth import Role
from streams.connect import connect
from tests.waits import until
from tools import (
    EffectLedger,
    EffectLedgerConfig,
    InProcess,
    NeedsApproval,
    Outcome,
    Registry,
    Remote,
    Tier,
    Tool,
    ToolContext,
    ToolDispatcher,
    ToolFailure,
    ToolResult,
    args_hash,
    kv_key,
)

pytestmark = pytest.mark.connected

ROOT = Path(__file__).resolve().parents[2]

TRANSFER_SCHEMA = {
    "type": "object",
    "properties": {
        "from": {"type": "string"},
        "to": {"type": "string"},
        "amount": {"type": "integer", "exclusiveMinimum": 0},
    },
    "required": ["from", "to", "amount"],
    "additionalProperties": False,
}
ARGS = '{"from": "alice", "to": "bob", "amount": 30}'


class Bank:
    """An in-memory bank with its own idempotency on the call's key."""

    def __init__(self, delay: float = 0.0, hang_after: bool = False) -> None:
        self.balances = {"alice": 100, "bob": 0}
        self.applied: dict[str, dict[str, Any]] = {}
        self.entered = 0  # raw executions of the tool function
        self.delay = delay
        self.hang_after = hang_after  # apply, then never answer (a timeout)

    async def transfer(self, args: dict[str, Any], ctx: ToolContext) -> Any:
        self.entered += 1
        if ctx.key in self.applied:
            return self.applied[ctx.key]
        await asyncio.sleep(self.delay)
        src, dst, amount = args["from"], args["to"], args["amount"]
        if self.balances[src] < amount:
            raise ToolFailure("insufficient funds", retryable=False)
        self.balances[src] -= amount
        self.balances[dst] += amount
        receipt = {"transfer": len(self.applied) + 1, "amount": amount, "balance": self.balances}
        receipt = json.loads(json.dumps(receipt))
        self.applied[ctx.key] = receipt
        if self.hang_after:
            await asyncio.sleep(30)
        return receipt

    async def reconcile(self, key: str) -> Outcome | None:
        receipt = self.applied.get(key)
        return Outcome.success(receipt) if receipt is not None else None


def transfer_tool(bank: Bank, *, reconcile: bool = True, timeout_s: float = 2.0) -> Tool:
    return Tool(
        "transfer",
        "Move money between accounts",
        TRANSFER_SCHEMA,
        InProcess(bank.transfer),
        tier=Tier.SIDE_EFFECTING,
        timeout_s=timeout_s,
        reconcile=bank.reconcile if reconcile else None,
    )


def ctx(call_id: str = "call_1", **kw: Any) -> ToolContext:
    return ToolContext(run_id="run-7", step=2, call_id=call_id, **kw)


@pytest.fixture
async def nc(nats_server: Service) -> AsyncIterator[Client]:
    # The agent executor's credential: what it may do with tools, and no more.
    conn = await connect(
        f"nats://127.0.0.1:{nats_server.port}", "test-tools", nats_server.bus_auth(Role.AGENT)
    )
    yield conn
    await conn.close()


@pytest.fixture
async def ledger(nc: Client) -> EffectLedger:
    return await EffectLedger.open(nc.jetstream())


def dispatcher(ledger: EffectLedger, *tools: Tool, nc: Client | None = None) -> ToolDispatcher:
    return ToolDispatcher(Registry(tools), ledger=ledger, nc=nc, lease_grace_s=0.1, poll_s=0.02)


def as_result(r: object) -> ToolResult:
    assert isinstance(r, ToolResult), r
    return r


# -- the effect ledger -------------------------------------------------------


async def test_ledger_bucket_is_created_idempotently(nc: Client) -> None:
    js = nc.jetstream()
    ledgers = await asyncio.gather(*(EffectLedger.open(js) for _ in range(3)))
    again = await EffectLedger.open(js)
    status = await again.kv.status()
    assert status.bucket == EffectLedgerConfig().bucket == "JETSERVE_EFFECTS"
    info = await js.stream_info("KV_JETSERVE_EFFECTS")
    assert info.config.storage == StorageType.FILE
    assert info.config.max_msgs_per_subject == 1
    # Any idempotency key maps to one legal KV token.
    weird = "run with spaces/*.>/3/call:é"
    assert kv_key(weird).startswith("fx.")
    assert len(kv_key(weird)) == 67
    eff = await ledgers[0].record_intent(weird, "t", "h", lease_s=1)
    assert eff.won
    assert (await ledgers[1].status(weird)) == eff.entry


async def test_intent_is_create_only_and_first_outcome_wins(ledger: EffectLedger) -> None:
    a = await ledger.record_intent("k1", "transfer", "h", lease_s=5)
    b = await ledger.record_intent("k1", "transfer", "h", lease_s=5)
    assert a.won
    assert not b.won
    assert b.entry == a.entry
    assert b.revision == a.revision
    first = await ledger.record_outcome("k1", Outcome.success({"n": 1}), a.revision)
    assert first.won
    assert first.entry.state == "done"
    late = await ledger.record_outcome("k1", Outcome.success({"n": 2}), a.revision)
    assert not late.won
    assert late.entry.outcome == Outcome.success({"n": 1})
    assert await ledger.status("never") is None


# -- side-effecting calls ----------------------------------------------------


async def test_same_key_twice_runs_once_and_returns_the_first_outcome(
    ledger: EffectLedger,
) -> None:
    bank = Bank()
    d = dispatcher(ledger, transfer_tool(bank))
    first = as_result(await d.call("transfer", ARGS, ctx(), {"transfer"}))
    again = as_result(await d.call("transfer", ARGS, ctx(), {"transfer"}))
    assert first.ok
    assert first.source == "run"
    assert again.ok
    assert again.source == "ledger"
    assert again.result == first.result
    assert bank.entered == 1
    assert bank.balances == {"alice": 70, "bob": 30}
    # Past the run's deadline nothing runs, but a settled key still answers.
    late = as_result(await d.call("transfer", ARGS, ctx(deadline=time.time() - 1), {"transfer"}))
    assert late.source == "ledger"
    assert late.result == first.result
    fresh = as_result(
        await d.call("transfer", ARGS, ctx("call_0", deadline=time.time() - 1), {"transfer"})
    )
    assert fresh.error == "deadline exceeded"
    assert await ledger.status(ctx("call_0").key) is None
    entry = await ledger.status(ctx().key)
    assert entry is not None
    assert entry.state == "done"
    assert entry.settled_by == "run"
    assert entry.args_hash == args_hash({"from": "alice", "to": "bob", "amount": 30})

    # A new call id is a new effect; a definite failure is recorded as the outcome.
    big = '{"from": "alice", "to": "bob", "amount": 500}'
    fail = as_result(await d.call("transfer", big, ctx("call_2"), {"transfer"}))
    assert (fail.status, fail.error, fail.retryable) == ("error", "insufficient funds", False)
    replay = as_result(await d.call("transfer", big, ctx("call_2"), {"transfer"}))
    assert replay.source == "ledger"
    assert replay.error == "insufficient funds"
    assert bank.entered == 2

    # The same key with other arguments is refused, never run.
    other = '{"from": "alice", "to": "bob", "amount": 1}'
    r = as_result(await d.call("transfer", other, ctx(), {"transfer"}))
    assert r.status == "error"
    assert "different arguments" in r.error
    assert bank.entered == 2


async def test_a_large_result_is_recorded_bounded_and_the_effect_settled(
    ledger: EffectLedger,
) -> None:
    """A side-effecting tool's result over the ledger's value size was refused at
    every redelivery: the entry stayed an intent, the run waited to its deadline
    (or ended ambiguous) with the effect certainly done."""
    applied: list[str] = []

    async def export(args: dict[str, Any], c: ToolContext) -> Any:
        applied.append(c.key)
        return {"rows": ["x" * 1000] * 2000}  # ~2 MB

    tool = Tool("export", "Export", {"type": "object"}, InProcess(export),
                tier=Tier.SIDE_EFFECTING)  # fmt: skip
    d = dispatcher(ledger, tool)
    first = as_result(await d.call("export", "{}", ctx(), {"export"}))
    assert first.ok
    assert first.result["truncated"] is True
    assert first.result["bytes"] > 2_000_000
    assert first.result["preview"].startswith('{"rows":["xxx')
    entry = await ledger.status(ctx().key)
    assert entry is not None
    assert entry.state == "done"  # settled, not an intent left to time out
    again = as_result(await d.call("export", "{}", ctx(), {"export"}))
    assert again.source == "ledger"
    assert again.result == first.result
    assert applied == [ctx().key]  # the effect once


async def test_approval_gate_then_once_through_the_ledger(ledger: EffectLedger) -> None:
    bank = Bank()
    gated = Tool(
        "transfer",
        "Move money (a human approves)",
        TRANSFER_SCHEMA,
        InProcess(bank.transfer),
        tier=Tier.REQUIRES_APPROVAL,
        reconcile=bank.reconcile,
    )
    d = dispatcher(ledger, gated)
    ask = await d.call("transfer", ARGS, ctx(), {"transfer"})
    assert isinstance(ask, NeedsApproval)
    assert ask.arguments["amount"] == 30
    assert bank.entered == 0
    assert await ledger.status(ctx().key) is None
    # Approved (say after an executor restart): runs once; a repeat replays.
    first = as_result(await d.call("transfer", ARGS, ctx(), {"transfer"}, approved=True))
    again = as_result(await d.call("transfer", ARGS, ctx(), {"transfer"}, approved=True))
    assert first.ok
    assert again.source == "ledger"
    assert bank.entered == 1
    no = ToolDispatcher.denied(ask)
    assert json.loads(no.content()) == {"error": "denied by the approver", "retryable": False}


async def test_concurrent_duplicates_make_one_effect(ledger: EffectLedger) -> None:
    bank = Bank(delay=0.2)
    # Separate dispatchers (think: two executors after a redelivery) share the ledger.
    ds = [dispatcher(ledger, transfer_tool(bank, reconcile=False)) for _ in range(4)]
    calls = [d.call("transfer", ARGS, ctx(), {"transfer"}) for d in ds for _ in range(3)]
    results = [as_result(r) for r in await asyncio.gather(*calls)]
    assert bank.entered == 1  # kv.create let exactly one caller run it
    assert {r.status for r in results} == {"ok"}
    assert len({json.dumps(r.result, sort_keys=True) for r in results}) == 1
    assert sorted(r.source for r in results) == ["ledger"] * 11 + ["run"]
    assert bank.balances == {"alice": 70, "bob": 30}


async def test_crash_after_intent_is_reconciled_or_ambiguous(ledger: EffectLedger) -> None:
    bank = Bank()
    d = dispatcher(ledger, transfer_tool(bank))
    digest = args_hash({"from": "alice", "to": "bob", "amount": 30})

    # Crash between intent and the effect: reconcile says "not done" -> it runs now.
    await ledger.record_intent(ctx("c1").key, "transfer", digest, lease_s=0)
    r = as_result(await d.call("transfer", ARGS, ctx("c1"), {"transfer"}))
    assert r.ok
    assert r.source == "run"
    assert bank.entered == 1
    entry = await ledger.status(ctx("c1").key)
    assert entry is not None
    assert entry.attempt == 2
    assert entry.state == "done"

    # Crash between the effect and its outcome: reconcile says "done" -> that outcome.
    await ledger.record_intent(ctx("c2").key, "transfer", digest, lease_s=0)
    await bank.transfer({"from": "alice", "to": "bob", "amount": 30}, ctx("c2"))
    r = as_result(await d.call("transfer", ARGS, ctx("c2"), {"transfer"}))
    assert r.ok
    assert r.source == "reconciled"
    assert r.result == bank.applied[ctx("c2").key]
    assert bank.entered == 2
    assert bank.balances == {"alice": 40, "bob": 60}
    again = as_result(await d.call("transfer", ARGS, ctx("c2"), {"transfer"}))
    assert again.source == "ledger"
    assert again.result == r.result
    assert bank.entered == 2

    # Without reconcile: ambiguous, never blindly repeated, until an operator resolves.
    blind = dispatcher(ledger, transfer_tool(bank, reconcile=False))
    await ledger.record_intent(ctx("c3").key, "transfer", digest, lease_s=0)
    r = as_result(await blind.call("transfer", ARGS, ctx("c3"), {"transfer"}))
    assert r.status == "ambiguous"
    assert not r.retryable
    assert bank.entered == 2
    assert "awaiting reconciliation" in json.loads(r.content())["error"]
    late = as_result(
        await blind.call("transfer", ARGS, ctx("c3", deadline=time.time() - 1), {"transfer"})
    )
    assert late.status == "ambiguous"  # not "deadline exceeded": it may have happened
    assert [e.key for e in await ledger.pending()] == [ctx("c3").key]
    await ledger.resolve(ctx("c3").key, Outcome.failure("never happened"))
    r = as_result(await blind.call("transfer", ARGS, ctx("c3"), {"transfer"}))
    assert (r.source, r.error) == ("ledger", "never happened")
    assert bank.entered == 2
    assert await ledger.pending() == []


async def test_a_crashed_tools_error_text_stays_out_of_the_log(
    ledger: EffectLedger, caplog: pytest.LogCaptureFixture
) -> None:
    # A tool's exception text may quote its arguments (the model's output): it
    # was logged at warning through the ambiguous effect's reason, and whole, with
    # the traceback, at debug. The run still gets it; the log gets the type.
    secret = "acct-7731-zebra"

    async def leaky(args: dict[str, Any], ctx: ToolContext) -> Any:
        raise ValueError(f"cannot pay {args['to']} {secret}")

    tool = Tool(
        "transfer", "Move money", TRANSFER_SCHEMA, InProcess(leaky), tier=Tier.SIDE_EFFECTING
    )
    caplog.set_level(logging.DEBUG, logger="tools")
    r = as_result(await dispatcher(ledger, tool).call("transfer", ARGS, ctx("leak"), {"transfer"}))
    assert r.status == "ambiguous"
    assert secret in json.loads(r.content())["error"]  # the run's own view
    assert "ValueError" in caplog.text  # what and where were logged
    assert "tool_crashed" in caplog.text
    assert secret not in caplog.text


async def test_side_effecting_timeout_is_reconciled_or_ambiguous(ledger: EffectLedger) -> None:
    # The effect lands, then the tool never answers: a timeout is not "failed".
    bank = Bank(hang_after=True)
    d = dispatcher(ledger, transfer_tool(bank, timeout_s=0.2))
    t0 = time.monotonic()
    r = as_result(await d.call("transfer", ARGS, ctx(), {"transfer"}))
    assert r.ok
    assert r.source == "reconciled"
    assert r.result == bank.applied[ctx().key]
    assert time.monotonic() - t0 < 1.0

    blind = dispatcher(ledger, transfer_tool(bank, reconcile=False, timeout_s=0.2))
    r = as_result(await blind.call("transfer", ARGS, ctx("c9"), {"transfer"}))
    assert r.status == "ambiguous"
    assert r.error.startswith("timeout: ")
    entry = await ledger.status(ctx("c9").key)
    assert entry is not None
    assert entry.state == "intent"


async def test_executor_killed_between_effect_and_outcome(
    ledger: EffectLedger, nats_server: Service, tmp_path: Path
) -> None:
    """A real process records the intent, performs the effect, and is SIGKILLed
    before it can record the outcome. Its successor must not repeat the effect."""
    book = tmp_path / "bank.jsonl"
    script = textwrap.dedent(
        f"""
        import asyncio, json, os, signal, sys
        from streams.auth import Role
        from streams.connect import BusAuth, connect
        from tools import *

        async def transfer(args, ctx):
            with open({str(book)!r}, "a") as f:
                f.write(json.dumps({{"key": ctx.key, "receipt": {{"amount": args["amount"]}}}}))
                f.write("\\n")
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)  # after the effect, before the outcome

        async def main():
            auth = BusAuth.from_env(Role.AGENT)
            nc = await connect("nats://127.0.0.1:{nats_server.port}", "doomed", auth)
            ledger = await EffectLedger.open(nc.jetstream())
            tool = Tool("transfer", "t", {TRANSFER_SCHEMA!r}, InProcess(transfer),
                        tier=Tier.SIDE_EFFECTING, timeout_s=0.5)
            d = ToolDispatcher(Registry([tool]), ledger=ledger, lease_grace_s=0.1)
            await d.call("transfer", {ARGS!r}, ToolContext(run_id="run-7", step=2,
                         call_id="call_k"), {{"transfer"}})

        asyncio.run(main())
        """
    )
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, **nats_server_env(nats_server, Role.AGENT)},
        capture_output=True,
        timeout=20,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    key = ctx("call_k").key
    entry = await ledger.status(key)
    assert entry is not None
    assert entry.state == "intent"

    def applied() -> list[dict[str, Any]]:
        return [json.loads(line) for line in book.read_text().splitlines()]

    async def from_book(key: str) -> Outcome | None:
        for row in applied():
            if row["key"] == key:
                return Outcome.success(row["receipt"])
        return None

    async def must_not_run(args: dict[str, Any], c: ToolContext) -> Any:
        raise AssertionError("the effect ran twice")

    def tool(reconcile: bool) -> Tool:
        return Tool(
            "transfer",
            "t",
            TRANSFER_SCHEMA,
            InProcess(must_not_run),
            tier=Tier.SIDE_EFFECTING,
            timeout_s=0.5,
            reconcile=from_book if reconcile else None,
        )

    # The successor without a reconciler: waits out the dead owner's lease, then
    # reports ambiguous rather than run it again.
    r = as_result(
        await dispatcher(ledger, tool(False)).call("transfer", ARGS, ctx("call_k"), {"transfer"})
    )
    assert r.status == "ambiguous"
    # With one: the book says it happened; that is the outcome, recorded.
    r = as_result(
        await dispatcher(ledger, tool(True)).call("transfer", ARGS, ctx("call_k"), {"transfer"})
    )
    assert r.ok
    assert r.source == "reconciled"
    assert r.result == {"amount": 30}
    assert len(applied()) == 1
    entry = await ledger.status(key)
    assert entry is not None
    assert entry.state == "done"
    assert entry.settled_by == "reconciled"


# -- remote tools ------------------------------------------------------------

SERVER = """
import asyncio, os, sys
from streams.auth import Role
from streams.connect import BusAuth, connect
from tests.waits import until
from tools import Outcome, ToolFailure, serve_tool

applied = {}
balances = {"alice": 100, "bob": 0}
entered = 0

async def echo(args, ctx):
    return {"pid": os.getpid(), "args": args, "key": ctx.key, "deadline": ctx.deadline}

async def transfer(args, ctx):
    global entered
    entered += 1
    if ctx.key in applied:
        return applied[ctx.key]
    if balances[args["from"]] < args["amount"]:
        raise ToolFailure("insufficient funds", retryable=False)
    if args["amount"] == 17:  # slow: the effect lands after the caller's timeout
        await asyncio.sleep(1.0)
    balances[args["from"]] -= args["amount"]
    balances[args["to"]] += args["amount"]
    applied[ctx.key] = {"amount": args["amount"], "entered": entered, "pid": os.getpid()}
    if args["amount"] == 13:  # unlucky: the effect lands, the reply never comes
        await asyncio.sleep(30)
    return applied[ctx.key]

async def reconcile(key):
    return Outcome.success(applied[key]) if key in applied else None

async def crash(args, ctx):
    raise RuntimeError("remote bug")

async def main():
    nc = await connect(sys.argv[1], "tool-host", BusAuth.from_env(Role.TOOLS))
    await serve_tool(nc, echo, "jetserve.tool.echo")
    await serve_tool(nc, transfer, "jetserve.tool.transfer", reconcile=reconcile)
    await serve_tool(nc, crash, "jetserve.tool.crash")
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.fixture
def tool_host(nats_server: Service, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process (plain Python here; any language that speaks NATS would do)."""
    url = f"nats://127.0.0.1:{nats_server.port}"
    errors = tmp_path / "tool-host.err"
    with errors.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, url],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), **nats_server_env(nats_server, Role.TOOLS)},
        )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", errors.read_text()
        yield proc
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def remote_tools() -> list[Tool]:
    return [
        Tool("echo", "Echo", {"type": "object"}, Remote("jetserve.tool.echo"), timeout_s=2),
        Tool(
            "transfer",
            "Move money",
            TRANSFER_SCHEMA,
            Remote("jetserve.tool.transfer", reconcile=True),
            tier=Tier.SIDE_EFFECTING,
            timeout_s=0.3,
        ),
        Tool("crash", "Crashes", {"type": "object"}, Remote("jetserve.tool.crash"), timeout_s=2),
        Tool(
            "crash_fx",
            "Crashes mid-effect",
            {"type": "object"},
            Remote("jetserve.tool.crash"),
            tier=Tier.SIDE_EFFECTING,
        ),
        Tool("nobody", "Unserved", {"type": "object"}, Remote("jetserve.tool.nobody")),
        Tool(
            "nobody_fx",
            "Unserved",
            {"type": "object"},
            Remote("jetserve.tool.nobody"),
            tier=Tier.SIDE_EFFECTING,
        ),
    ]


ALL_REMOTE = {"echo", "transfer", "crash", "crash_fx", "nobody", "nobody_fx"}


async def test_remote_tool_round_trip_across_processes(
    nc: Client, ledger: EffectLedger, tool_host: subprocess.Popen[str], nats_server: Service
) -> None:
    d = dispatcher(ledger, *remote_tools(), nc=nc)
    deadline = time.time() + 30
    r = as_result(await d.call("echo", '{"x": [1, 2]}', ctx(deadline=deadline), ALL_REMOTE))
    assert r.ok
    assert r.result["pid"] == tool_host.pid != os.getpid()
    assert r.result["args"] == {"x": [1, 2]}
    assert r.result["key"] == ctx().key
    assert r.result["deadline"] == deadline

    # Side-effecting over NATS: once per key; the tool's own error is structured.
    first = as_result(await d.call("transfer", ARGS, ctx("t1"), ALL_REMOTE))
    again = as_result(await d.call("transfer", ARGS, ctx("t1"), ALL_REMOTE))
    assert first.ok
    assert again.source == "ledger"
    assert again.result == first.result
    assert first.result["entered"] == 1
    poor = as_result(
        await d.call(
            "transfer", '{"from": "bob", "to": "alice", "amount": 99}', ctx("t2"), ALL_REMOTE
        )
    )
    assert (poor.error, poor.retryable) == ("insufficient funds", False)

    # Discoverable with the NATS service API (by the operator).
    admin = await connect(
        f"nats://127.0.0.1:{nats_server.port}", "operator", nats_server.bus_auth()
    )
    try:
        answer = await admin.request("$SRV.INFO.jetserve_tool_transfer", b"", timeout=2)
    finally:
        await admin.close()
    info = json.loads(answer.data)
    assert {e["subject"] for e in info["endpoints"]} == {
        "jetserve.tool.transfer",
        "jetserve.tool.transfer.reconcile",
    }
    assert {e["queue_group"] for e in info["endpoints"]} == {"tools"}


async def test_remote_failures_are_structured(
    nc: Client, ledger: EffectLedger, tool_host: subprocess.Popen[str]
) -> None:
    d = dispatcher(ledger, *remote_tools(), nc=nc)
    # Nobody serves the subject: retryable, and for an effect the key is freed.
    r = as_result(await d.call("nobody", "{}", ctx(), ALL_REMOTE))
    assert (r.status, r.retryable) == ("error", True)
    assert "no responders" in r.error
    r = as_result(await d.call("nobody_fx", "{}", ctx("n1"), ALL_REMOTE))
    assert (r.status, r.retryable) == ("error", True)
    assert "no responders" in r.error
    assert await ledger.status(ctx("n1").key) is None
    r = as_result(await d.call("nobody_fx", "{}", ctx("n1"), ALL_REMOTE))  # the key is free
    assert r.retryable
    assert await ledger.status(ctx("n1").key) is None

    # A remote crash: an error for a read-only tool, ambiguous for an effect.
    r = as_result(await d.call("crash", "{}", ctx(), ALL_REMOTE))
    assert r.status == "error"
    assert "remote bug" in r.error
    r = as_result(await d.call("crash_fx", "{}", ctx("x1"), ALL_REMOTE))
    assert r.status == "ambiguous"
    assert "remote bug" in r.error

    # A remote timeout after the effect landed: the remote reconcile answers.
    unlucky = '{"from": "alice", "to": "bob", "amount": 13}'
    r = as_result(await d.call("transfer", unlucky, ctx("u1"), ALL_REMOTE))
    assert r.ok
    assert r.source == "reconciled"
    assert r.result["amount"] == 13

    # A remote timeout before the effect lands, which it does later (the tool
    # server goes on): not a retryable failure (the model's retry would be a new
    # call under a new key, and the money would move twice) but ambiguous; the
    # intent stays, and a later look with the key finds the effect.
    late = '{"from": "alice", "to": "bob", "amount": 17}'
    r = as_result(await d.call("transfer", late, ctx("l1"), ALL_REMOTE))
    assert r.status == "ambiguous"
    assert r.error.startswith("timeout; not applied yet, and may still be")

    async def landed() -> bool:
        again = as_result(await d.call("transfer", late, ctx("l1"), ALL_REMOTE))
        return again.ok and again.source == "reconciled"

    await until(landed, "the late effect, found by its key")

    # Schema-invalid arguments never leave this process.
    r = as_result(await d.call("transfer", '{"from": "alice"}', ctx("v1"), ALL_REMOTE))
    assert r.error.startswith("invalid arguments: $: 'to' is a required property")
    assert await ledger.status(ctx("v1").key) is None


def nats_server_env(server: Service, role: Role) -> dict[str, str]:
    """A child process's NATS credential, as the file its environment names."""
    assert server.creds is not None
    return server.creds.nats_env(role)

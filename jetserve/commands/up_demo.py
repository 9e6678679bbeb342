"""What ``jetserve up`` shows beyond a chat: an agent run that calls a tool gated
by an approval, decided by a second key, and the WebSocket bridge.

With the simulator, the demo task is scripted (the model calls ``payout``, then
answers), so the run is the same every time; a real engine decides for itself."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlencode

import httpx

from jetserve.fleet import Fleet

TASK = "Pay carol 30."
TOOLS = ["payout", "balance"]
TERMINAL = {"completed", "failed", "cancelled", "halted"}


def prepare(fleet: Fleet) -> str:
    """Script the simulator for the demo task (when it runs one) and make the
    approver: another key of the tenant with the ``approve`` scope (the run's
    creator may not decide its own gated calls). Its key."""
    if fleet.sim is not None:
        fn = {"name": "payout", "arguments": json.dumps({"to": "carol", "amount": 30})}
        call = {"tool_calls": [{"id": "call_1", "type": "function", "function": fn}]}
        answer = {"content": "Paid carol 30."}
        rules = [
            {"match": {"last_role": "user", "contains": TASK}, "response": call},
            {"match": {"last_role": "tool", "contains": TASK}, "response": answer},
        ]
        httpx.post(f"{fleet.sim_url}/sim/scripts?append=1", json=rules).raise_for_status()
    with fleet.admin() as admin:
        created = admin.create_key(fleet.spec.tenant, "approver", {"actions": ["approve"]})
    return str(created["api_key"])


def run_body(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": TASK}],
        "tools": TOOLS,
        "budget": {"max_steps": 4, "max_cost": 0.01},
        "timeout": 300,
    }


def agent_check(fleet: Fleet, approver_key: str, timeout_s: float = 60.0) -> str:
    """A run through the executor: wait for its approval, approve it with the
    approver's key, wait for the end. One line saying what happened."""
    auth = {"Authorization": f"Bearer {fleet.api_key}"}
    with httpx.Client(base_url=fleet.base_url, timeout=30) as c:
        r = c.post("/v1/runs", json=run_body(fleet.spec.model), headers=auth)
        r.raise_for_status()
        run_id = r.json()["id"]
        seen: list[str] = []
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            run = c.get(f"/v1/runs/{run_id}", headers=auth).json()
            if not seen or seen[-1] != run["status"]:
                seen.append(run["status"])
            if run["status"] == "awaiting_approval":
                call_id = run["pending_approval"]["call_id"]
                c.post(
                    f"/v1/runs/{run_id}/approvals/{call_id}",
                    json={"approve": True},
                    headers={"Authorization": f"Bearer {approver_key}"},
                ).raise_for_status()
            elif run["status"] in TERMINAL:
                steps = run["usage"]["steps"]
                return f"{run_id}: {' -> '.join(seen)}: {run.get('result')!r} ({steps} steps)"
            time.sleep(0.1)
    raise TimeoutError(f"agent run {run_id} did not end in {timeout_s}s: {' -> '.join(seen)}")


def playground_link(fleet: Fleet, approver_key: str) -> str:
    """The playground with both keys and the model filled in, from the URL fragment
    (which browsers never send; the page drops it from the address bar)."""
    fields = {"key": fleet.api_key, "model": fleet.spec.model, "approver": approver_key}
    return f"{fleet.base_url}/playground#{urlencode(fields)}"


def examples(fleet: Fleet, approver_key: str) -> str:
    """Ready-to-paste commands: an agent run with its approval, and the WebSocket."""
    base, key, model = fleet.base_url, fleet.api_key, fleet.spec.model
    body = json.dumps(run_body(model))
    ws = base.replace("http://", "ws://") + "/v1/ws"
    chat = {"model": model, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    request = json.dumps({"type": "request", "id": "c1", "op": "chat", "body": chat})
    return (
        "in a browser (a chat; and the agent run: Start run, then Approve):\n\n"
        f"  {playground_link(fleet, approver_key)}\n\n"
        "an agent run (its payout waits for an approval by another key):\n\n"
        f"  export KEY={key} APPROVER={approver_key}\n"
        f"  curl -s {base}/v1/runs -H \"Authorization: Bearer $KEY\" -d '{body}'\n"
        f'  curl -s {base}/v1/runs/RUN_ID -H "Authorization: Bearer $KEY"   # awaiting_approval\n'
        f'  curl -s {base}/v1/runs/RUN_ID/approvals/call_1 -H "Authorization: Bearer $APPROVER"'
        " -d '{\"approve\": true}'\n"
        f'  curl -sN {base}/v1/runs/RUN_ID/events -H "Authorization: Bearer $KEY"\n\n'
        "the WebSocket bridge (several requests may share one socket):\n\n"
        "  .venv/bin/python - <<'EOF'\n"
        "import asyncio, websockets\n"
        "async def main():\n"
        f"    auth = {{'Authorization': 'Bearer {key}'}}\n"
        f"    async with websockets.connect('{ws}', additional_headers=auth) as ws:\n"
        f"        await ws.send({request!r})\n"
        "        async for frame in ws:\n"
        "            print(frame)\n"
        "            if '\"done\"' in frame:\n"
        "                break\n"
        "asyncio.run(main())\n"
        "EOF\n"
    )

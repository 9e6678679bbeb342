"""/playground in a real browser: headless Chromium (Debian's package), driven over
the Chrome DevTools Protocol with `websockets`, against a real fleet.

It checks the streamed text over SSE and over the WebSocket bridge against the
simulator's own answer, a clean Stop on both (the engine call is aborted), an
agent run started from the page (the demo task of `jetserve up`: its payout call
approved from the page with a second key, to the tool's result; two gated calls in
one turn; its event stream resumed across a gateway restart; and a cancel),
and the page's Content-Security-Policy. Set JETSERVE_PLAYGROUND_PNG=docs/playground.png
to refresh the screenshot in the docs (the agent run test takes it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
import websockets

from jetserve.commands import up_demo
from jetserve.fleet import Fleet, FleetSpec
from tests.refusals import checked_fleet
from tests.waits import until, until_sync

pytestmark = pytest.mark.connected

MODEL = "sim-8b"
WIDTH, HEIGHT = 900, 640
# Chromium must not reach out on its own: the closed network refuses it, and
# QUIC, component updates and the like would stall start-up or spam the log.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--remote-debugging-port=0",
    f"--window-size={WIDTH},{HEIGHT}",
]
# Collects the page's CSP violations (CDP-injected scripts are not subject to CSP).
CSP_PROBE = (
    "window.__csp = [];"
    "document.addEventListener('securitypolicyviolation',"
    " e => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));"
)
PAGE_STATE = """({
  state: document.body.dataset.state,
  output: document.getElementById('output').textContent,
  error: document.getElementById('error').textContent,
  usage: document.getElementById('usage').textContent,
  requestId: document.getElementById('request-id').textContent,
  csp: window.__csp,
})"""
RUN_STATE = """({
  status: document.getElementById('agent').dataset.status,
  runId: document.getElementById('run-id').textContent,
  events: [...document.querySelectorAll('#run-events li')].map(li => ({
    label: li.dataset.label,
    seq: li.dataset.seq ? Number(li.dataset.seq) : null,
    text: [...li.childNodes].slice(1).map(n => n.textContent).join(''),
  })),
  approvalShown: !document.getElementById('run-approval').hidden,
  pending: document.getElementById('run-pending').textContent,
  decision: document.getElementById('run-decision').textContent,
  usage: document.getElementById('run-usage').textContent,
  error: document.getElementById('run-error').textContent,
  startDisabled: document.getElementById('run-start').disabled,
  cancelDisabled: document.getElementById('run-cancel').disabled,
  csp: window.__csp,
})"""


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    # Every engine call streams at 10 ms a token unless its request says otherwise:
    # a browser cannot put X-Sim-Fault on a WebSocket upgrade, and Stop needs a
    # stream that is still running. One agent executor with the demo tools, as
    # `jetserve up` runs. Its gateway listens with SO_REUSEPORT, so that a test can
    # replace it on its port.
    spec = FleetSpec(
        workers=1,
        agents=1,
        profile="fast",
        sim_args=["--fault-rate", "slow:10=1.0"],
        gateways_share_port=True,
    )
    with checked_fleet(request, spec) as f:
        yield f


@pytest.fixture(scope="module")
def approver_key(fleet: Fleet) -> str:
    """What `jetserve up` does for its demo run: the simulator scripted for the task
    (a payout call, gated by an approval, then an answer) and a second key of the
    tenant with the approve scope. That key."""
    return up_demo.prepare(fleet)


class Chromium:
    def __init__(self) -> None:
        exe = shutil.which("chromium")
        if exe is None:
            pytest.fail(
                "Debian's chromium is not installed: run `make setup` "
                "(or `apt-get install -y --no-install-recommends chromium`).",
                pytrace=False,
            )
        self.profile = Path(tempfile.mkdtemp(prefix="jetserve-chromium-"))
        self.log = self.profile.parent / f"{self.profile.name}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [exe, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.port = self._wait_port(20.0)

    def _wait_port(self, limit_s: float) -> int:
        """The port Chromium chose, from DevToolsActivePort in its profile."""
        active = self.profile / "DevToolsActivePort"
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                self.stop()
                pytest.fail(f"chromium exited ({self.proc.returncode}): {self.log_tail()}")
            lines = active.read_text().splitlines() if active.exists() else []
            if len(lines) >= 2:
                return int(lines[0])
            time.sleep(0.02)
        self.stop()
        pytest.fail(f"chromium did not open its DevTools port in {limit_s}s: {self.log_tail()}")

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Its helpers (zygote, renderers) share the session it was started in.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        shutil.rmtree(self.profile, ignore_errors=True)
        self.log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Chromium]:
    browser = Chromium()
    yield browser
    browser.stop()


class CdpError(Exception):
    pass


class Page:
    """One browser tab over CDP: commands by id; the events of enabled domains are
    kept in `events` (page state itself is polled)."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for raw in self.ws:
            msg = json.loads(raw)
            if "method" in msg:
                self.events.append(msg)
                continue
            fut = self.pending.pop(msg.get("id", -1), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        n = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[n] = fut
        await self.ws.send(json.dumps({"id": n, "method": method, "params": params}))
        msg = await asyncio.wait_for(fut, 10)
        if "error" in msg:
            raise CdpError(f"{method}: {msg['error']}")
        result: dict[str, Any] = msg["result"]
        return result

    async def js(self, expression: str) -> Any:
        res = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in res:
            raise CdpError(f"{expression!r}: {res['exceptionDetails']}")
        return res["result"].get("value")

    async def wait(self, expression: str, limit_s: float = 10.0) -> Any:
        """Until `expression` is truthy in the page: its value."""
        end = time.monotonic() + limit_s
        last: Any = None
        while time.monotonic() < end:
            try:
                last = await self.js(expression)
            except CdpError:  # between documents while navigating
                last = None
            if last:
                return last
            await asyncio.sleep(0.02)
        state = await self.js(PAGE_STATE)
        run = await self.js(RUN_STATE)
        raise AssertionError(f"not true within {limit_s}s: {expression}; page: {state}; run: {run}")

    async def state(self) -> dict[str, Any]:
        value: dict[str, Any] = await self.js(PAGE_STATE)
        return value

    async def run_state(self) -> dict[str, Any]:
        value: dict[str, Any] = await self.js(RUN_STATE)
        return value

    async def open(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait(
            "document.body && document.body.dataset.ready === '1' && location.hash === ''"
        )

    async def click(self, element_id: str) -> None:
        await self.js(f"document.getElementById({json.dumps(element_id)}).click()")


@pytest.fixture
async def page(chromium: Chromium) -> AsyncIterator[Page]:
    base = f"http://127.0.0.1:{chromium.port}"
    async with httpx.AsyncClient(timeout=10) as c:
        target = (await c.put(f"{base}/json/new?about:blank")).json()
        try:
            async with websockets.connect(target["webSocketDebuggerUrl"], max_size=None) as ws:
                p = Page(ws)
                await p.call("Page.enable")
                await p.call("Page.addScriptToEvaluateOnNewDocument", source=CSP_PROBE)
                await p.call(
                    "Emulation.setDeviceMetricsOverride",
                    width=WIDTH,
                    height=HEIGHT,
                    deviceScaleFactor=1,
                    mobile=False,
                )
                try:
                    yield p
                finally:
                    p.reader.cancel()
        finally:
            await c.get(f"{base}/json/close/{target['id']}")


def playground_url(fleet: Fleet, **opts: str | int) -> str:
    """The page with its fields filled from the fragment (the key never reaches the server)."""
    fields = {"key": fleet.api_key, "model": MODEL, **opts}
    return f"{fleet.base_url}/playground#{urlencode(fields)}"


async def reference(fleet: Fleet, prompt: str, max_tokens: int) -> str:
    """The simulator's own text for the page's request, asked directly, not streamed."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
    }
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(
            f"{fleet.sim_url}/v1/chat/completions", json=body, headers={"X-Sim-Fault": "none"}
        )
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


async def sim_record(fleet: Fleet, request_id: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=5) as c:
        r = await c.get(f"{fleet.sim_url}/sim/requests/{request_id}")
    record: dict[str, Any] = r.json() if r.status_code == 200 else {}
    return record


async def sim_stats(fleet: Fleet) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=5) as c:
        stats: dict[str, Any] = (await c.get(f"{fleet.sim_url}/sim/stats")).json()
    return stats


async def wait_aborted(fleet: Fleet, request_id: str, limit_s: float = 5.0) -> dict[str, Any]:
    end = time.monotonic() + limit_s
    rec: dict[str, Any] = {}
    while time.monotonic() < end:
        rec = await sim_record(fleet, request_id)
        if rec.get("status") == "aborted":
            return rec
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine call {request_id} not aborted: {rec}")


def png_size(data: bytes) -> tuple[int, int]:
    """Checks a PNG's structure (signature, chunk CRCs, IHDR..IEND, inflatable data)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    pos, chunks = 8, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR"
    assert chunks[-1][0] == b"IEND"
    zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    width, height = struct.unpack(">II", chunks[0][1][:8])
    return width, height


async def api_run(fleet: Fleet, run_id: str) -> dict[str, Any]:
    """The run as the API shows it to its creator."""
    async with httpx.AsyncClient(timeout=5) as c:
        r = await c.get(
            f"{fleet.base_url}/v1/runs/{run_id}",
            headers={"Authorization": f"Bearer {fleet.api_key}"},
        )
    r.raise_for_status()
    run: dict[str, Any] = r.json()
    return run


def save_screenshot(png: bytes, path: Path) -> bytes:
    """Writes it (and to $JETSERVE_PLAYGROUND_PNG, for the docs); what the file holds."""
    path.write_bytes(png)
    if target := os.environ.get("JETSERVE_PLAYGROUND_PNG"):
        Path(target).write_bytes(png)
    return path.read_bytes()


async def test_page_is_static_and_locked_down(fleet: Fleet) -> None:
    async with httpx.AsyncClient(timeout=5) as c:
        r = await c.get(f"{fleet.base_url}/playground")  # no credential needed
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp
    assert "script-src 'sha256-" in csp
    assert "unsafe-inline" not in csp
    assert "unsafe-eval" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert fleet.api_key not in r.text
    assert "Bearer sk-" not in r.text
    assert "http://" not in r.text  # no CDN, no absolute URLs
    assert "https://" not in r.text


async def test_sse_streams_the_engine_text(fleet: Fleet, page: Page, tmp_path: Path) -> None:
    prompt = "stream me something over SSE"
    await page.open(playground_url(fleet, prompt=prompt, max_tokens=24))
    assert await page.js("document.getElementById('key').value") == fleet.api_key
    await page.click("send-sse")
    await page.wait("['done', 'error'].includes(document.body.dataset.state)")
    state = await page.state()
    assert state["state"] == "done", state
    assert state["error"] == "", state
    assert state["output"] == await reference(fleet, prompt, 24)
    assert state["usage"].endswith("completion tokens"), state
    assert len(state["requestId"]) == 32, state
    assert state["csp"] == [], state

    shot = await page.call("Page.captureScreenshot", format="png")
    saved = tmp_path / "playground.png"
    saved.write_bytes(base64.b64decode(shot["data"]))
    assert png_size(saved.read_bytes()) == (WIDTH, HEIGHT)


async def test_websocket_streams_the_engine_text(fleet: Fleet, page: Page) -> None:
    prompt = "and now over the WebSocket bridge"
    await page.open(playground_url(fleet, prompt=prompt, max_tokens=24))
    await page.click("send-ws")
    await page.wait("['done', 'error'].includes(document.body.dataset.state)")
    state = await page.state()
    assert state["state"] == "done", state
    assert state["error"] == "", state
    assert state["output"] == await reference(fleet, prompt, 24)
    assert state["usage"].endswith("completion tokens"), state
    assert state["csp"] == [], state


@pytest.mark.parametrize("transport", ["sse", "ws"])
async def test_stop_cancels_cleanly(fleet: Fleet, page: Page, transport: str) -> None:
    # 2000 tokens (ignore_eos) at 50 ms (SSE, the page's extra header) or 10 ms a
    # token (WebSocket, the fleet's default): still streaming when Stop is pressed.
    opts: dict[str, str | int] = {
        "prompt": f"a long answer over {transport}",
        "max_tokens": 2000,
        "body": json.dumps({"ignore_eos": True}),
    }
    if transport == "sse":
        opts["headers"] = "X-Sim-Fault: slow:50"
    await page.open(playground_url(fleet, **opts))
    aborted_before = (await sim_stats(fleet))["aborted"]
    await page.click(f"send-{transport}")
    await page.wait("document.getElementById('output').textContent.length > 0")
    await page.click("stop")
    state = await page.state()
    assert state["state"] == "cancelled", state
    assert state["error"] == "", state
    assert await page.js("document.getElementById('stop').disabled") is True

    rec = await wait_aborted(fleet, state["requestId"])
    assert 0 < rec["generated_tokens"] < 2000, rec
    assert (await sim_stats(fleet))["aborted"] == aborted_before + 1
    # Nothing more reaches the page, and it still reads as a clean cancel.
    after = await page.state()
    assert after["state"] == "cancelled", after
    assert after["error"] == "", after
    assert after["output"] == state["output"]
    assert after["csp"] == [], after


async def test_csp_blocks_injected_script(fleet: Fleet, page: Page) -> None:
    await page.open(playground_url(fleet))
    await page.js(
        "const s = document.createElement('script');"
        "s.textContent = 'window.__pwned = 1'; document.body.append(s);"
    )
    violations = await page.wait("window.__csp.length && window.__csp")
    assert violations[0].startswith("script-src"), violations
    assert await page.js("window.__pwned === undefined") is True


def server_events(state: dict[str, Any]) -> list[tuple[str, str]]:
    """The run's events as the page lists them (label, text), without the page's own
    notes (a decision it sent has no sequence)."""
    return [(e["label"], e["text"]) for e in state["events"] if e["seq"] is not None]


async def test_agent_run_approved_from_the_page(
    fleet: Fleet, page: Page, approver_key: str, tmp_path: Path
) -> None:
    task = up_demo.TASK  # the demo task of `jetserve up`
    await page.open(
        playground_url(fleet, prompt="Hello before the agent run", max_tokens=16, task=task)
    )
    # The tools default to the ones the demo run uses, served by `jetserve up`'s executor.
    tools = await page.js("document.getElementById('run-tools').value")
    assert [t.strip() for t in tools.split(",")] == up_demo.TOOLS
    await page.click("send-sse")  # a chat too, for the screenshot of the whole page
    await page.wait("document.body.dataset.state === 'done'")

    await page.click("run-start")
    await page.wait(
        "document.getElementById('agent').dataset.status === 'awaiting_approval'"
        " && !document.getElementById('run-approval').hidden",
        limit_s=30,
    )
    state = await page.run_state()
    run_id = state["runId"]
    assert run_id.startswith("run_"), state
    assert server_events(state) == [
        ("status", "queued, step 0"),
        ("task", task),
        ("status", "running, step 0"),
        ("tool call", 'payout({"to": "carol", "amount": 30}) · call_1'),
        (
            "approval pending",
            'payout({"to":"carol","amount":30}) · call_1: waits for the approver key',
        ),
    ], state
    assert state["pending"] == 'payout({"to":"carol","amount":30}) · call_1', state
    assert (state["startDisabled"], state["cancelDisabled"]) == (True, False), state
    run = await api_run(fleet, run_id)
    assert run["status"] == "awaiting_approval", run
    assert run["pending_approval"]["call_id"] == "call_1", run

    # The creator's own key may not decide (it lacks the approve scope, and a run's
    # creator may not approve its own calls anyway): the page says why.
    await page.js(f"document.getElementById('approver-key').value = {json.dumps(fleet.api_key)}")
    await page.click("run-approve")
    await page.wait("document.getElementById('run-error').textContent.includes('403')")
    assert "approve_scope_required" in (await page.run_state())["error"]
    assert (await api_run(fleet, run_id))["status"] == "awaiting_approval"

    # The approver's key (approve scope) lets the payout run; the run finishes.
    await page.js(f"document.getElementById('approver-key').value = {json.dumps(approver_key)}")
    await page.click("run-approve")
    await page.wait("document.getElementById('agent').dataset.status === 'completed'", limit_s=30)
    state = await page.run_state()
    run = await api_run(fleet, run_id)
    assert run["status"] == "completed", run
    assert run["result"] == "Paid carol 30.", run
    [decision] = run["approvals"]
    assert (decision["approve"], decision["call_id"]) == (True, "call_1"), decision
    assert decision["key_id"] != fleet.key_id, decision  # the approver's, not the creator's
    [receipt] = [m for m in run["messages"] if m["role"] == "tool"]

    events = server_events(state)
    assert events[5:] == [
        ("tool result", f"call_1: {receipt['content']}"),
        ("status", "running, step 1"),
        ("model answer", "Paid carol 30."),
        ("run completed", "Paid carol 30."),
    ], state
    assert "carol" in receipt["content"], receipt
    seqs = [e["seq"] for e in state["events"] if e["seq"] is not None]
    assert seqs == sorted(seqs), state  # in stream order
    assert ("approved", f"call_1: approved by {decision['key_id']}") in [
        (e["label"], e["text"]) for e in state["events"]
    ], state
    assert (state["error"], state["approvalShown"]) == ("", False), state
    assert state["usage"].startswith("2 model calls, "), state
    assert (state["startDisabled"], state["cancelDisabled"]) == (False, True), state
    assert state["csp"] == [], state

    # No prompt text in the fleet's logs (the engine's own log aside).
    logs = {log.stem: log for log in fleet.workdir.glob("*.log") if not log.stem.startswith("sim")}
    assert any(n.startswith("gateway") for n in logs), sorted(logs)
    assert "agent0" in logs, sorted(logs)
    for name, log in logs.items():
        assert "Pay carol" not in log.read_text(errors="replace"), name

    # The whole page, for the docs: the chat above, the finished run below.
    height = await page.js("document.documentElement.scrollHeight")
    shot = await page.call(
        "Page.captureScreenshot",
        format="png",
        captureBeyondViewport=True,
        clip={"x": 0, "y": 0, "width": WIDTH, "height": height, "scale": 1},
    )
    saved = save_screenshot(base64.b64decode(shot["data"]), tmp_path / "playground-agent.png")
    assert png_size(saved) == (WIDTH, height)


async def test_agent_run_cancelled_from_the_page(
    fleet: Fleet, page: Page, approver_key: str
) -> None:
    # The link `jetserve up` prints: both keys and the model filled in, the demo task.
    await page.open(up_demo.playground_link(fleet, approver_key))
    fields = await page.js(
        "['key', 'model', 'approver-key', 'run-prompt']"
        ".map(id => document.getElementById(id).value)"
    )
    assert fields == [fleet.api_key, MODEL, approver_key, up_demo.TASK]
    await page.click("run-start")
    await page.wait(
        "document.getElementById('agent').dataset.status === 'awaiting_approval'", limit_s=30
    )
    await page.click("run-cancel")
    await page.wait("document.getElementById('agent').dataset.status === 'cancelled'", limit_s=30)
    state = await page.run_state()
    run = await api_run(fleet, state["runId"])
    assert run["status"] == "cancelled", run
    assert run["approvals"] == [], run
    assert server_events(state)[-1][0] == "run cancelled", state
    assert (state["error"], state["approvalShown"]) == ("", False), state
    assert (state["startDisabled"], state["cancelDisabled"]) == (False, True), state
    assert state["csp"] == [], state


async def test_agent_run_two_gated_calls_approve_and_reject(
    fleet: Fleet, page: Page, approver_key: str
) -> None:
    # One model turn asks for two gated payouts: the run parks twice at the same step,
    # and the page shows each approval in turn. The first is approved, the second rejected.
    task = "Pay dave 40 and erin 50."
    calls = [
        {"id": cid, "type": "function", "function": {"name": "payout", "arguments": json.dumps(a)}}
        for cid, a in [
            ("call_1", {"to": "dave", "amount": 40}),
            ("call_2", {"to": "erin", "amount": 50}),
        ]
    ]
    rules = [
        {"match": {"last_role": "user", "contains": task}, "response": {"tool_calls": calls}},
        {
            "match": {"last_role": "tool", "contains": task},
            "response": {"content": "Paid dave 40."},
        },
    ]
    async with httpx.AsyncClient(timeout=5) as c:
        (await c.post(f"{fleet.sim_url}/sim/scripts?append=1", json=rules)).raise_for_status()
    await page.open(playground_url(fleet, task=task, approver=approver_key))
    await page.click("run-start")
    for call_id, button in [("call_1", "run-approve"), ("call_2", "run-reject")]:
        await page.wait(
            "!document.getElementById('run-approval').hidden"
            f" && document.getElementById('run-pending').textContent.endsWith('· {call_id}')",
            limit_s=30,
        )
        await page.click(button)
    await page.wait("document.getElementById('agent').dataset.status === 'completed'", limit_s=30)
    state = await page.run_state()
    run = await api_run(fleet, state["runId"])
    assert run["status"] == "completed", run
    assert [(a["call_id"], a["approve"]) for a in run["approvals"]] == [
        ("call_1", True),
        ("call_2", False),
    ], run
    labels = [label for label, _ in server_events(state)]
    assert labels.count("approval pending") == 2, state
    results = [text for label, text in server_events(state) if label == "tool result"]
    tool_messages = [m for m in run["messages"] if m["role"] == "tool"]
    assert results == [f"{m['tool_call_id']}: {m['content']}" for m in tool_messages], state
    assert results[1].startswith("call_2: "), results
    assert "denied" in results[1], results
    notes = [(e["label"], e["text"].split(":")[0]) for e in state["events"] if e["seq"] is None]
    assert notes == [("approved", "call_1"), ("rejected", "call_2")], state
    assert (state["error"], state["csp"]) == ("", []), state


async def test_agent_run_lost_stream_then_cancel(
    fleet: Fleet, page: Page, approver_key: str
) -> None:
    # The browser gets a 404 for the run's events (CDP's Fetch domain answers in the
    # gateway's place): the page says so and stops watching, Cancel stays on; Cancel
    # then cancels the run, and the page watches again to show it end.
    await page.open(up_demo.playground_link(fleet, approver_key))
    await page.call("Fetch.enable", patterns=[{"urlPattern": "*/events"}])
    await page.click("run-start")
    paused: list[dict[str, Any]] = []

    async def asked() -> bool:
        nonlocal paused
        paused = [e for e in page.events if e["method"] == "Fetch.requestPaused"]
        return bool(paused)

    await until(asked, "the page's request for events", every_s=0.02)
    body = {"error": {"message": "gone", "type": "invalid_request_error", "code": "run_not_found"}}
    await page.call(
        "Fetch.fulfillRequest",
        requestId=paused[0]["params"]["requestId"],
        responseCode=404,
        responseHeaders=[{"name": "Content-Type", "value": "application/json"}],
        body=base64.b64encode(json.dumps(body).encode()).decode(),
    )
    await page.call("Fetch.disable")
    await page.wait("document.getElementById('agent').dataset.status === 'error'")
    state = await page.run_state()
    assert state["error"] == "404 run_not_found: gone", state
    assert (state["startDisabled"], state["cancelDisabled"]) == (False, False), state

    await page.click("run-cancel")
    await page.wait("document.getElementById('agent').dataset.status === 'cancelled'", limit_s=30)
    state = await page.run_state()
    assert (await api_run(fleet, state["runId"]))["status"] == "cancelled"
    assert server_events(state)[-1][0] == "run cancelled", state
    assert (state["error"], state["csp"]) == ("", []), state


def events_requests(page: Page, run_id: str) -> list[dict[str, Any]]:
    """The page's requests for the run's event stream (CDP's Network domain)."""
    return [
        e["params"]["request"]
        for e in page.events
        if e["method"] == "Network.requestWillBeSent"
        and e["params"]["request"]["url"].endswith(f"/v1/runs/{run_id}/events")
    ]


async def test_agent_run_events_resume_after_a_gateway_restart(
    fleet: Fleet, page: Page, approver_key: str
) -> None:
    # Last in the file: it replaces the fleet's gateway. While the run waits for its
    # approval the gateway holding the page's event stream is killed and a new one
    # takes its port; the page reconnects with Last-Event-ID and carries on.
    await page.open(up_demo.playground_link(fleet, approver_key))
    await page.call("Network.enable")
    await page.click("run-start")
    await page.wait(
        "document.getElementById('agent').dataset.status === 'awaiting_approval'", limit_s=30
    )
    before = await page.run_state()
    run_id = before["runId"]
    last_seq = max(e["seq"] for e in before["events"] if e["seq"] is not None)
    assert len(events_requests(page, run_id)) == 1

    old = fleet.gateways[0]
    await asyncio.to_thread(old.kill)
    await asyncio.to_thread(fleet.start_gateway)  # the same port (SO_REUSEPORT), ready
    # The page's first retry waits 0.5 s.
    await until_sync(lambda: len(events_requests(page, run_id)) >= 2, "the page to reconnect")

    await page.click("run-approve")
    await page.wait("document.getElementById('agent').dataset.status === 'completed'", limit_s=30)
    state = await page.run_state()
    assert (await api_run(fleet, run_id))["status"] == "completed"
    resumed = events_requests(page, run_id)[1:]
    # Every reconnection resumes after the last event the page had.
    assert {r["headers"].get("Last-Event-ID") for r in resumed} == {str(last_seq)}, resumed
    # Every event once, in order, none lost: the run's whole stream, read afresh.
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.get(
            f"{fleet.base_url}/v1/runs/{run_id}/events",
            headers={"Authorization": f"Bearer {fleet.api_key}"},
        )
    ids = [int(line[4:]) for line in r.text.splitlines() if line.startswith("id: ")]
    assert [e["seq"] for e in state["events"] if e["seq"] is not None] == ids, state
    assert [label for label, _ in server_events(state)] == [
        "status",
        "task",
        "status",
        "tool call",
        "approval pending",
        "tool result",
        "status",
        "model answer",
        "run completed",
    ], state
    assert (state["error"], state["csp"]) == ("", []), state

"""The ``soak`` scenario: minutes of ordinary mixed load on one fleet, no faults.

Poisson arrivals (``--rate``, 40 req/s by default for this scenario) on 2 workers
and a simulator with 64 sequences; 60% streaming, the rest whole responses; half
the requests share one of 16 system prompts (the prefix lanes), the rest go to
the class subject; 5% are hung up by their client at a random moment. It
answers two questions:

- **does anything fail?** Every accepted request must complete, apart from the
  ones its client abandoned on purpose: ``failed`` and ``lost`` must be 0, and so
  must the requests past ``max_deliver`` and the dead-letter queue.
- **does memory stay flat?** The RSS of the gateway, of each worker and of
  nats-server, sampled every few seconds: the median of the first minute
  against that of the last.

It also reports the frames capture (``JETSERVE_FRAMES``, workers/inference/
relay.py): its bytes and messages per request at the end of the run, and the
resume window they give at the run's rate and at 10x and 100x it (the capture
keeps 10 minutes within 512 MB a partition stream: the window is the shorter of
the two).
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import msgspec

from jetserve.bench.arrivals import gap
from jetserve.bench.fleet.client import Shot, chat, summarize, system_prompt
from jetserve.bench.openloop import open_loop
from jetserve.fleet import Fleet, FleetSpec
from streams.definitions import DEFAULT_TOPOLOGY

STREAM_SHARE = 0.6
CANCEL_SHARE = 0.05
PREFIX_SHARE = 0.5
GROUPS = 16
SAMPLE_EVERY_S = 5.0
PATIENCE_S = 150.0  # past the default 120 s deadline: a request without an end is lost


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


class SoakClient:
    """One request per arrival; what each client saw."""

    def __init__(self, fleet: Fleet, seed: int) -> None:
        self.fleet = fleet
        self.rng = random.Random(seed)
        self.prompts = [system_prompt(g, 200) for g in range(GROUPS)]
        self.clients = [
            httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=10))
            for _ in range(40)
        ]
        self._turn = 0

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()

    def request(self, i: int) -> tuple[dict[str, Any], bool, float | None]:
        """(body, streaming, hang up after this many seconds or None)."""
        rng = self.rng
        system = self.prompts[rng.randrange(GROUPS)] if rng.random() < PREFIX_SHARE else None
        body = chat(system, f"Request {i}: summarise the account's open tickets.", 0)
        body["max_tokens"] = rng.randint(16, 64)
        streaming = rng.random() < STREAM_SHARE
        cancel = rng.uniform(0.05, 0.5) if rng.random() < CANCEL_SHARE else None
        return body, streaming, cancel

    async def one(self, i: int, t0: float) -> Shot:
        body, streaming, cancel = self.request(i)
        client = self.clients[self._turn % len(self.clients)]
        self._turn += 1
        shot = Shot(cls="interactive", sent=time.monotonic() - t0)
        sent = time.monotonic()
        headers = {"Authorization": f"Bearer {self.fleet.api_key}"}
        try:
            async with asyncio.timeout(cancel if cancel is not None else PATIENCE_S):
                if streaming:
                    await self._stream(client, body, headers, shot, sent)
                else:
                    await self._whole(client, body, headers, shot, sent)
        except TimeoutError:
            if cancel is not None:
                shot.outcome, shot.error = "cancelled", ""
            else:
                shot.outcome = "lost" if shot.request_id else "error"
                shot.error = "hung"
        except httpx.HTTPError as exc:
            shot.outcome = "failed" if shot.request_id else "error"
            shot.error = type(exc).__name__
        return shot

    async def _whole(
        self, c: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str], shot: Shot,
        sent: float,
    ) -> None:  # fmt: skip
        r = await c.post(f"{self.fleet.base_url}/v1/chat/completions", json=body, headers=headers)
        shot.status, shot.request_id = r.status_code, r.headers.get("x-request-id")
        if r.status_code != 200:
            shot.error = str(msgspec.json.decode(r.content).get("error", {}).get("code"))
            shot.outcome = "rejected" if shot.request_id is None else "failed"
            return
        shot.outcome, shot.e2e = "ok", time.monotonic() - sent

    async def _stream(
        self, c: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str], shot: Shot,
        sent: float,
    ) -> None:  # fmt: skip
        url = f"{self.fleet.base_url}/v1/chat/completions"
        async with c.stream("POST", url, json={**body, "stream": True}, headers=headers) as r:
            shot.status, shot.request_id = r.status_code, r.headers.get("x-request-id")
            if r.status_code != 200:
                shot.error = str(msgspec.json.decode(await r.aread()).get("error", {}).get("code"))
                shot.outcome = "rejected" if shot.request_id is None else "failed"
                return
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    shot.outcome, shot.e2e = "ok", time.monotonic() - sent
                    return
                if line.startswith("data: ") and '"error"' in line:
                    shot.outcome = "failed"
                    shot.error = str(msgspec.json.decode(line[6:])["error"].get("code"))
                    return
                if shot.ttft is None and '"content"' in line:
                    shot.ttft = time.monotonic() - sent
            shot.outcome, shot.error = "failed", "stream ended without [DONE]"


def _sampler(fleet: Fleet, t0: float, samples: list[dict[str, Any]]) -> asyncio.Task[None]:
    procs = {f"gateway{i}": g.proc.pid for i, g in enumerate(fleet.gateways)}
    procs |= {f"worker{i}": w.proc.pid for i, w in enumerate(fleet.workers)}
    if fleet.nats is not None:
        procs["nats-server"] = fleet.nats.proc.pid

    async def sample() -> None:
        while True:
            row: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 1)}
            row |= {name: rss_mb(pid) for name, pid in procs.items()}
            samples.append(row)
            await asyncio.sleep(SAMPLE_EVERY_S)

    return asyncio.create_task(sample())


def _flatness(samples: list[dict[str, Any]], duration: float) -> dict[str, Any]:
    """Median RSS of the first and of the last minute (shorter runs: a quarter)."""
    window = min(60.0, duration / 4)
    out: dict[str, Any] = {"window_s": window}
    names = [k for k in samples[0] if k != "t_s"] if samples else []
    for name in names:
        first = [s[name] for s in samples if s["t_s"] <= window and s[name]]
        last = [s[name] for s in samples if s["t_s"] >= duration - window and s[name]]
        if first and last:
            a, b = statistics.median(first), statistics.median(last)
            out[name] = {
                "first_mb": round(a, 1),
                "last_mb": round(b, 1),
                "change_pct": round(100 * (b - a) / a, 1),
            }
    return out


def resume_window(
    captured_bytes: int, captured_messages: int, requests: int, rate: float, partitions: int = 1
) -> dict[str, Any]:
    """The frames capture per request, and the window it gives at a rate: the
    capture keeps ``max_age`` unless ``max_bytes`` (per partition stream) fills
    first (oldest out)."""
    limits = DEFAULT_TOPOLOGY.frames
    per = captured_bytes / max(requests, 1)

    def window(rps: float) -> float:
        return round(limits.window_s(per, rps, partitions), 1)

    return {
        "requests": requests,
        "bytes_per_request": round(per),
        "messages_per_request": round(captured_messages / max(requests, 1), 2),
        "max_bytes": limits.max_bytes,
        "partitions": partitions,
        "max_age_s": limits.max_age_s,
        "window_s": {f"{m * rate:g} req/s": window(m * rate) for m in (1, 10, 100)},
        # The rate at which the bytes bound, not the age, starts to decide.
        "full_age_up_to_rps": round(
            limits.max_bytes * partitions / max(per * limits.max_age_s, 1e-9), 1
        ),
    }


def _metric(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        out[m.group(1) or ""] = out.get(m.group(1) or "", 0.0) + float(m.group(2))
    return out


async def _bus_counts(fleet: Fleet) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as c:
        gw = (await c.get(fleet.gateway_metrics_urls[0])).text
        workers = [
            (await c.get(f"http://127.0.0.1:{p}/metrics")).text for p in fleet.worker_metrics_ports
        ]
    nc = await fleet.connect()
    try:
        js = nc.jetstream()
        info = await js.stream_info("JETSERVE_DLQ")
        dead = info.state.messages
        # Every capture stream, as many as the fleet records (docs/scale.md).
        req = await js.stream_info(DEFAULT_TOPOLOGY.stream)
        topo = DEFAULT_TOPOLOGY.with_stream_lanes(req.config.metadata)
        frames = [(await js.stream_info(name)).state for name in topo.frames_streams]
    finally:
        await nc.close()
    lane: Counter[str] = Counter()
    unconfirmed = 0.0
    for text in workers:
        for labels, v in _metric(text, "jetserve_worker_lane_events_total").items():
            lane[labels.split('"')[1]] += int(v)
        unconfirmed += sum(_metric(text, "jetserve_worker_acks_unconfirmed_total").values())
    rejected = _metric(gw, "jetserve_gateway_rejected_total")
    return {
        "max_deliveries_exceeded": int(rejected.get('{reason="max_deliveries_exceeded"}', 0)),
        "dead_letters": dead,
        "capture_partitions": len(frames),
        "capture_bytes": sum(s.bytes for s in frames),
        "capture_messages": sum(s.messages for s in frames),
        "acks_unconfirmed": int(unconfirmed),
        "lane_events": dict(lane),
    }


async def soak(rate: float, duration: float, seed: int) -> dict[str, Any]:
    spec = FleetSpec(workers=2, profile="h100-8b", sim_args=["--max-num-seqs", "64"])
    fleet = await asyncio.to_thread(lambda: Fleet(spec).start())
    samples: list[dict[str, Any]] = []
    client = SoakClient(fleet, seed)
    try:
        await asyncio.sleep(1.5)  # lane priorities settle after the last worker joined
        t0 = time.monotonic()
        sampler = _sampler(fleet, t0, samples)

        def arrivals() -> Iterator[float]:
            at = 0.0
            while at < duration:
                yield at
                at += gap(client.rng, rate, 1.0)

        shots = await open_loop(
            arrivals(), lambda i: client.one(i, t0), t0=t0, clock=time.monotonic
        )
        sampler.cancel()
        counts = await _bus_counts(fleet)
    finally:
        await client.aclose()
        await asyncio.to_thread(fleet.stop)
    for s in shots:
        if s.outcome == "error":  # no answer at all: a failure too
            s.outcome = "failed"
    done = [s for s in shots if s.outcome != "cancelled"]
    capture = resume_window(
        counts.pop("capture_bytes"),
        counts.pop("capture_messages"),
        len(shots),
        rate,
        counts.pop("capture_partitions"),
    )
    row = summarize("soak", done, duration, cancelled=len(shots) - len(done), **counts)
    return {
        "scenario": "soak",
        "setup": {
            "workers": 2,
            "profile": "h100-8b",
            "max_num_seqs": 64,
            "rate_rps": rate,
            "duration_s": duration,
            "streaming_share": STREAM_SHARE,
            "cancel_share": CANCEL_SHARE,
            "prefix_share": PREFIX_SHARE,
            "faults": "none",
        },
        "rss": _flatness(samples, duration),
        "capture": capture,
        "rss_samples": samples,
        "rows": [asdict(row)],
    }

"""What one request costs the bus and Redis, counted on a real fleet: the
per-request figures docs/scale.md multiplies out to 1k, 10k and 100k req/s.

    .venv/bin/python bench/scale_counts.py --out bench/results/scale/fast   # fast simulator
    .venv/bin/python bench/scale_counts.py --model-only --out DIR   # re-multiply counts.json

To count a commit while the working tree has other people's edits, run it from an
export: ``git archive HEAD | tar -x -C /tmp/x``, then in /tmp/x
``PYTHONPATH=. python bench/scale_counts.py --rev $(git rev-parse HEAD) ...``.

It starts a fleet (``jetserve.fleet.Fleet``) whose nats-server also serves its
monitoring port, and for each request kind (below) sends N requests with C in
flight in three setups: ``shared`` (no route contract: the class subjects and
lanes), ``routed`` (a route for the chat model: its deployment pool, coalescing
on) and ``hedged`` (the chat kind only, the route hedging after p95). Around
each phase it reads:

- a tap: an admin connection subscribed to ``>``, which sees every message
  published in the account, ``$JS.API.*`` requests, ``$JS.ACK.*`` acks, ``$KV.*``
  puts and everything the server delivers to ``_INBOX.*`` (pull deliveries, KV
  watch deliveries, PubAcks, API answers, heartbeats); each is put in a family
  (:func:`family`) and counted with its size (payload + headers);
- nats-server's ``/varz`` (in/out messages and bytes), ``/jsz`` (messages stored
  per stream, API calls) and ``/connz`` (messages per connection: per role);
- Redis ``INFO commandstats`` and a ``MONITOR`` session, whose lines are put in
  families by command and key (Lua scripts named by their SHA-1);
- the gateways' hedge and coalescing counters.

An idle window before the phases gives the background rates (membership, the
queue watch, idle pulls), and a second idle window with more workers and a second
gateway checks how membership grows. A second pass with no tap and no MONITOR
(they cost the server CPU) reads each process's CPU per request from /proc.

Everything goes to ``<out>/counts.json`` (per request, per second, raw deltas),
``<out>/model.json`` (the mix multiplied out to 1k, 10k and 100k req/s, and the
per-process clock costs) and ``<out>/summary.md``. The arithmetic (families,
per-request figures, the multiplication in docs/scale.md) is in plain functions
that tests/unit checks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

OUT = Path("bench/results/scale")

# -- request kinds ------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """One kind of request of the mix."""

    name: str
    op: str  # chat | embed
    cls: str  # the X-Jetserve-Class header (embeddings always go to embed)
    stream: bool
    prompt_tokens: int
    max_tokens: int = 0
    temperature: float = 0.7
    idempotency_key: bool = False
    share: float = 0.0  # of the stated mix (docs/scale.md); 0: a variant, not in the mix


KINDS: tuple[Kind, ...] = (
    # 80%: interactive chat, streamed, sampled (T=0.7: never coalesced).
    Kind("chat", "chat", "interactive", True, 500, 250, 0.7, share=0.80),
    # 15%: batch, whole responses, greedy (T=0: may coalesce where the route allows).
    Kind("batch", "chat", "batch", False, 1000, 250, 0.0, share=0.15),
    # 5%: embeddings of one 256-token input.
    Kind("embed", "embed", "embed", False, 256, share=0.05),
    # Variants, for the slopes: a short answer (per-token frames), an Idempotency-Key.
    Kind("chat_short", "chat", "interactive", True, 500, 32, 0.7),
    Kind("chat_idem", "chat", "interactive", True, 500, 250, 0.7, idempotency_key=True),
)

_TEXT = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money"
)
_WORDS = _TEXT.split(" ")


def prompt(tokens: int, salt: str, n: int) -> str:
    """``tokens`` words (a token each in the simulator), unique from the second word."""
    words = [salt, f"r{n}"] + [_WORDS[(n * 7 + i) % len(_WORDS)] for i in range(tokens - 2)]
    return " ".join(words[:tokens])


def request(
    kind: Kind, salt: str, n: int, model: str, embed_model: str
) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(path, body, headers) of request ``n`` of ``kind``."""
    text = prompt(kind.prompt_tokens, salt, n)
    headers = {"X-Jetserve-Class": kind.cls}
    if kind.idempotency_key:
        headers["Idempotency-Key"] = f"{salt}-{kind.name}-{n}"
    if kind.op == "embed":
        return "/v1/embeddings", {"model": embed_model, "input": text}, headers
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": kind.max_tokens,
        "temperature": kind.temperature,
        "ignore_eos": True,
        "stream": kind.stream,
    }
    if kind.stream:
        body["stream_options"] = {"include_usage": True}
    return "/v1/chat/completions", body, headers


# -- families ---------------------------------------------------------------

STREAMS = {  # stream name -> the family word used for it
    "JETSERVE_REQ": "workqueue",
    "JETSERVE_FRAMES": "frames",
    "JETSERVE_LEDGER": "ledger",
    "JETSERVE_OUTBOX": "outbox",
    "JETSERVE_DLQ": "dlq",
    "KV_jetserve_workers": "membership",
    "KV_jetserve_cancels": "cancel-marks",
    "KV_jetserve_failures": "failure-counts",
    "KV_jetserve_routes": "routes",
    "KV_jetserve_leases": "leases",
    "KV_jetserve_evidence": "evidence",
}

# Families whose rate follows the processes and the clock more than the requests:
# the membership heartbeat and its watches, the gateways' queue watch (a consumer
# list every 0.5 s while busy), the workers' pending peeks and standing lane pulls
# (each renewed about every poll_s, 1 s, and answered 408 when it expires empty).
PERIODIC_PREFIXES = (
    "kv-put membership",
    "deliver membership",
    "puback membership",
    "kv-put leases",  # the rollout guard's lease, renewed every tick
    "puback leases",
    "api CONSUMER.LIST",
    "api-reply consumer_list_response",
    "api STREAM.INFO",
    "api-reply stream_info_response",
    "api CONSUMER.INFO",
    "api-reply consumer_info_response",
    "pull ",
    "status ",
)


def periodic(fam: str) -> bool:
    return fam.startswith(PERIODIC_PREFIXES)


def stream_word(stream: str) -> str:
    return STREAMS.get(stream, stream)


def _ack_kind(payload: bytes) -> str:
    head = payload[:5]
    if head in (b"", b"+ACK"):
        return "ack"
    if head.startswith(b"+WPI"):
        return "in-progress"
    if head.startswith(b"-NAK"):
        return "nak"
    if head.startswith(b"+TERM"):
        return "term"
    if head.startswith(b"+NXT"):
        return "ack-next"
    return "ack-other"


_API_TYPE = re.compile(rb'"type":"io\.nats\.jetstream\.api\.v1\.([a-z_]+)"')
_PUBACK = re.compile(rb'^\{"stream":"([^"]+)"')
_FRAME_TYPE = re.compile(rb'^\{"type":"(\w+)"')


def family(subject: str, reply: str, payload: bytes, status: str = "", stream_hdr: str = "") -> str:
    """The family of one message seen on the bus.

    A JetStream delivery (pull or push) travels with its stream subject and an
    ack reply (``$JS.ACK.<stream>.<consumer>...``): it is a ``deliver``, not a
    second publish. ``status``: nats-py's ``Status`` header (100 idle heartbeat
    or flow control, 404/408 a pull that brought nothing); ``stream_hdr``: the
    ``Nats-Stream`` header (a direct get's answer)."""
    if reply.startswith("$JS.ACK."):
        r = reply.split(".")
        stream, consumer = stream_word(r[2]), r[3] if len(r) > 3 else ""
        if stream == "workqueue":
            return "deliver workqueue" + (" (pool)" if consumer.startswith("pool-") else "")
        return f"deliver {stream}"
    p = subject.split(".")
    if p[0] == "_INBOX":
        role = p[1] if len(p) > 2 else "?"
        if reply.startswith("$JS.FC."):
            return f"flow-control {stream_word(reply.split('.')[2])} -> {role}"
        if status:
            return f"status {status} -> {role}"
        if stream_hdr:
            return f"direct-get {stream_word(stream_hdr)} -> {role}"
        if (m := _PUBACK.match(payload)) is not None:
            return f"puback {stream_word(m.group(1).decode())} -> {role}"
        if (m := _API_TYPE.search(payload[:120])) is not None:
            return f"api-reply {m.group(1).decode()} -> {role}"
        if not payload:
            return f"ack-confirm -> {role}"  # the server's answer to an acknowledged ack
        return f"inbox -> {role}"
    if p[0] == "$JS" and len(p) > 2:
        if p[1] == "ACK":
            return f"{_ack_kind(payload)} {stream_word(p[2])}"
        if p[1] == "FC":
            return f"flow-control-reply {stream_word(p[2])}"
        if p[1] == "API":
            ops = p[2:4] if p[2] in ("CONSUMER", "STREAM") and len(p) > 3 else p[2:3]
            if ops[-1] in ("MSG", "DURABLE") and len(p) > 4:
                ops = p[2:5]
            op = ".".join(ops)
            tail = p[2 + len(ops) :]
            stream = f" {stream_word(tail[0])}" if tail else ""
            if op == "CONSUMER.MSG.NEXT":
                return f"pull{stream}"
            return f"api {op}{stream}"
        if p[1] == "EVENT":
            return "advisory"  # sent because the tap listens: not in the model
        return "$JS other"
    if p[0] == "$KV" and len(p) > 1:
        return f"kv-put {stream_word('KV_' + p[1])}"
    if p[0] == "jetserve" and len(p) > 1:
        space = p[1]
        if space == "req":
            if len(p) == 3:
                return "publish req (class subject)"
            return "publish req (excess)" if p[3] == "excess" else "publish req (lane)"
        if space == "pool":
            return "publish pool (lane)" if len(p) > 4 else "publish pool (class subject)"
        if space == "reply":
            m = _FRAME_TYPE.match(payload)
            return f"frame {m.group(1).decode() if m else '?'}"
        return f"publish {space}"
    return f"other {p[0]}"


def header_bytes(headers: dict[str, str] | None) -> int:
    """The size of a NATS header block with these headers (re-serialised)."""
    if not headers:
        return 0
    return len("NATS/1.0\r\n") + sum(len(k) + len(v) + 4 for k, v in headers.items()) + 2


def wire_size(subject: str, reply: str, size: int) -> int:
    """A delivered message's bytes on a connection: ``HMSG subject sid reply
    hdr_len total_len\\r\\n`` + headers + payload + ``\\r\\n`` (sid and lengths
    taken as 12 bytes)."""
    return len("HMSG ") + len(subject) + 1 + len(reply) + 12 + 2 + size + 2


@dataclass
class Tally:
    """Messages and bytes (payload + headers) per family."""

    msgs: Counter[str] = field(default_factory=Counter)
    nbytes: Counter[str] = field(default_factory=Counter)
    wire: Counter[str] = field(default_factory=Counter)  # with subject, reply and framing

    def add(self, fam: str, size: int, wire: int = 0) -> None:
        self.msgs[fam] += 1
        self.nbytes[fam] += size
        self.wire[fam] += wire or size

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return {k: (self.msgs[k], self.nbytes[k]) for k in self.msgs}


def delta(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> dict[str, tuple[int, int]]:
    out = {}
    for k, (m, b) in after.items():
        m0, b0 = before.get(k, (0, 0))
        if m - m0:
            out[k] = (m - m0, b - b0)
    return out


def per_request(
    counts: dict[str, tuple[int, int]],
    n: int,
    seconds: float,
    background: dict[str, tuple[float, float]],
) -> dict[str, dict[str, float]]:
    """Per request: (the phase's count - the background rate x its seconds) / n,
    floored at 0; the raw figure too. ``background``: family -> (msgs/s, bytes/s)
    of an idle window."""
    out: dict[str, dict[str, float]] = {}
    for fam, (m, b) in sorted(counts.items()):
        bm, bb = background.get(fam, (0.0, 0.0))
        out[fam] = {
            "msgs": round(max(m - bm * seconds, 0.0) / n, 3),
            "bytes": round(max(b - bb * seconds, 0.0) / n, 1),
            "raw_msgs": round(m / n, 3),
            "raw_bytes": round(b / n, 1),
        }
    return out


def rates(counts: dict[str, tuple[int, int]], seconds: float) -> dict[str, tuple[float, float]]:
    return {k: (m / seconds, b / seconds) for k, (m, b) in counts.items()}


def group(
    per_req: dict[str, dict[str, float]], key: Callable[[str], str]
) -> dict[str, dict[str, float]]:
    """Families summed under ``key(family)``."""
    out: dict[str, dict[str, float]] = {}
    for fam, row in per_req.items():
        g = out.setdefault(key(fam), {"msgs": 0.0, "bytes": 0.0})
        g["msgs"] = round(g["msgs"] + row["msgs"], 3)
        g["bytes"] = round(g["bytes"] + row["bytes"], 1)
    return out


def subject_family(fam: str) -> str:
    """The subject family of docs/scale.md's table: a family with its recipient dropped."""
    return fam.split(" -> ")[0]


# The rows of docs/scale.md's per-request table: subject families, summed.
DOC_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("work queue: publish (jetserve.req.*, jetserve.pool.*)", ("publish req", "publish pool")),
    ("work queue: delivery to a worker", ("deliver workqueue",)),
    ("work queue: PubAck to the gateway", ("puback workqueue",)),
    ("work queue: ack + its confirmation", ("ack workqueue", "ack-confirm")),
    (
        "work queue: in-progress, nak, term",
        ("in-progress workqueue", "nak workqueue", "term workqueue", "ack-next", "ack-other"),
    ),
    (
        "work queue: pulls and their expiries (408/404/409)",
        ("pull workqueue", "status 408", "status 404", "status 409"),
    ),
    (
        "reply frames: token, meta, final (jetserve.reply.*)",
        ("frame token", "frame meta", "frame final", "frame error"),
    ),
    ("reply frames: heartbeats", ("frame heartbeat",)),
    ("ledger: publish + PubAck", ("publish ledger", "puback ledger")),
    (
        "outbox: publish + PubAck + delete + answer",
        (
            "publish outbox",
            "puback outbox",
            "api STREAM.MSG.DELETE outbox",
            "api-reply stream_msg_delete_response",
        ),
    ),
    (
        "cancels: publish + KV mark + PubAck",
        ("publish cancel", "kv-put cancel-marks", "puback cancel-marks"),
    ),
    (
        "membership: KV put + PubAck + watch deliveries",
        ("kv-put membership", "puback membership", "deliver membership"),
    ),
    (
        "JS API: consumer list (the gateways' queue watch)",
        ("api CONSUMER.LIST", "api-reply consumer_list_response"),
    ),
    (
        "JS API: consumer/stream info, message deletes, other",
        (
            "api ",
            "api-reply",
            "direct-get",
            "status 100",
            "flow-control",
            "pull ",
            "deliver ",
            "puback ",
            "kv-put ",
            "inbox",
            "publish ",
        ),
    ),
)


def doc_group(fam: str) -> str | None:
    """The docs/scale.md row of a family; None for what the model leaves out
    (the advisories nats-server sends only because the tap listens)."""
    f = subject_family(fam)
    if f == "advisory":
        return None
    for name, prefixes in DOC_GROUPS:
        if f.startswith(prefixes):
            return name
    return "other"


def mix_per_request(
    per_kind: dict[str, dict[str, dict[str, float]]], shares: dict[str, float]
) -> dict[str, dict[str, float]]:
    """The mix's figure per request: each kind's figures weighted by its share."""
    out: dict[str, dict[str, float]] = {}
    for kind, share in shares.items():
        for fam, row in per_kind[kind].items():
            acc = out.setdefault(fam, {})
            for key, value in row.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    acc[key] = acc.get(key, 0.0) + share * value
    return {f: {k: round(v, 3) for k, v in row.items()} for f, row in out.items()}


def at_rate(per_req: float, rate: float) -> float:
    """What ``per_req`` per request is at ``rate`` requests per second."""
    return per_req * rate


def membership_rates(workers: int, gateways: int, every_s: float = 1.0) -> tuple[float, float]:
    """(KV puts/s, watch deliveries/s) of the membership bucket: each worker puts
    its key every ``every_s``; every worker and gateway watches every put."""
    puts = workers / every_s
    return puts, puts * (workers + gateways)


# -- Redis ------------------------------------------------------------------


def script_names() -> dict[str, str]:
    """SHA-1 -> name of every Lua script jetserve registers (what EVALSHA names)."""
    from gateway.inference import coalesce_fleet, hedge_budget
    from gateway.tenancy import accounting_lua

    scripts = {
        "reserve": accounting_lua.RESERVE_LUA,
        "reconcile": accounting_lua.RECONCILE_LUA,
        "hedge-add": hedge_budget._ADD,
        "hedge-take": hedge_budget._TAKE,
    }
    for name in ("_CLAIM", "_LEAVE", "_END", "_PAY"):
        scripts[f"coalesce-{name[1:].lower()}"] = getattr(coalesce_fleet, name)
    return {hashlib.sha1(s.encode()).hexdigest(): n for n, s in scripts.items()}


def key_family(key: str) -> str:
    """``jetserve:idem:abc`` -> ``jetserve:idem``; other keys: their first two parts."""
    parts = key.split(":")
    return ":".join(parts[:2]) if len(parts) > 1 else key


def redis_family(args: list[str], client_type: str, shas: dict[str, str]) -> str:
    """One MONITOR line's family: the command and its first key's family; a
    script's own calls are marked ``lua``."""
    if not args:
        return "?"
    cmd = args[0].upper()
    if cmd in ("EVALSHA", "EVAL"):
        name = shas.get(args[1], args[1][:8]) if len(args) > 1 else "?"
        key = key_family(args[3]) if len(args) > 3 and args[2] != "0" else ""
        return f"EVALSHA {name} {key}".strip()
    key = (
        key_family(args[1])
        if len(args) > 1 and cmd not in ("PING", "INFO", "MULTI", "EXEC")
        else ""
    )
    return f"{'lua ' if client_type == 'lua' else ''}{cmd} {key}".strip()


def commandstats(info: dict[str, Any]) -> dict[str, int]:
    """``INFO commandstats`` -> command -> calls."""
    out = {}
    for k, v in info.items():
        if k.startswith("cmdstat_") and isinstance(v, dict):
            out[k.removeprefix("cmdstat_")] = int(v.get("calls", 0))
    return out


# -- the fleet --------------------------------------------------------------


def start_fleet(spec: Any, monitor_port: int) -> Any:
    """A Fleet whose nats-server also serves its monitoring port (``-m``):
    jetserve.fleet starts nats-server through ``start_nats``, whose ``cluster``
    argument takes extra flags; this wraps it for the one call."""
    import jetserve.fleet as fleet_mod

    real = fleet_mod.__dict__["start_nats"]

    def with_monitor(*a: Any, **kw: Any) -> Any:
        kw["cluster"] = [*(kw.get("cluster") or []), "-m", str(monitor_port)]
        return real(*a, **kw)

    fleet_mod.__dict__["start_nats"] = with_monitor
    try:
        return fleet_mod.Fleet(spec).start()
    finally:
        fleet_mod.__dict__["start_nats"] = real


class Observer:
    """The tap, the monitoring endpoints and Redis, read around a phase."""

    def __init__(self, fleet: Any, monitor_port: int, tap: bool) -> None:
        self.fleet = fleet
        self.mon = f"http://127.0.0.1:{monitor_port}"
        self.want_tap = tap
        self.tally = Tally()
        self.redis_tally: Counter[str] = Counter()
        self.shas = script_names()
        self._tasks: list[asyncio.Task[None]] = []
        self.nc: Any = None
        self.rds: Any = None
        self.dropped = 0

    async def start(self) -> None:
        import redis.asyncio as aioredis

        from streams.auth import Role

        self.rds = aioredis.from_url(self.fleet.redis_url, decode_responses=True)
        if not self.want_tap:
            return
        self.nc = await self.fleet.connect(Role.ADMIN, name="scale-tap")

        async def count(msg: Any) -> None:
            hdrs = msg.headers or {}
            fam = family(
                msg.subject,
                msg.reply or "",
                msg.data,
                hdrs.get("Status", ""),
                hdrs.get("Nats-Stream", ""),
            )
            size = len(msg.data) + header_bytes(msg.headers)
            self.tally.add(fam, size, wire_size(msg.subject, msg.reply or "", size))

        big = 1 << 30
        await self.nc.subscribe(">", cb=count, pending_msgs_limit=big, pending_bytes_limit=big)
        await self.nc.flush()
        self._tasks.append(asyncio.create_task(self._monitor()))

    async def _monitor(self) -> None:
        import redis.asyncio as aioredis

        # No read timeout: an idle fleet sends Redis nothing for many seconds.
        rds = aioredis.from_url(self.fleet.redis_url, decode_responses=True, socket_timeout=None)
        async with rds.monitor() as m:
            while True:
                info = await m.next_command()
                args = info["command"].split(" ")
                self.redis_tally[redis_family(args, info["client_type"], self.shas)] += 1

    async def http(self, path: str) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.get(self.mon + path)
            r.raise_for_status()
            data: dict[str, Any] = r.json()
            return data

    async def gateway_counters(self) -> dict[str, float]:
        out: dict[str, float] = {}
        async with httpx.AsyncClient(timeout=5) as c:
            for url in self.fleet.gateway_metrics_urls:
                text = (await c.get(url)).text
                for m in re.finditer(
                    r"^jetserve_gateway_(hedges_total|coalesced_total)(\{[^}]*\})? (\S+)$",
                    text,
                    re.M,
                ):
                    outcome = re.search(r'outcome="([^"]*)"', m.group(2) or "")
                    name = m.group(1) + (f":{outcome.group(1)}" if outcome else "")
                    out[name] = out.get(name, 0.0) + float(m.group(3))
        return out

    async def snapshot(self) -> dict[str, Any]:
        await asyncio.sleep(0)
        self.check()
        if self.nc is not None:
            await self.nc.flush()
        varz = await self.http("/varz")
        jsz = await self.http("/jsz?accounts=true&streams=true")
        connz = await self.http("/connz?limit=1024")
        streams = {}
        for acc in jsz.get("account_details") or []:
            for s in acc.get("stream_detail") or []:
                st = s.get("state", {})
                streams[s["name"]] = {
                    "last_seq": st.get("last_seq", 0),
                    "bytes": st.get("bytes", 0),
                    "messages": st.get("messages", 0),
                    "consumers": st.get("consumer_count", 0),
                }
        conns: dict[str, list[int]] = {}
        for c in connz.get("connections") or []:
            role = role_of(c.get("name", ""))
            row = conns.setdefault(role, [0, 0, 0, 0, 0])
            row[0] += c.get("in_msgs", 0)
            row[1] += c.get("out_msgs", 0)
            row[2] += c.get("in_bytes", 0)
            row[3] += c.get("out_bytes", 0)
            row[4] += 1
        info = await self.rds.info("commandstats")
        return {
            "t": time.monotonic(),
            "tally": self.tally.snapshot(),
            "wire": dict(self.tally.wire),
            "redis_monitor": dict(self.redis_tally),
            "redis_calls": commandstats(info),
            "varz": {
                k: varz.get(k, 0)
                for k in (
                    "in_msgs",
                    "out_msgs",
                    "in_bytes",
                    "out_bytes",
                    "slow_consumers",
                    "mem",
                )
            },
            "js_api": (jsz.get("api") or {}).get("total", 0),
            "js_memory": jsz.get("memory", 0),
            "streams": streams,
            "conns": conns,
            "gateway": await self.gateway_counters(),
        }

    def check(self) -> None:
        """A dead MONITOR would count nothing from then on: fail the run."""
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise RuntimeError(f"redis MONITOR stopped: {t.exception()!r}")

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.nc is not None:
            await self.nc.close()
        if self.rds is not None:
            await self.rds.aclose()


def role_of(name: str) -> str:
    """A connection's role, by the name jetserve's processes give it."""
    if name.startswith("gateway-"):
        return "gateway"
    if name.startswith("worker"):
        return "worker"
    if name.startswith("agent"):
        return "agent"
    return name or "unnamed"


def diff_snap(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """What happened between two snapshots."""
    streams = {}
    for name, s in b["streams"].items():
        s0 = a["streams"].get(name, {"last_seq": 0, "bytes": 0})
        streams[name] = {
            "stored_msgs": s["last_seq"] - s0["last_seq"],
            "bytes_now_minus_before": s["bytes"] - s0["bytes"],
            "consumers": s["consumers"],
        }
    conns = {}
    for role, row in b["conns"].items():
        r0 = a["conns"].get(role, [0, 0, 0, 0, 0])
        conns[role] = {
            "in_msgs": row[0] - r0[0],
            "out_msgs": row[1] - r0[1],
            "in_bytes": row[2] - r0[2],
            "out_bytes": row[3] - r0[3],
            "connections": row[4],
        }
    calls = b["redis_calls"]
    mon = b["redis_monitor"]
    return {
        "seconds": b["t"] - a["t"],
        "tally": delta(a["tally"], b["tally"]),
        "wire": {
            k: v - a["wire"].get(k, 0) for k, v in b["wire"].items() if v - a["wire"].get(k, 0)
        },
        "redis_monitor": {
            k: v - a["redis_monitor"].get(k, 0)
            for k, v in mon.items()
            if v - a["redis_monitor"].get(k, 0)
        },
        "redis_calls": {
            k: v - a["redis_calls"].get(k, 0)
            for k, v in calls.items()
            if v - a["redis_calls"].get(k, 0)
        },
        "varz": {k: b["varz"][k] - a["varz"][k] for k in b["varz"] if k != "mem"}
        | {"mem_after": b["varz"]["mem"]},
        "js_api": b["js_api"] - a["js_api"],
        "js_memory_delta": b["js_memory"] - a["js_memory"],
        "streams": streams,
        "conns": conns,
        "gateway": {k: v - a["gateway"].get(k, 0.0) for k, v in b["gateway"].items()},
    }


# -- load -------------------------------------------------------------------


async def drive(
    fleet: Any, kind: Kind, n: int, concurrency: int, salt: str, model: str
) -> dict[str, Any]:
    """Send n requests of ``kind``, ``concurrency`` at a time; outcomes and tokens."""
    sem = asyncio.Semaphore(concurrency)
    statuses: Counter[int] = Counter()
    tokens = Counter[str]()
    base = fleet.base_url
    auth = {"Authorization": f"Bearer {fleet.api_key}"}

    async def one(c: httpx.AsyncClient, i: int) -> None:
        path, body, headers = request(kind, salt, i, model, "sim-embed")
        async with sem:
            try:
                if kind.stream:
                    async with c.stream(
                        "POST", base + path, json=body, headers=auth | headers
                    ) as r:
                        usage = None
                        async for line in r.aiter_lines():
                            if line.startswith("data: {") and '"usage"' in line:
                                with contextlib.suppress(ValueError):
                                    usage = json.loads(line[6:]).get("usage") or usage
                        statuses[r.status_code] += 1
                else:
                    r = await c.post(base + path, json=body, headers=auth | headers)
                    statuses[r.status_code] += 1
                    usage = r.json().get("usage") if r.status_code == 200 else None
            except httpx.HTTPError:
                statuses[0] += 1
                return
        if usage:
            tokens["prompt"] += usage.get("prompt_tokens") or 0
            tokens["completion"] += usage.get("completion_tokens") or 0

    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        await asyncio.gather(*(one(c, i) for i in range(n)))
    return {
        "statuses": {str(k): v for k, v in statuses.items()},
        "tokens": dict(tokens),
        "send_seconds": round(time.monotonic() - t0, 3),
    }


ROUTE: dict[str, Any] = {
    "name": "sim-8b",
    "description": "bench/scale_counts.py: one deployment pool, coalescing on",
    "candidates": [
        {"name": "sim-8b", "adapter": "openai", "engine": "jetserve-sim", "model": "sim-8b"}
    ],
    "coalesce": {"enabled": True},
    "routing": {"mode": "affinity"},
}
# The same with hedging after the class's p95 first-token delay, extras capped at 10%.
ROUTE_HEDGED: dict[str, Any] = {
    **ROUTE,
    "description": "bench/scale_counts.py: one deployment pool, coalescing and hedging on",
    "hedge": {"enabled": True, "delay": "p95", "min_samples": 20, "max_extra_ratio": 0.1},
}
SETUPS = ("shared", "routed", "hedged")


async def apply_route(fleet: Any, body: dict[str, Any]) -> None:
    async with httpx.AsyncClient(
        base_url=fleet.admin_url, headers={"Authorization": f"Bearer {fleet.admin_token}"}
    ) as c:
        r = await c.put(f"/admin/routes/{body['name']}", json=body)
        r.raise_for_status()


async def wait_pool(fleet: Any, deployment: str, workers: int, limit_s: float = 20.0) -> None:
    """Until the gateway sees ``workers`` live workers in the deployment's pool."""
    end = time.monotonic() + limit_s
    pat = re.compile(rf'^jetserve_gateway_pool_workers\{{deployment="{deployment}"\}} (\S+)$', re.M)
    async with httpx.AsyncClient(timeout=5) as c:
        while time.monotonic() < end:
            text = (await c.get(fleet.gateway_metrics_urls[0])).text
            m = pat.search(text)
            if m and float(m.group(1)) >= workers:
                return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"gateway never saw {workers} workers of {deployment}")


# -- the run ----------------------------------------------------------------


def cpu_groups(fleet: Any) -> dict[str, list[int]]:
    groups = {
        "gateway": [g.proc.pid for g in fleet.gateways],
        "worker": [w.proc.pid for w in fleet.workers],
        "nats": [n.proc.pid for n in fleet.nats_nodes],
        "redis": [fleet.redis.proc.pid],
        "sim": [fleet.sim.proc.pid] if fleet.sim else [],
    }
    return {k: v for k, v in groups.items() if v}


async def measured(
    obs: Observer, what: Callable[[], Awaitable[dict[str, Any]]], settle_s: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What happened on the bus and in Redis while ``what`` ran, and ``settle_s``
    after it (settlements, outbox deletes and trailing acks land then)."""
    a = await obs.snapshot()
    out = await what()
    await asyncio.sleep(settle_s)
    b = await obs.snapshot()
    return out, diff_snap(a, b)


def phase_figures(
    d: dict[str, Any], n: int, background: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    secs = d["seconds"]
    per = per_request(d["tally"], n, secs, background)
    wire = {f: round(w / n, 1) for f, w in d["wire"].items()}
    tap_msgs = sum(m for m, _ in d["tally"].values())
    tap_bytes = sum(b for _, b in d["tally"].values())
    adv = d["tally"].get("advisory", (0, 0))
    v = d["varz"]
    groups: dict[str, dict[str, float]] = {}
    for fam, row in per.items():
        g = doc_group(fam)
        if g is None:
            continue
        acc = groups.setdefault(g, {"msgs": 0.0, "bytes": 0.0, "wire_bytes": 0.0})
        acc["msgs"] = round(acc["msgs"] + row["msgs"], 3)
        acc["bytes"] = round(acc["bytes"] + row["bytes"], 1)
        share = row["msgs"] / row["raw_msgs"] if row["raw_msgs"] else 0.0  # net of idle
        acc["wire_bytes"] = round(acc["wire_bytes"] + wire.get(fam, 0.0) * share, 1)
    return {
        "seconds": round(secs, 3),
        "families": per,
        "families_wire_bytes": wire,
        "groups": groups,
        "per_second": {
            f: {"msgs": round(m / secs, 2), "bytes": round(b / secs, 1), "periodic": periodic(f)}
            for f, (m, b) in sorted(d["tally"].items())
        },
        "total_msgs": round(sum(r["msgs"] for f, r in per.items() if f != "advisory"), 2),
        "total_bytes": round(sum(r["bytes"] for f, r in per.items() if f != "advisory"), 1),
        "stored": {
            s: round(x["stored_msgs"] / n, 3) for s, x in d["streams"].items() if x["stored_msgs"]
        },
        "stored_bytes": {
            s: round(x["bytes_now_minus_before"] / n, 1)
            for s, x in d["streams"].items()
            if x["stored_msgs"]
        },
        "consumers": {s: x["consumers"] for s, x in d["streams"].items()},
        "js_memory_delta_per_request": round(d["js_memory_delta"] / n, 1),
        "varz": {
            # The tap is one more receiver of everything it counted: not in the model.
            "in_msgs": round(v["in_msgs"] / n, 2),
            "out_msgs_without_tap": round((v["out_msgs"] - tap_msgs) / n, 2),
            "in_bytes": round(v["in_bytes"] / n, 1),
            "out_bytes_without_tap": round((v["out_bytes"] - tap_bytes) / n, 1),
            "advisories_for_tap": round(adv[0] / n, 3),
            "slow_consumers": v["slow_consumers"],
        },
        "js_api_calls": round(d["js_api"] / n, 3),
        "by_role": {
            r: {k: round(x / n, 2) for k, x in row.items() if k != "connections"}
            for r, row in d["conns"].items()
            if r != "scale-tap"
        },
        "redis": {k: round(v / n, 3) for k, v in sorted(d["redis_monitor"].items())},
        "redis_commandstats": {k: round(v / n, 3) for k, v in sorted(d["redis_calls"].items())},
        "gateway_counters": {k: round(v, 1) for k, v in d["gateway"].items() if v},
    }


async def idle_window(obs: Observer, seconds: float) -> dict[str, Any]:
    async def wait() -> dict[str, Any]:
        await asyncio.sleep(seconds)
        return {}

    _, d = await measured(obs, wait, 0.0)
    return d


def idle_figures(d: dict[str, Any]) -> dict[str, Any]:
    secs = d["seconds"]
    return {
        "seconds": round(secs, 2),
        "families_per_s": {
            k: {"msgs": round(m / secs, 2), "bytes": round(b / secs, 1)}
            for k, (m, b) in sorted(d["tally"].items())
        },
        "wire_bytes_per_s": {k: round(w / secs, 1) for k, w in sorted(d["wire"].items())},
        "redis_per_s": {k: round(v / secs, 2) for k, v in sorted(d["redis_monitor"].items())},
        "varz_per_s": {k: round(v / secs, 1) for k, v in d["varz"].items() if k != "mem_after"},
        "by_role_per_s": {
            r: {k: round(x / secs, 2) for k, x in row.items() if k != "connections"}
            for r, row in d["conns"].items()
        },
        "js_api_per_s": round(d["js_api"] / secs, 2),
        "consumers": {s: x["consumers"] for s, x in d["streams"].items()},
    }


async def use_setup(fleet: Any, setup: str, concurrency: int) -> None:
    """Put the fleet in ``setup``: no route (shared), the route, or the hedged route."""
    if setup == "shared":
        return
    await apply_route(fleet, ROUTE_HEDGED if setup == "hedged" else ROUTE)
    await wait_pool(fleet, "sim-8b", len(fleet.workers))
    # The pool's consumers are made on first use; hedging needs min_samples first.
    await drive(fleet, KINDS[0], 40, concurrency, f"warm{setup}{time.time()}", "sim-8b")
    await asyncio.sleep(2.0)


async def count_run(args: argparse.Namespace, fleet: Any, monitor_port: int) -> dict[str, Any]:
    obs = Observer(fleet, monitor_port, tap=True)
    await obs.start()
    out: dict[str, Any] = {"setups": {}}
    try:
        await asyncio.sleep(args.settle)
        idle_d = await idle_window(obs, args.idle)
        out["idle"] = idle_figures(idle_d)
        background = rates(idle_d["tally"], idle_d["seconds"])
        for setup in args.setups:
            await use_setup(fleet, setup, args.concurrency)
            kinds = [k for k in KINDS if k.name in args.kinds]
            if setup == "hedged":  # the hedge's cost: the chat kind is enough
                kinds = [k for k in kinds if k.name == "chat"]
            rows: dict[str, Any] = {}
            for kind in kinds:
                n = args.requests if kind.share else max(args.requests // 2, 20)
                salt = f"s{setup}{kind.name}{int(time.time())}"

                def run(
                    kind: Kind = kind, n: int = n, salt: str = salt
                ) -> Awaitable[dict[str, Any]]:
                    return drive(fleet, kind, n, args.concurrency, salt, "sim-8b")

                res, d = await measured(obs, run, args.settle_after)
                rows[kind.name] = {
                    "kind": asdict(kind),
                    "requests": n,
                    **res,
                    **phase_figures(d, n, background),
                }
                row = rows[kind.name]
                print(
                    f"{setup:7s} {kind.name:11s} n={n} {res['statuses']} "
                    f"{row['total_msgs']:.1f} msgs/req {row['total_bytes'] / 1024:.1f} KiB/req "
                    f"in {row['seconds']:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
            out["setups"][setup] = rows
        if args.more_workers:
            # Membership and the queue watch as the fleet grows (idle): more
            # workers, then a second gateway.
            grow: dict[str, Any] = {f"{len(fleet.workers)}w{len(fleet.gateways)}g": out["idle"]}
            for _ in range(args.more_workers):
                await asyncio.to_thread(fleet.start_worker, wait=False)
            await asyncio.to_thread(fleet.wait_workers, len(fleet.workers))
            await asyncio.sleep(args.settle)
            key = f"{len(fleet.workers)}w{len(fleet.gateways)}g"
            grow[key] = idle_figures(await idle_window(obs, args.idle))
            await asyncio.to_thread(fleet.start_gateway)
            await asyncio.sleep(args.settle)
            key = f"{len(fleet.workers)}w{len(fleet.gateways)}g"
            grow[key] = idle_figures(await idle_window(obs, args.idle))
            out["idle_growth"] = grow
    finally:
        await obs.close()
    return out


async def cpu_run(args: argparse.Namespace, fleet: Any) -> dict[str, Any]:
    """CPU-ms per request per process (routed, as the model's basis), with
    nothing watching the bus: no tap, no MONITOR."""
    from jetserve.bench.cpu import CpuMeter

    meter = CpuMeter(cpu_groups(fleet))
    await use_setup(fleet, "routed", args.concurrency)
    out: dict[str, Any] = {}
    for kind in [k for k in KINDS if k.share]:
        n = args.cpu_requests
        await drive(fleet, kind, 20, args.concurrency, f"cpuwarm{kind.name}", "sim-8b")
        await asyncio.sleep(1.0)
        before = meter.sample()
        salt = f"cpu{kind.name}{int(time.time())}"
        res = await drive(fleet, kind, n, args.concurrency, salt, "sim-8b")
        await asyncio.sleep(args.settle_after)
        d = CpuMeter.delta(before, meter.sample())
        serving = sum(v for k, v in d.items() if k in ("gateway", "worker", "nats", "redis"))
        out[kind.name] = {
            "requests": n,
            "statuses": res["statuses"],
            "send_seconds": res["send_seconds"],
            "req_per_s": round(n / res["send_seconds"], 1),
            "cpu_ms_per_request": {k: round(v * 1000 / n, 2) for k, v in d.items()},
            "serving_cpu_ms_per_request": round(serving * 1000 / n, 2),
        }
        print(f"cpu     {kind.name:11s} {out[kind.name]['cpu_ms_per_request']}", file=sys.stderr)
    return out


def git_state() -> dict[str, Any]:
    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            return ""

    return {"rev": run("git", "rev-parse", "HEAD"), "dirty": run("git", "status", "--porcelain")}


# -- the model --------------------------------------------------------------

RATES = (1_000, 10_000, 100_000)
# Groups whose rate follows the fleet (processes, lanes, the clock), not requests:
# the model gives them formulas of their own.
PER_PROCESS_GROUPS = (
    "work queue: pulls and their expiries (408/404/409)",
    "membership: KV put + PubAck + watch deliveries",
    "JS API: consumer list (the gateways' queue watch)",
    "JS API: consumer/stream info, message deletes, other",
)


def replica_rate(profile_name: str, batch: int, prompt: int, output: int) -> float:
    """Requests a second one engine replica completes at ``batch`` sequences in
    flight, from the simulator profile's step model (sim/profiles.py): every
    sequence decodes one token a step, and each prompt costs its tokens'
    compute once (chunked prefill rides in the decode steps)."""
    from sim.profiles import PROFILES

    prof = PROFILES[profile_name]
    context = batch * (prompt + output // 2)  # tokens of KV the average step reads
    step = prof.step_time(batch, batch, context)
    per_request = output * step / batch + prompt * prof.token_compute_s
    return 1.0 / per_request


def mix_groups(
    setup_rows: dict[str, Any], shares: dict[str, float], key: str = "groups"
) -> dict[str, dict[str, float]]:
    """The mix's per-request figure of each docs/scale.md row."""
    return mix_per_request({k: setup_rows[k][key] for k in shares}, shares)


def redis_mix(setup_rows: dict[str, Any], shares: dict[str, float]) -> dict[str, float]:
    out: Counter[str] = Counter()
    for kind, share in shares.items():
        for fam, per in setup_rows[kind]["redis"].items():
            out[fam] += share * per
    return {k: round(v, 3) for k, v in sorted(out.items())}


def model(
    result: dict[str, Any], basis: str = "routed", replica_batch: int = 128
) -> dict[str, Any]:
    """The per-request counts of ``basis`` multiplied out to RATES, with the
    fleet each rate needs (engine replicas from the h100-8b step model,
    gateways from the measured gateway CPU per request)."""
    rows = result["setups"][basis]
    shares = {k.name: k.share for k in KINDS if k.share and k.name in rows}
    total = sum(shares.values())
    shares = {k: v / total for k, v in shares.items()}
    per_req = mix_groups(rows, shares)
    request_driven = {g: v for g, v in per_req.items() if g not in PER_PROCESS_GROUPS}
    chat = next(k for k in KINDS if k.name == "chat")
    batch = next(k for k in KINDS if k.name == "batch")
    r_chat = replica_rate("h100-8b", replica_batch, chat.prompt_tokens, chat.max_tokens)
    r_batch = replica_rate("h100-8b", replica_batch, batch.prompt_tokens, batch.max_tokens)
    gen_share = shares.get("chat", 0) + shares.get("batch", 0)
    # Replica-seconds per request of the generating kinds (embeddings: own engines).
    per_replica = gen_share / (shares.get("chat", 0) / r_chat + shares.get("batch", 0) / r_batch)
    cpu = result.get("cpu", {})
    cpu_mix = (
        {
            proc: round(
                sum(shares[k] * cpu[k]["cpu_ms_per_request"].get(proc, 0.0) for k in shares), 2
            )
            for proc in ("gateway", "worker", "nats", "redis")
        }
        if all(k in cpu for k in shares)
        else {}
    )
    frames = sum(v["msgs"] for g, v in per_req.items() if g.startswith("reply frames"))
    out: dict[str, Any] = {
        "basis": basis,
        "shares": shares,
        "per_request": per_req,
        "redis_per_request": redis_mix(rows, shares),
        "cpu_ms_per_request": cpu_mix,
        "replica_req_per_s": {
            "chat": round(r_chat, 1),
            "batch": round(r_batch, 1),
            "mix": round(per_replica, 1),
            "batch_size": replica_batch,
        },
        "frames_per_request": round(frames, 2),
        "rates": {},
    }
    for rate in RATES:
        replicas = math.ceil(rate * gen_share / per_replica)
        gateways = math.ceil(rate * cpu_mix.get("gateway", 0) / 1000 / 0.7) if cpu_mix else None
        puts, deliveries = membership_rates(replicas, gateways or 0)
        out["rates"][str(rate)] = {
            "groups": {
                g: {
                    "msgs_s": round(at_rate(v["msgs"], rate)),
                    "bytes_s": round(at_rate(v["wire_bytes"], rate)),
                }
                for g, v in request_driven.items()
            },
            "msgs_s": round(at_rate(sum(v["msgs"] for v in request_driven.values()), rate)),
            "wire_bytes_s": round(
                at_rate(sum(v["wire_bytes"] for v in request_driven.values()), rate)
            ),
            "frames_stored_s": round(at_rate(frames, rate)),
            "replicas": replicas,
            "gateways": gateways,
            "membership_puts_s": puts,
            "membership_deliveries_s": deliveries,
            "redis_top_level_s": round(
                at_rate(
                    sum(
                        v
                        for k, v in out["redis_per_request"].items()
                        if not k.startswith(("lua ", "INFO", "HELLO", "SCRIPT"))
                    ),
                    rate,
                )
            ),
            "redis_lua_calls_s": round(
                at_rate(
                    sum(v for k, v in out["redis_per_request"].items() if k.startswith("lua ")),
                    rate,
                )
            ),
            "cores": {p: round(rate * ms / 1000, 1) for p, ms in cpu_mix.items()},
        }
    return out


def per_process(result: dict[str, Any], setup: str, kind: str = "chat") -> dict[str, Any]:
    """What each gateway and worker costs the bus by the clock, from a phase of
    ``kind`` (busy) and the first idle window: the queue watch's consumer lists,
    the workers' pending peeks, standing lane pulls and their expiries."""
    meta = result["meta"]
    gateways, workers = 1, meta["workers"]
    busy = result["setups"][setup][kind]["per_second"]
    idle = result["idle"]["families_per_s"]

    def rate(table: dict[str, Any], fam: str, key: str = "msgs") -> float:
        return float(table.get(fam, {}).get(key, 0.0))

    lists = rate(busy, "api-reply consumer_list_response -> gateway")
    list_bytes = rate(busy, "api-reply consumer_list_response -> gateway", "bytes")
    return {
        "from": f"{setup}/{kind}",
        "workqueue_consumers": result["setups"][setup][kind]["consumers"].get("JETSERVE_REQ"),
        "gateway_consumer_list_pages_s": round(lists / gateways, 2),
        "gateway_consumer_list_bytes_s": round(list_bytes / gateways),
        "consumer_list_bytes_per_page": round(list_bytes / lists) if lists else None,
        "worker_consumer_info_s": round(rate(busy, "api CONSUMER.INFO workqueue") / workers, 2),
        "worker_pulls_s_busy": round(rate(busy, "pull workqueue") / workers, 1),
        "worker_pull_expiries_s_busy": round(rate(busy, "status 408 -> worker") / workers, 1),
        "worker_pulls_s_idle": round(rate(idle, "pull workqueue") / workers, 1),
        "worker_pull_expiries_s_idle": round(rate(idle, "status 408 -> worker") / workers, 1),
        "membership_msgs_s_idle": {
            k: round(
                sum(
                    v["msgs"]
                    for f, v in g["families_per_s"].items()
                    if doc_group(f) == "membership: KV put + PubAck + watch deliveries"
                ),
                2,
            )
            for k, g in result.get("idle_growth", {"idle": result["idle"]}).items()
        },
    }


def _fmt(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    if x >= 1e3:
        return f"{x / 1e3:.1f} k"
    return f"{x:.3g}"


def summary_md(result: dict[str, Any], mod: dict[str, Any] | None) -> str:
    """Tables for docs/scale.md: per request, per kind and setup; the model."""
    meta = result["meta"]
    lines = [
        "# Per-request bus and Redis counts (bench/scale_counts.py)",
        "",
        f"`{meta['command']}` at {meta['git'].get('rev', '')[:12]}, {meta['when']}, "
        f"profile `{meta['profile']}`, {meta['workers']} workers, 1 gateway, "
        f"{meta['concurrency']} in flight.",
        "",
        "Messages and bytes (payload + headers; `wire` adds subject, reply and framing) per "
        "request, net of the idle window's background rate. The pulls, membership and "
        "JS API rows follow the clock and the processes, not the requests: their figure "
        "per request depends on the phase's rate (docs/scale.md gives their formulas).",
        "",
    ]
    for setup, rows in result["setups"].items():
        kinds = list(rows)
        lines += [f"## {setup}", "", "| row | " + " | ".join(kinds) + " |"]
        lines.append("|---|" + "---|" * len(kinds))
        names = [g for g, _ in DOC_GROUPS] + ["other"]
        for g in names:
            cells = []
            for k in kinds:
                v = rows[k]["groups"].get(g)
                cells.append(f"{v['msgs']:.2f} / {v['wire_bytes']:.0f} B" if v else "")
            if any(cells):
                lines.append(f"| {g} | " + " | ".join(cells) + " |")
        lines.append(
            "| stored per stream | "
            + " | ".join(
                ", ".join(f"{s} {x:g}" for s, x in rows[k]["stored"].items()) for k in kinds
            )
            + " |"
        )
        lines.append(
            "| Redis commands (top level) | "
            + " | ".join(
                ", ".join(
                    f"{f} {x:g}"
                    for f, x in rows[k]["redis"].items()
                    if not f.startswith(("lua ", "INFO", "HELLO", "SCRIPT"))
                )
                for k in kinds
            )
            + " |"
        )
        lines.append("")
    if mod and "rates" in mod:
        lines += [f"## The model (basis: {mod['basis']})", ""]
        lines.append(
            "| row | per request | " + " | ".join(f"{r // 1000}k req/s" for r in RATES) + " |"
        )
        lines.append("|---|---|" + "---|" * len(RATES))
        for g, v in mod["per_request"].items():
            if g in PER_PROCESS_GROUPS:
                continue
            cells = [
                f"{_fmt(mod['rates'][str(r)]['groups'][g]['msgs_s'])} msg/s, "
                f"{_fmt(mod['rates'][str(r)]['groups'][g]['bytes_s'])}B/s"
                for r in RATES
            ]
            lines.append(
                f"| {g} | {v['msgs']:.2f} msgs, {v['wire_bytes']:.0f} B | "
                + " | ".join(cells)
                + " |"
            )
        lines.append("")
    if mod:
        lines.append("```json")
        lines.append(json.dumps({k: v for k, v in mod.items() if k != "per_request"}, indent=1))
        lines.append("```")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--profile", default="fast", help="simulator profile (fast: no engine latency)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--requests", type=int, default=300, help="per kind of the mix (variants: half)")
    p.add_argument("--cpu-requests", type=int, default=400, help="per kind, CPU pass")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--idle", type=float, default=10.0, help="s of each idle window")
    p.add_argument(
        "--settle",
        type=float,
        default=20.0,
        help="s before an idle window (idle pulls back off to 8 s)",
    )
    p.add_argument("--settle-after", type=float, default=2.0, help="s after a phase's last answer")
    p.add_argument("--more-workers", type=int, default=2, help="added for the growth window")
    p.add_argument("--kinds", default=",".join(k.name for k in KINDS))
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU pass")
    p.add_argument(
        "--model-only",
        action="store_true",
        help="recompute the model and summary from <out>/counts.json",
    )
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--rev", default="", help="the commit measured, when run from an export of it")
    args = p.parse_args(argv)
    args.kinds = set(args.kinds.split(","))
    args.setups = [s for s in args.setups.split(",") if s]
    counts = args.out / "counts.json"
    if args.model_only:
        return write(json.loads(counts.read_text()), args.out)

    from jetserve.fleet import FleetSpec
    from jetserve.services import free_port

    result: dict[str, Any] = {
        "meta": {
            "command": "bench/scale_counts.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "git": {"rev": args.rev, "exported": True} if args.rev else git_state(),
            "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
            "profile": args.profile,
            "workers": args.workers,
            "concurrency": args.concurrency,
            "routes": {"routed": ROUTE, "hedged": ROUTE_HEDGED},
        }
    }
    port = free_port()
    fleet = start_fleet(FleetSpec(workers=args.workers, profile=args.profile), port)
    try:
        result["meta"]["nats_server"] = subprocess.run(
            [fleet.nats.args[0], "--version"], capture_output=True, text=True, check=False
        ).stdout.strip()
        result.update(asyncio.run(count_run(args, fleet, port)))
    finally:
        fleet.stop()
    if not args.no_cpu:
        fleet = start_fleet(FleetSpec(workers=args.workers, profile=args.profile), free_port())
        try:
            time.sleep(args.settle)
            result["cpu"] = asyncio.run(cpu_run(args, fleet))
        finally:
            fleet.stop()
    return write(result, args.out)


def write(result: dict[str, Any], out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "counts.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    mod = None
    basis = "routed" if "routed" in result["setups"] else next(iter(result["setups"]))
    if all(k.name in result["setups"][basis] for k in KINDS if k.share):
        mod = model(result, basis)
    if "chat" in result["setups"][basis]:
        mod = {**(mod or {}), "per_process": per_process(result, basis)}
    if mod:
        (out / "model.json").write_text(json.dumps(mod, indent=1, sort_keys=True) + "\n")
    (out / "summary.md").write_text(summary_md(result, mod))
    print(f"wrote {out}/counts.json, summary.md" + (", model.json" if mod else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

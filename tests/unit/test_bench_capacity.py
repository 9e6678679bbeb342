"""`jetserve bench capacity`: level parsing, the per-level figures (latency over the
window, CPU-ms per request by component), max rates and ratios, the summary and
plots, the closed-loop client against in-memory servers, and one whole run on a
real fleet (marked `connected`)."""

from __future__ import annotations

import asyncio
import io
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from jetserve.bench import plots
from jetserve.bench.capacity import CapacityBar
from jetserve.bench.capacity_report import PLOTS, markdown, warnings, write_outputs
from jetserve.bench.capacity_stats import (
    CapacityResults,
    Level,
    aggregate,
    build,
    components,
    decode,
    encode,
    max_rates,
    parse_levels,
    ratios,
)
from jetserve.bench.cli import build_parser
from jetserve.bench.cli import main as bench_main
from jetserve.bench.client import stream_one
from jetserve.bench.client_plain import complete_one
from jetserve.bench.closedloop import ClosedJob, body_maker, run_closed
from jetserve.bench.targets import Target
from jetserve.bench.timeline import Outcome, Timeline
from jetserve.bench.workload import RequestSpec

CPU_PATH = {
    "direct": [],
    "jetserve": ["gateway", "workers", "nats", "redis"],
    "litellm": ["litellm"],
}


def tl(
    end: float, e2e: float, *, outcome: Outcome = "ok", ttft: float | None = None, tokens: int = 16
) -> Timeline:
    return Timeline(
        index=0,
        cls="capacity",
        scheduled=end - e2e,
        sent=end - e2e,
        end=end,
        outcome=outcome,
        status=200 if outcome == "ok" else 429,
        error="" if outcome == "ok" else "queue_full",
        ttft=ttft,
        e2e=e2e if outcome == "ok" else None,
        output_tokens=tokens if outcome == "ok" else None,
    )


def test_levels_parse_sorted_and_once_each() -> None:
    assert parse_levels("16,4, 4,1,") == [1, 4, 16]
    assert parse_levels("32") == [32]
    for bad in ("0", "x", "", "2.5", "-1"):
        with pytest.raises(ValueError, match="concurrency level"):
            parse_levels(bad)


def test_components_of_each_target() -> None:
    assert components("direct", CPU_PATH) == ["engine"]
    assert components("jetserve", CPU_PATH) == [
        "engine", "gateway", "worker", "nats-server", "redis-server",
    ]  # fmt: skip
    assert components("litellm", CPU_PATH) == ["engine", "proxy"]
    assert components("elsewhere", {}) == ["engine"]


def test_a_level_counts_only_the_window_and_divides_cpu_per_request() -> None:
    inside = [tl(1.0 + i * 0.02, 0.010 + i * 0.001, ttft=0.002) for i in range(100)]
    before = [tl(0.5, 0.01, ttft=0.002), tl(0.99, 0.5, ttft=0.002)]  # ended before it opened
    after = [tl(3.5, 0.01, ttft=0.002), tl(9.0, 0.0, outcome="timeout")]  # ended after it
    failed = [tl(1.5, 0.0, outcome="rejected"), tl(2.5, 0.0, outcome="rejected")]
    cpu = {  # CpuMeter.delta over the window: seconds by group
        "engine": 0.2, "gateway": 0.5, "workers": 0.6, "nats": 0.3, "redis": 0.1,
        "litellm": 0.05, "generator": 0.4, "other": 1.0,
    }  # fmt: skip
    lv = aggregate(
        "jetserve", 8, before + inside + failed + after, (1.0, 3.0), cpu,
        components("jetserve", CPU_PATH), stream=True, clients=1, unfinished=1,
    )  # fmt: skip
    assert (lv.completed, lv.errors) == (100, 2)
    assert lv.error_kinds == {"rejected 429 queue_full": 2}
    assert lv.failed_after_window == 2  # the timeout after it, and one never ended
    assert lv.window_s == 2.0
    assert lv.req_per_s == 50.0
    assert lv.e2e.n == 100
    assert lv.e2e.p50 == pytest.approx(0.0595)
    assert lv.ttft is not None
    assert lv.ttft.p50 == pytest.approx(0.002)
    assert lv.e2e.p99 is not None
    assert lv.p99_over_p50 == pytest.approx(lv.e2e.p99 / 0.0595)
    assert lv.output_tokens == {"min": 16, "max": 16}
    # CPU-ms per completed request, for the components on jetserve's path only.
    assert lv.cpu_ms_per_request == {
        "engine": 2.0, "gateway": 5.0, "worker": 6.0, "nats-server": 3.0, "redis-server": 1.0,
    }  # fmt: skip
    assert lv.cpu_ms_total == 17.0
    assert lv.cpu_s["proxy"] == 0.05  # measured, though not on this path
    assert (lv.generator_cores, lv.other_cores) == (0.2, 0.5)
    assert lv.generator_ms_per_request == 4.0


def test_a_level_without_streaming_cpu_or_completions() -> None:
    lv = aggregate("direct", 1, [tl(1.5, 0.1)], (1.0, 2.0), {}, ["engine"], stream=False)
    assert lv.ttft is None
    assert lv.cpu_ms_per_request == {}
    assert lv.cpu_ms_total is None
    assert lv.generator_cores is None
    empty = aggregate("direct", 1, [tl(5.0, 0.1)], (1.0, 2.0), {"engine": 0.1}, ["engine"],
                      stream=True)  # fmt: skip
    assert (empty.completed, empty.req_per_s, empty.p99_over_p50) == (0, 0.0, None)
    assert empty.cpu_ms_per_request == {}


def level(target: str, c: int, rate: float, *, gen: float = 0.1, tokens: int = 16) -> Level:
    """A level of `rate` req/s over a 10 s window: 2% of requests take 30 ms, the
    rest 10 ms; CPU-ms per request: engine 1, gateway 2, workers 2, NATS 1, Redis 0.1,
    LiteLLM 5; the generator `gen` cores."""
    n = round(rate * 10)
    slow = n // 50 + 1
    tls = [tl(1.0 + 10 * i / n, 0.030 if i < slow else 0.010, ttft=0.003, tokens=tokens)
           for i in range(n)]  # fmt: skip
    per_request = {"engine": 0.001, "gateway": 0.002, "workers": 0.002, "nats": 0.001,
                   "redis": 0.0001, "litellm": 0.005}  # fmt: skip
    cpu = {k: v * n for k, v in per_request.items()} | {"generator": 10 * gen, "other": 0.5}
    return aggregate(target, c, tls, (1.0, 11.0), cpu, components(target, CPU_PATH), stream=True)


def results(levels: list[Level]) -> CapacityResults:
    return build(
        levels,
        meta={"command": "jetserve bench capacity --concurrency 4,16", "git": "abc1234",
              "machine": {"cores": 2, "usable_cores": 2, "arch": "x86_64", "python": "3.11"}},
        config={"levels": [4, 16], "duration": 10.0, "warmup": 1.0, "stream": True,
                "input_tokens": 64, "max_tokens": 16, "ignore_eos": True, "api": "chat",
                "profile": "fast", "workers": 2, "gateways": 1},
        targets=[{"name": lv.target} for lv in levels[::2]],
    )  # fmt: skip


LEVELS = [
    level("direct", 4, 200), level("direct", 16, 300),
    level("jetserve", 4, 60), level("jetserve", 16, 90),
    level("litellm", 4, 40), level("litellm", 16, 30),
]  # fmt: skip


def test_max_rates_and_ratios() -> None:
    maxes = max_rates(LEVELS)
    assert {n: (m.req_per_s, m.concurrency) for n, m in maxes.items()} == {
        "direct": (300.0, 16), "jetserve": (90.0, 16), "litellm": (40.0, 4),
    }  # fmt: skip
    assert maxes["jetserve"].cpu_ms_total == pytest.approx(6.1)
    r = ratios(maxes)
    assert r["jetserve/direct"] == pytest.approx(0.3)
    assert r["jetserve/litellm"] == pytest.approx(2.25)
    del maxes["litellm"]
    assert ratios(maxes)["jetserve/litellm"] is None  # not in this run
    res = results(LEVELS)
    assert res.target_names() == ["direct", "jetserve", "litellm"]
    assert res.tail_at_highest["litellm"] == pytest.approx(3.0)  # p99 30 ms / p50 10 ms
    assert decode(encode(res)) == res


def test_summary_table_ratios_and_warnings() -> None:
    busy = level("jetserve", 32, 80, gen=0.95, tokens=12)
    res = results([*LEVELS, busy])
    md = markdown(res, PLOTS)
    assert md.startswith("# jetserve bench capacity")
    assert "`jetserve bench capacity --concurrency 4,16`" in md
    header = next(line for line in md.splitlines() if line.startswith("| target | C |"))
    columns = ("req/s", "p50 ms", "p99 ms", "p99/p50", "TTFT p50", "engine", "gateway",
               "worker", "nats-server", "redis-server", "proxy", "total",
               "other cores")  # fmt: skip
    for col in columns:
        assert f" {col} |" in header, col
    row = next(line for line in md.splitlines() if line.startswith("| jetserve | 16 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:6] == ["90.0", "10.0", "30.0", "3.00"]  # req/s, p50, p99, p99/p50
    assert cells[9:15] == ["1.00", "2.00", "2.00", "1.00", "0.10", "-"]  # CPU-ms, no proxy
    assert cells[15:18] == ["6.10", "0.10", "0.05"]  # total; generator and other cores
    assert "- jetserve/direct: 0.30x" in md
    assert "- jetserve/litellm: 2.25x" in md
    assert "![cpu_per_request.png](cpu_per_request.png)" in md
    warned = warnings(res)
    assert any("generator used 0.95 cores" in w for w in warned)
    assert any("outputs of 12..12 tokens, not 16" in w for w in warned)
    assert "## Warnings" in md


@pytest.mark.skipif(not plots.available(), reason="matplotlib (the bench extra) not installed")
def test_outputs_and_plots_are_written(tmp_path: Path) -> None:
    lines = write_outputs(results(LEVELS), tmp_path)
    assert "  jetserve/direct: 0.30x" in lines
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["schema"] == "jetserve-bench-capacity/1"
    for name in PLOTS:
        size = (tmp_path / name).stat().st_size
        assert 5_000 < size < 200_000, (name, size)
    assert "## Plots" in (tmp_path / "summary.md").read_text()


def test_progress_bar_counts_measured_time() -> None:
    out = io.StringIO()
    bar = CapacityBar(2, 2.0, stream=out, tty=True)
    bar.start("direct C=4")
    bar.window(1.0, 120, 1)
    assert "25% direct C=4  1.0/2s done 120 bad 1" in bar.render()
    bar.end_run()
    bar.start("jetserve C=4")
    assert "50% jetserve C=4  0.0/2s done 0 bad 0" in bar.render()


def test_cli_defaults_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["capacity"])
    assert (args.concurrency, args.profile, args.max_tokens, args.stream) == (
        [4, 16, 32], "fast", 16, True,
    )  # fmt: skip
    assert build_parser().parse_args(["capacity", "--no-stream"]).stream is False
    for argv in (["capacity", "--concurrency", "0"], ["capacity", "--litellm", "maybe"]):
        with pytest.raises(SystemExit) as exc:
            bench_main(argv)
        assert exc.value.code == 2
    assert "usage: jetserve bench capacity" in capsys.readouterr().err
    assert bench_main(["capacity", "--max-tokens", "0"]) == 2


def job(stream: bool, concurrency: int = 3) -> ClosedJob:
    return ClosedJob(
        target=Target(name="t", url="http://t/v1", key="sk-x"),
        concurrency=concurrency, duration=0.3, warmup=0.1, stream=stream,
        input_tokens=8, max_tokens=4, salt="zsalt",
    )  # fmt: skip


def test_bodies_are_unique_and_ask_for_exact_lengths() -> None:
    stream_body = msgspec.json.decode(body_maker(job(True))(7))
    assert stream_body["stream"] is True
    assert stream_body["stream_options"] == {"include_usage": True}
    assert (stream_body["max_tokens"], stream_body["ignore_eos"]) == (4, True)
    words = stream_body["messages"][0]["content"].split()
    assert words[:2] == ["zsalt", "r7"]
    assert len(words) == 8
    plain = msgspec.json.decode(body_maker(job(False))(8))
    assert plain["stream"] is False
    assert "stream_options" not in plain
    assert plain["messages"][0]["content"].split()[1] == "r8"


def full(content: str = " a b c d") -> dict[str, Any]:
    return {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 4},
    }


class Server:
    """An in-memory OpenAI server that counts requests in flight."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.in_flight = self.most = 0
        self.prompts: list[str] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert request.headers["authorization"] == "Bearer sk-x"
        self.prompts.append(body["messages"][0]["content"])
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(0.005)
        finally:
            self.in_flight -= 1
        if not self.stream:
            return httpx.Response(200, json=full())
        chunk = {"choices": [{"index": 0, "delta": {"content": " a"}, "finish_reason": None}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 4}}
        events = [chunk] * 4 + [usage]
        sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        return httpx.Response(200, content=sse + b"data: [DONE]\n\n")


@pytest.mark.parametrize("stream", [True, False])
async def test_the_closed_loop_keeps_c_requests_in_flight(stream: bool) -> None:
    server = Server(stream)
    marks: list[str] = []
    res = await run_closed(job(stream), marks.append, transport=httpx.MockTransport(server))
    assert marks == ["begin", "end"]
    assert server.most <= 3  # never more than C at once: each client waits for its answer
    assert len(server.prompts) == len(set(server.prompts)) == len(res.timelines)
    assert all(t.outcome == "ok" for t in res.timelines), {t.error for t in res.timelines}
    assert {t.output_tokens for t in res.timelines} == {4}
    assert all((t.ttft is not None) == stream for t in res.timelines)
    lo, hi = res.window
    assert lo < hi
    lv = aggregate("t", 3, res.timelines, res.window, {}, ["engine"], stream=stream)
    assert 0 < lv.completed < len(res.timelines)  # the warm-up's requests are not counted


@pytest.mark.parametrize("stream", [True, False])
async def test_the_clients_keep_their_connections_alive(stream: bool) -> None:
    # A real HTTP/1.1 server on loopback (chunked bodies, as uvicorn sends them) that
    # counts connections: C clients open C connections, however many requests they send.
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                assert length is not None
                await reader.readexactly(int(length.group(1)))
                if stream:
                    chunk = {"choices": [{"delta": {"content": " a"}, "finish_reason": None}]}
                    usage = {"choices": [], "usage": {"completion_tokens": 4}}
                    events = [chunk] * 4 + [usage]
                    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                    body += b"data: [DONE]\n\n"
                    kind = b"text/event-stream"
                else:
                    body, kind = json.dumps(full()).encode(), b"application/json"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: " + kind
                    + b"\r\ntransfer-encoding: chunked\r\n\r\n"
                    + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
                )  # fmt: skip
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        target = Target(name="t", url=f"http://127.0.0.1:{port}/v1", key="sk-x")
        res = await run_closed(msgspec.structs.replace(job(stream, 2), target=target))
    finally:
        server.close()
        await server.wait_closed()
    assert all(t.outcome == "ok" for t in res.timelines), {t.error for t in res.timelines}
    assert len(res.timelines) > 2
    assert len(connections) == 2


async def test_a_stream_held_open_after_done_stands_and_is_not_waited_for() -> None:
    forever = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        chunk = {"choices": [{"delta": {"content": " a"}, "finish_reason": "length"}]}
        yield b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n"
        await forever.wait()  # the body never ends
        yield b""

    spec = RequestSpec(index=0, at=0.0, cls="x", input_tokens=1, output_tokens=1)
    transport = httpx.MockTransport(lambda r: httpx.Response(200, content=body()))
    async with httpx.AsyncClient(transport=transport) as c:
        t = await stream_one(c, "http://t/v1/chat/completions", {}, b"{}", spec, t0=0.0,
                             deadline=time.perf_counter() + 30)  # fmt: skip
    assert (t.outcome, t.error, len(t.chunks)) == ("ok", "", 1)
    assert t.e2e is not None


async def test_non_streaming_outcomes() -> None:
    async def run(response: httpx.Response) -> Timeline:
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: response)) as c:
            return await complete_one(c, "http://t/v1/chat/completions", {}, b"{}", index=3,
                                      t0=0.0, deadline=1e12)  # fmt: skip

    ok = await run(httpx.Response(200, json=full()))
    assert (ok.outcome, ok.output_tokens, ok.index) == ("ok", 4, 3)
    assert ok.e2e is not None
    assert ok.ttft is None
    full_q = await run(httpx.Response(429, json={"error": {"code": "queue_full"}}))
    assert (full_q.outcome, full_q.error, full_q.e2e) == ("rejected", "queue_full", None)
    empty = await run(httpx.Response(200, json=full("")))
    assert (empty.outcome, empty.error) == ("error", "no output")
    junk = await run(httpx.Response(200, content=b"not json"))
    assert (junk.outcome, junk.error) == ("error", "no output")


@pytest.mark.connected
def test_capacity_on_a_real_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cap"
    argv = [
        "capacity", "--concurrency", "2", "--duration", "2", "--warmup", "0.5",
        "--cooldown", "0", "--workers", "1", "--litellm", "no", "--no-plots", "--quiet",
        "--out", str(out),
    ]  # fmt: skip
    assert bench_main(argv) == 0
    assert "jetserve/direct" in capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["machine"]["cores"] >= 1
    assert res["meta"]["command"].startswith("jetserve bench capacity --concurrency 2")
    assert [(lv["target"], lv["concurrency"]) for lv in res["levels"]] == [
        ("direct", 2), ("jetserve", 2),
    ]  # fmt: skip
    for lv in res["levels"]:
        assert lv["completed"] > 0, lv["error_kinds"]
        assert lv["errors"] == 0, lv["error_kinds"]
        assert lv["output_tokens"] == {"min": 16, "max": 16}
        assert lv["e2e"]["p50"] > 0
        assert lv["ttft"]["p50"] > 0
        assert lv["cpu_ms_total"] > 0
        assert lv["generator_cores"] is not None
        assert lv["other_cores"] is not None
    jet = res["levels"][1]["cpu_ms_per_request"]
    assert jet["gateway"] > 0
    assert jet["worker"] > 0
    assert set(jet) == {"engine", "gateway", "worker", "nats-server", "redis-server"}
    assert res["ratios"]["jetserve/direct"] > 0
    assert res["ratios"]["jetserve/litellm"] is None
    assert set(res["max_rate"]) == {"direct", "jetserve"}
    assert "| jetserve | 2 |" in (out / "summary.md").read_text()

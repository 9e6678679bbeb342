"""Workload generation for `jetserve bench`: arrivals, classes, lengths, prefixes,
cancellations, prompts, traces, and the small parsers."""

from __future__ import annotations

import itertools
import random
import statistics

import msgspec
import pytest

from jetserve.bench.arrivals import arrival_times, rescale
from jetserve.bench.dists import Dist, parse_dist
from jetserve.bench.prompts import prompt_text, request_body
from jetserve.bench.targets import parse_header, parse_target
from jetserve.bench.trace import at_rate, dump_trace, mean_rate, parse_trace
from jetserve.bench.units import parse_duration, parse_rates
from jetserve.bench.workload import WorkloadSpec, build_schedule, parse_class
from sim.tokenizer import Tokenizer


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def test_poisson_arrivals_have_the_rate_and_unit_cv() -> None:
    gaps = _gaps(arrival_times(random.Random(1), 10.0, count=20000))
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.03)
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    assert cv2 == pytest.approx(1.0, rel=0.06)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_the_rate_and_sets_cv(burstiness: float) -> None:
    # vLLM: shape = burstiness, scale = 1/(rate * burstiness): CV^2 = 1/burstiness.
    gaps = _gaps(arrival_times(random.Random(2), 5.0, burstiness, count=20000))
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.04)
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.08)


def test_arrivals_by_duration_start_at_zero_and_stop_in_time() -> None:
    times = arrival_times(random.Random(3), 20.0, duration=10.0)
    assert times[0] == 0.0
    assert times[-1] < 10.0
    assert 150 < len(times) < 250
    with pytest.raises(ValueError, match="must be > 0"):
        arrival_times(random.Random(3), 0.0, count=1)


def test_same_seed_same_schedule_and_prompts() -> None:
    spec = WorkloadSpec(seed=7, input_len=parse_dist("uniform:50:100"))
    a = build_schedule(spec, 4.0, duration=5.0)
    b = build_schedule(spec, 4.0, duration=5.0)
    assert a == b
    assert [prompt_text(r, seed=7, salt="s") for r in a] == [
        prompt_text(r, seed=7, salt="s") for r in b
    ]
    other = build_schedule(msgspec.structs.replace(spec, seed=8), 4.0, duration=5.0)
    assert [r.at for r in other] != [r.at for r in a]


def test_class_mix_and_per_class_lengths() -> None:
    spec = WorkloadSpec(
        classes=(
            parse_class("interactive=0.75"),
            parse_class("batch=0.25,in=1000,out=uniform:5:9"),
        ),
        input_len=parse_dist("100"),
        output_len=parse_dist("50"),
    )
    reqs = build_schedule(spec, 100.0, count=4000)
    batch = [r for r in reqs if r.cls == "batch"]
    assert len(batch) / len(reqs) == pytest.approx(0.25, abs=0.03)
    assert all(r.input_tokens == 1000 and 5 <= r.output_tokens <= 9 for r in batch)
    assert all(
        r.input_tokens == 100 and r.output_tokens == 50 for r in reqs if r.cls == "interactive"
    )


def test_prefix_groups_and_cancellations() -> None:
    spec = WorkloadSpec(
        input_len=parse_dist("40"),
        prefix_groups=3,
        prefix_len=24,
        prefix_share=0.5,
        cancel_rate=0.2,
        cancel_after=parse_dist("uniform:0.1:0.2"),
    )
    reqs = build_schedule(spec, 50.0, count=2000)
    grouped = [r for r in reqs if r.prefix_group is not None]
    assert len(grouped) / len(reqs) == pytest.approx(0.5, abs=0.04)
    assert {r.prefix_group for r in grouped} == {0, 1, 2}
    cancelled = [r for r in reqs if r.cancel_after is not None]
    assert len(cancelled) / len(reqs) == pytest.approx(0.2, abs=0.03)
    assert all(0.1 <= (r.cancel_after or 0) <= 0.2 for r in cancelled)


def test_prompts_have_the_length_and_share_group_prefixes() -> None:
    spec = WorkloadSpec(
        input_len=parse_dist("64"), prefix_groups=1, prefix_len=32, prefix_share=1.0
    )
    a, b = build_schedule(spec, 10.0, count=2)
    tok = Tokenizer()
    ta, tb = prompt_text(a, seed=0, salt="zsalt"), prompt_text(b, seed=0, salt="zsalt")
    # One word, one token in the simulator's tokenizer.
    assert len(tok.encode(ta)) == 64
    assert len(tok.encode(tb)) == 64
    wa, wb = ta.split(), tb.split()
    assert wa[:33] == wb[:33]  # the salt and the group prefix
    assert wa[33] != wb[33]  # then each its own
    # Another run (another salt) shares nothing with this one from the first token.
    assert prompt_text(a, seed=0, salt="zother").split()[0] != wa[0]


def test_request_body_asks_for_usage_and_exact_output() -> None:
    spec = WorkloadSpec()
    (r,) = build_schedule(spec, 1.0, count=1)
    body = msgspec.json.decode(request_body(r, api="chat", model="m", seed=0, salt="s"))
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 128
    assert body["ignore_eos"] is True
    assert body["messages"][0]["role"] == "user"
    plain = msgspec.json.decode(
        request_body(r, api="completions", model="m", seed=0, salt="s", ignore_eos=False)
    )
    assert "ignore_eos" not in plain
    assert isinstance(plain["prompt"], str)


def test_trace_round_trip_and_rescale() -> None:
    spec = WorkloadSpec(prefix_groups=2, prefix_len=8, prefix_share=0.5, cancel_rate=0.3)
    reqs = build_schedule(spec, 5.0, count=50)
    back = parse_trace(dump_trace(reqs))
    assert [(r.cls, r.input_tokens, r.output_tokens, r.prefix_group) for r in back] == [
        (r.cls, r.input_tokens, r.output_tokens, r.prefix_group) for r in reqs
    ]
    assert [r.at for r in back] == pytest.approx([r.at for r in reqs], abs=1e-6)
    fast = at_rate(back, 20.0)
    assert mean_rate(fast) == pytest.approx(20.0)
    assert rescale([1.0, 2.0, 4.0], 1.0) == pytest.approx([0.0, 2 / 3, 2.0])


def test_trace_lines_and_errors() -> None:
    text = (
        '# a comment\n{"t": 2.5, "input_tokens": 10, "output_tokens": 5}\n'
        '{"t": 1.0, "class": "batch", "prefix_group": 0, "prefix_len": 20,'
        ' "input_tokens": 10, "output_tokens": 3, "cancel_after_s": 0.5}\n'
    )
    first, second = parse_trace(text)
    assert (first.at, first.cls, first.prefix_group, first.input_tokens) == (0.0, "batch", 0, 21)
    assert first.cancel_after == 0.5
    assert (second.at, second.cls) == (1.5, "interactive")
    with pytest.raises(ValueError, match="trace:1"):
        parse_trace('{"t": 0, "input_tokens": 0, "output_tokens": 1}')
    with pytest.raises(ValueError, match="trace:1"):
        parse_trace('{"t": 0, "input_tokens": 1, "output_tokens": 1, "bogus": 1}')
    with pytest.raises(ValueError, match="no requests"):
        parse_trace("\n")


def test_parsers() -> None:
    assert parse_duration("200ms") == pytest.approx(0.2)
    assert parse_duration("1.5") == 1.5
    assert parse_duration("2m") == 120.0
    with pytest.raises(ValueError, match="not a duration: 'fast'"):
        parse_duration("fast")
    assert parse_rates("2, 4,8") == [2.0, 4.0, 8.0]
    with pytest.raises(ValueError, match="a rate must be > 0"):
        parse_rates("0,1")
    assert parse_dist("256") == Dist("fixed", 256)
    assert parse_dist("lognormal:256:0.5").mean() == pytest.approx(256 * 1.1331, rel=1e-3)
    for bad in ("uniform:5:1", "zipf:1:2", "x", "normal:1"):
        with pytest.raises(ValueError, match="distribution"):
            parse_dist(bad)
    t = parse_target("gw=http://127.0.0.1:8080,key=sk-1,model=m")
    assert (t.name, t.url, t.key, t.model) == ("gw", "http://127.0.0.1:8080/v1", "sk-1", "m")
    assert parse_target("v=http://h:1/openai/v1/").url == "http://h:1/openai/v1"
    assert "sk-1" not in str(t.public())
    for bad in ("nourl", "x=ftp://h", "x=http://h,token=1"):
        with pytest.raises(ValueError, match=r"^(expected|not an http|unknown target option)"):
            parse_target(bad)
    assert parse_header("X-Sim-Fault: slow:50") == ("X-Sim-Fault", "slow:50")
    with pytest.raises(ValueError, match="expected NAME=WEIGHT"):
        parse_class("batch")

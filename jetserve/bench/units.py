"""Parsing of the small quantities on the command line: durations and rate lists."""

from __future__ import annotations

import re

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|m|us)?\s*$")
_SCALE = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}


def parse_duration(text: str) -> float:
    """`200ms`, `1.5s`, `2m`, or a bare number of seconds -> seconds."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"not a duration: {text!r} (e.g. 200ms, 1.5s, 2m)")
    return float(m.group(1)) * _SCALE[m.group(2)]


def parse_rates(text: str) -> list[float]:
    """`2,4,8` -> [2.0, 4.0, 8.0] (req/s), each > 0, kept in the given order."""
    rates: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        value = float(part)
        if not value > 0:
            raise ValueError(f"a rate must be > 0 req/s: {part!r}")
        rates.append(value)
    if not rates:
        raise ValueError(f"no rates in {text!r}")
    return rates


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def fmt_rate(rate: float) -> str:
    """2.0 -> '2', 2.5 -> '2.5': rates as people type them."""
    return f"{rate:g}"

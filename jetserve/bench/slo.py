"""Service-level objectives for goodput, as vLLM's `--goodput ttft:200 tpot:50`:
a request is good when it completed and met every objective given."""

from __future__ import annotations

import msgspec

from jetserve.bench.timeline import Timeline
from jetserve.bench.units import parse_duration

_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2e", "e2el": "e2e"}


class Slo(msgspec.Struct, frozen=True, kw_only=True):
    ttft: float | None = None  # seconds
    tpot: float | None = None
    e2e: float | None = None

    @property
    def empty(self) -> bool:
        return self.ttft is None and self.tpot is None and self.e2e is None

    def meets(self, tl: Timeline) -> bool:
        if tl.outcome != "ok":
            return False
        if self.ttft is not None and (tl.ttft is None or tl.ttft > self.ttft):
            return False
        # vLLM counts a one-token reply's TPOT as 0: it meets any TPOT objective.
        tpot = tl.tpot()
        if self.tpot is not None and tpot is not None and tpot > self.tpot:
            return False
        return not (self.e2e is not None and (tl.e2e is None or tl.e2e > self.e2e))

    def describe(self) -> dict[str, float]:
        """Milliseconds, as people write them."""
        return {
            k: round(v * 1000, 3)
            for k, v in (("ttft_ms", self.ttft), ("tpot_ms", self.tpot), ("e2e_ms", self.e2e))
            if v is not None
        }

    def text(self) -> str:
        return ", ".join(f"{k[:-3]} <= {v:g} ms" for k, v in self.describe().items()) or "none"


def parse_slo(items: list[str]) -> Slo:
    """`["ttft=200ms", "tpot=50ms"]`; a bare number is milliseconds (vLLM's unit)."""
    fields: dict[str, float] = {}
    for item in items:
        key, sep, value = item.replace(":", "=", 1).partition("=")
        name = _KEYS.get(key.strip().lower())
        if not sep or name is None:
            raise ValueError(f"expected ttft=|tpot=|e2e=DURATION: {item!r}")
        text = value.strip()
        seconds = float(text) / 1000 if _is_number(text) else parse_duration(text)
        if seconds <= 0:
            raise ValueError(f"an objective must be > 0: {item!r}")
        fields[name] = seconds
    return Slo(**fields)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True

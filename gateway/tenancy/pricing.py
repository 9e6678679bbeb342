"""Prices, in integer micro-USD per 1000 tokens, under a named version.

The worst case (prompt estimate + max_tokens) is reserved before dispatch; the
actual usage is charged after. Integer arithmetic with ceilings: a sum of
charges is exact and never under the true cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streams.wire import Usage


@dataclass(frozen=True)
class Price:
    input_per_1k: int = 100  # micro-USD per 1000 prompt tokens ($0.10 / 1M)
    output_per_1k: int = 300
    cached_per_1k: int | None = None  # None: cached prompt tokens cost as input

    def cost(self, usage: Usage) -> int:
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        cached_rate = self.input_per_1k if self.cached_per_1k is None else self.cached_per_1k
        units = (
            (usage.prompt_tokens - cached) * self.input_per_1k
            + cached * cached_rate
            + usage.completion_tokens * self.output_per_1k
        )
        return -(-units // 1000)  # ceil

    def worst_case(self, prompt_tokens: int, max_tokens: int) -> int:
        return self.cost(Usage(prompt_tokens=prompt_tokens, completion_tokens=max_tokens))


@dataclass(frozen=True)
class PriceBook:
    version: str = "v1"
    prices: dict[str, Price] = field(default_factory=dict)
    default: Price = Price()

    def for_model(self, model: str) -> Price:
        return self.prices.get(model, self.default)


def parse_price(text: str) -> tuple[str, Price]:
    """``model=IN/OUT`` in micro-USD per 1000 tokens, e.g. ``sim-8b=500/1500``."""
    model, _, rates = text.partition("=")
    inp, _, out = rates.partition("/")
    if not model or not inp.isdigit() or not out.isdigit():
        raise ValueError(f"expected MODEL=IN/OUT (micro-USD per 1K tokens), got {text!r}")
    return model, Price(int(inp), int(out))

"""The real-engine tiers' one request through a fleet (tests/vllm, tests/llamacpp)."""

from __future__ import annotations

import dataclasses
from typing import Any

import openai

from jetserve.fleet import Fleet, FleetSpec


@dataclasses.dataclass
class Relayed:
    """One streamed chat answer as an OpenAI SDK client read it through a fleet."""

    text: str
    finish: str | None
    usage: Any


def stream_through_fleet(spec: FleetSpec, body: dict[str, Any]) -> Relayed:
    """SDK -> gateway -> NATS -> worker -> the real engine and back, streamed with
    usage: what the client read (the real-engine tiers' one fleet request)."""
    with (
        Fleet(spec) as fleet,
        openai.OpenAI(
            base_url=f"{fleet.base_url}/v1", api_key=fleet.api_key, max_retries=0
        ) as client,
    ):
        stream = client.chat.completions.create(
            **body, stream=True, stream_options={"include_usage": True}
        )
        parts: list[str] = []
        finish, usage = None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
    return Relayed("".join(parts), finish, usage)

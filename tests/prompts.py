"""Requests that share a long system prompt by group: the prefix-affinity tests'
(lanes, the KV index)."""

from __future__ import annotations


def system_prompt(group: int) -> str:
    rules = "".join(f"Rule {i}: answer group {group} politely and briefly. " for i in range(12))
    return f"You are assistant number {group}. {rules}"


def chat(group: int, question: int) -> dict[str, object]:
    return {
        "model": "sim-8b",
        "max_tokens": 8,
        "messages": [
            {"role": "system", "content": system_prompt(group)},
            {"role": "user", "content": f"Question {question} from a user of group {group}?"},
        ],
    }

"""Which work-queue subject a request goes to: the routing half of prefix
affinity (the worker half is ``workers/inference/affinity.py``).

- ``affinity``: a request with a long enough prefix goes to the lane its
  prefix hashes to, so requests sharing a system prompt share a lane, and the
  lane's owning replica keeps that prefix's KV blocks warm.
- ``round_robin``: requests cycle over the lanes, prefixes ignored (a baseline).
- ``least_loaded``: the plain class subject, where whichever worker has a free
  slot pulls first.

With the KV index on (``--kv-index``, gateway/inference/kv_routing.py), an
``affinity`` request on the shared lanes goes to the lane of the replica whose
engine holds the longest prefix of its routing text, else to its hash lane.

The prefix key includes the tenant unless the route marks the prefix shared:
cache-timing side channels must not cross tenants by default. It includes the
LoRA adapter a request names: an adapter's KV blocks are its own (vLLM keys
its prefix cache by adapter), so one prompt under two adapters shares nothing.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping
from typing import Any

from gateway.inference.kv_routing import KvRouting
from streams.definitions import Topology
from streams.kv_index import PrefixKey, prefix_keys
from streams.routes import RoutingPolicy
from streams.subjects import (
    excess_subject,
    lane_subject,
    pool_lane_subject,
    pool_subject,
    request_subject,
)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


def prefix_text(op: str, body: Mapping[str, Any], routing: RoutingPolicy) -> str | None:
    """The head of the prompt that identifies its shared prefix, or None.

    Leading system/developer messages are the prefix when long enough (many
    users, one long system prompt); otherwise the head of the whole prompt."""
    if op == "chat":
        messages = [m for m in body.get("messages") or [] if isinstance(m, Mapping)]
        system = ""
        for m in messages:
            if m.get("role") not in ("system", "developer"):
                break
            system += _text(m.get("content"))
        head = system if len(system) >= routing.min_prefix_chars else ""
        if not head:
            head = "".join(f"{m.get('role')}:{_text(m.get('content'))}\n" for m in messages)
    elif op == "completion":
        prompt = body.get("prompt")
        head = prompt if isinstance(prompt, str) else ""
    else:
        return None
    if len(head) < routing.min_prefix_chars:
        return None
    return head[: routing.prefix_chars]


def prompt_chars(op: str, body: Mapping[str, Any]) -> int:
    """The length of the whole prompt text, as :func:`prefix_text` reads it."""
    if op == "chat":
        messages = [m for m in body.get("messages") or [] if isinstance(m, Mapping)]
        return sum(len(str(m.get("role"))) + len(_text(m.get("content"))) + 2 for m in messages)
    prompt = body.get("prompt") if op == "completion" else None
    return len(prompt) if isinstance(prompt, str) else 0


class LaneRouter:
    def __init__(self, topology: Topology, kv: KvRouting | None = None) -> None:
        self._topo = topology
        self._turn = itertools.count()
        self.kv = kv  # the fleet's KV index (None: hash lanes only)

    def subject(
        self,
        op: str,
        cls: str,
        tenant: str,
        body: Mapping[str, Any],
        routing: RoutingPolicy,
        shared_prefix: bool = False,
        excess: bool = False,
        pool: str = "",
        adapter: str = "",
    ) -> str:
        """The work-queue subject (see :meth:`route`)."""
        return self.route(op, cls, tenant, body, routing, shared_prefix, excess, pool, adapter)[0]

    def route(
        self,
        op: str,
        cls: str,
        tenant: str,
        body: Mapping[str, Any],
        routing: RoutingPolicy,
        shared_prefix: bool = False,
        excess: bool = False,
        pool: str = "",
        adapter: str = "",
    ) -> tuple[str, list[PrefixKey]]:
        """The work-queue subject: a lane by prefix (or by the KV index) or in
        turn, the class's own, or (``excess``, a tenant past its turn) the
        class's excess subject; with ``pool`` (a deployment pool's token), the
        pool's lane or plain subject (a pool has no excess: its workers are the
        route's alone). And the request's prefix keys, when the KV index is on
        (the worker that serves it ties them to the blocks it stores)."""
        if pool:
            plain = pool_subject(pool, cls)
            lanes = self._topo.pool_lanes if cls in self._topo.lane_classes else 0
        elif excess and cls in self._topo.excess_classes:
            return excess_subject(cls), []
        else:
            plain = request_subject(cls)
            lanes = self._topo.lanes_of(cls) if cls in self._topo.lane_classes else 0
        if routing.mode == "least_loaded" or not lanes:
            return plain, []
        keys: list[PrefixKey] = []
        if routing.mode == "round_robin":
            lane = next(self._turn) % lanes
        else:
            head = prefix_text(op, body, routing)
            if head is None:
                return plain, []
            scope = "" if shared_prefix else tenant
            if adapter:  # a base model's keys stay as they were
                scope = f"{scope}\0{adapter}"
            digest = hashlib.blake2b(f"{scope}\0{head}".encode(), digest_size=8).digest()
            lane = int.from_bytes(digest, "big") % lanes
            if self.kv is not None and not pool:
                # Pools keep their hash lanes: the index covers the shared lanes.
                keys = prefix_keys(scope, head, prompt_chars(op, body))
                lane = self.kv.lane(lanes, keys, lane, cls)
        subject = pool_lane_subject(pool, cls, lane) if pool else lane_subject(cls, lane)
        return subject, keys

"""Deployment pools: subjects that only the workers of one deployment pull.

A request whose route contract names candidate deployments must be served by
one of them. On the shared class subjects every worker would pull it, and one
outside the candidates could only hand it back (a delivery spent, the request
delayed). So each deployment has a *pool*: its own plain subject per class
(``jetserve.pool.<token>.<class>``) and prefix-affinity lanes for the lane
classes (``...<class>.lNN``), each a durable consumer of the same work-queue
stream, pulled only by workers that declare that deployment. The gateway
publishes a routed request to its first candidate's pool that has live
workers; a worker whose attempt fails retryably hands the request to the next
candidate's pool (fallback only inside the contract). Lanes in a pool are
owned among the pool's workers alone.

The token is the deployment name when it is a plain token, else a hash of it:
deployment names may hold dots, which subjects cannot.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from streams.definitions import PRIORITY_GROUP, Topology
from streams.subjects import LANE_CLASSES, RequestClass, pool_lane_subject, pool_subject

_PLAIN = re.compile(r"[A-Za-z0-9_-]{1,48}")


def adapter_pool(deployment: str, adapter: str) -> str:
    """The pool of the workers of ``deployment`` whose engine holds the LoRA
    ``adapter``: requests for the adapter go only there. ``@`` never occurs in a
    deployment name (streams.routes.Name), so this names no deployment's pool."""
    return f"{deployment}@{adapter}"


def pool_token(deployment: str) -> str:
    if _PLAIN.fullmatch(deployment):
        return deployment
    return "h" + hashlib.blake2b(deployment.encode(), digest_size=10).hexdigest()


def pool_of_consumer(name: str, cls: str, lane: bool) -> str:
    """The pool token of a consumer of ``cls`` (``pool-<token>-<cls>[-lNN]``), as
    ``Topology.consumer_class`` read it; "" for a shared one (``workers-...``)."""
    if not name.startswith("pool-"):
        return ""
    head = name.rsplit("-", 1)[0] if lane else name
    return head[len("pool-") : -len(cls) - 1]


def pool_consumer_name(token: str, cls: RequestClass | str) -> str:
    return f"pool-{token}-{RequestClass(cls).value}"


def pool_lane_consumer_name(token: str, cls: RequestClass | str, lane: int) -> str:
    return f"{pool_consumer_name(token, cls)}-l{lane:02d}"


def pool_consumer_configs(topo: Topology, token: str) -> list[dict[str, Any]]:
    """Raw JetStream configs of a pool's consumers: a plain one per class, and
    ``topo.pool_lanes`` lanes (priority group, as the shared lanes) per lane class."""
    lim = topo.limits
    base = {
        "ack_policy": "explicit",
        "ack_wait": int(lim.ack_wait_s * 1e9),
        "max_waiting": lim.max_waiting,
        "max_ack_pending": -1,
    }
    out = []
    for cls in topo.classes:
        out.append(
            {
                **base,
                "durable_name": pool_consumer_name(token, cls),
                "filter_subject": pool_subject(token, cls),
                "max_deliver": lim.max_deliver,
            }
        )
        if cls not in LANE_CLASSES:
            continue
        for lane in range(topo.pool_lanes):
            out.append(
                {
                    **base,
                    "durable_name": pool_lane_consumer_name(token, cls, lane),
                    "filter_subject": pool_lane_subject(token, cls, lane),
                    "max_deliver": topo.lane_max_deliver,
                    "priority_groups": [PRIORITY_GROUP],
                    "priority_policy": "prioritized",
                }
            )
    return out

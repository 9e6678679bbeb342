"""One way for a process to open its Redis: a single server or a Redis Cluster.

Both are reached with the process's own ACL user (the URL names it, the password
comes from the environment: jetserve/commands/common.py). On a cluster the URL
names any one node; the client learns the others from it (``CLUSTER SLOTS``) and
routes each command to the primary that holds its key's slot. The key names are
the same on both: the multi-key scripts tag their keys so that each script's keys
share a slot (gateway/tenancy/accounting_keys.py, gateway/inference/coalesce_fleet.py).
"""

from __future__ import annotations

from typing import TypeAlias

import redis.asyncio as redis

# What the stores take: either client offers the commands they use.
RedisClient: TypeAlias = "redis.Redis | redis.RedisCluster"
# Connections per cluster node (see open_redis).
CLUSTER_MAX_CONNECTIONS = 1024


def open_redis(
    url: str,
    *,
    password: str | None = None,
    cluster: bool = False,
    max_connections: int = 64,
    timeout_s: float = 2.0,
) -> redis.Redis | redis.RedisCluster:
    """A client for ``url``; ``cluster``: a Redis Cluster seeded from that node.

    A single server's pool is bounded and blocking: bursts queue for a connection
    instead of opening thousands. The cluster client's pool (per node) does not
    queue: past its bound a command fails at once, so it gets
    :data:`CLUSTER_MAX_CONNECTIONS` per node rather than a burst's 503s."""
    if cluster:
        return redis.RedisCluster.from_url(
            url,
            password=password,
            max_connections=CLUSTER_MAX_CONNECTIONS,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
        )
    pool = redis.BlockingConnectionPool.from_url(
        url,
        password=password,
        max_connections=max_connections,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )
    # from_pool: the client owns the pool, so aclose() closes its connections too
    # (Redis(connection_pool=...) leaves them open, for whoever made the pool).
    return redis.Redis.from_pool(pool)

"""The accountant's Redis key names, and the registry of orgs that hold budget.

Every key one request's scripts touch carries its org as a Redis Cluster hash
tag, ``{<org>}``: a script may only name keys of one hash slot, and an org's
limits, counters, rate-limit state, reservations and expiry index then all live
in one slot, on one primary; different orgs spread over the cluster's primaries.
On a single Redis the tag is just part of the name (one code path for both).
Org ids are safe ids (``[A-Za-z0-9_-]``), so a tag can never hold a brace.

``P`` is the prefix (default ``jetserve:acct:``, which the gateway's Redis ACL
user owns)::

    P{<org>}:limits:<level>:<ident>          hash   budget, period, rpm, tpm, weight
    P{<org>}:spend:<level>:<bucket>:<ident>  hash   spent, reserved (micro-USD)
    P{<org>}:gcra:<rpm|tpm>:<level>:<ident>  string GCRA theoretical arrival time (µs)
    P{<org>}:resv:<request_id>               hash   one live reservation
    P{<org>}:done:<request_id>               hash   a settled request's charge and writer
    P{<org>}:resv-expiry                     zset   the org's holds by expiry (µs)
    P resv-orgs                              zset   orgs that may hold, by registration time

The sweep of abandoned holds must find every org's index without a fleet-wide
key in the reserve script (that key would pin every script to its slot). So a
gateway registers an org in ``resv-orgs`` *before* its first reservation for it,
and again every :data:`REGISTRY_REFRESH_S`; the sweep reads the registry, then
each org's index. An org is dropped from the registry only when its index is
empty *and* its last registration is older than the refresh plus
:data:`REGISTRY_MARGIN_S`, checked and removed by one script on the registry key
(:data:`PRUNE_LUA`): a gateway that may still reserve for the org without
registering again registered it within the refresh, so its score is too recent
to drop. The margin covers a reserve still in flight when its registration
lapses (bounded by the accountant's timeout) and clock skew between gateways.
Why not scan each primary instead: a SCAN on every node each sweep costs the
whole keyspace, misses keys that move during a resharding, and needs a command
the gateway's ACL user does not have (``KEYS``/``SCAN`` over every prefix).
"""

from __future__ import annotations

from gateway.tenancy.limits import Level, LimitKind

DEFAULT_PREFIX = "jetserve:acct:"
# How often a process registers an org again while it keeps reserving for it.
REGISTRY_REFRESH_S = 60.0
# Past refresh + margin without a registration, an org with no holds is dropped.
REGISTRY_MARGIN_S = 300.0

# KEYS[1] the registry; ARGV[1] the org, ARGV[2] the cutoff (µs). Drops the org
# only if its last registration is older than the cutoff (the caller saw its
# index empty first); returns 1 when it did.
PRUNE_LUA = """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if s and tonumber(s) < tonumber(ARGV[2]) then return redis.call('ZREM', KEYS[1], ARGV[1]) end
return 0
"""


class AccountingKeys:
    """The key names of one prefix (see the module docstring)."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix

    def _org(self, org: str) -> str:
        return f"{self.prefix}{{{org}}}:"

    def limits(self, org: str, level: Level, ident: str) -> str:
        return f"{self._org(org)}limits:{level}:{ident}"

    def spend(self, org: str, level: Level, bucket: str, ident: str) -> str:
        return f"{self._org(org)}spend:{level}:{bucket}:{ident}"

    def gcra(self, org: str, kind: LimitKind, level: Level, ident: str) -> str:
        return f"{self._org(org)}gcra:{kind}:{level}:{ident}"

    def resv(self, org: str, request_id: str) -> str:
        return f"{self._org(org)}resv:{request_id}"

    def done(self, org: str, request_id: str) -> str:
        return f"{self._org(org)}done:{request_id}"

    def index(self, org: str) -> str:
        return f"{self._org(org)}resv-expiry"

    @property
    def registry(self) -> str:
        return f"{self.prefix}resv-orgs"

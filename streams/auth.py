"""Who may publish and subscribe what on the bus: one NATS user per role.

The table below is the whole authorization of a deployment; ``jetserve
nats-config`` renders it as the nats-server ``authorization`` block
(jetserve/credentials.py) and docs/security.md explains it. Every name in it
comes from the stream and subject definitions, so a renamed stream changes the
permissions with it.

JetStream is reached through subjects too: ``$JS.API.STREAM.INFO.<stream>``,
``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`` (a pull), ``$JS.ACK.<stream>.>``
(an ack), ``$KV.<bucket>.<key>`` (a KV put). Granting those per stream is what
keeps a worker off the routes bucket and a service off the work queue.

Each role receives replies (JetStream API answers, pull deliveries, push
consumers) on its own inbox prefix, so no role can read another's: a service
of tenant ``t`` on ``_INBOX.tenant.t.>``, the internal roles on ``_INBOX.<role>.>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from streams.agent_topology import DEFAULT_AGENT, AgentTopology
from streams.definitions import (
    DEFAULT_TOPOLOGY,
    MAX_FRAMES_PARTITIONS,
    MAX_LANE_SHARDS,
    Topology,
    frames_stream_names,
)
from streams.depth import DEPTH_SUBJECT
from streams.evidence import EVIDENCE_BUCKET
from streams.ids import is_safe_id
from streams.leases import LEASES_BUCKET
from streams.marks import CANCELS_BUCKET, FAILURES_BUCKET
from streams.outbox import DEFAULT_OUTBOX, OutboxTopology
from streams.request_ledger import DEFAULT_LEDGER, LedgerTopology
from streams.routes import ROUTES_BUCKET
from streams.subjects import (
    KV_INDEX_SUBJECT,
    LIVE,
    POOL_SPACE,
    PREFIX,
    ROLLOUT_EVENTS,
    RequestClass,
    request_subject,
)

# Buckets other packages own (their names are theirs; the bus only needs them here).
MEMBERS_BUCKET = "jetserve_workers"  # workers/inference/affinity.py
EFFECTS_BUCKET = "JETSERVE_EFFECTS"  # tools/effects.py
TOOL_SUBJECTS = f"{PREFIX}.tool.>"  # remote tools are served under jetserve.tool.<name>
SERVICE_INBOX = "_INBOX.tenant"


class Role(StrEnum):
    GATEWAY = "gateway"
    WORKER = "worker"
    AGENT = "agent"  # the agent run executor
    ADMIN = "admin"  # the operator's CLI and provisioning: the whole bus
    SERVICE = "service"  # a tenant's service on the NATS-native API
    TOOLS = "tools"  # a process serving remote tools


def inbox_prefix(role: Role, tenant: str | None = None) -> str:
    """The subject prefix a process of ``role`` receives its replies under."""
    if role is Role.SERVICE:
        return service_inbox(tenant)
    return f"_INBOX.{role.value}"


def service_inbox(tenant: str | None) -> str:
    if tenant is None or not is_safe_id(tenant):
        raise ValueError(f"a service credential names one tenant (a safe id), not {tenant!r}")
    return f"{SERVICE_INBOX}.{tenant}"


def tenant_of_inbox(subject: str) -> str | None:
    """The tenant a service inbox subject belongs to, or None if it is none."""
    head = SERVICE_INBOX + "."
    if not subject.startswith(head):
        return None
    tenant = subject[len(head) :].split(".", 1)[0]
    return tenant if is_safe_id(tenant) else None


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # May publish to the reply subject of a request it received (nats-server
    # ``allow_responses``): a tool server answers without a publish grant.
    allow_responses: bool = False


_READ_STREAM = ("INFO", "MSG.GET")
# Create it if nobody has yet, never change it: with UPDATE a worker's or an
# executor's credential could add any subject to a stream it may read (its
# bucket's), and so record every tenant's API traffic (keys, prompts, answers).
# A create of a stream that exists with another config is refused by the server.
_MAKE_STREAM = ("INFO", "MSG.GET", "CREATE")
_OWN_STREAM = ("INFO", "MSG.GET", "CREATE", "UPDATE")


def _stream(name: str, ops: tuple[str, ...]) -> list[str]:
    """The JetStream API subjects of ``ops`` on one stream (never DELETE or PURGE)."""
    subjects = [f"$JS.API.STREAM.{op}.{name}" for op in ops]
    subjects += [f"$JS.API.DIRECT.GET.{name}", f"$JS.API.DIRECT.GET.{name}.>"]
    return subjects


def _consumers(stream: str, *, manage: bool, names: tuple[str, ...] = (">",)) -> list[str]:
    """Read (info, pull, ack) ``names`` of ``stream``'s consumers; with ``manage``
    also create and delete them (durables, and the ephemerals a watch or a push
    subscription makes)."""
    out: list[str] = []
    for n in names:
        out += [f"$JS.API.CONSUMER.INFO.{stream}.{n}", f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{n}"]
        out.append(f"$JS.ACK.{stream}.{n}" if n == ">" else f"$JS.ACK.{stream}.{n}.>")
    if names == (">",):  # all of them: list them too (one request reads every lane)
        out.append(f"$JS.API.CONSUMER.LIST.{stream}")
    if manage:
        out += [
            f"$JS.API.CONSUMER.CREATE.{stream}",
            f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DELETE.{stream}.>",
            f"$JS.API.CONSUMER.NAMES.{stream}",
            f"$JS.FC.{stream}.>",
        ]
    return out


def _kv(bucket: str, *, own: bool, make: bool = False) -> list[str]:
    """Read, watch and put one KV bucket (``own``: create or update it too;
    ``make``: create it if absent, never update it)."""
    stream = f"KV_{bucket}"
    ops = _OWN_STREAM if own else _MAKE_STREAM if make else _READ_STREAM
    return [
        *_stream(stream, ops),
        *_consumers(stream, manage=True),
        f"$KV.{bucket}.>",
    ]


def _marks(bucket: str, *, write: bool = False, watch: bool = False) -> list[str]:
    """A mark bucket (streams/marks.py): bind or create it and read by key;
    ``write``: put too; ``watch``: read them all (an ordered consumer)."""
    stream = f"KV_{bucket}"
    subjects = _stream(stream, _MAKE_STREAM)
    if watch:
        subjects += _consumers(stream, manage=True)
    return [*subjects, f"$KV.{bucket}.>"] if write else subjects


def _request_streams(topo: Topology) -> tuple[str, ...]:
    """The work-queue streams of any layout (one stream, one per class, and
    every lane shard there may be): credentials are made before a gateway picks."""
    split = topo.split(True, MAX_LANE_SHARDS)
    return (topo.split(False).stream, *split.request_streams)


def frames_streams(topo: Topology) -> list[str]:
    """Every capture stream a fleet of ``topo``'s names may run: the single one
    and each partition's up to the most there may be. The count is the fleet's
    (recorded in its work-queue stream), so the credentials do not depend on it."""
    return [topo.frames_stream, *frames_stream_names(topo.frames_stream, MAX_FRAMES_PARTITIONS)]


def permissions(
    role: Role,
    tenant: str | None = None,
    topo: Topology = DEFAULT_TOPOLOGY,
    agent: AgentTopology = DEFAULT_AGENT,
    ledger: LedgerTopology = DEFAULT_LEDGER,
    outbox: OutboxTopology = DEFAULT_OUTBOX,
) -> Permissions:
    """The subjects ``role`` may publish and subscribe; everything else is refused."""
    inbox = f"{inbox_prefix(role, tenant)}.>"
    reply = f"{PREFIX}.reply.>"
    live = f"{LIVE}.>"  # the reply subjects' live twins (workers/inference/relay.py)
    frames = frames_streams(topo)
    if role is Role.ADMIN:
        return Permissions(publish=(">",), subscribe=(">",))
    if role is Role.SERVICE:
        # Its requests on the NATS-native API; answers on its inbox; its own
        # tenant's run events live (the tenant token is in the subject).
        run_events = f"{PREFIX}.run.{tenant}.>"
        return Permissions(publish=(f"{PREFIX}.api.>",), subscribe=(inbox, run_events))
    if role is Role.TOOLS:
        # $SRV: the NATS service API (discovery and stats of its tools).
        return Permissions(publish=(), subscribe=(TOOL_SUBJECTS, "$SRV.>"), allow_responses=True)
    if role is Role.WORKER:
        return Permissions(
            publish=(
                *(x for q in _request_streams(topo) for x in _stream(q, _READ_STREAM)),
                *(s for name in frames for s in _stream(name, ("INFO",))),
                *(x for q in _request_streams(topo) for x in _consumers(q, manage=False)),
                *_kv(MEMBERS_BUCKET, own=False, make=True),
                *_marks(CANCELS_BUCKET, watch=True),  # cancels sent before it listened
                *_marks(FAILURES_BUCKET, write=True),  # attempts that really failed
                reply,  # frames, to whichever gateway or executor asked
                live,
                f"{PREFIX}.dlq.req.>",  # a message it cannot read
                f"{PREFIX}.dlq.pool.>",
                # Hand a failed request to the next candidate's pool
                # (streams/pools.py; the gateway makes the pools).
                f"{POOL_SPACE}.>",
                KV_INDEX_SUBJECT,  # what its engine's KV cache holds (streams/kv_index.py)
            ),
            # The fleet depth reader's looks: pending counts without asking the server.
            subscribe=(inbox, f"{PREFIX}.cancel.>", DEPTH_SUBJECT),
        )
    if role is Role.AGENT:
        return Permissions(
            publish=(
                *(x for q in _request_streams(topo) for x in _stream(q, _READ_STREAM)),
                # Cancel a queued model call.
                *(f"$JS.API.STREAM.MSG.DELETE.{q}" for q in _request_streams(topo)),
                *(s for name in frames for s in _stream(name, _READ_STREAM)),
                # Resume a model call.
                *(s for name in frames for s in _consumers(name, manage=True)),
                *_stream(agent.stream, _MAKE_STREAM),
                *_stream(agent.events_stream, _MAKE_STREAM),
                *_consumers(agent.stream, manage=True),
                *_kv(agent.bucket, own=False, make=True),
                *_kv(EFFECTS_BUCKET, own=False, make=True),
                *_marks(CANCELS_BUCKET, write=True),  # a cancelled model call's mark
                "$JS.API.STREAM.NAMES",
                request_subject(RequestClass.AGENT),  # its model calls
                f"{PREFIX}.cancel.>",
                f"{PREFIX}.agent.>",  # step nudges (children) and settlements
                f"{PREFIX}.run.>",  # run events
                f"{PREFIX}.agentctl.>",  # cancel notices to children
                f"{PREFIX}.dlq.agent.>",
                TOOL_SUBJECTS,
            ),
            subscribe=(
                inbox,
                reply,
                live,
                f"{PREFIX}.agentctl.cancel.*",
                f"{PREFIX}.resumed.>",
            ),
        )
    # The gateway: the control plane. It provisions the request-path streams,
    # publishes requests, reads replies and answers services on their inboxes.
    owned = [*_request_streams(topo), *frames, topo.dlq_stream, agent.stream]
    owned += [agent.events_stream, outbox.stream]
    publish = [s for name in owned for s in _stream(name, _OWN_STREAM)]
    # The ledger, the audit trail: created, never changed (lower limits would purge
    # it); an operator changes its config with the admin credential.
    publish += _stream(ledger.stream, _MAKE_STREAM)
    publish += [s for name in (*owned, ledger.stream) for s in _consumers(name, manage=True)]
    publish += [*_kv(ROUTES_BUCKET, own=True), *_kv(agent.bucket, own=True)]
    publish += _kv(LEASES_BUCKET, own=True)  # the rollout guard's election
    publish += _kv(EVIDENCE_BUCKET, own=True)  # evidence per route revision
    publish += [*_kv(EFFECTS_BUCKET, own=False)]  # the admin API resolves ambiguous effects
    publish += _kv(MEMBERS_BUCKET, own=False)  # which deployment pools have live workers
    publish += _marks(CANCELS_BUCKET, write=True)  # a cancel's durable mark
    publish += ["$JS.API.INFO", "$JS.API.STREAM.NAMES"]
    # Cancelled or dead-lettered.
    publish += [f"$JS.API.STREAM.MSG.DELETE.{q}" for q in _request_streams(topo)]
    publish.append(f"$JS.API.STREAM.MSG.DELETE.{outbox.stream}")  # a settlement applied
    publish += [
        f"{PREFIX}.req.>",
        f"{POOL_SPACE}.>",
        f"{PREFIX}.cancel.>",
        f"{PREFIX}.resumed.>",
        f"{PREFIX}.ledger.>",
        f"{outbox.subject_prefix}.>",
        f"{PREFIX}.agent.>",
        f"{PREFIX}.run.>",
        f"{PREFIX}.agentctl.>",
        f"{PREFIX}.dlq.>",
        ROLLOUT_EVENTS,
        f"{PREFIX}.depth.>",  # the elected reader's queue depths (gateway/inference/depth_share.py)
        reply,  # a dead-lettered request's error frame
        live,
        f"{SERVICE_INBOX}.>",  # answers to services (checked: the caller's own inbox)
    ]
    return Permissions(
        publish=tuple(publish),
        subscribe=(
            inbox,
            f"{PREFIX}.api.>",
            reply,
            live,
            f"{PREFIX}.resumed.>",
            KV_INDEX_SUBJECT,  # the fleet's KV index (--kv-index)
            f"{PREFIX}.depth.>",
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>",
        ),
    )

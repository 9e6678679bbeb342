"""Settling agent runs: the hold a run took on its tenant's budgets becomes the
actual charge once the whole run tree has ended, and one ledger record says so.

A durable pull consumer (``gateway-run-settle``) shared by every gateway
replica reads ``jetserve.agent.settle`` (the executor asks once a root run
ends). The charge is the sum of the own spend of every run in the tree (so a
child is never counted twice, nor missed when its parent was cancelled under
it). ``Accountant.settle`` is atomic and happens once per run id; whoever
settles writes the ledger record, so a redelivered request charges nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from gateway.errors import GatewayError
from gateway.tenancy.accounting import Accountant, Scope
from gateway.tenancy.records import AGENT_RUN_ROUTE, RecordHead
from gateway.tenancy.request_ledger import LedgerWriteError, LedgerWriter
from streams.agent import Run, Spend, decode_settle
from streams.agent_store import RunStore
from streams.consumer import Limit, PullConsumer, PullLoop
from streams.errors import RunStoreError
from streams.subjects import RequestClass

log = logging.getLogger(__name__)

# Past the root's deadline by this much, a tree with runs that never ended (an
# executor fleet that was down) is settled with what they recorded so far.
_STRAGGLER_GRACE_S = 120.0
_BATCH = 16  # requests one pull may bring, and settled at once
_GRACE_S = 5.0  # for settlements in flight at shutdown (then redelivered)
_RECORD_RETRY_S = 2.0  # a ledger that refused the record: asked again after this
RUN_SETTLE_WRITER = "run-settle"  # the settlement's name, whichever replica applies it


class RunSettler:
    def __init__(
        self,
        js: JetStreamContext,
        store: RunStore,
        accountant: Accountant,
        ledger: LedgerWriter,
        gateway_id: str,
    ) -> None:
        self._js = js
        self._store = store
        self._accountant = accountant
        self._ledger = ledger
        self._gateway_id = gateway_id
        self._slots = Limit(_BATCH)
        self._consumer = PullConsumer(
            self._serve, graceful_timeout_s=_GRACE_S, name=f"run settler {gateway_id}"
        )
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        topo = self._store.topo
        sub = await self._js.pull_subscribe_bind(topo.settle_consumer, topo.stream)
        loop = PullLoop(
            sub, self._consumer.start, slots=self._slots, batch=_BATCH, error_backoff_s=1.0
        )
        self._consumer.add(loop)
        self._task = asyncio.create_task(self._consumer.run())

    async def stop(self) -> None:
        """Stop pulling, hand strays back, let settlements in flight finish."""
        self._consumer.shutdown()
        if self._task is not None:
            await self._task

    async def _serve(self, msg: Msg) -> None:
        try:
            await self._one(msg)
        finally:
            await self._slots.release()

    async def _one(self, msg: Msg) -> None:
        try:
            run_id = decode_settle(msg.data).run_id
        except msgspec.DecodeError:
            await msg.term()
            return
        try:
            verdict = await self.settle(run_id)
        except (RunStoreError, GatewayError) as exc:
            log.warning("settling run %s: %s", run_id, exc.message)
            verdict = 2.0
        with contextlib.suppress(nats.errors.Error):
            if verdict is None:
                await msg.ack()
            else:
                await msg.nak(delay=verdict)

    async def settle(self, run_id: str) -> float | None:
        """Settle ``run_id``'s tree: None when done (or nothing to do), else
        seconds to wait before trying again (runs of the tree still going)."""
        stored = await self._store.get(run_id)
        if stored is None:
            return None
        root = stored.run
        tree = await self._tree(root)
        live = [r for r in tree if not r.terminal]
        if live and time.time() < root.deadline + _STRAGGLER_GRACE_S:
            return 1.0
        spent = Spend()
        for r in tree:
            spent = spent.plus(r.spent)
        # Under one writer's name for every replica: a redelivery (this settler
        # killed between the charge and the record, or the ledger down) is told
        # "repeat" with the charge applied, and writes the record (the ledger
        # de-duplicates it by the run's id). Unnamed, it was told "someone else
        # did it" and the run was charged with no record, ever.
        settled, charge = await self._accountant.settle(
            root.id, spent.cost_micros, RUN_SETTLE_WRITER, org=root.org or root.tenant
        )
        if not settled:
            return None  # no hold, or settled by another path (the orphan sweep)
        head = RecordHead(
            scope=Scope(root.org, root.tenant, root.key_id),
            request_id=root.id,
            op="chat",
            cls=RequestClass.AGENT.value,
            model=root.model,
            created=root.created,
            price_version=root.price.version,
            gateway=self._gateway_id,
            route=AGENT_RUN_ROUTE,
        )
        record = head.settled(
            policy="admitted",
            attempts=spent.steps,
            usage=spent.usage(),
            charge_micros=charge,
            reserved_micros=root.budget.max_cost_micros,
            outcome=root.status,
            status=200,
            duration_ms=max(0.0, root.updated - root.created) * 1000,
        )
        # Who let the tree's gated calls run: the ledger's half of the audit
        # trail (the runs keep the whole decisions).
        approvers = (a.key_id for r in tree for a in r.approvals if a.approve)
        record = msgspec.structs.replace(record, approved_by=tuple(dict.fromkeys(approvers)))
        try:
            await self._ledger.append(record)
        except LedgerWriteError as exc:
            # Charged, not recorded: the request is redelivered, and its repeat
            # writes the record (acked here, the record was lost).
            log.error("ledger append for run %s failed: %s", root.id, exc.message)
            return _RECORD_RETRY_S
        return None

    async def _tree(self, root: Run) -> list[Run]:
        out, todo = [root], list(root.children)
        while todo:
            stored = await self._store.get(todo.pop())
            if stored is not None:
                out.append(stored.run)
                todo.extend(stored.run.children)
        return out

"""``jetserve conformance``: run the adapter corpus (``jetserve/conformance/``)
against a live engine and print the translation-loss report. With
``--evidence ROUTE --deployment D`` the report is attached to the route's
current revision as D's conformance evidence, covering the fingerprint D had
when the run started (docs/rollout.md): a route changed meanwhile refuses it."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jetserve.commands.admin import add_admin_options, client
from jetserve.commands.admin_client import AdminError
from jetserve.commands.common import engine_api_key
from jetserve.conformance.publish import document, run_dialects
from jetserve.conformance.report import Report, matrix_markdown
from workers.engines.factory import DIALECTS, SIM_DIALECTS

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    p = sub.add_parser("conformance", allow_abbrev=False, help="adapter translation-loss report")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        required=True,
        help="engine base URL (an API key it checks: JETSERVE_ENGINE_API_KEY, or _FILE)",
    )
    p.add_argument(
        "--dialect",
        choices=[*DIALECTS, "all"],
        default="openai",
        help="the adapter; all: each adapter in turn against an engine that speaks every "
        "dialect (the simulator)",
    )
    p.add_argument("--model", default="sim-8b", help="model name (Triton's URL needs it)")
    p.add_argument(
        "--no-faults",
        dest="faults",
        action="store_false",
        help="a real engine: skip the cases that need the simulator's X-Sim-Fault",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report here")
    p.add_argument(
        "--markdown",
        default=None,
        metavar="PATH",
        help="also write the reports as one document (docs/conformance.md's shape)",
    )
    p.add_argument(
        "--evidence",
        default=None,
        metavar="ROUTE",
        help="attach the report to ROUTE's current revision (admin API; with --deployment)",
    )
    p.add_argument(
        "--deployment",
        default=None,
        help="the route's candidate deployment this engine serves (its adapter is the dialect)",
    )
    add_admin_options(p)


async def _run(args: argparse.Namespace) -> list[Report]:
    dialects = list(SIM_DIALECTS) if args.dialect == "all" else [args.dialect]
    return await run_dialects(
        args.engine,
        dialects,
        model=args.model,
        api_key=engine_api_key(),
        faults_supported=args.faults,
    )


def _covered(args: argparse.Namespace) -> tuple[int, str]:
    """The route's current revision and the deployment's fingerprint, read
    before the run; the deployment must be the route's, of this adapter."""
    if args.dialect == "all" or not args.deployment:
        raise SystemExit("jetserve conformance: --evidence needs --deployment and one --dialect")
    with client(args) as admin:
        shown = admin.show_route(args.evidence)
    deps = {d["name"]: d for d in shown["contract"]["candidates"]}
    dep = deps.get(args.deployment)
    if dep is None:
        raise SystemExit(
            f"jetserve conformance: {args.evidence} has no deployment {args.deployment!r}"
            f" (it has {sorted(deps)})"
        )
    if dep["adapter"] != args.dialect:
        raise SystemExit(
            f"jetserve conformance: {args.deployment} uses the {dep['adapter']} adapter;"
            f" run --dialect {dep['adapter']}"
        )
    return int(shown["revision"]), str(shown["fingerprints"][args.deployment])


def _attach(args: argparse.Namespace, report: Report, revision: int, fingerprint: str) -> None:
    body = {
        "revision": revision,
        "conformance": {args.deployment: report.to_json()},
        "covers": {args.deployment: fingerprint},
    }
    with client(args) as admin:
        admin.attach_evidence(args.evidence, body)
    print(
        f"attached to {args.evidence} r{revision} as {args.deployment}'s conformance"
        f" (fingerprint {fingerprint})"
    )


def run(args: argparse.Namespace) -> int:
    """Exit 0 when nothing was silently dropped and nothing failed, else 1."""
    try:
        covered = _covered(args) if args.evidence else None
    except AdminError as exc:
        print(f"jetserve conformance: {exc}", file=sys.stderr)
        return 1
    reports = asyncio.run(_run(args))
    for report in reports:
        print(report.to_markdown())
        if report.silent_drops:
            print(f"SILENT DROPS: {', '.join(r.case for r in report.silent_drops)}")
        if report.failures:
            print(f"FAILURES: {', '.join(r.case for r in report.failures)}")
    if len(reports) > 1:
        print(matrix_markdown(reports))
    if args.json:
        body = reports[0].to_json() if len(reports) == 1 else [r.to_json() for r in reports]
        Path(args.json).write_text(json.dumps(body, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(document(reports, args.engine))
    if covered is not None:
        try:
            _attach(args, reports[0], *covered)
        except AdminError as exc:
            print(f"jetserve conformance: not attached: {exc}", file=sys.stderr)
            return 1
    return 0 if all(r.ok for r in reports) else 1

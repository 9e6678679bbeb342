"""``jetserve conformance``: run the adapter corpus (``jetserve/conformance/``)
against a live engine and print the translation-loss report."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING

from jetserve.conformance.report import Report
from jetserve.conformance.runner import run_corpus
from workers.engines.factory import DIALECTS, make_adapter

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    p = sub.add_parser("conformance", allow_abbrev=False, help="adapter translation-loss report")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True, help="engine base URL")
    p.add_argument("--dialect", choices=DIALECTS, default="openai")
    p.add_argument("--model", default="sim-8b", help="model name (Triton's URL needs it)")
    p.add_argument("--engine-api-key", default=None)
    p.add_argument(
        "--no-faults",
        dest="faults",
        action="store_false",
        help="a real engine: skip the cases that need the simulator's X-Sim-Fault",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report here")


async def _run(args: argparse.Namespace) -> Report:
    async with make_adapter(args.dialect, args.engine, args.engine_api_key, args.model) as adapter:
        return await run_corpus(
            adapter, engine_url=args.engine, dialect=args.dialect, faults_supported=args.faults
        )


def run(args: argparse.Namespace) -> int:
    """Exit 0 when nothing was silently dropped and nothing failed, else 1."""
    report = asyncio.run(_run(args))
    print(report.to_markdown())
    if report.silent_drops:
        print(f"SILENT DROPS: {', '.join(r.field for r in report.silent_drops)}")
    if report.failures:
        print(f"FAILURES: {', '.join(r.field for r in report.failures)}")
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0 if report.ok else 1

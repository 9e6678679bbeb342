"""``jetserve bench ...``: the benchmark harness (``jetserve/bench/``), which parses
every flag after ``bench`` itself."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    # Every flag after `bench` belongs to jetserve.bench.cli: an unmatchable prefix
    # char keeps argparse from reading them as this parser's options.
    b = sub.add_parser(
        "bench",
        allow_abbrev=False,
        add_help=False,
        prefix_chars="\x00",
        help="open-loop benchmarks, side by side (jetserve bench --help)",
    )
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jetserve.bench.cli import main as bench_main

    return bench_main(args.bench_args)

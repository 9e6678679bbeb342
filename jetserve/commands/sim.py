"""``jetserve sim``: the vLLM-like engine simulator (the top-level ``sim`` package).

The simulator owns its flags: ``jetserve/cli.py`` hands everything after ``sim``
to its parser before this parser sees them; the entry here only lists it in help.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    s = sub.add_parser(
        "sim", allow_abbrev=False, help="the vLLM-like engine simulator", add_help=False
    )
    s.set_defaults(func=_without_flags)


def run(rest: Sequence[str]) -> int:
    from sim.cli import main as sim_main

    return sim_main(list(rest))


def _without_flags(args: argparse.Namespace) -> int:
    return run([])

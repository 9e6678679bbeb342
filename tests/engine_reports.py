"""Where the real-engine tiers leave their translation-loss reports: one markdown file
per engine under bench/results/engines/, committed after a run (docs/adapters.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jetserve.conformance.report import Report

REPORTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "engines"


def save(engine: str, report: Report, versions: str) -> Path:
    """``versions``: the engine build the report was measured on."""
    REPORTS.mkdir(parents=True, exist_ok=True)
    path = REPORTS / f"{engine}-corpus.md"
    # The server's URL names a free port, different every run.
    fixed = dataclasses.replace(report, engine_url=f"the {engine} tier's server ({versions})")
    path.write_text(fixed.to_markdown() + "\n")
    return path

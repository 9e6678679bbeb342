"""The translation-loss report: one row per (field, adapter), as markdown and JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from workers.engines.translation import ROWS


class Status(StrEnum):
    PASSED = "passed"
    TRANSFORMED = "transformed"
    EMULATED = "emulated"
    REJECTED = "rejected"
    NOT_APPLICABLE = "not_applicable"  # the case needs the simulator's fault hooks
    DROPPED = "dropped"  # SILENT DROP: accepted, but the effect is missing
    FAILED = "failed"  # wrong error class, a claimed rejection that wasn't, a crash


@dataclass(frozen=True)
class Row:
    field: str
    case: str
    status: Status
    note: str = ""


@dataclass
class Report:
    adapter: str
    dialect: str
    engine_url: str
    rows: list[Row] = field(default_factory=list)

    @property
    def silent_drops(self) -> list[Row]:
        return [r for r in self.rows if r.status is Status.DROPPED]

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.status is Status.FAILED]

    @property
    def ok(self) -> bool:
        return not self.silent_drops and not self.failures

    def status(self, row: str) -> Status:
        for r in self.rows:
            if r.field == row:
                return r.status
        raise KeyError(row)

    def to_json(self) -> dict[str, Any]:
        return {
            "adapter": self.adapter,
            "dialect": self.dialect,
            "engine_url": self.engine_url,
            "ok": self.ok,
            "rows": [asdict(r) for r in self.rows],
        }

    def to_markdown(self) -> str:
        lines = [
            f"Adapter `{self.dialect}` against {self.engine_url}",
            "",
            "| field | status | note |",
            "|---|---|---|",
        ]
        for r in self.rows:
            lines.append(f"| `{r.field}` | {_cell(r.status)} | {_escape(r.note)} |")
        return "\n".join(lines) + "\n"


def matrix_markdown(reports: Sequence[Report]) -> str:
    """Field x adapter -> status, for several adapters side by side."""
    head = "| field | " + " | ".join(r.dialect for r in reports) + " |"
    lines = [head, "|---|" + "---|" * len(reports)]
    fields = [f for f in ROWS if any(_has(r, f) for r in reports)]
    for f in fields:
        cells = [_cell(r.status(f)) if _has(r, f) else "" for r in reports]
        lines.append(f"| `{f}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def notes_markdown(reports: Sequence[Report]) -> str:
    """What each non-pass-through status means for each adapter."""
    lines: list[str] = []
    for rep in reports:
        for r in rep.rows:
            if r.status is not Status.PASSED and r.note:
                lines.append(f"- **{rep.dialect}** `{r.field}` ({r.status}): {r.note}")
    return "\n".join(lines) + ("\n" if lines else "")


def _has(report: Report, row: str) -> bool:
    return any(r.field == row for r in report.rows)


def _cell(status: Status) -> str:
    return f"**{status.value.upper()}**" if status in (Status.DROPPED, Status.FAILED) else status


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")

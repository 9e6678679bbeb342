"""The translation-loss report: one row per (case, adapter), with the case's field, as
markdown and JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


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
        """The status of `row`'s first case (a field or a case name)."""
        for r in self.rows:
            if row in (r.field, r.case):
                return r.status
        raise KeyError(row)

    def counts(self) -> dict[Status, int]:
        return {s: n for s in Status if (n := sum(r.status is s for r in self.rows))}

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
            "| case | field | status | note |",
            "|---|---|---|---|",
        ]
        for r in self.rows:
            lines.append(f"| {r.case} | `{r.field}` | {_cell(r.status)} | {_escape(r.note)} |")
        return "\n".join(lines) + "\n"


def matrix_markdown(reports: Sequence[Report]) -> str:
    """Case x adapter -> status, for several adapters side by side, in the corpus's
    order (the reports must have run the same cases)."""
    head = "| case | field | " + " | ".join(r.dialect for r in reports) + " |"
    lines = [head, "|---|---|" + "---|" * len(reports)]
    for i, row in enumerate(reports[0].rows if reports else []):
        cells = [_cell(r.rows[i].status) for r in reports]
        lines.append(f"| {row.case} | `{row.field}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_markdown(reports: Sequence[Report]) -> str:
    """How many cases each adapter passed, transformed, emulated, rejected..."""
    statuses = [s for s in Status if any(s in r.counts() for r in reports)]
    lines = [
        "| adapter | " + " | ".join(s.value for s in statuses) + " |",
        "|---|" + "---|" * len(statuses),
    ]
    for r in reports:
        counts = r.counts()
        lines.append(
            f"| {r.dialect} | " + " | ".join(str(counts.get(s, 0)) for s in statuses) + " |"
        )
    return "\n".join(lines) + "\n"


def notes_markdown(reports: Sequence[Report]) -> str:
    """What each non-pass-through status means for each adapter, once per field."""
    lines: list[str] = []
    for rep in reports:
        seen: set[tuple[str, str]] = set()
        for r in rep.rows:
            if r.status is not Status.PASSED and r.note and (r.field, r.note) not in seen:
                seen.add((r.field, r.note))
                lines.append(f"- **{rep.dialect}** `{r.field}` ({r.status}): {_escape(r.note)}")
    return "\n".join(lines) + ("\n" if lines else "")


def _cell(status: Status) -> str:
    return f"**{status.value.upper()}**" if status in (Status.DROPPED, Status.FAILED) else status


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")

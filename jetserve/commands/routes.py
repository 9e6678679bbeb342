"""``jetserve routes apply|list|show|diff|history|rollback|status|evidence|delete``: route contracts
through the gateway's admin API (the only writer of the routes bucket)."""

from __future__ import annotations

import argparse
import getpass
import importlib
import json
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from jetserve.commands.admin import admin_command, admin_group
from jetserve.commands.admin_client import AdminClient

if TYPE_CHECKING:
    from jetserve.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    actions = admin_group(sub, "routes", "route contracts (admin API)")
    ap = admin_command(actions, "apply", _apply, "apply a contract file")
    ap.add_argument("file", help="a route contract, .json or .yaml")
    ap.add_argument(
        "--expected-revision",
        type=int,
        default=None,
        help="refuse (409) unless the route is at this revision (0: must not exist)",
    )
    admin_command(actions, "list", _list)
    admin_command(actions, "show", _show).add_argument("name")
    d = admin_command(actions, "diff", _diff, "field diff of two revisions")
    d.add_argument("name")
    d.add_argument("--from", dest="from_rev", type=int, default=None, help="default: previous")
    d.add_argument("--to", dest="to_rev", type=int, default=None, help="default: current")
    admin_command(actions, "history", _history).add_argument("name")
    rb = admin_command(actions, "rollback", _rollback, "restore an earlier revision")
    rb.add_argument("name")
    rb.add_argument(
        "--to", type=int, default=None, help="default: the newest earlier, different contract"
    )
    rb.add_argument("--reason", default="", help="kept in the route history")
    st = admin_command(actions, "status", _status, "a rollout's arms, guard and decision")
    st.add_argument("name")
    st.add_argument("--json", action="store_true", help="the admin API's answer as it is")
    ev = admin_command(actions, "evidence", _evidence, "a revision's evidence and its triggers")
    ev.add_argument("name")
    ev.add_argument("--revision", type=int, default=None, help="default: the current one")
    ev.add_argument("--attach", default=None, help="a JSON file of evidence to merge in")
    ev.add_argument("--approve", action="store_true", help="record your approval (user@host)")
    ev.add_argument(
        "--measure-slo",
        action="store_true",
        help="keep the route's production figures now (ledger, guard window) as the baseline "
        "of the slo_regression trigger",
    )
    rm = admin_command(actions, "delete", _delete)
    rm.add_argument("name")
    rm.add_argument("--expected-revision", type=int, default=None)


def load_contract(path: str) -> dict[str, Any]:
    """A contract file as a mapping; validation is the admin API's (one rulebook)."""
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        try:
            yaml = importlib.import_module("yaml")
        except ImportError:
            raise SystemExit(
                "reading YAML needs PyYAML (pip install pyyaml); or use JSON"
            ) from None
        data = yaml.safe_load(text)
        retry = data.get("retry") if isinstance(data, dict) else None
        if isinstance(retry, dict) and True in retry:
            # YAML 1.1 reads a bare ``on:`` key as the boolean true.
            retry["on"] = retry.pop(True)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{path}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: a route contract must be a mapping")
    return data


def _apply(admin: AdminClient, args: argparse.Namespace) -> None:
    contract = load_contract(args.file)
    actor = f"{getpass.getuser()}@{socket.gethostname()}"
    out = admin.apply_route(contract, args.expected_revision, actor)
    if out["changed"]:
        print(f"revision {out['revision']}")
    else:
        print(f"unchanged at revision {out['revision']}")
    for dep, fp in sorted(out["fingerprints"].items()):
        print(f"  {dep}  {fp}")


def _list(admin: AdminClient, args: argparse.Namespace) -> None:
    for r in admin.list_routes():
        cands = ",".join(c["name"] for c in r["contract"]["candidates"])
        print(f"{r['name']}\trevision {r['revision']}\t{_when(r['updated_at'])}\t{cands}")


def _show(admin: AdminClient, args: argparse.Namespace) -> None:
    print(json.dumps(admin.show_route(args.name), indent=2, sort_keys=True))


def _history(admin: AdminClient, args: argparse.Namespace) -> None:
    for h in admin.route_history(args.name):
        if h.get("deleted"):
            print(f"--   {_when(h['updated_at'])}  deleted")
            continue
        fps = " ".join(f"{k}={v}" for k, v in sorted(h["fingerprints"].items()))
        line = f"r{h['revision']:<3} {_when(h['updated_at'])}  {h['updated_by']}  {fps}"
        back = h.get("rollback")
        if back:
            how = "automatic rollback" if back["automatic"] else "rollback"
            line += f"  ({how} to r{back['to_revision']} from r{back['from_revision']}"
            line += f": {back['reason']})" if back["reason"] else ")"
        print(line)


def _diff(admin: AdminClient, args: argparse.Namespace) -> None:
    print(format_diff(admin.route_diff(args.name, args.from_rev, args.to_rev)), end="")


def _rollback(admin: AdminClient, args: argparse.Namespace) -> None:
    actor = f"{getpass.getuser()}@{socket.gethostname()}"
    out = admin.rollback_route(args.name, args.to, args.reason, actor)
    if not out["changed"]:
        print(f"unchanged at revision {out['revision']} (already that contract)")
        return
    back = out["rollback"]
    print(f"revision {out['revision']}: revision {back['to_revision']} restored")
    for dep, fp in sorted(out["fingerprints"].items()):
        print(f"  {dep}  {fp}")


def _status(admin: AdminClient, args: argparse.Namespace) -> None:
    out = admin.route_status(args.name)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return
    print(format_status(out), end="")


def format_status(st: dict[str, Any]) -> str:
    """The status as an operator reads it: arms, guard against thresholds, decision."""
    lines = [f"{st['route']} revision {st['revision']} since {_when(st['since'])}"]
    canary = (st.get("rollout") or {}).get("canary")
    if canary:
        scope = ",".join(canary["classes"]) or "all classes"
        tenants = ",".join(canary["tenants"]) or "all tenants"
        lines.append(
            f"canary: {canary['candidate']} at {canary['share']:.1%} of {scope}, {tenants}"
        )
    for arm in ("stable", "canary"):
        a = st["arms"][arm]
        lines.append(
            f"  {arm:<7} {a['requests']:>7} requests  {st['shares'][arm]:6.1%}"
            f"  errors {a['errors']}"
        )
    guard = st.get("guard")
    if guard:
        lines.append(f"guard (last {guard['window_s']:g}s, from {guard['min_samples']} per arm):")
        for arm in ("stable", "canary"):
            g = guard[arm]
            p95 = "-" if g["ttft_p95_ms"] is None else f"{g['ttft_p95_ms']:.0f} ms"
            lines.append(
                f"  {arm:<7} {g['requests']:>7} requests  error rate {g['error_rate']:.1%}"
                f"  first-token p95 {p95}"
            )
        lines.append(
            f"  error ratio {_ratio(guard['error_ratio'])} (max {guard['max_error_ratio']:g})"
            f"  first-token p95 ratio {_ratio(guard['ttft_p95_ratio'])}"
            f" (max {guard['max_ttft_p95_ratio']:g})"
        )
    shadow = st.get("shadow")
    if shadow:
        lines.append(
            f"shadow: {shadow['copies']} copies ({shadow['paired']} paired), "
            f"{shadow['errors']} errors, {shadow['error_class_mismatches']} error-class "
            f"mismatches; shadow/served p50: first token {_ratio(shadow['ttft_ratio_p50'])}, "
            f"e2e {_ratio(shadow['e2e_ratio_p50'])}, "
            f"output tokens {_ratio(shadow['output_tokens_ratio_p50'])}; "
            f"exact at T=0 {shadow['exact_matches']}/{shadow['exact_compared']}, "
            f"valid JSON {shadow['json_valid']}/{shadow['json_checked']}"
        )
    lines.append(f"decision: {st['decision']}: {st['reason']}")
    back = st.get("rollback")
    if back:
        how = "automatic rollback" if back["automatic"] else "rollback"
        lines.append(
            f"this revision is a {how} to r{back['to_revision']} from r{back['from_revision']}"
            + (f": {back['reason']}" if back["reason"] else "")
        )
    return "\n".join(lines) + "\n"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _evidence(admin: AdminClient, args: argparse.Namespace) -> None:
    update: dict[str, Any] = {}
    if args.attach:
        try:
            update = json.loads(Path(args.attach).read_text())
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{args.attach}: not JSON: {exc}") from None
        if not isinstance(update, dict):
            raise SystemExit(f"{args.attach}: evidence must be a JSON object")
    if args.approve:
        update["approved_by"] = f"{getpass.getuser()}@{socket.gethostname()}"
    if args.measure_slo:
        update["measure_slo"] = True
    if update:
        if args.revision is not None:
            update["revision"] = args.revision
        admin.attach_evidence(args.name, update)
    out = admin.route_evidence(args.name, args.revision)
    print(format_evidence(out), end="")


def format_evidence(out: dict[str, Any]) -> str:
    ev = out["evidence"]
    if ev is None:
        return f"{out['name']}: {out['reason']} (current revision {out['current_revision']})\n"
    lines = [
        f"{out['name']} evidence of revision {ev['revision']} (current {out['current_revision']}),"
        f" recorded {_when(ev['recorded_at'])}, due after {ev['max_age_days']:g} days",
        "  approved by: " + (", ".join(ev["approved_by"]) or "nobody"),
        "  fingerprints: " + " ".join(f"{k}={v}" for k, v in sorted(ev["fingerprints"].items())),
    ]
    checked = ev.get("checked") or {}  # absent from an older gateway's answer
    conformance = ev.get("conformance") or {}
    lines.append("  conformance:" + ("" if conformance else " -"))
    for dep, report in sorted(conformance.items()):
        lines.append(
            f"    {dep}: {_conformance_summary(report)}{_checked(checked, f'conformance/{dep}')}"
        )
    for part in ("bench", "fault_suite", "guard", "slo"):
        value = ev.get(part)  # ``slo``: absent from an older gateway's answer
        shown = json.dumps(value, sort_keys=True) if value else "-"
        lines.append(f"  {part}: {shown}{_checked(checked, part) if value else ''}")
    if out["triggers"]:
        lines.append("re-evaluate:")
        lines += [f"  {t['kind']}: {t['detail']}" for t in out["triggers"]]
    else:
        lines.append("no trigger has fired")
    return "\n".join(lines) + "\n"


def _conformance_summary(report: Any) -> str:
    """``ok: 40 passed, 6 transformed, ...`` of a conformance report (its rows'
    statuses); a report in another shape is shown as it is."""
    rows = report.get("rows") if isinstance(report, dict) else None
    if not isinstance(rows, list):
        return json.dumps(report, sort_keys=True)
    counts: dict[str, int] = {}
    for row in rows:
        status = str(row.get("status", "?")) if isinstance(row, dict) else "?"
        counts[status] = counts.get(status, 0) + 1
    verdict = "ok" if report.get("ok") else "NOT ok"
    return f"{verdict}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def _checked(checked: dict[str, dict[str, str]], item: str) -> str:
    fps = checked.get(item)
    if not fps:
        return " (as given)"
    return " (measured on " + " ".join(f"{d}={fp}" for d, fp in sorted(fps.items())) + ")"


def _delete(admin: AdminClient, args: argparse.Namespace) -> None:
    out = admin.delete_route(args.name, args.expected_revision)
    print(f"deleted {out['name']} (was revision {out['revision']})")


def format_diff(diff: dict[str, Any]) -> str:
    """A unified, field-level diff: one ``-``/``+`` pair per changed leaf."""
    frm = f"r{diff['from']}" if diff["from"] is not None else "(none)"
    lines = [f"--- {diff['name']} {frm}", f"+++ {diff['name']} r{diff['to']}"]
    for ch in diff["changes"]:
        if ch["before"] is not None:
            lines.append(f"- {ch['path']}: {_value(ch['before'])}")
        if ch["after"] is not None:
            lines.append(f"+ {ch['path']}: {_value(ch['after'])}")
    if not diff["changes"]:
        lines.append("  (no changes)")
    return "\n".join(lines) + "\n"


def _value(v: object) -> str:
    return msgspec.json.encode(v).decode()


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

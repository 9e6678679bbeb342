"""``jetserve routes apply|list|show|diff|history|delete``: route contracts
through the gateway's admin API (the only writer of the routes bucket)."""

from __future__ import annotations

import argparse
import getpass
import importlib
import json
import socket
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from jetserve.admin_client import AdminClient

Opts = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def add_routes_parser(actions: argparse._SubParsersAction[Any], opts: Opts) -> None:
    ap = opts(actions.add_parser("apply", allow_abbrev=False, help="apply a contract file"))
    ap.add_argument("file", help="a route contract, .json or .yaml")
    ap.add_argument(
        "--expected-revision",
        type=int,
        default=None,
        help="refuse (409) unless the route is at this revision (0: must not exist)",
    )
    opts(actions.add_parser("list", allow_abbrev=False))
    opts(actions.add_parser("show", allow_abbrev=False)).add_argument("name")
    d = opts(actions.add_parser("diff", allow_abbrev=False, help="field diff of two revisions"))
    d.add_argument("name")
    d.add_argument("--from", dest="from_rev", type=int, default=None, help="default: previous")
    d.add_argument("--to", dest="to_rev", type=int, default=None, help="default: current")
    opts(actions.add_parser("history", allow_abbrev=False)).add_argument("name")
    rm = opts(actions.add_parser("delete", allow_abbrev=False))
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


def routes_command(admin: AdminClient, args: argparse.Namespace) -> None:
    action = args.action
    if action == "apply":
        contract = load_contract(args.file)
        actor = f"{getpass.getuser()}@{socket.gethostname()}"
        out = admin.apply_route(contract, args.expected_revision, actor)
        if out["changed"]:
            print(f"revision {out['revision']}")
        else:
            print(f"unchanged at revision {out['revision']}")
        for dep, fp in sorted(out["fingerprints"].items()):
            print(f"  {dep}  {fp}")
    elif action == "list":
        for r in admin.list_routes():
            cands = ",".join(c["name"] for c in r["contract"]["candidates"])
            print(f"{r['name']}\trevision {r['revision']}\t{_when(r['updated_at'])}\t{cands}")
    elif action == "show":
        print(json.dumps(admin.show_route(args.name), indent=2, sort_keys=True))
    elif action == "history":
        for h in admin.route_history(args.name):
            if h.get("deleted"):
                print(f"--   {_when(h['updated_at'])}  deleted")
                continue
            fps = " ".join(f"{k}={v}" for k, v in sorted(h["fingerprints"].items()))
            print(f"r{h['revision']:<3} {_when(h['updated_at'])}  {h['updated_by']}  {fps}")
    elif action == "diff":
        print(format_diff(admin.route_diff(args.name, args.from_rev, args.to_rev)), end="")
    elif action == "delete":
        out = admin.delete_route(args.name, args.expected_revision)
        print(f"deleted {out['name']} (was revision {out['revision']})")
    else:  # pragma: no cover - argparse enforces the choices
        raise SystemExit(f"unknown routes action {action}")


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


def _value(v: Any) -> str:
    return msgspec.json.encode(v).decode()


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

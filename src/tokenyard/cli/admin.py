"""`tokenyard admin …`: the administrative operations from a terminal, straight on the store
(`TOKENYARD_DATABASE_URL`, else the SQLite file in the state directory).

    tokenyard admin orgs create acme --balance 50 --rpm 600
    tokenyard admin keys create --org org_… --name ci --models 'SmolLM2*' --tpm 100000
    tokenyard admin keys revoke key_…
    tokenyard admin users create --org org_… --email ada@acme.test   (cli/admin_users.py)
    tokenyard admin budgets set --user user_… --monthly 20 --total 100
    tokenyard admin priority set --key key_… high      (high | normal | low | org)
    tokenyard admin prices set SmolLM2-135M-Instruct.Q4_1 --input 0.10 --output 0.40
    tokenyard admin credit add org_… 25.00
    tokenyard admin orgs set-moderation org_… --input block --output flag
    tokenyard admin orgs capture org_… --on --retention-days 3     (--off; no flag: show)
    tokenyard admin regions set --org org_… eu          (--project proj_…; "any": unbind)
    tokenyard admin mcp add --org org_… --label calc --url URL   (cli/admin_mcp.py)
    tokenyard admin usage --group-by day --format csv
    tokenyard admin shadow report --alias smollm2 --since 2026-11-22
    tokenyard admin deployments                         (these two ask the running server:
    tokenyard admin replicas drain --deployment D --replica URL [--undo]    --url, --api-key)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from tokenyard.cli.admin_mcp import add_mcp_parsers, mcp_operations
from tokenyard.cli.admin_users import add_budget_args, add_user_parsers, user_operations
from tokenyard.cli.fleet_admin import FLEET_NOUNS, add_fleet_parsers, run_fleet_admin
from tokenyard.gateway.admin import GROUPS, Admin, AdminError, Json, to_csv, to_table
from tokenyard.gateway.moderation import org_moderation
from tokenyard.gateway.region_admin import set_org_regions, set_project_regions
from tokenyard.store.records import PRIORITY_CLASSES

#: A key's priority class may also be "org": it follows its org's.
_KEY_PRIORITIES = [*PRIORITY_CLASSES, "org"]


def _limit_args(parser: argparse.ArgumentParser, free_tier: bool = False) -> None:
    parser.add_argument("--rpm", type=int, help="requests per minute")
    parser.add_argument("--tpm", type=int, help="tokens per minute")
    parser.add_argument("--max-concurrency", type=int, help="requests in flight")
    if free_tier:
        parser.add_argument("--free-tier", type=int, dest="free_tier_daily_requests",
                            help="free requests per UTC day (orgs without prepaid credit)")


def add_admin_parser(sub: Any) -> None:
    """`admin` and its nouns and verbs."""
    admin = sub.add_parser("admin", help="orgs, keys, limits, prices, credit, usage")
    # --format is accepted after any verb too (default=SUPPRESS keeps the top-level one).
    fmt = argparse.ArgumentParser(add_help=False)
    fmt.add_argument("--format", choices=["table", "csv", "json"], default=argparse.SUPPRESS)
    admin.add_argument("--format", choices=["table", "csv", "json"], default="table",
                       help="output format")
    nouns = admin.add_subparsers(dest="noun", required=True)

    orgs = nouns.add_parser("orgs", parents=[fmt],
        help="organizations: create, list, moderation policy, body capture").add_subparsers(
        dest="verb", required=True)
    create = orgs.add_parser("create", parents=[fmt], help="create an org")
    create.add_argument("name")
    create.add_argument("--balance", help="prepaid credit (decimal); none: postpaid")
    create.add_argument("--priority", choices=list(PRIORITY_CLASSES),
                        help="the scheduler class of its requests (default normal)")
    _limit_args(create, free_tier=True)
    orgs.add_parser("list", parents=[fmt], help="every org with its limits and balance")
    moderation = orgs.add_parser("set-moderation", parents=[fmt],
                                 help="the org's moderation policy (the stricter of it and "
                                      "the deployment's applies)")
    moderation.add_argument("org_id")
    moderation.add_argument("--input", choices=["off", "flag", "block"])
    moderation.add_argument("--output", choices=["off", "flag", "block"])
    capture = orgs.add_parser("capture", parents=[fmt],
                              help="capture the org's request and response bodies, redacted "
                                   "(no flag: show the setting)")
    capture.add_argument("org_id")
    on_off = capture.add_mutually_exclusive_group()
    on_off.add_argument("--on", dest="enabled", action="store_const", const=True)
    on_off.add_argument("--off", dest="enabled", action="store_const", const=False)
    capture.add_argument("--retention-days", type=int,
                         help="days each capture is kept (default 7)")

    projects = nouns.add_parser("projects", parents=[fmt],
        help="projects of an org").add_subparsers(
        dest="verb", required=True)
    create = projects.add_parser("create", parents=[fmt], help="create a project in an org")
    create.add_argument("org_id")
    create.add_argument("name")

    keys = nouns.add_parser("keys", parents=[fmt],
        help="API keys: create (the secret is shown once), list, revoke").add_subparsers(
        dest="verb", required=True)
    create = keys.add_parser("create", parents=[fmt],
                             help="create a key (its secret is shown once)")
    create.add_argument("--org", dest="org_id", required=True)
    create.add_argument("--name", default="key")
    create.add_argument("--project", dest="project_id")
    create.add_argument("--user", dest="user_id", help="the user (of the org) it belongs to")
    add_budget_args(create)
    create.add_argument("--models", help="comma-separated model globs (default: all)")
    create.add_argument("--max-context", type=int, dest="max_context_tokens")
    create.add_argument("--admin", action="store_true", help="may use /admin/v1")
    create.add_argument("--expires-at", help="ISO 8601 time")
    create.add_argument("--priority", choices=_KEY_PRIORITIES,
                        help="the scheduler class of its requests (default: its org's)")
    _limit_args(create)
    listing = keys.add_parser("list", parents=[fmt],
        help="keys (never their secrets), of an org with --org")
    listing.add_argument("--org", dest="org_id")
    revoke = keys.add_parser("revoke", parents=[fmt],
        help="revoke a key: it stops authenticating within a second")
    revoke.add_argument("key_id")

    limits = nouns.add_parser("limits", parents=[fmt],
        help="a key's or an org's rate limits (rpm, tpm, concurrency)").add_subparsers(
        dest="verb", required=True)
    set_limits = limits.add_parser("set", parents=[fmt], help="set a key's or an org's limits")
    who = set_limits.add_mutually_exclusive_group(required=True)
    who.add_argument("--key", dest="key_id")
    who.add_argument("--org", dest="org_id")
    _limit_args(set_limits, free_tier=True)
    set_limits.add_argument("--batch-enqueued-tokens", type=int,
                            help="an org's Batch API quota: estimated tokens its batches "
                            "at work may hold (default: TOKENYARD_BATCH_ENQUEUED_TOKENS)")

    priority = nouns.add_parser("priority", parents=[fmt],
        help="a key's or an org's scheduling class (high, normal, low)").add_subparsers(
        dest="verb", required=True)
    set_priority = priority.add_parser(
        "set", parents=[fmt], help="a key's or an org's priority class (high runs first)")
    who = set_priority.add_mutually_exclusive_group(required=True)
    who.add_argument("--key", dest="key_id")
    who.add_argument("--org", dest="org_id")
    set_priority.add_argument("priority", choices=_KEY_PRIORITIES,
                              help="'org' (keys only): follow the org's class")

    prices = nouns.add_parser("prices", parents=[fmt],
        help="prices per million tokens, per model").add_subparsers(
        dest="verb", required=True)
    set_price = prices.add_parser("set", parents=[fmt], help="prices per million tokens")
    set_price.add_argument("model")
    for name in ("input", "cached-input", "output"):
        set_price.add_argument(f"--{name}", default="0")
    prices.add_parser("list", parents=[fmt], help="every model's prices")

    credit = nouns.add_parser("credit", parents=[fmt],
        help="add to an org's credit balance").add_subparsers(
        dest="verb", required=True)
    add = credit.add_parser("add", parents=[fmt],
        help="add an amount (decimal) to an org's balance")
    add.add_argument("org_id")
    add.add_argument("amount")

    cap = nouns.add_parser("spend-cap", parents=[fmt],
        help="an org's or a project's monthly spend cap").add_subparsers(
        dest="verb", required=True)
    set_cap = cap.add_parser("set", parents=[fmt], help="monthly cap (decimal); 'none' removes it")
    set_cap.add_argument("org_id")
    set_cap.add_argument("cap")
    set_cap.add_argument("--project", dest="project_id")

    usage = nouns.add_parser("usage", parents=[fmt], help="usage report from the ledger")
    usage.add_argument("--group-by", choices=GROUPS, default="model")
    usage.add_argument("--since", help="ISO 8601 date or time (inclusive)")
    usage.add_argument("--until", help="ISO 8601 date or time (exclusive)")
    usage.add_argument("--org", dest="org_id")

    regions = nouns.add_parser("regions", parents=[fmt],
        help="the regions an org's or a project's requests may be served in").add_subparsers(
        dest="verb", required=True)
    set_regions = regions.add_parser(
        "set", parents=[fmt], help="the regions an org's (or a project's) requests may be "
                                   "served in; 'any' lifts the binding")
    who = set_regions.add_mutually_exclusive_group(required=True)
    who.add_argument("--org", dest="org_id")
    who.add_argument("--project", dest="project_id")
    set_regions.add_argument("allowed_regions", nargs="+", metavar="REGION")

    shadow = nouns.add_parser("shadow", parents=[fmt],
        help="shadow traffic: compare a shadow deployment with its primary").add_subparsers(
        dest="verb", required=True)
    report = shadow.add_parser("report", parents=[fmt],
                               help="shadow traffic: each (alias, primary, shadow) pair")
    report.add_argument("--alias")
    report.add_argument("--since", help="ISO 8601 date or time (inclusive)")
    add_user_parsers(nouns, fmt)
    add_mcp_parsers(nouns, fmt)
    add_fleet_parsers(nouns, fmt)


def _operation(args: argparse.Namespace) -> Callable[[Admin], Awaitable[Json | list[Json]]]:
    a = {k: v for k, v in vars(args).items() if v is not None}
    noun, verb = args.noun, getattr(args, "verb", None)
    table: dict[tuple[str, str | None], Callable[[Admin], Awaitable[Any]]] = {
        ("orgs", "create"): lambda ad: ad.create_org(a),
        ("orgs", "list"): lambda ad: ad.list_orgs(),
        ("orgs", "set-moderation"): lambda ad: org_moderation(ad.store, args.org_id, a),
        ("orgs", "capture"): lambda ad: (ad.capture(args.org_id) if args.enabled is None
                                         else ad.set_capture(args.org_id, a)),
        ("projects", "create"): lambda ad: ad.create_project(args.org_id, a),
        ("keys", "create"): lambda ad: ad.create_key(a),
        ("keys", "list"): lambda ad: ad.list_keys(args.org_id),
        ("keys", "revoke"): lambda ad: ad.revoke_key(args.key_id),
        ("limits", "set"): lambda ad: (ad.set_key_limits(args.key_id, a) if args.key_id
                                       else ad.set_org_limits(args.org_id, a)),
        ("priority", "set"): lambda ad: (ad.set_key_priority(args.key_id, a) if args.key_id
                                         else ad.set_org_priority(args.org_id, a)),
        ("prices", "set"): lambda ad: ad.set_price(args.model, a),
        ("prices", "list"): lambda ad: ad.list_prices(),
        ("credit", "add"): lambda ad: ad.add_credit(args.org_id, a),
        ("spend-cap", "set"): lambda ad: ad.set_spend_cap(
            args.org_id, {**a, "cap": None if args.cap.lower() == "none" else args.cap}),
        ("usage", None): lambda ad: ad.usage(a),
        **user_operations(args, a),
        **mcp_operations(args, a),
        ("shadow", "report"): lambda ad: ad.shadow_report(a),
        ("regions", "set"): lambda ad: (
            set_org_regions(ad.store, args.org_id, a) if args.org_id
            else set_project_regions(ad.store, args.project_id, a)),
    }
    return table[(noun, verb)]


def _print(result: Json | list[Json], fmt: str) -> None:
    rows = result if isinstance(result, list) else [result]
    if fmt == "json":
        print(json.dumps(result, indent=2))
    elif fmt == "csv":
        sys.stdout.write(to_csv(rows))
    else:
        print(to_table(rows))


async def _run(args: argparse.Namespace) -> Json | list[Json]:
    from tokenyard.config import ServeConfig
    from tokenyard.store.db import Database
    from tokenyard.store.repo import Store

    db = await Database.open(ServeConfig.from_env().database)
    try:
        return await _operation(args)(Admin(Store(db)))
    finally:
        await db.close()


def run_admin(args: argparse.Namespace) -> int:
    """Entry point of `tokenyard admin`."""
    if args.noun in FLEET_NOUNS:
        return run_fleet_admin(args)
    try:
        result = asyncio.run(_run(args))
    except AdminError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _print(result, args.format)
    return 0

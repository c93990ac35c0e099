"""`tokenyard admin users …` and `tokenyard admin budgets …` (`gateway/admin_users.py`).

    tokenyard admin users create --org org_… --email ada@acme.test --name Ada \\
        [--project proj_…] [--monthly-budget 20] [--total-budget 100]
    tokenyard admin users list [--org org_…]
    tokenyard admin keys create --org org_… --user user_… [--monthly-budget 5]
    tokenyard admin budgets set --key key_… --monthly 5 --total 50   (either 'none': no cap)
    tokenyard admin budgets set --user user_… --monthly 20
    tokenyard admin budgets list [--org org_…]       (with this month's and all-time spend)
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

from tokenyard.gateway import admin_users
from tokenyard.gateway.admin import Admin

Operation = Callable[[Admin], Awaitable[Any]]


def add_budget_args(parser: argparse.ArgumentParser, *flags: str) -> None:
    """The two caps, as `flags` (default --monthly-budget, --total-budget); 'none': none."""
    monthly, total = flags or ("--monthly-budget", "--total-budget")
    parser.add_argument(monthly, dest="monthly_budget",
                        help="spend cap per UTC calendar month (decimal)")
    parser.add_argument(total, dest="total_budget", help="spend cap in all (decimal)")


def add_user_parsers(nouns: Any, fmt: argparse.ArgumentParser) -> None:
    """The `users` and `budgets` nouns."""
    users = nouns.add_parser("users", parents=[fmt],
        help="users of an org (their keys and budgets)").add_subparsers(
        dest="verb", required=True)
    create = users.add_parser("create", parents=[fmt], help="create a user of an org")
    create.add_argument("--org", dest="org_id", required=True)
    create.add_argument("--email", required=True)
    create.add_argument("--name")
    create.add_argument("--project", dest="project_id",
                        help="the project the user works in (its keys default to it)")
    add_budget_args(create)
    listing = users.add_parser("list", parents=[fmt], help="users, of an org with --org")
    listing.add_argument("--org", dest="org_id")

    budgets = nouns.add_parser("budgets", parents=[fmt],
        help="a key's or a user's spend budgets").add_subparsers(
        dest="verb", required=True)
    set_budget = budgets.add_parser(
        "set", parents=[fmt], help="replace a key's or a user's budget (an unset cap: none)")
    who = set_budget.add_mutually_exclusive_group(required=True)
    who.add_argument("--key", dest="key_id")
    who.add_argument("--user", dest="user_id")
    add_budget_args(set_budget, "--monthly", "--total")
    listing = budgets.add_parser("list", parents=[fmt],
                                 help="every budget, with this month's and all-time spend")
    listing.add_argument("--org", dest="org_id")


def user_operations(args: argparse.Namespace, a: dict[str, Any]
                    ) -> dict[tuple[str, str | None], Operation]:
    """The operations of the two nouns, over `a` (the arguments that were given)."""
    for name in ("monthly_budget", "total_budget"):
        if str(a.get(name, "")).lower() == "none":
            del a[name]
    return {
        ("users", "create"): lambda ad: admin_users.create_user(ad, a),
        ("users", "list"): lambda ad: admin_users.list_users(ad, a.get("org_id")),
        ("budgets", "set"): lambda ad: (
            admin_users.set_budget(ad, "key", args.key_id, a) if args.key_id
            else admin_users.set_budget(ad, "user", args.user_id, a)),
        ("budgets", "list"): lambda ad: admin_users.budgets(ad, a.get("org_id")),
    }

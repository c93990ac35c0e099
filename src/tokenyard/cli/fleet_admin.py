"""`tokenyard admin deployments`, `tokenyard admin replicas drain` and `tokenyard admin
models …`: the fleet's state lives in the running server, not the store, so these ask it
over HTTP (`/admin/v1/deployments`, `/admin/v1/replicas/drain`, `/admin/v1/models`) with
an admin key.

    tokenyard admin deployments --url http://127.0.0.1:8000
    tokenyard admin replicas drain --deployment D --replica http://10.0.0.7:8001 [--undo]
    tokenyard admin models list                  # each model's load state
    tokenyard admin models load|unload|pin|unpin NAME
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any
from urllib.parse import quote

import aiohttp

from tokenyard.cli.ray_admin import add_scale_parser, run_scale
from tokenyard.config import default_api_key
from tokenyard.gateway.admin import to_csv, to_table

FLEET_NOUNS = frozenset({"deployments", "replicas", "models"})
#: `admin models` verbs that act on one model (POST /admin/v1/models/NAME/VERB).
MODEL_VERBS = ("load", "unload", "pin", "unpin")
DEFAULT_URL = "http://127.0.0.1:8000"


def add_fleet_parsers(nouns: Any, fmt: argparse.ArgumentParser) -> None:
    """`deployments` and `replicas drain` under `tokenyard admin`."""
    server = argparse.ArgumentParser(add_help=False)
    server.add_argument("--url", default=os.environ.get("TOKENYARD_URL", DEFAULT_URL),
                        help="the server (default $TOKENYARD_URL, else %(default)s)")
    server.add_argument("--api-key", help="an admin key (default $TOKENYARD_API_KEY, else "
                        "the development key of the state directory)")
    nouns.add_parser("deployments", parents=[fmt, server],
                     help="the running server's deployments, replicas and aliases")
    replicas = nouns.add_parser("replicas", parents=[fmt],
        help="a deployment's replicas: drain one, or scale a Ray-placed deployment").add_subparsers(
        dest="verb", required=True)
    drain = replicas.add_parser("drain", parents=[fmt, server],
                                help="stop sending new work to a replica (--undo: resume)")
    drain.add_argument("--deployment", required=True)
    drain.add_argument("--replica", required=True, help="the replica's id (its URL)")
    drain.add_argument("--undo", action="store_true", help="resume sending it work")
    add_scale_parser(replicas, fmt)  # on the Ray cluster, not the server (cli/ray_admin.py)
    models = nouns.add_parser("models", parents=[fmt], help="models loaded on demand: "
                              "their state; load, unload, pin, unpin").add_subparsers(
        dest="verb", required=True)
    models.add_parser("list", parents=[fmt, server], help="every model's load state")
    for verb, text in (("load", "load it now (answers once it serves)"),
                       ("unload", "unload it (its running requests end first)"),
                       ("pin", "never unload it"), ("unpin", "unload it again when idle")):
        models.add_parser(verb, parents=[fmt, server], help=text).add_argument(
            "name", help="the deployment's name")


async def _call(args: argparse.Namespace) -> tuple[int, Any]:
    key = args.api_key or default_api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    base = args.url.rstrip("/")
    async with aiohttp.ClientSession(headers=headers) as session:
        if args.noun == "deployments":
            request = session.get(f"{base}/admin/v1/deployments")
        elif args.noun == "models" and args.verb == "list":
            request = session.get(f"{base}/admin/v1/models")
        elif args.noun == "models":
            name = quote(args.name, safe="")
            request = session.post(f"{base}/admin/v1/models/{name}/{args.verb}")
        else:
            request = session.post(f"{base}/admin/v1/replicas/drain", json={
                "deployment": args.deployment, "replica": args.replica,
                "drain": not args.undo})
        async with request as response:
            return response.status, await response.json(content_type=None)


def _rows(body: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per replica (and one per alias) for the table and CSV formats."""
    rows: list[dict[str, Any]] = []
    for dep in body.get("data", []):
        for replica in dep["replicas"]:
            rows.append({"deployment": dep["name"], "kind": dep["kind"],
                         "max_context": dep["max_context"], "replica": replica["id"],
                         "state": replica["state"], "inflight": replica["inflight"],
                         "served": replica["served"], "failed": replica["failed"]})
    for alias in body.get("aliases", []):
        shadow = alias["shadow"]
        rows.append({"deployment": alias["name"], "kind": "alias",
                     "replica": " ".join(f"{d}={w:g}" for d, w in alias["routes"].items()),
                     "state": f"shadow {shadow['deployment']} {shadow['share']:g}"
                     if shadow else ""})
    return rows


def run_fleet_admin(args: argparse.Namespace) -> int:
    """Run `admin deployments` or `admin replicas drain`; 2 on a refusal or no server."""
    if getattr(args, "verb", None) == "scale":  # `deployments` has no verb
        return run_scale(args)
    try:
        status, body = asyncio.run(_call(args))
    except (aiohttp.ClientError, OSError) as exc:
        print(f"error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    if status != 200:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        print(f"error: {error.get('message', body)}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(body, indent=2))
        return 0
    if args.noun == "deployments":
        rows = _rows(body)
    elif args.noun == "models" and args.verb == "list":
        rows = body.get("data", [])
    else:
        rows = [body]
    if args.format == "csv":
        sys.stdout.write(to_csv(rows))
    else:
        print(to_table(rows))
    return 0

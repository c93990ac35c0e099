"""Administration of data residency: the regions an org's requests may be served in, and
a project's narrower list (`gateway/regions.py` applies them).

    POST /admin/v1/orgs/{org_id}/regions        {allowed_regions: ["eu", ...] | null}
    POST /admin/v1/projects/{project_id}/regions {allowed_regions: [...] | null}
    tokenyard admin regions set --org ORG eu [us ...]      ("any": no binding)
    tokenyard admin regions set --project PROJ eu          ("any": its org's)

null (or "any") lifts the binding: any region for an org, its org's for a project. A
project's list must lie within its org's. A change reaches a gateway's key cache within
its lifetime (`key_cache_ttl_s`, a second by default).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenyard.fleet_values import valid_region
from tokenyard.gateway.admin import AdminError, Json, NotFound
from tokenyard.store import regions as stored
from tokenyard.store.repo import Store

FIELD = "allowed_regions"
#: What lifts a binding where a list is expected.
ANY = "any"


def region_args(args: Mapping[str, Any]) -> tuple[str, ...] | None:
    """`allowed_regions` as a tuple of names (a JSON list, or "eu,us" text); None: any."""
    if FIELD not in args:
        raise AdminError(FIELD, f"{FIELD} is required (null: any region)")
    value = args[FIELD]
    if value is None or value == ANY or value == [ANY]:
        return None
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not value:
        raise AdminError(FIELD, f"{FIELD} must be a non-empty list of region names, or null")
    bad = [v for v in value if not valid_region(v)]
    if bad:
        raise AdminError(FIELD, f"{FIELD}: {bad[0]!r} is not a region name (lowercase "
                                "letters, digits and dashes, e.g. eu or us-east-1)")
    return tuple(sorted(set(value)))


async def set_org_regions(store: Store, org_id: str, args: Mapping[str, Any]) -> Json:
    """Bind the org's requests to regions (or lift the binding)."""
    value = region_args(args)
    if not await stored.set_org_regions(store.db.engine, org_id, value):
        raise NotFound("org_id", f"no org {org_id}")
    return {"org_id": org_id, FIELD: None if value is None else list(value)}


async def set_project_regions(store: Store, project_id: str,
                              args: Mapping[str, Any]) -> Json:
    """Narrow a project's regions within its org's (or let it follow its org's)."""
    value = region_args(args)
    org_id, _ = await stored.project_regions(store.db.engine, project_id)
    if org_id is None:
        raise NotFound("project_id", f"no project {project_id}")
    _, org_list = await stored.org_regions(store.db.engine, org_id)
    if value is not None and org_list is not None and not set(value) <= set(org_list):
        outside = sorted(set(value) - set(org_list))
        raise AdminError(FIELD, f"{', '.join(outside)} is outside the regions of org "
                                f"{org_id} ({', '.join(org_list)})")
    await stored.set_project_regions(store.db.engine, project_id, value)
    return {"project_id": project_id, "org_id": org_id,
            FIELD: None if value is None else list(value)}

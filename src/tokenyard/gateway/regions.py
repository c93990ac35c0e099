"""Data residency (the seeds' regions): which deployments a request may reach, and where an
org's stored data may be read.

- A deployment declares the region it runs in (`region` in the fleet file; an upstream
  counts as the region of the endpoint it calls). One that declares none serves only
  orgs that are not bound to regions: nothing says where it runs.
- An org may be bound to `allowed_regions`, and a project to a narrower list; the key
  lookup hands the gateway the combination (`KeyContext.allowed_regions`), so routing
  checks it without a query. A request names a deployment in an allowed region, or an
  alias with such a target (the canary draw is made among its allowed targets, and a
  shadow copy outside them is not made); anything else is a 403 naming the region.
- `tokenyard serve --region R` is a regional endpoint: `regional_fleet` keeps only R's
  deployments (a fleet built from flags runs here, so its deployments are R's), aliases
  keep their targets in R, and an org's stored responses and captures are read only
  through gateways of its regions (`require_data_region`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from tokenyard.deployments import AliasSpec, FleetSpec
from tokenyard.errors import APIError
from tokenyard.fleet_values import FleetConfigError

#: The error code of a request outside its allowed regions.
REGION_NOT_ALLOWED = "region_not_allowed"


def _names(regions: Collection[str | None]) -> str:
    return ", ".join(sorted(r for r in regions if r))


def _where(regions: Collection[str | None]) -> str:
    """Where a model is served, in words: "in region eu", "only in regions eu, us",
    "without a declared region" (a deployment that names none)."""
    named = _names(regions)
    count = sum(1 for r in regions if r)
    where = ("" if not count else f"in region {named}" if count == 1
             else f"only in regions {named}")
    if None not in regions:
        return where
    return f"{where} and without a declared region" if where else "without a declared region"


def outside_regions(model: str, regions: Collection[str | None],
                    allowed: Collection[str]) -> APIError:
    """403 for `model`, served only in `regions`, asked for by a key allowed `allowed`."""
    where = _where(regions)
    return APIError(
        403, f"The model `{model}` is served {where}; this key's organization may be "
             f"served only in {_names(allowed) or 'no region'}.",
        param="model", code=REGION_NOT_ALLOWED)


def regional_fleet(fleet: FleetSpec, region: str | None) -> FleetSpec:
    """The part of `fleet` a gateway of `region` serves (all of it for None): its
    deployments in `region`, each alias with its targets there (an alias with none is
    left out) and its shadow only if that is there too. A fleet built from flags (no
    file) runs with this gateway, so its deployments are put in `region`.
    FleetConfigError when no deployment is in `region`."""
    if region is None:
        return fleet
    if fleet.path is None:
        return replace(fleet, deployments={
            name: replace(spec, region=region) for name, spec in fleet.deployments.items()})
    deployments = {name: spec for name, spec in fleet.deployments.items()
                   if spec.region == region}
    if not deployments:
        raise FleetConfigError(f"--region {region}: no deployment of {fleet.path} is in "
                               f"region {region}")
    aliases: dict[str, AliasSpec] = {}
    for name, alias in fleet.aliases.items():
        routes = tuple((t, w) for t, w in alias.routes if t in deployments)
        if routes and sum(w for _, w in routes) > 0:
            shadow = alias.shadow if alias.shadow and alias.shadow.deployment in deployments \
                else None
            aliases[name] = replace(alias, routes=routes, shadow=shadow)
    return replace(fleet, deployments=deployments, aliases=aliases)


def require_data_region(gateway_region: str | None, allowed: frozenset[str] | None,
                        what: str) -> None:
    """403 unless a gateway of `gateway_region` may read `what` of an org allowed
    `allowed`: a gateway without a region, or one of the org's regions."""
    if gateway_region is None or allowed is None or gateway_region in allowed:
        return
    regions = _names(allowed) or "no region"
    raise APIError(
        403, f"This gateway serves region {gateway_region}; the {what} of this key's "
             f"organization may be read only through a gateway of {regions}.",
        code=REGION_NOT_ALLOWED)

"""LoRA adapters registered on a running engine deployment (the admin API:
`POST /admin/v1/deployments/{name}/adapters`, `DELETE …/adapters/{adapter}`).

Every replica of the deployment reads the adapter from `path` (a folder on its host) and
serves it (`POST /v1/engine/loras`); then the gateway serves it as `base:adapter`, as if
the fleet file listed it (`lora_spec.py`), with its own prices when given. What is
registered so lives in this process until a fleet reload or a restart (list an adapter in
the fleet file to keep it); a replica restarted since has only its command line's
adapters, and with `serve --workers N` only the worker that took the call knows it.
"""

from __future__ import annotations

import dataclasses

from tokenyard.balancer.replica_client import ReplicaError
from tokenyard.deployments import PriceSpec
from tokenyard.errors import APIError, invalid_request, model_not_found
from tokenyard.gateway.routing import Router
from tokenyard.gateway.served import Fleet, Served
from tokenyard.lora_spec import AdapterSpec, valid_lora_name, with_adapters


def _base(fleet: Fleet, base: str) -> Served:
    served = fleet.deployments.get(base)
    if served is None or served.spec.parent is not None:
        raise model_not_found(base)
    if served.kind != "engine":
        raise invalid_request(f"The deployment {base!r} is not one of tokenyard's engines: "
                              "it serves no LoRA adapters.", param="name")
    return served


async def register_adapter(fleet: Fleet, base: str, name: str, path: str,
                           prices: PriceSpec | None = None) -> Served:
    """Serve adapter `name` on deployment `base` from now on (replacing one of that name);
    the deployment `base:name`. 404 for an unknown base, 400 for a bad name or an adapter
    a replica cannot load (its message says why)."""
    served = _base(fleet, base)
    if not valid_lora_name(name):
        raise invalid_request("An adapter's name is up to 64 letters, digits, '.', '_' and "
                              "'-'.", param="name")
    full = f"{base}:{name}"
    taken = fleet.deployments.get(full)
    if taken is not None and taken.spec.parent != base:
        raise invalid_request(f"{full!r} is a deployment of its own.", param="name")
    try:
        await served.pool.load_lora(name, path)
    except ReplicaError as exc:
        raise invalid_request(f"A replica of {base} cannot load the adapter: {exc}",
                              param="path") from None
    one = dataclasses.replace(served.spec, adapters=(AdapterSpec(name, path, prices),))
    adapter = served.adapter(with_adapters({base: one})[full])
    fleet.deployments[full] = adapter
    _reroute(fleet)
    if prices is not None and fleet.gateway is not None:
        await fleet.gateway.set_prices({full: prices})
    return adapter


async def unregister_adapter(fleet: Fleet, base: str, name: str) -> None:
    """Stop serving adapter `name` of `base` (its running requests finish with it); 404
    if it is not served, 400 while an alias routes to it."""
    _base(fleet, base)
    full = f"{base}:{name}"
    served = fleet.deployments.get(full)
    if served is None or served.spec.parent != base:
        raise model_not_found(full)
    routed = [a.name for a in fleet.router.fleet.aliases.values()
              if any(target == full for target, _ in a.routes)]
    if routed:
        raise APIError(400, f"The aliases {', '.join(routed)} route to {full}: change them "
                       "first.", param="name", code="adapter_in_use")
    del fleet.deployments[full]
    _reroute(fleet)
    await served.pool.unload_lora(name)


def _reroute(fleet: Fleet) -> None:
    """The router over the deployments as they are now (aliases unchanged)."""
    spec = dataclasses.replace(fleet.router.fleet, deployments={
        n: s.spec for n, s in fleet.deployments.items()})
    fleet.router = Router(spec)

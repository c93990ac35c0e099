"""deploy/kubernetes/ (issue 24 §3): every manifest validates against Kubernetes' own schemas
(`kubernetes-validate`, which bundles them: no cluster, no network), strictly (an
unknown field fails), and the pieces fit together: the fleet file in the ConfigMap parses
and finds the engines through the headless Service's DNS name, and every Secret, port and
label a manifest refers to exists."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import require_service
from tokenyard.balancer.discovery import DnsTarget
from tokenyard.deployments import parse_fleet

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.37.0"


def _resources() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for _, doc in _resources() if doc["kind"] == kind}


def test_every_manifest_validates_against_the_kubernetes_schemas() -> None:
    try:
        import kubernetes_validate
    except ImportError:
        require_service("kubernetes-validate", False, "it is not installed (the dev extra)")
        raise
    resources = _resources()
    kinds = {doc["kind"] for _, doc in resources}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "StatefulSet", "Secret",
            "ConfigMap"} <= kinds
    for name, doc in resources:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc.message}")


def test_a_manifest_with_an_unknown_field_fails_validation() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    engine = _by_kind("StatefulSet")["tokenyard-engine"]
    broken = {**engine, "spec": {**engine["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_fleet_file_finds_the_engines_through_the_headless_service() -> None:
    fleet_text = _by_kind("ConfigMap")["tokenyard-fleet"]["data"]["fleet.toml"]
    fleet = parse_fleet(tomllib.loads(fleet_text))
    engine_service = _by_kind("Service")["tokenyard-engine"]
    assert engine_service["spec"]["clusterIP"] == "None"  # headless: one A record per pod
    statefulset = _by_kind("StatefulSet")["tokenyard-engine"]
    assert statefulset["spec"]["serviceName"] == "tokenyard-engine"
    (spec,) = fleet.deployments.values()
    (url,) = spec.urls
    target = DnsTarget.parse(url)
    name, namespace, *rest = target.host.split(".")
    assert (name, rest) == ("tokenyard-engine", ["svc", "cluster", "local"])
    assert namespace == "default"
    assert target.port == engine_service["spec"]["ports"][0]["port"]
    assert engine_service["spec"]["selector"].items() <= (
        statefulset["spec"]["template"]["metadata"]["labels"].items())
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert str(target.port) in container["args"]
    assert container["resources"]["requests"]


def test_every_secret_and_configmap_referenced_exists() -> None:
    secrets = {name: doc["stringData"] for name, doc in _by_kind("Secret").items()}
    configmaps = _by_kind("ConfigMap")
    pods = [doc["spec"]["template"]["spec"] for _, doc in _resources()
            if doc["kind"] in ("Deployment", "StatefulSet")]
    seen = set()
    for pod in pods:
        for container in pod["containers"]:
            for env in container.get("env", []):
                ref = env["valueFrom"]["secretKeyRef"]
                assert ref["key"] in secrets[ref["name"]], ref
                seen.add(env["name"])
        for volume in pod.get("volumes", []):
            assert volume["configMap"]["name"] in configmaps
    assert {"TOKENYARD_REPLICA_TOKEN", "TOKENYARD_DATABASE_URL", "TOKENYARD_REDIS_URL"} <= seen
    hpa = _by_kind("HorizontalPodAutoscaler")["tokenyard-gateway"]
    assert hpa["spec"]["scaleTargetRef"]["name"] in _by_kind("Deployment")

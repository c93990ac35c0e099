"""The official OpenAPI documents in `../shared/specs/` as test oracles.

`Spec.load(name)` reads one document (OpenAI's is OpenAPI 3.0: its `nullable` is turned
into JSON Schema's null type once, at load), and `validate` checks a JSON value against
one of its schemas — a component by name, or the schema the spec gives for a route's
request or response — resolving `$ref`s inside the document. Failures name the path in
the value and the rule it broke, so a test's message says what to fix.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

#: `../shared/specs/` beside the repository (CI lays `shared/` there too).
SPECS = Path(__file__).resolve().parents[3] / "shared" / "specs"

FILES = {
    "openai": "openai.openapi.json",
    "anthropic": "anthropic.openapi.json",
    "openresponses": "openresponses.openapi.json",
}


def _nullable(node: Any) -> Any:
    """OpenAPI 3.0's `nullable: true` as JSON Schema: null joins the allowed types."""
    if isinstance(node, list):
        return [_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _nullable(value) for key, value in node.items()}
    if out.pop("nullable", False) is True:
        kind = out.get("type")
        if isinstance(kind, str):
            out["type"] = [kind, "null"]
            if "enum" in out and None not in out["enum"]:
                out["enum"] = [*out["enum"], None]
        elif isinstance(kind, list):
            out["type"] = [*kind, "null"] if "null" not in kind else kind
        else:
            out = {"anyOf": [out, {"type": "null"}]}
    return out


class Spec:
    """One OpenAPI document, ready to validate values against its schemas."""

    def __init__(self, name: str, document: dict[str, Any]) -> None:
        self.name = name
        self.document = document
        resource = Resource(contents=document, specification=DRAFT202012)
        self.uri = f"urn:tokenyard:spec:{name}"
        self.registry: Registry[Any] = Registry().with_resource(self.uri, resource)

    @classmethod
    @functools.cache
    def load(cls, name: str) -> Spec:
        """The document `name` ("openai", "anthropic", "openresponses"), read once."""
        path = SPECS / FILES[name]
        document = json.loads(path.read_text())
        if str(document.get("openapi", "")).startswith("3.0"):
            document = _nullable(document)
        return cls(name, document)

    @property
    def schemas(self) -> dict[str, Any]:
        return dict(self.document["components"]["schemas"])

    def ref(self, component: str) -> dict[str, Any]:
        """A schema that is the component `component`."""
        if component not in self.schemas:
            raise KeyError(f"{self.name} has no component schema {component!r}")
        return {"$ref": f"{self.uri}#/components/schemas/{component}"}

    def operation(self, path: str, method: str = "post") -> dict[str, Any]:
        return dict(self.document["paths"][path][method])

    def response_schema(self, path: str, status: int | str, method: str = "post",
                        media: str = "application/json") -> dict[str, Any]:
        """The schema the spec gives for `status` (else its `default`, else `4XX`-style
        ranges) of the operation, with `$ref`s pointing into this document."""
        responses = self.operation(path, method)["responses"]
        key = str(status)
        for candidate in (key, f"{key[0]}XX", f"{key[0]}xx", "default"):
            if candidate in responses:
                content = responses[candidate].get("content", {})
                if media in content:
                    return self._rooted(content[media]["schema"])
        raise KeyError(f"{self.name} {method.upper()} {path} has no {media} schema for "
                       f"{status}")

    def request_schema(self, path: str, method: str = "post",
                       media: str = "application/json") -> dict[str, Any]:
        body = self.operation(path, method)["requestBody"]["content"][media]["schema"]
        return self._rooted(body)

    def _rooted(self, schema: dict[str, Any]) -> dict[str, Any]:
        """`schema` with its local `$ref`s made absolute (it is validated on its own)."""
        def walk(node: Any) -> Any:
            if isinstance(node, dict):
                return {k: (f"{self.uri}{v}" if k == "$ref" and isinstance(v, str)
                            and v.startswith("#") else walk(v)) for k, v in node.items()}
            if isinstance(node, list):
                return [walk(item) for item in node]
            return node
        return dict(walk(copy.deepcopy(schema)))

    def errors(self, value: Any, schema: dict[str, Any]) -> Iterator[ValidationError]:
        validator = Draft202012Validator(schema, registry=self.registry)
        yield from validator.iter_errors(value)

    def validate(self, value: Any, schema: dict[str, Any] | str, what: str = "") -> None:
        """Raise AssertionError listing every way `value` breaks `schema` (a component's
        name or a schema)."""
        if isinstance(schema, str):
            schema = self.ref(schema)
        found = sorted(self.errors(value, schema), key=lambda e: list(e.absolute_path))
        if found:
            lines = [f"{what or 'value'} breaks the {self.name} spec:"]
            for err in found[:20]:
                where = "/".join(str(p) for p in err.absolute_path) or "(root)"
                best = _deepest(err)
                lines.append(f"  at {where}: {best.message[:300]}")
            raise AssertionError("\n".join(lines))


def _deepest(err: ValidationError) -> ValidationError:
    """Of an anyOf/oneOf failure, the branch error that went deepest (the likely intent)."""
    if not err.context:
        return err
    return max(err.context, key=lambda e: (len(e.absolute_path), -len(e.message)))


def properties(spec: Spec, name: str) -> set[str]:
    """The properties of component `name`, its `allOf` parts' included."""
    schema = spec.schemas[name]
    found = set(schema.get("properties", {}))
    for part in schema.get("allOf", ()):
        if "$ref" in part:
            found |= properties(spec, part["$ref"].rsplit("/", 1)[-1])
        found |= set(part.get("properties", {}))
    return found


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str | None, dict[str, Any]]]:
    """(event name, JSON data) of each `data:` line of an SSE stream (`[DONE]` skipped)."""
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: ") and line != "data: [DONE]":
            yield name, json.loads(line[len("data: "):])

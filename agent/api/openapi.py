"""``/openapi.json``: OpenAPI 3.1 built from the route table and the same pydantic models that
validate requests, so the document cannot drift from the code."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

from agent.api.models import Problem
from agent.api.problems import PROBLEM_CONTENT_TYPE
from agent.api.routing import Route

_REF = "#/components/schemas/{model}"
_ERROR_TEXT = {400: "Malformed request: body, query parameter or header",
               401: "Missing or invalid token",
               403: "Token lacks the scope, or no tokens configured",
               404: "Not found", 409: "Conflict", 413: "Body too large",
               422: "Invalid request: the offending fields and why",
               502: "NVML call failed", 503: "Not ready"}


def _schema(model: type[BaseModel], components: dict[str, Any], mode: str) -> dict[str, Any]:
    doc = model.model_json_schema(ref_template=_REF,
                                  mode="validation" if mode == "validation" else "serialization")
    for name, sub in doc.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components.setdefault(model.__name__, doc)
    return {"$ref": _REF.format(model=model.__name__)}


def _problem(description: str, components: dict[str, Any]) -> dict[str, Any]:
    return {"description": description,
            "content": {PROBLEM_CONTENT_TYPE: {"schema": _schema(Problem, components, "s")}}}


def build_openapi(routes: list[Route], *, version: str) -> dict[str, Any]:
    components: dict[str, Any] = {}
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        op: dict[str, Any] = {
            "operationId": route.handler.__name__.strip("_"),
            "summary": route.summary,
            "tags": [route.tag],
            "parameters": [
                {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                for name in re.findall(r"{(\w+)}", route.path)
            ] + [{"name": q.name, "in": "query", "required": False, "schema": q.schema,
                  "description": q.description} for q in route.query],
            "responses": {},
        }
        if route.body is not None:
            op["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": _schema(route.body, components, "validation")}}}
        ok: dict[str, Any] = {"description": "OK"}
        if route.response is not None:
            ok["content"] = {route.content_type: {
                "schema": _schema(route.response, components, "serialization")}}
        elif route.content_type != "application/json":
            ok["content"] = {route.content_type: {"schema": {"type": "string"}}}
        op["responses"][str(route.status)] = ok
        for status, model in route.extra_responses.items():
            op["responses"][str(status)] = {"description": model.__doc__ or "", "content": {
                "application/json": {"schema": _schema(model, components, "s")}}}
        # 400 everywhere: an unknown or repeated query parameter, or a request the HTTP
        # parser refuses, on any route.
        errors = set(route.errors) | {400}
        if route.body is not None:
            errors |= {413, 422}
        if "{" in route.path:
            errors.add(404)
        if not route.public:
            errors.add(401)
            if route.mutating:
                errors.add(403)
        for status in sorted(errors):
            op["responses"].setdefault(str(status), _problem(_ERROR_TEXT[status], components))
        if not route.public:
            op["security"] = [{"bearer": []}] if route.mutating else [{}, {"bearer": []}]
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "gpu-node-agent", "version": version,
                 "description": "Per-node NVIDIA GPU agent API. Errors are RFC 9457 problems."},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "A token from the agent's --token-file"}}},
    }

"""OpenAPI documentation of the routes that parse their body by hand (request_body.py).

FastAPI documents a body only when it parses it; these helpers put the pydantic
request model's JSON schema (references inlined) and the documented responses into
each route's OpenAPI operation, so /openapi.json describes what the server accepts
and returns (schemathesis fuzzes the server against it).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from graphserve.server.response_bodies import ErrorResponse

ERROR_STATUSES = {
    400: "Invalid request: bad JSON, a wrong type or value, a prompt that does not fit.",
    401: "Missing or wrong API key.",
    404: "Unknown model.",
    413: "Request body over --max-body-bytes.",
    429: "Queue full (--max-queue-len); retry after the Retry-After header's seconds.",
    500: "The engine step serving the request failed.",
    503: "Model loading, server shutting down, or engine stopped.",
}


# Before OpenAPI 3.2 an event stream's `schema` describes one event: `data` holds a
# chunk as JSON (the response model's shape, or {"error": ...}), the last one "[DONE]".
SSE_EVENT_SCHEMA = {
    "type": "object",
    "properties": {"data": {"type": "string", "contentMediaType": "application/json"}},
    "required": ["data"],
}


def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {key: _inline_refs(value, defs) for key, value in node.items()}
    if isinstance(node, list):
        return [_inline_refs(item, defs) for item in node]
    return node


def request_body(model: type[BaseModel], example: dict[str, Any] | None = None) -> dict[str, Any]:
    """`openapi_extra` for a route that reads `model` from a JSON body (no recursive models),
    with a valid `example` body (shown in /docs; schemathesis sends it first)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    media: dict[str, Any] = {"schema": _inline_refs(schema, defs)}
    if example is not None:
        media["example"] = example
    return {"requestBody": {"required": True, "content": {"application/json": media}}}


def responses(ok: type[BaseModel], *, streams: bool = False, errors: tuple[int, ...] = tuple(ERROR_STATUSES)) -> dict:
    """FastAPI `responses=`: the 200 body (plus SSE when the route streams) and the error bodies."""
    documented: dict[int | str, dict[str, Any]] = {200: {"model": ok, "description": "Success."}}
    if streams:
        documented[200]["content"] = {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}
        documented[200]["description"] = "The response, or with `stream: true` server-sent events ending in [DONE]."
    for status in errors:
        documented[status] = {"model": ErrorResponse, "description": ERROR_STATUSES[status]}
    return documented

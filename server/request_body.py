"""Read and validate a JSON request body, whatever Content-Type the client sent.

`curl -d '{...}'` sends application/x-www-form-urlencoded; OpenAI-compatible servers
accept it as JSON anyway, so routes parse the raw body instead of FastAPI's Body().
The body is read at most `max_body_bytes` far: a larger one is a 413, whether it
declares its length or comes chunked. A client that leaves during the upload (or is cut
off by the body timeout, server/connections.py) is the client-disconnect case: a silent
499, no traceback, no 5xx in the metrics.
"""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from graphserve.server.errors import bad_request, body_too_large, from_validation_errors
from graphserve.server.generation import ClientDisconnected
from graphserve.server.state import get_state

ModelT = TypeVar("ModelT", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected() from None
    return b"".join(chunks)


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    raw = await read_body(request, get_state(request).max_body_bytes)
    if not raw.strip():
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors())) from None

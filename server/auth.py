"""Bearer-token check for the API routes when the server runs with --api-key."""

from __future__ import annotations

import hmac

from fastapi import Request

from graphserve.server.errors import APIError
from graphserve.server.state import get_state


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: 401 unless `Authorization: Bearer <api key>` matches. Async, so
    FastAPI runs it on the event loop: a plain `def` dependency costs every request a hop
    to anyio's thread pool."""
    expected = get_state(request).api_key
    if not expected:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise APIError(
            401,
            "Incorrect or missing API key; send it as 'Authorization: Bearer <key>'.",
            type="invalid_request_error",
            code="invalid_api_key",
        )

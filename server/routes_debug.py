"""POST /debug/fault: make the engine's next step fail. Tests only.

The router is mounted only when the server starts with GRAPHSERVE_ENABLE_FAULT_INJECTION=1
(`create_app(..., enable_fault_injection=True)`); otherwise the route does not exist (404).
Body: {"kind": "step"} (the requests in the next step fail, the engine goes on),
{"kind": "request"} (the newest request makes every batch it is in fail: it fails alone,
its batch mates are retried without it) or {"kind": "fatal"} (the engine loop dies:
/health 503, the process exits non-zero).
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from graphserve.server.auth import require_api_key
from graphserve.server.protocol import _Request
from graphserve.server.request_body import parse_body
from graphserve.server.state import get_state

router = APIRouter(dependencies=[Depends(require_api_key)], include_in_schema=False)


class FaultRequest(_Request):
    kind: Literal["step", "request", "fatal"]


@router.post("/debug/fault")
async def inject_fault(request: Request) -> JSONResponse:
    state = get_state(request)
    body = await parse_body(request, FaultRequest)
    engine = state.ready_engine()
    engine.inject_fault(body.kind)
    return JSONResponse({"injected": body.kind})

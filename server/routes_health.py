"""GET /health (readiness) and GET /metrics (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from graphserve.server.state import get_state

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 once the model is loaded; 503 while it loads, while draining, or after the engine failed."""
    status = get_state(request).health()  # a failure's cause is in the log, not here
    return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

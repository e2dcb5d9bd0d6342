"""GET /health (readiness) and GET /metrics (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.state import get_state

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 once the model is loaded; 503 while it loads or after the engine died."""
    state = get_state(request)
    engine = state.engine
    if state.startup_error is not None:
        return JSONResponse({"status": "failed"}, status_code=503)  # the cause is in the log, not here
    if engine.dead:
        return JSONResponse({"status": "dead"}, status_code=503)
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not engine.ready:
        return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)

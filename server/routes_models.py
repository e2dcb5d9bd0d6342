"""GET /v1/models and /v1/models/{model}."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from graphserve.server.auth import require_api_key
from graphserve.server.protocol import ModelCard, ModelList
from graphserve.server.sse import json_response
from graphserve.server.state import ServerState, get_state

router = APIRouter(dependencies=[Depends(require_api_key)])


def model_card(state: ServerState, model: str | None = None) -> ModelCard:
    """The served model's card: 503 unless the engine is ready, 404 unless `model` names it."""
    engine = state.ready_engine(model)
    return ModelCard(
        id=state.model_name,
        created=state.created,
        root=engine.model_path,  # the local model folder, as vLLM reports it
        max_model_len=engine.max_model_len,
    )


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    return json_response(ModelList(data=[model_card(get_state(request))]))


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> Response:
    return json_response(model_card(get_state(request), model))

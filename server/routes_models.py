"""GET /v1/models and /v1/models/{model}."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from server.auth import require_api_key
from server.protocol import ModelCard, ModelList
from server.state import ServerState, get_state

router = APIRouter(dependencies=[Depends(require_api_key)])


def model_card(state: ServerState) -> ModelCard:
    engine = state.ready_engine()
    return ModelCard(
        id=state.model_name,
        created=state.created,
        root=engine.model_path,  # the local model folder, as vLLM reports it
        max_model_len=engine.max_model_len,
    )


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state = get_state(request)
    return JSONResponse(ModelList(data=[model_card(state)]).model_dump(mode="json"))


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    state = get_state(request)
    state.ready_engine()
    state.check_model(model)
    return JSONResponse(model_card(state).model_dump(mode="json"))

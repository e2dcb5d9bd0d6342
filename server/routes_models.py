"""GET /v1/models and /v1/models/{model}."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from graphserve.server.auth import require_api_key
from graphserve.server.response_bodies import ModelCard, ModelList
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


def adapter_cards(state: ServerState, base: ModelCard) -> list[ModelCard]:
    """A card per LoRA adapter, its parent the base model's id (as vLLM lists them)."""
    if state.loras is None:
        return []
    return [ModelCard(id=lora.name, created=base.created, root=lora.path, parent=base.id,
                      max_model_len=base.max_model_len) for lora in state.loras.adapters()]


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = get_state(request)
    base = model_card(state)
    return json_response(ModelList(data=[base, *adapter_cards(state, base)]))


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> Response:
    state = get_state(request)
    base = model_card(state, model)
    lora = state.adapter(model)
    if lora is None:
        return json_response(base)
    return json_response(next(card for card in adapter_cards(state, base) if card.id == lora.name))

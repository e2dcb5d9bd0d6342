"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM's: serve a LoRA adapter under a name
from then on, or stop serving one (requests running with it finish). Present only with
--allow-runtime-lora-updating; paths only under --lora-allowed-dir; behind the API key."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, Response

from graphserve.engine.errors import AdapterError
from graphserve.server.auth import require_api_key
from graphserve.server.errors import APIError, bad_request
from graphserve.server.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from graphserve.server.request_body import parse_body
from graphserve.server.state import get_state

logger = logging.getLogger("graphserve.server")

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, LoadLoraAdapterRequest)
    state.ready_engine()
    registry = state.loras
    if body.lora_name in (state.model_name, state.engine.model_name, state.engine.model_path):
        raise bad_request(f"{body.lora_name!r} names the base model", param="lora_name")
    if registry.get(body.lora_name) is not None and not body.load_inplace:
        raise bad_request(f"the LoRA adapter {body.lora_name!r} is already loaded", param="lora_name")
    try:
        path = registry.allowed(body.lora_path)
    except ValueError as exc:
        raise bad_request(str(exc), param="lora_path") from None
    try:
        await asyncio.to_thread(registry.check, path)
    except AdapterError as exc:
        raise bad_request(str(exc), param="lora_path") from None
    lora = registry.add(body.lora_name, path, replace=body.load_inplace)
    logger.info("LoRA adapter %r loaded from %s (id %d)", lora.name, lora.path, lora.lora_id)
    return PlainTextResponse(f"Success: LoRA adapter '{lora.name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, UnloadLoraAdapterRequest)
    state.ready_engine()
    try:
        lora = state.loras.remove(body.lora_name)
    except KeyError:
        raise APIError(404, f"The LoRA adapter `{body.lora_name}` cannot be found.", param="lora_name",
                       code="model_not_found") from None
    logger.info("LoRA adapter %r unloaded (id %d)", lora.name, lora.lora_id)
    return PlainTextResponse(f"Success: LoRA adapter '{lora.name}' removed successfully.")

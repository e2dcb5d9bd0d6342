"""Read and validate a JSON request body, whatever Content-Type the client sent.

`curl -d '{...}'` sends application/x-www-form-urlencoded; OpenAI-compatible servers
accept it as JSON anyway, so routes parse the raw body instead of FastAPI's Body().
"""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from server.errors import bad_request, from_validation_errors

ModelT = TypeVar("ModelT", bound=BaseModel)


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    raw = await request.body()
    if not raw.strip():
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors())) from None

"""The clients of a test module's `server` fixture (a BackgroundServer or a ServerProcess: anything with
a `.url`), shared by every module that starts one. A module whose server wants a header (an API key)
defines its own `client`."""
from collections.abc import Iterator

import httpx
import openai
import pytest

TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
        yield http


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def model(server) -> str:
    """The id /v1/models serves."""
    return httpx.get(server.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]

"""`return_token_ids` (vLLM's extension), through the real server with the official `openai`
client: each choice carries the generated ids (per chunk when streamed) and the prompt's ids
come back (completions: per choice; chat: per response / in each choice's first chunk). The
ids decode to the returned text and equal what the engine generates offline for the same
prompt ids. Left out, none of these fields appear in the JSON."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")

from graphserve import AsyncEngine, EngineConfig, SamplingParams
from graphserve.engine.llm import LLM
from graphserve.server.app import create_app
from live_server import BackgroundServer

MAX_MODEL_LEN = 512
MAX_TOKENS = 12
PROMPTS = ["The capital of France is", "Once upon a time, there was a"]
MESSAGES = [{"role": "user", "content": "Name three colours."}]
WITH_IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    config = EngineConfig(model=None, device="cpu", max_num_seqs=16, decode_chunk=4, max_model_len=MAX_MODEL_LEN,
                          kv_cache_bytes=64 * 1024**2)
    with BackgroundServer(create_app(AsyncEngine(config))) as background:
        background.wait_ready()
        yield background


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The same embedded model offline: what the engine generates for given prompt ids."""
    return LLM(device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, decode_chunk=4)


def engine_ids(llm: LLM, prompt_ids: list[int]) -> list[int]:
    out = llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]
    return list(out.token_ids)


def extra(obj: Any, name: str) -> Any:
    """A field the openai types do not declare (kept as a pydantic extra)."""
    return (obj.model_extra or {}).get(name)


def test_completions_return_token_ids(oai: openai.OpenAI, llm: LLM, model: str) -> None:
    response = oai.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0, n=2,
                                      extra_body=WITH_IDS)
    assert len(response.choices) == 4
    assert sum(len(extra(c, "token_ids")) for c in response.choices) == response.usage.completion_tokens
    for choice in response.choices:
        prompt_ids = extra(choice, "prompt_token_ids")
        token_ids = extra(choice, "token_ids")
        assert prompt_ids == llm.tokenizer.encode(PROMPTS[choice.index // 2])
        assert llm.tokenizer.decode(token_ids) == choice.text
        assert token_ids == engine_ids(llm, prompt_ids)


def test_completions_stream_return_token_ids(oai: openai.OpenAI, llm: LLM, model: str) -> None:
    prompt_ids = llm.tokenizer.encode(PROMPTS[1])
    stream = oai.completions.create(model=model, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0,
                                    stream=True, extra_body=WITH_IDS)
    text, token_ids, prompt_id_chunks, chunks = "", [], [], 0
    for chunk in stream:
        for choice in chunk.choices:
            chunks += 1
            text += choice.text
            token_ids += extra(choice, "token_ids")
            if extra(choice, "prompt_token_ids") is not None:
                prompt_id_chunks.append(extra(choice, "prompt_token_ids"))
    assert chunks > 1  # decode_chunk 4: several rounds, each chunk with its own ids
    assert prompt_id_chunks == [prompt_ids]  # once, in the first chunk
    assert llm.tokenizer.decode(token_ids) == text
    assert token_ids == engine_ids(llm, prompt_ids)


def test_chat_return_token_ids(oai: openai.OpenAI, llm: LLM, model: str, server: BackgroundServer) -> None:
    response = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body=WITH_IDS)
    prompt_ids = extra(response, "prompt_token_ids")
    rendered = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert prompt_ids == rendered
    token_ids = extra(response.choices[0], "token_ids")
    assert token_ids == engine_ids(llm, prompt_ids)
    assert llm.tokenizer.decode(token_ids) == response.choices[0].message.content


def test_chat_stream_return_token_ids(oai: openai.OpenAI, llm: LLM, model: str) -> None:
    stream = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True, extra_body=WITH_IDS)
    text, token_ids, prompt_id_chunks = "", [], []
    for index, chunk in enumerate(stream):
        if extra(chunk, "prompt_token_ids") is not None:
            assert index == 0
            prompt_id_chunks.append(extra(chunk, "prompt_token_ids"))
        for choice in chunk.choices:
            text += choice.delta.content or ""
            token_ids += extra(choice, "token_ids") or []
    assert len(prompt_id_chunks) == 1
    assert llm.tokenizer.decode(token_ids) == text
    assert token_ids == engine_ids(llm, prompt_id_chunks[0])


def test_token_ids_left_out_by_default(server: BackgroundServer) -> None:
    with httpx.Client(base_url=server.url, timeout=120.0) as http:
        body = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4}).json()
        assert "token_ids" not in body["choices"][0] and "prompt_token_ids" not in body["choices"][0]
        body = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}).json()
        assert "prompt_token_ids" not in body and "token_ids" not in body["choices"][0]
        with http.stream("POST", "/v1/chat/completions",
                         json={"messages": MESSAGES, "max_tokens": 4, "stream": True}) as response:
            assert "token_ids" not in response.read().decode()

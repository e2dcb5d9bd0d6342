"""LoRA adapters over HTTP through the real server and the official openai client: the request's `model`
picks an adapter (streamed or not, tokens as transformers + peft's), /v1/models lists adapters with their
parent, a grammar constrains an adapter's output, an unknown name is OpenAI's 404 model_not_found, runtime loads and unloads (behind the API key,
only under --lora-allowed-dir, a bad adapter a 400 naming the file) leave the base model's output alone,
and /metrics counts requests per adapter and exports the Inference Extension's LoRA gauge."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")
pytest.importorskip("peft", reason="peft (a dev extra) makes the adapters and the reference")

from graphserve import AsyncEngine, EngineConfig
from graphserve.engine.tokenizer import Tokenizer
from graphserve.server.app import create_app
from graphserve.server.cli import main as cli_main
from graphserve.server.lora_registry import LoraRegistry, parse_lora_modules
from live_server import BackgroundServer
from lora_adapters import ADAPTER_SPECS, make_adapter, peft_greedy
from tiny_models import make_tiny_model

KEY = "sk-lora-test"
PROMPT = "Once upon a time"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    model = make_tiny_model(root / "llama", "llama")
    allowed = root / "allowed"
    adapters = {name: make_adapter(model, allowed / name, seed=i, **spec)
                for i, (name, spec) in enumerate(ADAPTER_SPECS.items())}
    return model, adapters, root


@pytest.fixture(scope="module")
def server(files) -> Iterator[BackgroundServer]:
    model, adapters, root = files
    config = EngineConfig(model=str(model), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16,
                          num_kv_blocks=64, warm_up=False)
    modules = parse_lora_modules([f"attn={adapters['attn']}", f'{{"name": "mlp", "path": "{adapters["mlp"]}"}}'])
    registry = LoraRegistry(modules, max_rank=16, allowed_dirs=[str(root / "allowed")], runtime_updates=True)
    with BackgroundServer(create_app(AsyncEngine(config), api_key=KEY, loras=registry)) as background:
        background.wait_ready()
        yield background


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


@pytest.fixture(scope="module")
def expected(files) -> dict[str | None, str]:
    """transformers + peft's greedy continuation of PROMPT, as text, by adapter name."""
    model, adapters, _ = files
    tokenizer = Tokenizer(model)
    ids = tokenizer.encode(PROMPT)
    return {name: tokenizer.decode(peft_greedy(model, adapters.get(name), ids, MAX_TOKENS))
            for name in (None, *adapters)}


def _complete(oai: openai.OpenAI, model: str) -> str:
    out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def test_the_model_field_picks_the_adapter_streamed_or_not(oai, expected):
    base = oai.models.list().data[0].id
    assert _complete(oai, base) == expected[None]
    assert _complete(oai, "attn") == expected["attn"]
    stream = oai.completions.create(model="mlp", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert {c.model for c in chunks} == {"mlp"}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["mlp"]
    chat = oai.chat.completions.create(model="attn", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0)
    assert chat.model == "attn" and chat.choices[0].message.content is not None
    response = oai.responses.create(model="mlp", input="hi", max_output_tokens=4, temperature=0)
    assert response.model == "mlp" and response.output


def test_a_grammar_constrains_an_adapters_output(oai):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = oai.chat.completions.create(model="mlp", messages=[{"role": "user", "content": "ok?"}], max_tokens=40,
                                    temperature=0, response_format={"type": "json_schema",
                                                                    "json_schema": {"name": "a", "schema": schema}})
    # (the tiny byte tokenizer's EOS "</s>" is no special token: its text follows the JSON)
    value, _ = json.JSONDecoder().raw_decode(r.choices[0].message.content)
    assert value["answer"] in ("yes", "no") and r.choices[0].finish_reason == "stop"


def test_models_lists_adapters_with_their_parent_and_unknown_names_are_404(oai):
    cards = {m.id: m for m in oai.models.list().data}
    base = next(m for m in cards.values() if m.parent is None)
    assert {"attn", "mlp"} <= set(cards) and cards["attn"].parent == base.id == cards["mlp"].parent
    assert oai.models.retrieve("attn").parent == base.id
    with pytest.raises(openai.NotFoundError) as caught:
        oai.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"


def test_an_adapter_loaded_at_run_time_serves_then_unloads_and_the_base_is_unchanged(files, server, oai, http,
                                                                                      expected):
    _, adapters, root = files
    base = oai.models.list().data[0].id
    before = _complete(oai, base)
    assert httpx.post(server.url + "/v1/load_lora_adapter",
                      json={"lora_name": "all", "lora_path": str(adapters["all"])}).status_code == 401
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": str(adapters["all"])})
    assert loaded.status_code == 200, loaded.text
    assert _complete(oai, "all") == expected["all"]  # a third adapter in two slots: one gave way
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": str(adapters["all"])}
                     ).status_code == 400
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "all"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(oai, "all")
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "all"}).status_code == 404
    assert _complete(oai, base) == before == expected[None]


def test_runtime_loads_outside_the_allowed_dirs_or_of_bad_adapters_are_400s(files, http, tmp_path):
    _, adapters, root = files
    outside = shutil.copytree(adapters["all"], tmp_path / "outside")
    refused = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(outside)})
    assert refused.status_code == 400 and "--lora-allowed-dir" in refused.json()["error"]["message"]
    sneaky = http.post("/v1/load_lora_adapter",
                       json={"lora_name": "x", "lora_path": str(root / "allowed" / ".." / "llama")})
    assert sneaky.status_code == 400 and "allowed" in sneaky.json()["error"]["message"]
    broken = shutil.copytree(adapters["all"], root / "allowed" / "broken")
    (broken / "adapter_config.json").write_text('{"r": 99, "lora_alpha": 8}')
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(broken)})
    assert bad.status_code == 400
    assert re.search(r"adapter_config\.json: rank 99 is above the maximum 16", bad.json()["error"]["message"])
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400


def test_metrics_count_requests_per_adapter_and_export_the_lora_gauge(oai, http):
    _complete(oai, "attn")
    text = http.get("/metrics").text
    assert re.search(r'^graphserve_lora_requests_total\{lora_name="attn"\} [1-9]', text, re.M)
    gauge = re.search(r'^graphserve_lora_requests_info\{(.*)\} (\S+)$', text, re.M)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', gauge.group(1)))
    assert labels["max_lora"] == "2" and set(labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert float(gauge.group(2)) > 1.7e9  # a Unix time


def test_an_adapter_that_does_not_fit_ends_serve_with_one_line(files, tmp_path, capsys):
    model, adapters, _ = files
    wrong = shutil.copytree(adapters["attn"], tmp_path / "wrong")
    (wrong / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "target_modules": ["fc9"]}')
    assert cli_main(["serve", "--device", "cpu", "--model", str(model), "--lora-modules", f"bad={wrong}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "LoRA adapter 'bad'" in err[0] and "target module 'fc9'" in err[0]
    assert cli_main(["serve", "--device", "cpu", "--lora-modules", "nameonly"]) == 2
    assert "name=path" in capsys.readouterr().err

"""The examples in README.md run, as written there, against the embedded model.

Each example is the fenced block after a `<!-- readme-test: NAME -->` line in README.md, so a
README edit that breaks an example fails here. The bash blocks (curl) run in a shell, the
Python blocks with exec(); `localhost:8000` is replaced with the test server's address. The
Python examples after the quick start use its `client` and `model`, as the README says."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (a dev extra) validates the outputs")

from graphserve import LLM, AsyncEngine, EngineConfig, SamplingParams
from graphserve.server.app import create_app
from live_server import BackgroundServer, sse_payloads

README = Path(__file__).resolve().parent.parent / "README.md"
MARKER = re.compile(r"^<!-- readme-test: ([\w-]+) -->\n```(\w+)\n(.*?)\n```$", re.M | re.S)
EXPECTED = {
    "curl-completion": "bash",
    "curl-stream": "bash",
    "openai-chat": "python",
    "offline": "python",
    "structured-json-schema": "python",
    "structured-choice": "bash",
    "tools": "python",
    "token-ids": "python",
    "metrics": "bash",
}
README_ADDRESS = "localhost:8000"


def readme_examples() -> dict[str, tuple[str, str]]:
    """NAME -> (language, code) of every marked block in README.md."""
    found: dict[str, tuple[str, str]] = {}
    for name, language, code in MARKER.findall(README.read_text()):
        assert name not in found, f"README.md marks two examples {name!r}"
        found[name] = (language, code)
    return found


EXAMPLES = readme_examples()


def example(name: str, language: str) -> str:
    assert name in EXAMPLES, f"README.md has no example marked `<!-- readme-test: {name} -->`"
    found_language, code = EXAMPLES[name]
    assert found_language == language, f"README example {name!r} is {found_language}, expected {language}"
    return code


def at_server(code: str, server: BackgroundServer) -> str:
    assert README_ADDRESS in code, f"the example does not talk to {README_ADDRESS}:\n{code}"
    return code.replace(README_ADDRESS, f"{server.host}:{server.port}")


def run_bash(name: str, server: BackgroundServer) -> str:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    code = at_server(example(name, "bash"), server)
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"README example {name!r} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def run_python(name: str, namespace: dict[str, Any], server: BackgroundServer | None) -> str:
    code = example(name, "python")
    if server is not None:
        code = at_server(code, server)
    else:  # it uses the quick start's client, or no server at all
        assert README_ADDRESS not in code, f"README example {name!r} opens its own connection to {README_ADDRESS}"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"README.md:{name}", "exec"), namespace)
    return printed.getvalue()


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    config = EngineConfig(device="cpu", max_num_seqs=8, max_model_len=1024, kv_cache_bytes=64 * 1024**2)
    with BackgroundServer(create_app(AsyncEngine(config))) as background:
        background.wait_ready()
        yield background


@pytest.fixture(scope="module")
def quick_start(server: BackgroundServer) -> dict[str, Any]:
    """The namespace after the openai quick-start example: `client`, `model`, `chat`."""
    namespace: dict[str, Any] = {}
    namespace["printed"] = run_python("openai-chat", namespace, server)
    return namespace


def test_the_readme_marks_every_example() -> None:
    assert {name: language for name, (language, _) in EXAMPLES.items()} == EXPECTED
    assert len(README.read_text().splitlines()) <= 400


def test_curl_completion(server: BackgroundServer) -> None:
    body = json.loads(run_bash("curl-completion", server))
    assert body["object"] == "text_completion"
    (choice,) = body["choices"]
    assert choice["text"].strip()
    assert choice["finish_reason"] in ("stop", "length")
    assert 1 <= body["usage"]["completion_tokens"] <= 16
    assert body["usage"]["prompt_tokens"] > 0


def test_curl_stream(server: BackgroundServer) -> None:
    payloads = sse_payloads(run_bash("curl-stream", server).splitlines())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks and all(c["object"] == "text_completion" for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text.strip()
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_openai_chat(quick_start: dict[str, Any]) -> None:
    chat = quick_start["chat"]
    content = chat.choices[0].message.content
    assert quick_start["printed"] == content + "\n"
    # greedy: the embedded model's own reply to the conversation, as the offline engine gives it
    # (which words, and whether they end within 32 tokens: the served Q4_1 weights answer differently
    # on different hosts' rounding; here 'Le Grand Château, ... is the capital of France.' with the
    # kernels built for AVX-512, 'The capital of France is Paris.' built for AVX2)
    llm = LLM()
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Which city is the capital of France?"}])
    want = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0))[0]
    assert content == want.text and content.strip()
    assert chat.choices[0].finish_reason == want.finish_reason
    assert chat.usage.completion_tokens == len(want.token_ids)
    if want.finish_reason == "length":
        assert len(want.token_ids) == 32
    else:
        assert want.finish_reason == "stop" and want.token_ids[-1] == llm.tokenizer.eos_token_id
    assert chat.model == quick_start["model"]


def test_offline_llm_gives_the_servers_greedy_tokens(server: BackgroundServer) -> None:
    namespace: dict[str, Any] = {}
    printed = run_python("offline", namespace, None)
    (output,) = namespace["outputs"]
    assert printed == f"{output.text} {output.finish_reason}\n"
    assert output.finish_reason in ("stop", "length") and 1 <= len(output.token_ids) <= 16
    served = json.loads(run_bash("curl-completion", server))["choices"][0]  # the same prompt, greedy, 16 tokens
    assert (output.text, output.finish_reason) == (served["text"], served["finish_reason"])


def test_structured_json_schema(quick_start: dict[str, Any]) -> None:
    namespace = dict(quick_start)
    printed = run_python("structured-json-schema", namespace, None)
    person = namespace["person"]
    jsonschema.validate(person, namespace["schema"])
    assert person == json.loads(namespace["r"].choices[0].message.content)
    assert namespace["r"].choices[0].finish_reason == "stop"
    assert printed == f"{person}\n"


def test_structured_choice(server: BackgroundServer) -> None:
    body = json.loads(run_bash("structured-choice", server))
    (choice,) = body["choices"]
    assert choice["text"] in ("yes", "no")
    assert choice["finish_reason"] == "stop"


def test_tools(quick_start: dict[str, Any]) -> None:
    namespace = dict(quick_start)
    printed = run_python("tools", namespace, None)
    first = namespace["r"].choices[0]
    # OpenAI's default parallel_tool_calls: after its call the model may write on; whether it ends
    # within max_tokens (60) is its greedy pick on the Q4_1 weights, which differs by CPU
    if first.finish_reason == "length":
        assert namespace["r"].usage.completion_tokens == 60
    else:
        assert first.finish_reason == "tool_calls"
    call = namespace["call"]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, namespace["tools"][0]["function"]["parameters"])
    assert printed.splitlines()[0] == f"get_weather {arguments}"
    # the second turn: the tool's result went back and the model answered in text
    answer = namespace["answer"].choices[0]
    assert answer.message.tool_calls is None
    assert answer.message.content and printed.endswith(answer.message.content + "\n")
    roles = [m["role"] if isinstance(m, dict) else m.role for m in namespace["messages"]]
    assert roles == ["user", "assistant", "tool"]


def test_token_ids(quick_start: dict[str, Any], server: BackgroundServer) -> None:
    namespace = dict(quick_start)
    printed = run_python("token-ids", namespace, None)
    r = namespace["r"]
    choice = r.choices[0]
    prompt_ids, token_ids = choice.prompt_token_ids, choice.token_ids
    assert printed == f"{prompt_ids} {token_ids}\n"
    assert len(token_ids) == r.usage.completion_tokens and len(prompt_ids) == r.usage.prompt_tokens
    with httpx.Client(base_url=server.url, timeout=60.0) as http:
        assert http.post("/detokenize", json={"tokens": token_ids}).json()["prompt"] == choice.text
        assert http.post("/detokenize", json={"tokens": prompt_ids}).json()["prompt"] == "The capital of France is"


def test_metrics(quick_start: dict[str, Any], server: BackgroundServer) -> None:
    # the engine's figures reach the front end a moment after the quick start's requests end
    with httpx.Client(base_url=server.url, timeout=60.0) as http:
        deadline = time.monotonic() + 10.0
        while "\ngraphserve_num_requests_running 0.0" not in http.get("/metrics").text and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = run_bash("metrics", server).splitlines()
    values: dict[str, float] = {}
    for line in lines:
        name, _, value = line.rpartition(" ")
        values[name] = float(value)
    finished = sum(v for k, v in values.items() if k.startswith("graphserve_requests_total{finish_reason="))
    assert finished >= 1  # the quick start's chat, at least
    assert values["graphserve_num_requests_running"] == 0
    assert 0.0 <= values["graphserve_kv_cache_usage_ratio"] <= 1.0

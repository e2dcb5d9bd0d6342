"""GGUF files as served models (`--model file.gguf`): converted once into the cache, with their
weights dequantized to float32, config, tokenizer and chat template from the file's metadata.

The files are tiny random-weight models written at test time (tests/tiny_gguf.py); the reference
for greedy parity is the transformers model holding the weights the file dequantizes to, built
from the numbers written into the file, not from graphserve's conversion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer

gguf = pytest.importorskip("gguf", reason="gguf (gguf-py, a dependency of the CPU install) reads the files")

from graphserve import LLM, SamplingParams  # noqa: E402
from graphserve.engine.async_engine import AsyncEngine
from graphserve.engine.config import EngineConfig
from graphserve.engine.errors import ModelFilesError, UnsupportedModelError
from graphserve.engine.model_files.model_cache import COMPLETE_MARKER, cache_root, is_complete
from graphserve.engine.model_files.model_path import ensure_gguf_model, gguf_cache_path
from graphserve.kernels.rotary import rope_inv_freq
from graphserve.server.app import create_app
from live_server import BackgroundServer
from tiny_gguf import CHAT_TEMPLATE, EOS_ID, gguf_cache, write_tiny_gguf  # noqa: F401 (gguf_cache: a fixture)

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):\n"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def llama_q8(files: Path) -> tuple[torch.nn.Module, Path]:
    return write_tiny_gguf(files, "llama", "Q8_0")


def _reference_greedy(model: torch.nn.Module, prompt_ids: list[int], max_tokens: int,
                      eos_token_id: int | None = None) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=eos_token_id, pad_token_id=0)
    new = out[0, ids.shape[1]:].tolist()
    return new[: new.index(eos_token_id) + 1] if eos_token_id in new else new


# --------------------------------------------------------------------------- greedy parity


@pytest.mark.parametrize(("variant", "tensor_type"), [("llama", "F32"), ("llama", "Q8_0"), ("qwen2", "Q8_0"),
                                                       ("qwen3", "F32")])
def test_greedy_tokens_match_transformers_on_the_dequantized_weights(
        files: Path, llama_q8: tuple[torch.nn.Module, Path], variant: str, tensor_type: str) -> None:
    if (variant, tensor_type) == ("llama", "Q8_0"):
        reference, path = llama_q8
    else:
        reference, path = write_tiny_gguf(files, variant, tensor_type, add_bos_token=variant == "llama")
    llm = LLM(model=str(path), device="cpu", dtype="float32", kv_cache_bytes=16 * 1024**2)
    served = Path(llm.engine.model_path)
    assert served.parent.parent == cache_root() / "models" / "gguf" and served.name == path.stem
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    gguf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt_token_ids == gguf_tokenizer(prompt).input_ids, prompt  # the file's vocabulary
        assert output.token_ids == _reference_greedy(reference, output.prompt_token_ids, MAX_TOKENS), prompt


# llama.cpp keeps Llama 3.1's rope scaling as a tensor of frequency divisors (rope_freqs.weight),
# linear scaling as metadata; transformers' GGUF reader drops both. low/high_freq_factor 2/16 (not
# the usual 1/4): what must come back is the frequencies, not these numbers.
ROPE_SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 16.0,
               "original_max_position_embeddings": 512},
    "linear": {"rope_type": "linear", "factor": 4.0},
}


@pytest.mark.parametrize("scaling", ROPE_SCALINGS)
def test_the_files_rope_scaling_is_served(files: Path, scaling: str) -> None:
    folder = files / f"rope-{scaling}"
    folder.mkdir()
    rope = ROPE_SCALINGS[scaling]
    reference, path = write_tiny_gguf(folder, "llama3", "Q8_0", rope_scaling=rope)
    llm = LLM(model=str(path), device="cpu", dtype="float32", kv_cache_bytes=16 * 1024**2)
    served = json.loads((Path(llm.engine.model_path) / "config.json").read_text())["rope_parameters"]
    assert served["rope_type"] == scaling
    head_dim = reference.config.head_dim
    torch.testing.assert_close(rope_inv_freq(head_dim, served["rope_theta"], served),
                               rope_inv_freq(head_dim, reference.config.rope_parameters["rope_theta"], rope))

    prompt = " ".join(PROMPTS * 6)  # about 150 positions: the scaled frequencies turn visibly
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=0)
    output = llm.generate(prompt, params)[0]
    ids = output.prompt_token_ids
    assert len(ids) > 100
    assert output.token_ids == _reference_greedy(reference, ids, MAX_TOKENS)
    with torch.no_grad():  # teacher-forced over the prompt: every position's log-probability
        logits = reference(torch.tensor([ids])).logits[0, :-1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    served = torch.tensor([lp.logprob for lp in output.prompt_logprobs[1:]])
    torch.testing.assert_close(served, expected, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- the real server


def test_chat_completions_use_the_files_chat_template(llama_q8: tuple[torch.nn.Module, Path]) -> None:
    reference, path = llama_q8
    messages = [{"role": "user", "content": "Name the capital of France."}]
    gguf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert gguf_tokenizer.chat_template == CHAT_TEMPLATE
    prompt_ids = gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]
    expected = _reference_greedy(reference, prompt_ids, MAX_TOKENS, eos_token_id=EOS_ID)

    engine = AsyncEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", kv_cache_bytes=16 * 1024**2))
    with BackgroundServer(create_app(engine)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        server.wait_ready()
        response = client.post("/v1/chat/completions", json={
            "model": path.stem, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == path.stem  # the served name is the file's stem
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == len(expected)
    assert body["choices"][0]["message"]["content"] == gguf_tokenizer.decode(expected, skip_special_tokens=True)


# --------------------------------------------------------------------------- the cache


def test_second_start_reuses_the_conversion(llama_q8: tuple[torch.nn.Module, Path]) -> None:
    """`graphserve generate` on a file converted and served before: no conversion, the folder untouched
    (the first start served from it packed its blocks for the CPU kernel, gguf/packed.safetensors)."""
    _, path = llama_q8
    folder = ensure_gguf_model(path, progress=False)
    expected = LLM(model=str(folder), device="cpu", kv_cache_bytes=16 * 1024**2).generate(
        PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0].text
    before = {p.relative_to(folder): p.stat().st_mtime_ns for p in folder.rglob("*")}

    result = _graphserve("generate", "--device", "cpu", "--model", str(path), "--max-tokens", str(MAX_TOKENS),
                         "--ignore-eos", "--kv-cache-bytes", "16MiB", PROMPTS[0])
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
    assert "converting" not in result.stderr and "dequantizing" not in result.stderr
    assert {p.relative_to(folder): p.stat().st_mtime_ns for p in folder.rglob("*")} == before


def test_a_rewritten_file_gets_a_folder_of_its_own(files: Path) -> None:
    folder = files / "rewritten"
    folder.mkdir()
    _, path = write_tiny_gguf(folder, "qwen2", "F32", seed=1)
    first = ensure_gguf_model(path, progress=False)
    marker = json.loads((first / COMPLETE_MARKER).read_text())
    assert marker["source"] == {"gguf": str(path.resolve()), "size": path.stat().st_size,
                                "mtime_ns": path.stat().st_mtime_ns}

    write_tiny_gguf(folder, "qwen2", "F32", seed=2)  # same name, other weights
    os.utime(path, ns=(marker["source"]["mtime_ns"] + 10**9,) * 2)  # a coarse clock could repeat the mtime
    second = ensure_gguf_model(path, progress=False)
    assert second != first and second == gguf_cache_path(path) and second.name == first.name
    assert is_complete(first) and is_complete(second)
    assert (first / "model.safetensors").read_bytes() != (second / "model.safetensors").read_bytes()


# --------------------------------------------------------------------------- what is refused


def test_unsupported_architecture_is_one_line_naming_it(files: Path) -> None:
    folder = files / "phi3"
    folder.mkdir()
    _, path = write_tiny_gguf(folder, "llama", "F32", architecture="phi3")

    result = _graphserve("serve", "--device", "cpu", "--port", "1", "--model", str(path))
    assert result.returncode == 1
    last_line = (result.stdout + result.stderr).strip().splitlines()[-1]
    assert last_line.startswith("graphserve: ") and "GGUF architecture 'phi3' is not supported" in last_line
    assert not gguf_cache_path(path).parent.exists()  # refused before anything was written to the cache

    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'phi3'"):  # the offline API too
        LLM(model=str(path), device="cpu")


def test_unsupported_tensor_type_is_one_line_naming_the_tensor(files: Path) -> None:
    folder = files / "q8_1"
    folder.mkdir()
    _, path = write_tiny_gguf(folder, "qwen2", "F32", raw_tensor=("blk.1.ffn_down.weight", "Q8_1"))

    result = _graphserve("generate", "--device", "cpu", "--model", str(path), "hello")
    assert result.returncode == 1
    last_line = (result.stdout + result.stderr).strip().splitlines()[-1]
    assert last_line.startswith("graphserve: ")
    assert "tensor 'blk.1.ffn_down.weight' has type Q8_1" in last_line and "cannot dequantize" in last_line


def test_a_rope_scaling_the_engine_lacks_is_refused(files: Path) -> None:
    folder = files / "yarn"
    folder.mkdir()
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    _, path = write_tiny_gguf(folder, "qwen2", "F32", rope_scaling=yarn)
    with pytest.raises(UnsupportedModelError, match=r"rope scaling 'yarn' \(qwen2.rope.scaling.type\)"):
        ensure_gguf_model(path)


def test_a_missing_or_broken_file_is_a_model_files_error(files: Path) -> None:
    with pytest.raises(ModelFilesError, match="GGUF file not found"):
        LLM(model=str(files / "missing.gguf"), device="cpu")
    broken = files / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFilesError, match="not a readable GGUF file"):
        ensure_gguf_model(broken)


def _graphserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "graphserve", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})

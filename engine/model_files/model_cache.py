"""Model folders that graphserve builds into its cache (the embedded default model, converted
GGUF files), published atomically:

    publish_folder(target, build) -> Path   # build(tmp) fills a temporary folder; then it is renamed into place
    is_complete(folder) -> bool             # published whole, by this format version

A folder is built in a temporary folder next to the target (same filesystem), verified, marked
complete (COMPLETE_MARKER, written last), fsynced, then renamed into place. A file lock
serialises builders across processes; the completion check is repeated once the lock is held.
A folder without a valid marker (half copied, left by a crash, an older format) is never used:
it is rebuilt.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from graphserve.engine.errors import ModelFilesError

logger = logging.getLogger(__name__)

# Written last into the temporary folder, just before it is renamed into place.
COMPLETE_MARKER = ".graphserve-complete.json"
# Bump when a conversion's output changes: folders marked with another format are rebuilt.
FORMAT_VERSION = 3  # 2: GGUF conversions keep the quantized blocks too; 3: in gguf/blocks.safetensors
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_TMP_INFIX = ".tmp-"
_TRASH_INFIX = ".stale-"


def cache_root() -> Path:
    """``$GRAPHSERVE_CACHE`` if set (and not empty), else ``~/.cache/graphserve``."""
    env = os.environ.get("GRAPHSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "graphserve"


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


def say(log: logging.Logger, message: str, progress: bool) -> None:
    """Log ``message`` at INFO; with ``progress``, print it to stderr too when INFO is not shown."""
    log.info(message)
    if progress and not log.isEnabledFor(logging.INFO):
        print(f"graphserve: {message}", file=sys.stderr, flush=True)


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
        say(logger, f"waiting for another process preparing {lock_path.parent} ...", progress)
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


def publish_folder(target: Path, build: Callable[[Path], None], *, progress: bool = False,
                   source: dict[str, Any] | None = None) -> Path:
    """Make ``target`` a complete folder built by ``build(tmp_dir)``, atomically.

    ``build`` fills an empty temporary folder next to ``target`` (same filesystem); it
    must write at least REQUIRED_FILES. Then the completion marker is written, everything
    is fsynced, and the folder is renamed onto ``target``. Whatever sat at ``target``
    without a valid marker (a half-written folder, an older format) is renamed aside in
    the same instant and deleted afterwards. Everything runs under an inter-process file
    lock, and the completion check is repeated once the lock is held, so concurrent
    callers build once. Temporary folders of crashed runs are removed under the lock.
    If ``build`` raises, its temporary folder is removed and ``target`` is untouched.
    ``source`` (what the folder was built from) is recorded in the marker, for people reading it.
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
                **({"source": source} if source else {}),
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


"""The LoRA adapters a front end serves, by name: those of --lora-modules, and with
--allow-runtime-lora-updating those loaded and unloaded over HTTP (server/routes_lora.py). A request's
`model` names one; the engine gets its LoraRequest (name, id, folder) with the request.

Ids: the --lora-modules in order get 1, 2, ... (every front end numbers them alike); an adapter loaded at
run time gets the next id, never reused, so two loads under one name never share prefix-cache KV."""

from __future__ import annotations

import json
from pathlib import Path

from graphserve.engine.errors import AdapterError
from graphserve.engine.lora.adapter import inspect_adapter
from graphserve.engine.lora.layout import LoraLayout
from graphserve.engine.request import LoraRequest


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules entries, `name=path` or vLLM's JSON form {"name": ..., "path": ...}: (name, path)
    pairs, names distinct. ValueError naming the bad entry."""
    modules: list[tuple[str, str]] = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
                name, path = entry["name"], entry["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {value!r} is not name=path or a JSON object with name and path")
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules: {value!r} is not name=path")
        if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules: {value!r} needs a name and a path")
        if any(name == seen for seen, _ in modules):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        modules.append((name.strip(), path.strip()))
    return modules


def check_adapters(modules: list[tuple[str, str]], layout: LoraLayout, max_rank: int) -> None:
    """Every module's adapter fits the model (AdapterError naming the adapter, file and module)."""
    for name, path in modules:
        try:
            inspect_adapter(path, layout, max_rank)
        except AdapterError as exc:
            raise AdapterError(f"LoRA adapter {name!r}: {exc}") from None


class LoraRegistry:
    def __init__(self, modules: list[tuple[str, str]], max_rank: int, allowed_dirs: list[str] | None = None,
                 runtime_updates: bool = False):
        self.max_rank = max_rank
        self.allowed_dirs = [Path(d).expanduser().resolve() for d in allowed_dirs or []]
        self.runtime_updates = runtime_updates
        self._by_name = {name: LoraRequest(name, i + 1, str(Path(path).expanduser().resolve()))
                         for i, (name, path) in enumerate(modules)}
        self._next_id = len(modules) + 1
        self.layout: LoraLayout | None = None  # the served model's, once the engine is ready (bind)

    def bind(self, model_path: str) -> None:
        """The served model's layout, which runtime loads are checked against."""
        from graphserve.engine.models.config import ModelArgs
        from graphserve.engine.models.lora_layout import lora_layout

        self.layout = lora_layout(ModelArgs.from_dir(model_path))

    def get(self, name: str | None) -> LoraRequest | None:
        return self._by_name.get(name) if name else None

    def adapters(self) -> list[LoraRequest]:
        return sorted(self._by_name.values(), key=lambda lora: lora.lora_id)

    def allowed(self, path: str) -> Path:
        """`path` resolved (symlinks too); ValueError unless it lies under an allowed directory."""
        resolved = Path(path).expanduser().resolve()
        if not any(resolved.is_relative_to(d) for d in self.allowed_dirs):
            raise ValueError(f"lora_path {path!r} is not under an allowed directory (--lora-allowed-dir)")
        return resolved

    def check(self, path: Path) -> None:
        """The adapter at `path` fits the served model (AdapterError otherwise); reads only headers."""
        inspect_adapter(path, self.layout, self.max_rank)

    def add(self, name: str, path: Path, replace: bool = False) -> LoraRequest:
        """Serve the (checked) adapter at `path` as `name`, under a new id; ValueError if the name is taken
        (unless replace)."""
        if name in self._by_name and not replace:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded")
        lora = LoraRequest(name, self._next_id, str(path))
        self._next_id += 1
        self._by_name[name] = lora
        return lora

    def remove(self, name: str) -> LoraRequest:
        """Stop serving `name` (KeyError if it is not served); running requests finish with it."""
        return self._by_name.pop(name)

"""Server settings: built-in defaults < a TOML file in configs/ < command-line flags.

A config file holds flat keys (the flag names with underscores) or `[server]` /
`[engine]` tables. Engine keys are EngineConfig's fields; server keys are below.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from graphserve.engine.config import EngineConfig
from graphserve.server.lora_registry import LoraRegistry, parse_lora_modules
from graphserve.server.reasoning import REASONING_PARSERS, parser_name

DEFAULT_CONFIG_NAME = "default.toml"
API_KEY_ENV = "GRAPHSERVE_API_KEY"
FAULT_INJECTION_ENV = "GRAPHSERVE_ENABLE_FAULT_INJECTION"  # tests only: POST /debug/fault


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    log_requests: bool = False
    log_level: str = "info"
    shutdown_timeout: float = 30.0  # seconds running requests get after SIGTERM
    max_queue_len: int = 256  # engine requests waiting to run; beyond it new requests get 429
    max_body_bytes: int = 1024**2  # request bodies larger than this get 413
    allowed_origins: list[str] | None = None  # CORS origins; None: no CORS headers at all
    chat_content_special_tokens: bool = False  # parse special-token text inside chat message contents
    api_server_count: int | None = None  # front-end processes; None: decided by the machine (supervisor.py)
    max_connections: int = 2048  # open connections; beyond it idle ones are evicted, else 503 (connections.py)
    header_timeout: float = 10.0  # seconds for a request's head to arrive (from connect or its first byte)
    body_timeout: float = 30.0  # seconds for a request's body to arrive after its head
    # qwen3 | deepseek-r1 | gpt-oss: thinking apart from the answer (server/reasoning.py); auto (None): from the
    # chat template; none: off
    reasoning_parser: str | None = None
    # LoRA adapters served by name: "name=path" entries (server/lora_registry.py); any turns the engine's enable_lora on
    lora_modules: list[str] | None = None
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (server/routes_lora.py), for paths under lora_allowed_dirs
    allow_runtime_lora_updating: bool = False
    lora_allowed_dirs: list[str] | None = None


SERVER_KEYS = {f.name for f in fields(ServerSettings)}
ENGINE_KEYS = {f.name for f in fields(EngineConfig)}


class SettingsError(ValueError):
    """A config file or flag value that cannot be used."""


def repo_configs_dir() -> Path:
    """configs/ beside the server package: the repository's in a checkout (an editable install links
    back to it), graphserve/configs in an installed wheel."""
    return Path(__file__).resolve().parent.parent / "configs"


def default_config_path() -> Path | None:
    """configs/default.toml next to the package, else in the working directory, else none."""
    for folder in (repo_configs_dir(), Path.cwd() / "configs"):
        candidate = folder / DEFAULT_CONFIG_NAME
        if candidate.is_file():
            return candidate
    return None


def resolve_config_path(name: str) -> Path:
    """A path as given, or a bare name looked up in configs/ ("gpu-h200" or "gpu-h200.toml")."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    for folder in (repo_configs_dir(), Path.cwd() / "configs"):
        for candidate in (folder / name, folder / f"{name}.toml"):
            if candidate.is_file():
                return candidate
    raise SettingsError(f"config file not found: {name}")


def read_config_file(path: Path) -> dict[str, Any]:
    """Flatten the file's [server] and [engine] tables and top-level keys into one dict."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: invalid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("server", "engine") and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    unknown = sorted(set(flat) - SERVER_KEYS - ENGINE_KEYS)
    if unknown:
        raise SettingsError(f"{path}: unknown keys: {', '.join(unknown)}")
    return flat


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}


def parse_size(value: str | int) -> int:
    """Bytes from 123, "512MiB", "2GB", "1.5g" (the i-suffixed units are powers of 1024)."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise SettingsError(f"not a size in bytes: {value!r}")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    binary = "i" in unit
    scale = _SIZE_UNITS[unit[:1]] if unit else 1
    if binary:
        scale = 1024 ** {"k": 1, "m": 2, "g": 3, "t": 4}[unit[0]]
    return int(number * scale)


def format_size(value: int) -> str:
    """The shortest exact binary form: 1048576 -> "1MiB", 1000 -> "1000"."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= scale and value % scale == 0:
            return f"{value // scale}{unit}"
    return str(value)


def parse_origins(value: str) -> list[str]:
    """"https://a.example,https://b.example" (or "*") -> a list of CORS origins."""
    return [origin.strip() for origin in value.split(",") if origin.strip()]


def check_server_settings(server: ServerSettings) -> None:
    if server.max_queue_len < 1:
        raise SettingsError(f"max_queue_len must be >= 1, got {server.max_queue_len}")
    if server.api_server_count is not None and not 1 <= server.api_server_count <= 64:
        raise SettingsError(f"api_server_count must be in [1, 64], got {server.api_server_count}")
    if server.max_body_bytes < 1024:
        raise SettingsError(f"max_body_bytes must be >= 1024, got {server.max_body_bytes}")
    if server.max_connections < 1:
        raise SettingsError(f"max_connections must be >= 1, got {server.max_connections}")
    for name in ("header_timeout", "body_timeout"):
        if not 0 < getattr(server, name) < float("inf"):
            raise SettingsError(f"{name} must be a positive number of seconds, got {getattr(server, name)}")
    try:
        server.reasoning_parser = parser_name(server.reasoning_parser)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    if server.allowed_origins is not None and not isinstance(server.allowed_origins, list):
        raise SettingsError("allowed_origins must be a list of origins or a comma-separated string")
    if server.allow_runtime_lora_updating:
        if not server.lora_allowed_dirs:
            raise SettingsError("allow_runtime_lora_updating needs lora_allowed_dirs (--lora-allowed-dir DIR): the "
                                "directories adapters may be loaded from")
        if server.api_server_count not in (None, 1):
            raise SettingsError("allow_runtime_lora_updating serves with one front end: each front end keeps its "
                                "own adapter names (set api_server_count to 1)")
    try:
        parse_lora_modules(server.lora_modules)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def lora_registry(server: ServerSettings, engine: EngineConfig) -> "LoraRegistry | None":
    """The LoRA adapters a front end serves by name, or None when LoRA is off."""
    if not engine.enable_lora:
        return None
    return LoraRegistry(parse_lora_modules(server.lora_modules), engine.max_lora_rank, server.lora_allowed_dirs,
                        server.allow_runtime_lora_updating)


def fault_injection_enabled(environ: dict[str, str] | None = None) -> bool:
    """GRAPHSERVE_ENABLE_FAULT_INJECTION=1 (tests only) adds POST /debug/fault."""
    value = (os.environ if environ is None else environ).get(FAULT_INJECTION_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def merge_settings(file_values: dict[str, Any], flag_values: dict[str, Any]) -> tuple[ServerSettings, EngineConfig]:
    """Flags that were given (not None) override the file; the rest keep their defaults."""
    merged = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
    if merged.get("api_key") is None and os.environ.get(API_KEY_ENV):
        merged["api_key"] = os.environ[API_KEY_ENV]
    for key in ("kv_cache_bytes", "max_body_bytes"):
        if key in merged:
            merged[key] = parse_size(merged[key])
    if isinstance(merged.get("allowed_origins"), str):
        merged["allowed_origins"] = parse_origins(merged["allowed_origins"])
    for key in ("lora_modules", "lora_allowed_dirs"):  # a TOML string is one entry
        if isinstance(merged.get(key), str):
            merged[key] = [merged[key]]
    if merged.get("lora_modules") or merged.get("allow_runtime_lora_updating"):
        merged["enable_lora"] = True  # adapters served by name need the engine's slots
    server = ServerSettings(**{k: v for k, v in merged.items() if k in SERVER_KEYS})
    check_server_settings(server)
    try:
        engine = EngineConfig.from_dict({k: v for k, v in merged.items() if k in ENGINE_KEYS})
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"invalid engine setting: {exc}") from None
    return server, engine

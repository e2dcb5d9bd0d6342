"""The `graphserve` command: serve | generate | prepare-model."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from graphserve.engine.config import EngineConfig
from graphserve.engine.errors import GraphserveError
from graphserve.server.settings import (
    API_KEY_ENV,
    REASONING_PARSERS,
    ServerSettings,
    SettingsError,
    default_config_path,
    format_size,
    merge_settings,
    parse_origins,
    parse_size,
    read_config_file,
    resolve_config_path,
)

logger = logging.getLogger("graphserve.server")

ENGINE_FLAG_HELP = {
    "model": "local Hugging Face model folder, or a .gguf file (llama, qwen2, qwen3; converted once into the "
             "cache; see --dtype) (default: the embedded SmolLM2-135M-Instruct, a Q4_1 GGUF file)",
    "device": "auto | cpu | cuda (auto: cuda when a GPU is present)",
    "dtype": "auto | float32 | bfloat16 | float16 (auto: the checkpoint's on CUDA; on CPU float32, but a GGUF "
             "model's projections in the file's quantized blocks; float32 dequantizes them)",
    "max_model_len": "context length (prompt + output); default: the model's, capped by the KV pool",
    "max_num_seqs": "most sequences in the running batch",
    "max_num_batched_tokens": "prefill token budget per engine step",
    "block_size": "KV-cache block size in tokens (a power of two)",
    "decode_chunk": "K: decode steps per round between host syncs (EOS is checked once per round)",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use (weights, KV, graphs)",
    "kv_cache_bytes": "KV pool size on CPU, e.g. 536870912 or 512MiB",
    "num_kv_blocks": "force the number of KV blocks (overrides the memory budget)",
    "enforce_eager": "never capture or replay CUDA graphs",
    "warm_up": "before saying ready, run a burst of dummy requests through every path a first burst takes, "
               "so it compiles, loads and allocates nothing later; --no-warm-up: ready once the model is "
               "loaded (and the graphs captured); default on, off where GRAPHSERVE_WARM_UP=0",
    "prefix_caching": "reuse the KV of a prompt's cached prefix (full blocks, hash chain + token check, "
                      "LRU eviction); --no-prefix-caching: compute every prompt in full",
    "overlap_rounds": "launch each CUDA-graph decode round before the host reads the previous one's tokens "
                      "(--no-overlap-rounds: one round at a time)",
    "cuda_graph_max_batch": "largest batch bucket captured as a CUDA graph",
    "prefill_ahead": "short prefills (CUDA graphs) run ahead of the decode rounds queued on the GPU, and the core "
                     "prefills newcomers while it waits for a round: a prefix-cache hit's first token waits for "
                     "neither (experimental, off by default)",
    "cuda_graph_max_prefill_tokens": "prefill steps of up to this many tokens (in up to 64 sequences) replay a "
                                     "CUDA graph, as a prefix-cache hit's short prefill does; 0: always eager",
    "num_threads": "torch CPU threads of a CPU engine (default: torch's, all cores; the front ends run in "
                   "their own processes and use little: on the 2-core development machine 2 threads served "
                   "21/91/135 tok/s at 1/8/16 streams where 1 thread served 17/63/84, measured before the "
                   "CPU attention kernel; README has today's figures)",
    "grammar_compile_timeout": "seconds a response_format / structured_outputs / tools grammar may take to "
                               "compile; longer is a 400",
    "tensor_parallel_size": "shard the model over this many GPUs of the host (CPU: processes), one engine "
                            "process per rank (engine/distributed.py)",
    "seed": "seed the seeds of unseeded requests (default: drawn from the OS, so they differ across "
            "restarts and replicas)",
    "speculative_method": "speculative decoding: ngram (prompt lookup: drafts copied from the prompt and output "
                          "so far, verified in one pass; the same tokens, faster on text that repeats its input) "
                          "or draft (a smaller model, --draft-model, proposes them). Greedy and temperature-only "
                          "sampling rows; left out: off",
    "draft_model": "the draft model of --speculative-method draft: a folder or hub name of a smaller model with the "
                   "target's tokenizer (e.g. Llama-3.2-1B-Instruct for Llama-3.1-8B-Instruct)",
    "draft_quantization": "fp8: the draft model's projection weights in FP8 (per-channel scales), half the bytes a "
                          "draft step reads; default: the target's --quantization",
    "num_speculative_tokens": "k: most draft tokens verified per sequence and step, 1 to 16",
    "enable_lora": "serve LoRA adapters (on by itself with --lora-modules or --allow-runtime-lora-updating): a "
                   "request's model names one; requests for different adapters share batches and CUDA graphs",
    "max_loras": "LoRA adapters held on the device at once (slots); more waiting requests' adapters wait for a "
                 "slot, which the least recently used adapter no running request uses gives up",
    "max_cpu_loras": "LoRA adapters cached in host memory (default: --max-loras)",
    "max_lora_rank": "largest LoRA rank served; the device slots are sized by it",
    "speculative_max_batch": "decode rounds of more running sequences than this do not speculate (at large "
                             "batch verifying drafts costs more than it saves); default: 8 on CPU, 16 on CUDA (measured: "
                             "docs/benchmarks.md)",
}


def _field_type(annotation: Any) -> type:
    """EngineConfig is written with `from __future__ import annotations`: types are strings."""
    first = str(annotation).split("|")[0].strip()
    return {"bool": bool, "int": int, "float": float}.get(first, str)


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per EngineConfig field, default None so the config file's value survives."""
    group = parser.add_argument_group("engine")
    for field in fields(EngineConfig):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        default = field.default if field.default is not MISSING else None
        help_text = ENGINE_FLAG_HELP.get(field.name, field.name.replace("_", " "))
        kind = _field_type(field.type)
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif field.name == "kv_cache_bytes":
            group.add_argument(flag, type=parse_size, default=None, help=f"{help_text} (built-in default {default})")
        else:
            group.add_argument(flag, type=kind, default=None, help=f"{help_text} (built-in default {default})")


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        help="TOML settings file (a path, or a name in configs/ such as gpu-h200); "
        "default: configs/default.toml when present. Flags override it.",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphserve", description="OpenAI-compatible LLM inference server")
    commands = parser.add_subparsers(dest="command", metavar="{serve,generate,prepare-model}")

    serve = commands.add_parser("serve", help="run the HTTP server")
    add_config_flag(serve)
    group = serve.add_argument_group("server")
    defaults = ServerSettings()
    group.add_argument("--host", default=None, help=f"address to bind (default {defaults.host})")
    group.add_argument("--port", type=int, default=None, help=f"port to bind (default {defaults.port})")
    group.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})")
    group.add_argument("--served-model-name", default=None, help="model name clients use (default: the folder name)")
    group.add_argument(
        "--log-requests", action=argparse.BooleanOptionalAction, default=None, help="log every request and its end"
    )
    group.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=None,
        help=f"seconds running requests get to finish after SIGTERM (default {defaults.shutdown_timeout:g})",
    )
    group.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="most engine requests waiting to run; beyond it new requests get 429 with Retry-After "
        f"(default {defaults.max_queue_len})",
    )
    group.add_argument(
        "--max-body-bytes",
        type=parse_size,
        default=None,
        help=f"largest request body, e.g. 1MiB; larger ones get 413 "
        f"(default {format_size(defaults.max_body_bytes)})",
    )
    group.add_argument(
        "--allowed-origins",
        type=parse_origins,
        default=None,
        help="CORS: comma-separated origins allowed to call the API from a browser, or '*' (default: CORS off)",
    )
    group.add_argument(
        "--chat-content-special-tokens",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tokenize special-token text inside chat message contents as control tokens (the old "
        "behaviour; by default contents are text, so a user cannot forge system or assistant turns)",
    )
    group.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="front-end processes (HTTP, tokenization, streaming) on the one port, all feeding the one "
        "engine-core process (default: 1 on CPU; on a GPU machine one per ~3 cores, at most 4)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="most open connections; past it a new one evicts an idle one, else gets 503 "
        f"(default {defaults.max_connections})",
    )
    group.add_argument(
        "--header-timeout",
        type=float,
        default=None,
        help=f"seconds for a request's head to arrive, else 408 and close (default {defaults.header_timeout:g})",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=None,
        help=f"seconds for a request's body to arrive after its head, else 408 and close "
        f"(default {defaults.body_timeout:g})",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        help=f"split a reasoning model's thinking (<think>...</think>, harmony's analysis channel) from its answer: "
        f"chat responses carry it as reasoning_content / reasoning, /v1/responses as a reasoning item, and "
        f"response_format and tool grammars apply only after it; one of {', '.join(REASONING_PARSERS)}, auto "
        f"(the default: from the chat template when it is unambiguous) or none (off: the thinking is content)",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served under these names: a request's model picks one "
        "(turns --enable-lora on); also vLLM's JSON form '{\"name\": ..., \"path\": ...}'",
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, with its "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING), behind --api-key, for paths under --lora-allowed-dir; one front end",
    )
    group.add_argument(
        "--lora-allowed-dir",
        dest="lora_allowed_dirs",
        action="append",
        default=None,
        metavar="DIR",
        help="a directory runtime LoRA loads may read adapters from (repeatable)",
    )
    ray = serve.add_argument_group("Ray Serve (pip install graphserve[ray]; docs/scaling.md)")
    ray.add_argument("--ray", action="store_true",
                     help="serve replicas of this engine on Ray Serve, one endpoint at --host:--port, each prompt "
                     "routed to the replica holding its longest cached prefix, else to the least loaded one")
    ray.add_argument("--ray-address", default=None,
                     help="the Ray cluster to join (default: RAY_ADDRESS, else a Ray started for this command)")
    ray.add_argument("--replicas", type=int, default=None, help="a fixed number of replicas (default 1)")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas")
    ray.add_argument("--max-replicas", type=int, default=None, help="autoscaling: most replicas")
    ray.add_argument("--target-ongoing-requests", type=float, default=None,
                     help="autoscaling: ongoing requests per replica Ray Serve scales to keep")
    ray.add_argument("--imbalance-threshold", type=int, default=None,
                     help="a prompt leaves the replica holding its prefix when that replica has more than this many "
                     "ongoing requests over the least loaded one (default 4)")
    ray.add_argument("--router", choices=["prefix-affinity", "power-of-two"], default=None,
                     help="prefix-affinity (default): the replica holding the prompt's longest cached prefix, else the "
                     "least loaded; power-of-two: Ray Serve's default (the less loaded of two random replicas)")
    add_engine_flags(serve)

    generate = commands.add_parser("generate", help="generate text offline (no server)")
    generate.add_argument("prompt", nargs="+", help="one or more prompts")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=-1)
    generate.add_argument("--seed", type=int, default=None, help="sampling seed")
    generate.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    add_config_flag(generate)
    add_engine_flags(generate, skip=("seed", "tensor_parallel_size"))

    commands.add_parser("prepare-model", help="convert the embedded default model into the cache; print its folder")
    return parser


def load_settings(args: argparse.Namespace) -> tuple[ServerSettings, EngineConfig, Path | None]:
    config_path = resolve_config_path(args.config) if args.config else default_config_path()
    file_values = read_config_file(config_path) if config_path else {}
    server, engine = merge_settings(file_values, vars(args))  # it keeps only the settings' keys
    return server, engine, config_path


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def convert_gguf_model(engine_config: EngineConfig) -> EngineConfig:
    """--model FILE.gguf: convert the file (once, into the cache) here, before any process starts,
    so that a file graphserve cannot serve ends the command with one line; the engine loads the folder."""
    from graphserve.engine.model_files.model_path import ensure_gguf_model, is_gguf_path

    if not is_gguf_path(engine_config.model):
        return engine_config
    return dataclasses.replace(engine_config, model=str(ensure_gguf_model(engine_config.model)))


def cmd_serve(args: argparse.Namespace) -> int:
    from graphserve.server import supervisor

    server_settings, engine_config, config_path = load_settings(args)
    _setup_logging(server_settings.log_level)
    engine_config = convert_gguf_model(engine_config)
    if engine_config.model is not None:  # a folder it cannot serve ends the command here, in one line
        from graphserve.engine.models.config import ModelArgs

        ModelArgs.from_dir(engine_config.model)
    check_lora_modules(server_settings, engine_config)
    logger.info("config file: %s", config_path or "none (built-in defaults)")
    logger.info("engine config: %s", engine_config)
    shown = {**vars(server_settings), "api_key": "***" if server_settings.api_key else None}
    logger.info("server settings: %s", shown)
    if args.ray:
        return serve_on_ray(args, server_settings, engine_config)
    return supervisor.serve(server_settings, engine_config)


def check_lora_modules(server_settings: ServerSettings, engine_config: EngineConfig) -> None:
    """An adapter of --lora-modules that does not fit the model ends the command here, in one line."""
    if not server_settings.lora_modules:
        return
    from graphserve.engine.model_files.model_path import resolve_model_path
    from graphserve.engine.models.config import ModelArgs
    from graphserve.engine.models.lora_layout import lora_layout
    from graphserve.server.lora_registry import check_adapters, parse_lora_modules

    layout = lora_layout(ModelArgs.from_dir(resolve_model_path(engine_config.model)))
    check_adapters(parse_lora_modules(server_settings.lora_modules), layout, engine_config.max_lora_rank)


def serve_on_ray(args: argparse.Namespace, server_settings: ServerSettings, engine_config: EngineConfig) -> int:
    try:
        from graphserve.server.ray_app import app as ray_app
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith("ray"):
            raise
        print("graphserve: --ray needs Ray Serve: pip install graphserve[ray]", file=sys.stderr)
        return 1
    return ray_app.serve_on_ray(server_settings, engine_config, ray_app.scaling_from_args(args), args.ray_address)


def cmd_generate(args: argparse.Namespace) -> int:
    from graphserve import LLM, SamplingParams
    from graphserve.server.chat_prompt import render_chat_prompt
    from graphserve.server.protocol import ChatMessage

    _, engine_config, _ = load_settings(args)
    _setup_logging("warning")
    llm = LLM(**vars(convert_gguf_model(engine_config)))
    prompts: list[str] | list[list[int]] = list(args.prompt)
    if args.chat:
        prompts = [
            render_chat_prompt(llm.tokenizer, [ChatMessage(role="user", content=p)], add_generation_prompt=True)
            for p in args.prompt
        ]
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
    )
    outputs = llm.generate(prompts, params)
    for i, output in enumerate(outputs):
        if len(outputs) > 1:
            print(f"--- {i} ({output.finish_reason}, {len(output.token_ids)} tokens)")
        print(output.text)
    return 0


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from graphserve.engine.model_files.default_model import main as prepare_default_model

    return prepare_default_model([])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"serve": cmd_serve, "generate": cmd_generate, "prepare-model": cmd_prepare_model}
    if args.command not in handlers:
        parser.print_help()
        return 2
    try:
        return handlers[args.command](args)
    except SettingsError as exc:
        print(f"graphserve: {exc}", file=sys.stderr)
        return 2
    except GraphserveError as exc:  # a model that cannot be served, found before the server starts
        print(f"graphserve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

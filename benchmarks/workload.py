"""What throughput.py and serving.py share: the model they name, the request set, and
the provenance of a results file.

The request set (issue 9): N requests, prompt and output lengths each drawn uniformly from
[min_len, max_len] with a fixed seed, prompts as token ids (so their lengths are exact)
drawn uniformly from the vocabulary without its special tokens; ignore_eos, so every
request generates exactly its max_tokens. Request i is the same in every run with the
same seed and lengths, whatever N is (a shorter set is a prefix of a longer one)."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    max_tokens: int


def resolve_model(name: str | None) -> str | None:
    """"default" (or None) -> None, the embedded default model; a random_models config name
    (e.g. "qwen2.5-0.5b") -> its cached random-weight folder (written on first use);
    anything else is a model folder."""
    if name in (None, "", "default"):
        return None
    sys.path.insert(0, str(BENCH))
    from random_models import CONFIGS, models_root, random_model

    if name in CONFIGS:
        if not (models_root() / name / "config.json").is_file():
            # written by a child process: the weights are made on the GPU, and this process
            # must not keep their memory (or a CUDA context) while the engine or server runs
            subprocess.run([sys.executable, str(BENCH / "random_models.py"), name], check=True)
        return str(random_model(name))  # refreshes a stale tokenizer; no weights, no CUDA
    if not Path(name).is_dir():
        raise SystemExit(f"--model {name!r} is neither a random_models config ({', '.join(CONFIGS)}) nor a folder")
    return name


def model_folder(model: str | None) -> Path:
    if model is None:
        sys.path.insert(0, str(ROOT))
        from graphserve.engine.model_files.default_model import ensure_default_model

        return Path(ensure_default_model())
    return Path(model)


def vocabulary(model: str | None) -> tuple[int, set[int]]:
    """(ids a prompt may use: below both the model's and the tokenizer's vocabulary size,
    the ids to leave out: the tokenizer's special tokens and the config's BOS/EOS)."""
    from tokenizers import Tokenizer

    folder = model_folder(model)
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    size = min(config["vocab_size"], tok.get_vocab_size(with_added_tokens=True))
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        specials.update(value if isinstance(value, list) else [] if value is None else [value])
    return size, specials


def make_requests(num: int, min_len: int, max_len: int, vocab_size: int, exclude: set[int],
                  seed: int = 0) -> list[BenchRequest]:
    """The request set: lengths uniform in [min_len, max_len] (prompt and output drawn
    separately), prompt ids uniform below vocab_size, none in `exclude`."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = random.Random(seed)
    allowed = [i for i in range(vocab_size) if i not in exclude] if exclude else None
    out = []
    for _ in range(num):
        prompt_len, output_len = rng.randint(min_len, max_len), rng.randint(min_len, max_len)
        if allowed is None:
            prompt = [rng.randrange(vocab_size) for _ in range(prompt_len)]
        else:
            prompt = [allowed[rng.randrange(len(allowed))] for _ in range(prompt_len)]
        out.append(BenchRequest(prompt, output_len))
    return out


def same_lengths(requests: list[BenchRequest], vocab_size: int, exclude: set[int], seed: int) -> list[BenchRequest]:
    """Requests of the same prompt and output lengths, in the same order, with other prompt ids
    (so they hit no prefix cached from `requests`)."""
    rng = random.Random(seed)
    allowed = [i for i in range(vocab_size) if i not in exclude] if exclude else list(range(vocab_size))
    return [BenchRequest([allowed[rng.randrange(len(allowed))] for _ in r.prompt], r.max_tokens) for r in requests]


def describe(requests: list[BenchRequest]) -> dict:
    prompt = [len(r.prompt) for r in requests]
    output = [r.max_tokens for r in requests]
    return dict(num_requests=len(requests), prompt_tokens=sum(prompt), output_tokens=sum(output),
                prompt_len_mean=sum(prompt) / max(1, len(prompt)), output_len_mean=sum(output) / max(1, len(output)))


def cpu_model() -> str:
    """The CPU's name and its widest vector sets (x86 flags of /proc/cpuinfo), e.g. "AMD EPYC (avx2
    avx512f avx512_vnni)"."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith(("flags", "Features"))),
                 [])
    wide = [f for f in flags if f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm", "sve")]
    return f"{name} ({' '.join(wide)})" if wide else name


def provenance(benchmark: str) -> dict:
    """measure.run_info (GPU, torch, triton, transformers, command, date) where it works;
    on a machine without CUDA or triton the same keys with what there is. Plus the
    machine and the git commit when the tree is a checkout."""
    try:
        sys.path.insert(0, str(BENCH))
        from measure import run_info

        info = run_info(benchmark)
    except Exception:  # no CUDA (torch.cuda.get_device_name raises) or no triton
        info = dict(benchmark=benchmark, gpu=None, python=platform.python_version(),
                    command=" ".join(sys.argv), date=dt.datetime.now().isoformat(timespec="seconds"))
        try:
            import torch

            info["torch"] = torch.__version__
        except ImportError:
            pass
    info.update(platform=platform.platform(), cpus=os.cpu_count(), executable=sys.executable, cpu_model=cpu_model(),
                cpu_isa_cap=os.environ.get("GRAPHSERVE_CPU_ISA") or "native")
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            info["git_commit"] = commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# the server's time to first token and its three parts (server/metrics.py): histogram sums and counts
TTFT_METRICS = tuple(f"graphserve_{name}_seconds_{stat}" for name in (
    "time_to_first_token", "request_queue_time", "request_prefill_time", "request_first_token_return")
    for stat in ("sum", "count"))


def ttft_means(delta: dict[str, float]) -> dict[str, float | None]:
    """From the deltas of TTFT_METRICS over a run: the server-side mean TTFT and of each part
    (server_ttft_mean_s, server_queue_time_mean_s, server_prefill_time_mean_s,
    server_first_token_return_mean_s)."""
    means = {}
    for metric, key in (("time_to_first_token", "ttft"), ("request_queue_time", "queue_time"),
                        ("request_prefill_time", "prefill_time"), ("request_first_token_return", "first_token_return")):
        count = delta.get(f"graphserve_{metric}_seconds_count", 0.0)
        means[f"server_{key}_mean_s"] = delta.get(f"graphserve_{metric}_seconds_sum", 0.0) / count if count else None
    return means


def write_json(path: Path | str, result: dict) -> None:
    """measure.write_json where it imports (it needs torch), else the same by hand."""
    try:
        sys.path.insert(0, str(BENCH))
        from measure import write_json as write

        write(path, result)
    except ImportError:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")

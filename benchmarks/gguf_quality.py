"""What serving a GGUF file's quantized blocks costs in quality (issue 42), against llama.cpp on
the same files: teacher-forced over a fixed English text (benchmarks/data/, public domain), every
position's next-token distribution against the float32 model, as argmax agreement and mean
KL(float32 || quantized) in nats.

The float32 model is the embedded model's GGUF file dequantized (its weights are Q4_1: no float
original ships), run by transformers. Each other type is made from that file by llama.cpp's own
llama-quantize (--allow-requantize), so every row compares against the model it was made from.
Per file and type:
- graphserve `--quantization gguf`: the blocks kept quantized, activations rounded to int8 per
  block of 32 (engine/cpu/quant_linear.py);
- graphserve float32 on the same file: its weights dequantized, float activations (the weights'
  rounding alone);
- llama.cpp through llama-cpp-python's bindings (logits_all), built by benchmarks/llama_cpp_build.sh,
  2 threads.
Every position of one sequence is scored in one forward pass (prefill): each row of the quantized
kernels is quantized on its own, so a prefill row computes what a decode step does.

    .venv/bin/python benchmarks/gguf_quality.py --out benchmarks/results/gguf_quality-cpu-2026-12-05.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "benchmarks" / "data" / "declaration_of_independence.txt"
TYPES = ("Q4_1", "Q8_0", "Q4_0", "Q4_K_M")  # Q4_1: the embedded file as shipped; the rest made from it


def kl_and_agreement(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """Mean KL(reference || logits) over rows, in nats, and the share of rows whose argmax agrees."""
    ref_logp = torch.log_softmax(reference.double(), -1)
    logp = torch.log_softmax(logits.double(), -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    return {"argmax_agreement": (logits.argmax(-1) == reference.argmax(-1)).double().mean().item(),
            "mean_kl": kl.mean().item(), "p99_kl": kl.quantile(0.99).item()}


@torch.inference_mode()
def graphserve_logits(folder: Path, ids: list[int], quantization: str | None) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of our CPU model: one prefill over the whole sequence."""
    from graphserve.engine.models.attention import AttentionMetadata, make_attention_backend
    from graphserve.engine.models.loading.loader import load_model
    from graphserve.engine.sched.kv_cache import allocate_kv_cache

    cpu, n, block = torch.device("cpu"), len(ids), 16
    model = load_model(folder, torch.float32, cpu, make_attention_backend(cpu, block), 1024,
                       quantization=quantization)
    blocks = -(-n // block)
    kv = allocate_kv_cache(model.kv_args, blocks, block, torch.float32, cpu)
    meta = AttentionMetadata(True, torch.arange(n), torch.arange(blocks, dtype=torch.int32)[None],
                             torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), n,
                             query_lens_host=[n], context_lens_host=[n])
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta, kv)).float()


@torch.inference_mode()
def transformers_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model(torch.tensor([ids])).logits[0].float()


def llama_cpp_logits(gguf: Path, ids: list[int], llama_cpp_dir: Path, threads: int) -> torch.Tensor:
    os.environ["LLAMA_CPP_LIB_PATH"] = str(llama_cpp_dir / "build" / "bin")
    sys.path.insert(0, str(llama_cpp_dir / "python"))
    import numpy as np
    from llama_cpp import Llama

    model = Llama(model_path=str(gguf), logits_all=True, n_ctx=1024, n_batch=1024, n_ubatch=1024,
                  n_threads=threads, n_threads_batch=threads, verbose=False)
    model.eval(ids)
    logits = torch.from_numpy(np.array(model.scores[:len(ids)], dtype=np.float32))
    model.close()
    return logits


def variant(source: Path, kind: str, llama_cpp_dir: Path) -> Path:
    """`source` requantized to `kind` by llama-quantize (made once, beside llama.cpp's build)."""
    if kind == "Q4_1":
        return source
    target = llama_cpp_dir / "variants" / f"{source.stem.removesuffix('.Q4_1')}.{kind}.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(llama_cpp_dir / "build" / "bin" / "llama-quantize"), "--allow-requantize", str(source),
                        str(target) + ".tmp", kind, "2"], check=True, capture_output=True)
        os.replace(str(target) + ".tmp", target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=list(TYPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()

    from graphserve.engine.model_files.default_model import ensure_default_model, find_gguf
    from graphserve.engine.model_files.model_path import ensure_gguf_model
    from transformers import AutoTokenizer

    llama_cpp_bin = Path(subprocess.run(["bash", str(ROOT / "benchmarks" / "llama_cpp_build.sh")], check=True,
                                        capture_output=True, text=True).stdout.strip().splitlines()[-1])
    llama_cpp_dir = llama_cpp_bin.parents[1]  # its build/bin, python/, sdist/
    reference_folder = ensure_default_model(progress=False)
    ids = AutoTokenizer.from_pretrained(reference_folder)(TEXT.read_text())["input_ids"]
    reference = transformers_logits(reference_folder, ids)
    print(f"{len(ids)} positions of {TEXT.name}", flush=True)

    rows = []
    for kind in args.types:
        gguf = variant(find_gguf(), kind, llama_cpp_dir)
        folder = ensure_gguf_model(gguf, progress=False)
        row = {"type": kind, "file": gguf.name,
               "graphserve_gguf": kl_and_agreement(graphserve_logits(folder, ids, "gguf"), reference),
               "graphserve_float32": kl_and_agreement(graphserve_logits(folder, ids, None), reference),
               "llama_cpp": kl_and_agreement(llama_cpp_logits(gguf, ids, llama_cpp_dir, args.threads), reference)}
        rows.append(row)
        print(kind, " ".join(f"{arm}: agree {row[arm]['argmax_agreement']:.4f} KL {row[arm]['mean_kl']:.5f}"
                             for arm in ("graphserve_gguf", "graphserve_float32", "llama_cpp")), flush=True)
    if args.out:
        result = {"benchmark": "gguf_quality", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": platform.processor() or
                  platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
                  "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                               text=True).stdout.strip(),
                  "llama_cpp": sorted(p.name for p in (llama_cpp_dir / "sdist").glob("llama_cpp_python-*.tar.gz")),
                  "text": str(TEXT.relative_to(ROOT)), "positions": len(ids),
                  "reference": "transformers float32 on the embedded Q4_1 file's dequantized weights", "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

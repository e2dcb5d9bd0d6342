"""FP8 weights against the model's own dtype, teacher-forced (issue 13): the same token sequences
through the bf16 model, through `--quantization fp8` (our kernels), and through a plain fake-
quantized reference (each projection's weight quantized per output channel and dequantized back
to bf16, run by the bf16 path). Reports each one's logits' relative error and argmax agreement
against the bf16 model; FP8's agreement should be at least the fake-quantized reference's.

    python benchmarks/fp8_accuracy.py --models qwen2.5-0.5b llama-3.1-8b --out benchmarks/results/fp8_accuracy.json
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from teacher_forced import compare, teacher_forced_logits  # noqa: E402


def _load(path: str, dtype: torch.dtype, device: torch.device, quantization: str | None):
    from graphserve.engine.models.attention import make_attention_backend
    from graphserve.engine.models.loading.loader import load_model

    return load_model(path, dtype, device, make_attention_backend(device, 16), 1024, quantization=quantization)


@torch.no_grad()
def fp8_accuracy(path: str, device: torch.device, dtype: torch.dtype, prompts: int = 4, prompt_len: int = 64,
                 steps: int = 64) -> dict:
    """{"fp8": compare(...), "fake_quantized": compare(...)} against the `dtype` model, over
    `prompts` random sequences of prompt_len + steps tokens."""
    from graphserve.engine.models.fp8 import dequantize, quantize_per_channel
    from graphserve.engine.models.layers import Linear

    model = _load(path, dtype, device, None)
    gen = torch.Generator().manual_seed(0)
    high = min(30000, model.args.vocab_size)
    seqs = [torch.randint(high // 10, high, (prompt_len + steps,), generator=gen).to(device) for _ in range(prompts)]

    def run(model) -> torch.Tensor:
        return torch.cat([teacher_forced_logits(model, ids, prompt_len) for ids in seqs])

    reference = run(model)
    for module in model.layers.modules():  # the fake-quantized reference: same weights, rounded through e4m3
        if isinstance(module, Linear):
            module.weight.copy_(dequantize(*quantize_per_channel(module.weight), dtype))
            module.packed = None  # on CPU, F.linear on the rounded weight: what an FP8 projection runs there
    model.cpu_stack = None  # the CPU decode stack holds the panels packed at load, from the unrounded weights
    fake = run(model)
    del model
    gc.collect()
    model = _load(path, dtype, device, "fp8")
    fp8 = run(model)
    del model
    gc.collect()
    return {"fp8": compare(fp8, reference), "fake_quantized": compare(fake, reference), "positions": len(reference)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "llama-3.1-8b"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/fp8_accuracy.json"))
    args = parser.parse_args()

    from measure import run_info, write_json
    from workload import model_folder, provenance, resolve_model

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for name in args.models:
        path = model_folder(resolve_model(name))  # "default": the embedded model (CPU check)
        result = fp8_accuracy(str(path), device, dtype, args.prompts)
        rows.append(dict(model=name, dtype=str(dtype).split(".")[-1], **result))
        print(f"{name}: fp8 rel err {result['fp8']['rel_err']:.4f}, argmax agreement {result['fp8']['argmax_agreement']:.3f}"
              f"; fake-quantized {result['fake_quantized']['rel_err']:.4f}, "
              f"{result['fake_quantized']['argmax_agreement']:.3f} ({result['positions']} positions)", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    info = run_info("fp8_accuracy") if device.type == "cuda" else provenance("fp8_accuracy")
    write_json(args.out, dict(**info, rows=rows))


if __name__ == "__main__":
    main()

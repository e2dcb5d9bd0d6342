"""Random LoRA adapters made with peft (its own files, its own forward pass: the reference) for tests."""

from __future__ import annotations

from pathlib import Path

import torch

# three adapters of different ranks, scalings and modules (B non-zero: each changes the output)
ADAPTER_SPECS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
    "all": dict(r=16, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"]),
}


def make_adapter(model_dir: Path, out: Path, seed: int, std: float = 0.2, **spec) -> Path:
    """A peft LoRA adapter of the model in `model_dir` with random A and B (N(0, std)), saved to `out`."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(lora_dropout=0.0, **spec))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out)
    return out


def peft_greedy(model_dir: Path, adapter: Path | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers (+ peft with `adapter`) greedy tokens after prompt_ids, float32."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()

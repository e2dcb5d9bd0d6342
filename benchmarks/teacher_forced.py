"""Teacher-forced logits of our model: a prompt prefilled, then every following token of a fixed
sequence fed one decode step at a time (the decode kernels, as serving runs them), the logits of
each step kept. Shared by the GPU tests (tests/test_gpu_engine.py, tests/test_fp8.py) and
benchmarks/fp8_accuracy.py."""

from __future__ import annotations

import torch

# a block table that is not in order, so paging is exercised (16-token blocks, up to 144 tokens)
_TABLE = [3, 9, 1, 12, 5, 7, 2, 11, 4]


@torch.no_grad()
def teacher_forced_logits(model, ids: torch.Tensor, prompt_len: int, block_size: int = 16) -> torch.Tensor:
    """float32 logits [len(ids) - prompt_len, vocab]: row i predicts ids[prompt_len + i] (the
    prefill's last position, then each decode step). `model`: engine.models.llama.LlamaModel
    with an attention backend of `block_size`; len(ids) <= 144."""
    from graphserve.engine.models.attention import AttentionMetadata
    from graphserve.engine.sched.kv_cache import allocate_kv_cache

    dev = ids.device
    kv = allocate_kv_cache(model.kv_args, max(_TABLE) + 1, block_size, model.embed_tokens.weight.dtype, dev)
    table = torch.tensor([_TABLE], dtype=torch.int32, device=dev)
    if len(ids) > len(_TABLE) * block_size:
        raise ValueError(f"at most {len(_TABLE) * block_size} tokens")

    def slot(p: int) -> int:
        return _TABLE[p // block_size] * block_size + p % block_size

    meta = AttentionMetadata(True, torch.tensor([slot(p) for p in range(prompt_len)], device=dev), table,
                             torch.tensor([prompt_len], dtype=torch.int32, device=dev),
                             torch.tensor([0, prompt_len], dtype=torch.int32, device=dev), prompt_len,
                             query_lens_host=[prompt_len], context_lens_host=[prompt_len])
    logits = [model.compute_logits(model(ids[:prompt_len], torch.arange(prompt_len, device=dev), meta, kv))[-1:]]
    for p in range(prompt_len, len(ids) - 1):
        meta = AttentionMetadata(False, torch.tensor([slot(p)], device=dev), table,
                                 torch.tensor([p + 1], dtype=torch.int32, device=dev), context_lens_host=[p + 1])
        logits.append(model.compute_logits(model(ids[p:p + 1], torch.tensor([p], device=dev), meta, kv)))
    return torch.cat(logits).float()


def compare(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """Relative error ‖a − b‖ / ‖b‖ and the share of rows whose argmax agrees."""
    return dict(rel_err=((logits - reference).norm() / reference.norm()).item(),
                argmax_agreement=(logits.argmax(-1) == reference.argmax(-1)).float().mean().item())

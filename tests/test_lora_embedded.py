"""LoRA adapters on the embedded default model (SmolLM2-135M, float32 on CPU): three random peft adapters
of different ranks and modules each give transformers + peft's greedy tokens, alone and batched together
with the base model."""

from __future__ import annotations

import pytest

pytest.importorskip("peft", reason="peft (a dev extra) makes the adapters and the reference")

from graphserve import LLM, LoraRequest, SamplingParams
from lora_adapters import ADAPTER_SPECS, make_adapter, peft_greedy

MAX_TOKENS = 6
PROMPT = "The capital of France is"


def test_three_adapters_give_peft_tokens_alone_and_together(tmp_path):
    llm = LLM(device="cpu", dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, num_kv_blocks=64,
              warm_up=False)
    model = llm.engine.model_path
    adapters = {name: make_adapter(model, tmp_path / name, seed=i, std=0.12, **spec)
                for i, (name, spec) in enumerate(ADAPTER_SPECS.items())}
    loras = {name: LoraRequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ids = llm.generate([PROMPT], params)[0].prompt_token_ids
    want = {name: peft_greedy(model, adapters.get(name), ids, MAX_TOKENS) for name in (None, *loras)}
    assert all(want[name] != want[None] for name in loras)  # each adapter changes the output
    for name in (None, *loras):
        assert llm.generate([ids], params, lora_request=loras.get(name))[0].token_ids == want[name], name
    together = llm.generate([ids] * 4, params, lora_request=[None, *loras.values()])
    assert [o.token_ids for o in together] == [want[n] for n in (None, *loras)]

"""The KV block pool (engine/sched/kv_cache.py) as a user sizes it: the pool a configuration asks for
(num_kv_blocks, kv_cache_bytes), every block of it usable, the smallest one that can serve at all,
and every block free again afterwards."""

from __future__ import annotations

import pytest
import torch

from graphserve import LLM, SamplingParams
from tiny_models import make_tiny_model

BS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def make_llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), device="cpu", block_size=BS, **kw)


def run(llm: LLM, prompt: list[int], params: SamplingParams, max_steps: int = 200) -> list[int]:
    """One request, step by step (a request the pool can never take fails the test, not hangs it)."""
    engine = llm.engine
    engine.add_request("r", prompt, params)
    got = []
    for _ in range(max_steps):
        for out in engine.step():
            got += out.token_ids
        if not engine.has_unfinished():
            return got
    raise AssertionError(f"not finished after {max_steps} steps (KV free: {engine.block_manager.num_free_blocks})")


def kv_bytes(llm: LLM) -> int:
    """The memory the KV pool holds: its tensors' storage (the layers' K and V are views of it)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for pair in llm.engine.core.worker.kv_caches for t in pair}
    return sum(storages.values())


@pytest.mark.parametrize("usable", [1, 4])
def test_a_request_filling_every_block_of_the_pool_runs_without_preemption(model_dir, usable):
    """A pool of `usable` blocks (and the dummy one): a request whose prompt and output fill every
    slot of it gets the tokens of a roomy pool, and every block is free again afterwards."""
    params = SamplingParams(max_tokens=7 * usable, temperature=0, ignore_eos=True)
    prompt = [5 + (7 * j) % 250 for j in range(usable * BS - params.max_tokens)]
    want = run(make_llm(model_dir, num_kv_blocks=64), prompt, params)
    llm = make_llm(model_dir, num_kv_blocks=usable + 1)
    assert llm.engine.max_model_len == usable * BS
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks == usable
    assert run(llm, prompt, params) == want
    assert llm.engine.stats().num_preemptions == 0
    assert blocks.num_free_blocks == usable


def test_a_pool_without_a_usable_block_is_refused(model_dir):
    with pytest.raises(ValueError, match="at least 2 blocks"):
        make_llm(model_dir, num_kv_blocks=1)


def test_kv_cache_bytes_sets_the_pool_to_as_many_blocks_as_fit(model_dir):
    """On the CPU, kv_cache_bytes is the KV pool's size: the engine allocates as many whole blocks as
    fit in it (a block: K and V of every layer for block_size tokens)."""
    measured = make_llm(model_dir, num_kv_blocks=8)
    per_block = kv_bytes(measured) // 8
    core = measured.engine.core
    args, element = core.worker.model.kv_args, torch.empty((), dtype=core.worker.dtype).element_size()
    assert per_block == 2 * args.num_layers * BS * args.num_kv_heads * args.head_dim * element
    for budget in (20 * per_block, 20 * per_block + per_block // 2, 21 * per_block - 1):
        llm = make_llm(model_dir, kv_cache_bytes=budget)
        assert kv_bytes(llm) == 20 * per_block
        assert llm.engine.stats().kv_blocks_total == 19  # block 0 is never handed out

"""GPU: the whole model vs transformers on the same random weights (real shapes), and
the CUDA-graph decode path vs our eager path. Run on an H200 with `pytest -m gpu`."""

import gc
import sys
from pathlib import Path

import pytest
import torch
from tensor_checks import report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = pytest.mark.gpu

MODELS = ["qwen2.5-0.5b", "llama-3.1-8b"]


@pytest.fixture(scope="module", params=MODELS)
def model_path(request):
    from random_models import random_model

    return random_model(request.param)


def _free():
    gc.collect()
    torch.cuda.empty_cache()


@torch.no_grad()
def test_teacher_forced_logits_match_transformers(model_path):
    import transformers
    from teacher_forced import teacher_forced_logits

    from graphserve.engine.models.attention import TritonAttention
    from graphserve.engine.models.loading.loader import load_model

    dev = torch.device("cuda")
    prompt_len, steps, bs = 64, 64, 16
    ours = load_model(model_path, torch.bfloat16, dev, TritonAttention(bs), 1024)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 30000, (prompt_len + steps,), generator=gen).to(dev)
    ours_logits = teacher_forced_logits(ours, ids, prompt_len, bs)
    del ours
    _free()
    window = slice(prompt_len - 1, prompt_len + steps - 1)
    reference = {}
    for dtype in (torch.float32, torch.bfloat16):
        ref = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, device_map="cuda").eval()
        reference[dtype] = ref(ids[None]).logits[0, window].float()
        del ref
        _free()
    want = reference[torch.float32]
    rel = ((ours_logits - want).norm() / want.norm()).item()
    hf_bf16_rel = ((reference[torch.bfloat16] - want).norm() / want.norm()).item()
    argmax_agree = (ours_logits.argmax(-1) == want.argmax(-1)).float().mean().item()
    hf_bf16_agree = (reference[torch.bfloat16].argmax(-1) == want.argmax(-1)).float().mean().item()
    report(dict(test="teacher_forced", model=Path(model_path).name, ours_bf16_vs_hf_fp32=rel,
                 hf_bf16_vs_hf_fp32=hf_bf16_rel, argmax_agreement=argmax_agree,
                 hf_bf16_argmax_agreement=hf_bf16_agree))
    # bf16 rounding accumulates over the layers. On the random-weight 8B shape transformers'
    # own bf16 run is 5.6% off its float32 run (measured on an H200), so it is the yardstick
    # wherever it is itself outside 2e-2 / 95% agreement.
    assert rel < max(2e-2, 1.25 * hf_bf16_rel), (rel, hf_bf16_rel)
    assert argmax_agree >= min(0.95, hf_bf16_agree - 0.05), (argmax_agree, hf_bf16_agree)


@pytest.fixture(scope="module")
def llm(model_path):
    from graphserve import LLM

    # no prefix caching: the eager run repeats the graph run's prompts, and a cache hit prefills
    # only their tails, whose bf16 rounding differs from a whole prefill (on the random 8B shape
    # enough to flip a near-tie greedy token); the cache's own GPU check is benchmarks/prefix_bench.py
    llm = LLM(str(model_path), device="cuda", dtype="bfloat16", max_num_seqs=64, max_model_len=512,
              decode_chunk=8, num_kv_blocks=3000, prefix_caching=False)
    yield llm
    del llm
    _free()


def _compiled_kernel_variants() -> dict[str, int]:
    """Per Triton kernel in kernels/, how many variants this process has compiled."""
    import importlib
    import pkgutil

    import graphserve.kernels
    from triton.runtime.jit import JITFunction

    counts = {}
    for info in pkgutil.iter_modules(graphserve.kernels.__path__):
        module = importlib.import_module(f"graphserve.kernels.{info.name}")
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction):
                counts[f"{info.name}.{name}"] = sum(len(cache[0]) for cache in fn.device_caches.values())
    return counts


def test_serving_compiles_no_kernels_after_start_up(llm):
    """Every kernel a request needs is compiled while the engine starts: prompts whose block tables
    are 1, 15-17 and 31-32 blocks wide, prefilled through the graphs and eagerly (prompt logprobs),
    alone and together, then decoded greedily, sampled and with logprobs, compile nothing. (Runs
    first on its engine: the tests after it would compile what it checks for.) Before, the eager
    prefill's first table 16 or 32 blocks wide compiled the attention kernel while serving."""
    from graphserve import SamplingParams

    before = _compiled_kernel_variants()
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 240, 256, 257, 300, 496, 497]
    prompts = [torch.randint(100, 30000, (n,), generator=gen).tolist() for n in lengths]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for params in (greedy, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=1)):
        for prompt in prompts:
            llm.generate([prompt], params)
        llm.generate(prompts, params)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True))
    llm.generate(prompts[:3], SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True))
    after = _compiled_kernel_variants()
    assert after == before, {name: (before.get(name), n) for name, n in after.items() if before.get(name) != n}


def eager_rounds_both_ways(llm, batch: int, seed: int, switch) -> list:
    """The greedy tokens and logprobs of eager decode rounds (no graphs, no prefix-cache hits) over `batch`
    random prompts, 64 tokens each, with switch(False) and then with switch(True)."""
    from graphserve import SamplingParams

    engine = llm.engine.core
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 30000, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 200, (batch,), generator=gen)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=0)
    caching, engine.block_manager.prefix_caching = engine.block_manager.prefix_caching, False
    graphs, engine.worker.graphs = engine.worker.graphs, None
    try:
        runs = []
        for on in (False, True):
            switch(on)
            outs = llm.generate(prompts, params)
            runs.append(([o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]))
    finally:
        engine.worker.graphs = graphs
        engine.block_manager.prefix_caching = caching
    assert all(len(tokens) == 64 for tokens in runs[0][0])
    return runs


@pytest.mark.parametrize("batch", [1, 17])
def test_fused_step_bookkeeping_matches_the_torch_ops(llm, batch, monkeypatch):
    """engine/runner.FUSED_STEP_BOOKKEEPING: decode rounds whose steps read their inputs and record
    their tokens through kernels/step_bookkeeping.py give the greedy tokens and logprobs of the same
    rounds through the torch ops (both eager: only the bookkeeping differs)."""
    from graphserve.engine.runner import model_runner as runner

    runs = eager_rounds_both_ways(llm, batch, 100 + batch,
                                  lambda on: monkeypatch.setattr(runner, "FUSED_STEP_BOOKKEEPING", on))
    assert runs[1] == runs[0]


@pytest.mark.parametrize("batch", [1, 17])
def test_fused_greedy_merge_and_pdl_embedding_give_the_same_tokens(llm, batch, monkeypatch):
    """kernels/sampling.FUSED_MERGE with chunks of 1024 and engine/models/layers.PDL_EMBEDDING (each
    off until measured): eager decode rounds give the greedy tokens of the shipped kernels, and their
    logprobs within float32 reordering of the log-sum-exp."""
    from graphserve.engine.models import layers
    from graphserve.kernels import sampling

    def switch(on: bool) -> None:
        monkeypatch.setattr(sampling, "FUSED_MERGE", on)
        monkeypatch.setattr(sampling, "CHUNK", 1024 if on else 4096)
        monkeypatch.setattr(layers, "PDL_EMBEDDING", on)

    runs = eager_rounds_both_ways(llm, batch, 200 + batch, switch)
    assert runs[1][0] == runs[0][0]
    for got, want in zip(runs[1][1], runs[0][1]):
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


@pytest.mark.parametrize("batch", [1, 3, 17, 64])
def test_graph_path_matches_eager_path(llm, batch):
    """Decode rounds through the CUDA graphs give the greedy tokens of eager decode steps.
    Both runs prefill alike (the prefill graphs, no prefix-cache hits): a prefill's GEMMs at
    another row count (padded to a bucket, or only the uncached tail) round differently in
    bf16, which on the random 8B changes greedy tokens; test_prefill_graphs_match_eager_prefill
    holds the prefill graphs to their own padded forward."""
    from graphserve import SamplingParams

    engine = llm.engine.core
    assert engine.worker.graphs is not None
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(100, 30000, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 200, (batch,), generator=gen)]
    params = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
    free_before = engine.block_manager.num_free_blocks
    before = dict(engine.stats().graph_replays)
    caching, engine.block_manager.prefix_caching = engine.block_manager.prefix_caching, False
    try:
        with_graphs = [o.token_ids for o in llm.generate(prompts, params)]
        after = engine.stats().graph_replays
        graphs, engine.worker.graphs = engine.worker.graphs, None
        try:
            eager = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            engine.worker.graphs = graphs
    finally:
        engine.block_manager.prefix_caching = caching
    assert after.get(engine.worker.graphs.bucket_for(batch), 0) > before.get(engine.worker.graphs.bucket_for(batch), 0)
    assert with_graphs == eager
    assert engine.block_manager.num_free_blocks == free_before


@pytest.mark.parametrize("lengths", [(37,), (5, 60, 200, 1), (300, 300, 300), (64,), (16, 48)])
def test_prefill_graphs_match_eager_prefill(llm, lengths):
    """Prefills short enough for a prefill graph: each replay gives the logits of the same
    padded forward run eagerly; against an unpadded eager prefill, the first token is the
    same, and where no token was padded (the batch fills its bucket) the top-5 logprobs (but
    for the LM head's rounding at its own row count) and greedy generations are too. (With
    padding every projection runs at another row count, which may round differently in bf16:
    its logprob difference is reported.)"""
    from graphserve import SamplingParams

    engine = llm.engine.core
    graphs = engine.worker.runner.prefill_graphs
    assert graphs is not None
    replay_errors = []
    run = graphs.run

    def run_and_check(inputs, bucket):
        logits = run(inputs, bucket).clone()
        graphs._forward(bucket, graphs._meta(bucket))  # the same padded forward, eagerly
        eager = graphs.logits[:len(inputs.query_lens)]
        replay_errors.append(((logits - eager).abs().max() / eager.abs().max()).item())
        return logits

    gen = torch.Generator().manual_seed(sum(lengths))
    prompts = [torch.randint(100, 30000, (n,), generator=gen).tolist() for n in lengths]
    first = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    before = engine.stats().prefill_graph_steps
    graphs.run = run_and_check
    try:
        graph_first = llm.generate(prompts, first)
        graph_tokens = [o.token_ids for o in llm.generate(prompts, greedy)]
    finally:
        del graphs.run
    assert engine.stats().prefill_graph_steps == before + 2
    engine.worker.runner.prefill_graphs = None
    try:
        eager_first = llm.generate(prompts, first)
        eager_tokens = [o.token_ids for o in llm.generate(prompts, greedy)]
    finally:
        engine.worker.runner.prefill_graphs = graphs
    worst = 0.0
    for g, e in zip(graph_first, eager_first):
        assert g.token_ids == e.token_ids
        top_g, top_e = dict(g.logprobs[0].top), dict(e.logprobs[0].top)
        worst = max(worst, max(abs(top_g[t] - top_e[t]) for t in top_g.keys() & top_e.keys()))
    padded = graphs.bucket_for(sum(lengths), len(lengths)) != sum(lengths)
    report(dict(test="prefill_graph_vs_eager", model=Path(engine.model_path).name, lengths=list(lengths),
                 padded_tokens=padded, replay_vs_eager_rel=max(replay_errors), max_top5_logprob_diff=worst,
                 same_greedy=graph_tokens == eager_tokens))
    assert max(replay_errors) < 1e-3
    if not padded:  # the same projections; only the LM head runs at another row count (a bf16 ulp or so)
        assert worst < 0.25
        assert graph_tokens == eager_tokens


def test_constrained_rows_replay_masked_graphs(llm):
    """Grammar-constrained rows in a batch: their rounds replay the forward and masked
    sampling graphs with the masks fed while the round runs (K steps, launched ahead), every
    constrained output matches its grammar, and every row's tokens equal the eager run's."""
    import json
    import re

    from graphserve import SamplingParams
    from graphserve.engine.structured.grammar import GrammarSpec

    engine = llm.engine.core
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(100, 30000, (24,), generator=gen).tolist() for _ in range(6)]
    free = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    regex = SamplingParams(max_tokens=64, temperature=0, grammar=GrammarSpec("regex", r"[0-9]{3}-[a-z]{2,6}"))
    choice = SamplingParams(max_tokens=64, temperature=0.9, seed=3, grammar=GrammarSpec("choice", '["alpha", "beta"]'))
    obj = SamplingParams(max_tokens=200, temperature=0.7, seed=4, grammar=GrammarSpec("json_object"))
    params = [free, regex, free, choice, obj, free]
    # Grammars compile in the background and a row waits for its own. On a cold compiler the first
    # graph run's regex row differed from the eager run in one greedy token (H200: this test failed
    # 1 of 2 cold runs, and a probe's first of three graph runs differed, the later two matched);
    # with the grammars compiled first, 3 of 3 graph runs matched. Most likely the row was
    # prefilled in another batch, whose bf16 rounding flips a near-tie token of the random weights.
    # Compiled once here, both runs below schedule alike.
    llm.generate([[5, 6, 7]] * len(params), params)
    before = sum(engine.stats().graph_replays.values())
    ahead_before = engine.stats().decode_rounds_ahead
    outs = llm.generate(prompts, params)
    assert sum(engine.stats().graph_replays.values()) > before
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,6}", outs[1].text)
    assert outs[3].text in ("alpha", "beta")
    if outs[4].finish_reason == "stop":  # strict=False: xgrammar lets control characters into strings
        assert isinstance(json.loads(outs[4].text, strict=False), dict)
    assert engine.stats().decode_rounds_ahead > ahead_before  # grammar rows do not stop the overlap
    graphs, engine.worker.graphs = engine.worker.graphs, None
    try:
        eager = llm.generate(prompts, params)  # each mask computed between the steps, synchronously
    finally:
        engine.worker.graphs = graphs
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert engine.stats().grammar_requests == 0


def test_a_bf16_model_loads_without_a_float32_copy(tmp_path):
    """Loading in bf16 takes about the model's own bytes on the device at its peak: no float32 copy of
    the weights on the way (which would keep a model of more than half the GPU's memory from loading)."""
    from tiny_models import make_tiny_model

    from graphserve.engine.models.attention import make_attention_backend
    from graphserve.engine.models.loading.loader import load_model

    path = make_tiny_model(tmp_path / "wide", "llama", dtype=torch.bfloat16, hidden_size=1024,
                           intermediate_size=4096, num_hidden_layers=4, vocab_size=32000)  # a bf16 checkpoint
    device = torch.device("cuda")
    _free()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    model = load_model(path, torch.bfloat16, device, make_attention_backend(device, 16), 1024)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert torch.cuda.max_memory_allocated(device) - before < 1.5 * weights
    del model
    _free()

"""The embedded default model (SmolLM2-135M-Instruct): greedy parity with transformers in float32,
and on a CPU by default its GGUF file's Q4_1 blocks, whose tokens do not depend on the batch."""

import pytest
import torch
import transformers

from graphserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):",
    "Q: What is 12 times 12?\nA:",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old woodcutter who",
    "List three primary colors:",
    "Translate to French: Good morning, how are you today?",
    "The theory of relativity, developed by Albert Einstein in the early twentieth century, explains how space "
    "and time are linked for objects moving at a constant speed. In simple terms,",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32")


def test_greedy_batch_matches_transformers(llm):
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    start = llm.engine.block_manager.num_free_blocks
    outs = llm.generate(PROMPTS, params)
    assert llm.engine.block_manager.num_free_blocks == start
    hf = transformers.AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(llm.engine.model_path)
    for prompt, out in zip(PROMPTS, outs):
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        assert ids[0].tolist() == out.prompt_token_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist(), prompt


def test_chat_template_matches_transformers(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    hf_tok = transformers.AutoTokenizer.from_pretrained(llm.engine.model_path)
    expected = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert llm.tokenizer.apply_chat_template(messages) == expected
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    assert llm.tokenizer.apply_chat_template(with_system) == hf_tok.apply_chat_template(
        with_system, add_generation_prompt=True, tokenize=False)
    out = llm.generate([expected], SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # <|im_end|> ends the answer


def test_the_default_serves_the_files_blocks_and_no_batch_mate_moves_a_requests_tokens():
    """On a CPU the default serves the file's Q4_1 blocks, whose int8 activation rounding turns a
    last-bit difference into another token now and then: so a request's numbers must be bit for
    bit the same alone, together, and with its decodes riding along others' prefill chunks."""
    llm = LLM(device="cpu", max_num_batched_tokens=7, max_num_seqs=3)
    assert llm.engine.core.worker.quantization == "gguf"
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1, ignore_eos=True)

    def logprobs(prompts: list[str]) -> list[list[float]]:
        return [[lp.logprob for lp in o.logprobs] for o in llm.generate(prompts, params)]

    prompts = PROMPTS[:5]
    with_riders = logprobs(prompts)
    llm.engine.core.scheduler.mix_decodes = False
    assert logprobs(prompts) == with_riders
    assert [logprobs([p])[0] for p in prompts] == with_riders

"""The sampler's logit processors (engine/sample/sampler.py) on random logits, against what they
promise: repetition_penalty exactly as transformers' RepetitionPenaltyLogitsProcessor (a seen
token's positive logit divided, its negative logit multiplied: less likely either way), and
min_tokens held per request beside a grammar (it yields only where the grammar allows nothing but
the end)."""

from __future__ import annotations

import pytest
import torch

from graphserve.engine.sample.sampler import SamplingTensors, apply_processors, sample

transformers = pytest.importorskip("transformers")

ROWS, VOCAB, EOS = 6, 64, 3


def tensors(rows: int, **fields) -> SamplingTensors:
    base = dict(temperature=torch.zeros(rows), top_k=torch.full((rows,), VOCAB), top_p=torch.ones(rows),
                min_p=torch.zeros(rows), seeds=torch.arange(rows), output_pos=torch.zeros(rows, dtype=torch.int64))
    return SamplingTensors(**{**base, **fields})


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers_on_positive_and_negative_logits(penalty):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(ROWS, VOCAB, generator=generator) * 3
    prompt = torch.randint(0, VOCAB, (ROWS, 5), generator=generator)
    output = torch.randint(0, VOCAB, (ROWS, 7), generator=generator)
    prompt_mask = torch.zeros(ROWS, VOCAB, dtype=torch.bool).scatter_(1, prompt, True)
    counts = torch.zeros(ROWS, VOCAB).scatter_add_(1, output, torch.ones(ROWS, 7))
    seen = prompt_mask | (counts > 0)
    assert (logits[seen] < 0).any() and (logits[seen] > 0).any()  # both signs are exercised
    st = tensors(ROWS, repetition_penalty=torch.full((ROWS,), penalty), presence_penalty=torch.zeros(ROWS),
                 frequency_penalty=torch.zeros(ROWS), output_counts=counts, prompt_mask=prompt_mask)
    reference = transformers.RepetitionPenaltyLogitsProcessor(penalty)(torch.cat([prompt, output], 1), logits.clone())
    torch.testing.assert_close(apply_processors(logits, st), reference)
    if penalty > 1:  # every seen token loses ground to the unseen ones, whatever the sign of its logit
        assert (apply_processors(logits, st)[seen] < logits[seen]).all()


def test_min_tokens_yields_to_the_grammar_of_its_own_row_only():
    """Row 0's grammar allows only EOS: min_tokens gives way. Row 1's grammar allows EOS and another
    token and EOS has the higher logit: min_tokens still holds EOS off, whatever row 0 does."""
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 5.0
    logits[1, 10] = 1.0
    allowed = torch.zeros(2, VOCAB, dtype=torch.bool)
    allowed[0, EOS] = True
    allowed[1, [EOS, 10]] = True
    bits = torch.zeros(2, VOCAB, dtype=torch.int64)
    bits[allowed] = 1
    words = (bits.view(2, VOCAB // 32, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    ban = torch.zeros(2, VOCAB, dtype=torch.bool)
    ban[:, EOS] = True
    st = tensors(2, min_tokens=torch.tensor([4, 4]), min_tokens_ban=ban, token_bitmask=bitmask)
    assert sample(logits, st).tokens.tolist() == [EOS, 10]
    st.output_pos = torch.tensor([4, 4])  # min_tokens reached: EOS is free again
    assert sample(logits, st).tokens.tolist() == [EOS, EOS]

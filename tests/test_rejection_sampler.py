"""Tests of the rejection sampler of speculative decoding (engine/sample/rejection_sampler.py).

Greedy rows give plain greedy's
tokens, seeded sampled rows with a deterministic drafter give the plain sampler's tokens, and rejection
sampling with draft probabilities keeps the target distribution (a chi-square test that is shown to
reject deliberately biased acceptance rules)."""

import pytest
import torch

from graphserve.engine.sample.sampler import SamplingTensors, sample
from graphserve.engine.sample.hash_random import hash_uniform
from graphserve.engine.sample import rejection_sampler
from graphserve.engine.sample.rejection_sampler import PAD_TOKEN_ID, verify_drafts
from graphserve.engine.spec.drafter import pack_drafts


def _drafts_from(tokens: torch.Tensor, num_drafts: torch.Tensor, wrong_rate: float, vocab: int,
                 gen: torch.Generator) -> torch.Tensor:
    """[B, k] drafts: `tokens` with some replaced by another token, PAD_TOKEN_ID after num_drafts."""
    rows, k = tokens.shape
    wrong = torch.rand(rows, k, generator=gen) < wrong_rate
    shifted = (tokens + torch.randint(1, vocab, (rows, k), generator=gen)) % vocab
    drafts = torch.where(wrong, shifted, tokens)
    return torch.where(torch.arange(k)[None, :] < num_drafts[:, None], drafts, torch.full_like(drafts, PAD_TOKEN_ID))


def _expected_tokens(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> list[list[int]]:
    """Step by step, as decoding without speculation: take the target token of each position; go on
    while the draft there equals it."""
    out = []
    for row in range(target.shape[0]):
        tokens = []
        for j in range(target.shape[1]):
            tokens.append(int(target[row, j]))
            if j >= int(num_drafts[row]) or int(drafts[row, j]) != tokens[-1]:
                break
        out.append(tokens)
    return out


def _as_lists(result: rejection_sampler.VerifyOutput) -> list[list[int]]:
    tokens = result.token_ids.tolist()
    lists = [row[: n + 1] for row, n in zip(tokens, result.num_accepted.tolist())]
    for row, n in zip(tokens, result.num_accepted.tolist()):
        assert row[n + 1 :] == [PAD_TOKEN_ID] * (len(row) - n - 1)
    return lists


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_rows_equal_stepwise_argmax(with_draft_probs):
    gen = torch.Generator().manual_seed(1)
    rows, k, vocab = 96, 4, 50
    logits = torch.randn(rows, k + 1, vocab, generator=gen) * 3
    num_drafts = torch.randint(0, k + 1, (rows,), generator=gen)
    drafts = _drafts_from(logits[:, :k].argmax(-1), num_drafts, 0.25, vocab, gen)
    # half the rows sample: the greedy rows must not depend on them
    temperature = torch.where(torch.arange(rows) % 2 == 0, 0.0, 0.8)
    q = torch.rand(rows, k, vocab, generator=gen).softmax(-1) if with_draft_probs else None
    result = verify_drafts(logits, drafts, num_drafts, temperature, torch.arange(rows),
                           torch.zeros(rows, dtype=torch.long), q)

    expected = _expected_tokens(logits.argmax(-1), drafts, num_drafts)
    got = _as_lists(result)
    greedy_rows = range(0, rows, 2)
    assert [got[r] for r in greedy_rows] == [expected[r] for r in greedy_rows]
    accepted = result.num_accepted[0::2]
    assert 0 < accepted.sum() < num_drafts[0::2].sum()  # the drafts were partly right
    assert (result.num_accepted <= num_drafts).all()


def test_seeded_sampling_with_a_deterministic_drafter_equals_the_plain_sampler():
    """q = None: a seeded request's tokens are those it gets without speculation."""
    gen = torch.Generator().manual_seed(2)
    rows, k, vocab = 64, 4, 40
    logits = torch.randn(rows, k + 1, vocab, generator=gen) * 2
    temperature = torch.tensor([0.0, 0.6, 1.0, 1.7]).repeat(rows // 4)
    seeds = torch.randint(0, 2**32, (rows,), generator=gen)
    output_pos = torch.randint(0, 500, (rows,), generator=gen)
    plain = torch.stack([
        sample(logits[:, j], SamplingTensors(
            temperature=temperature, top_k=torch.full((rows,), vocab), top_p=torch.ones(rows), min_p=torch.zeros(rows),
            seeds=seeds, output_pos=output_pos + j)).tokens
        for j in range(k + 1)], dim=1)
    num_drafts = torch.randint(0, k + 1, (rows,), generator=gen)
    drafts = _drafts_from(plain[:, :k], num_drafts, 0.3, vocab, gen)

    result = verify_drafts(logits, drafts, num_drafts, temperature, seeds, output_pos)

    assert _as_lists(result) == _expected_tokens(plain, drafts, num_drafts)
    assert 0 < result.num_accepted.sum() < num_drafts.sum()


def test_noise_per_position_and_per_stream():
    seeds, pos = torch.tensor([0, 7, 2**32 - 1]), torch.tensor([0, 3, 123456])
    assert torch.equal(hash_uniform(seeds, pos[:, None], 300)[:, 0], hash_uniform(seeds, pos, 300))
    assert not torch.equal(hash_uniform(seeds, pos[:, None], 300, stream=1), hash_uniform(seeds, pos[:, None], 300))


def test_a_rows_result_does_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(3)
    rows, k, vocab = 12, 3, 20
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    q = torch.randn(rows, k, vocab, generator=gen).softmax(-1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(rows, k)
    args = (logits, drafts, torch.randint(0, k + 1, (rows,), generator=gen), torch.rand(rows, generator=gen),
            torch.arange(rows) * 31, torch.arange(rows), q)
    batch = verify_drafts(*args)
    for row in range(rows):
        alone = verify_drafts(*(a[row : row + 1] for a in args))
        assert torch.equal(alone.token_ids[0], batch.token_ids[row])
        assert alone.num_accepted[0] == batch.num_accepted[row]


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_runs_on_meta_tensors_so_it_has_no_host_sync_or_data_dependent_shape(with_draft_probs):
    """A meta tensor has no data: .item(), .tolist(), nonzero or boolean indexing would raise."""
    rows, k, vocab = 5, 3, 11
    meta = {"device": "meta"}
    result = verify_drafts(
        torch.empty(rows, k + 1, vocab, **meta), torch.empty(rows, k, dtype=torch.long, **meta),
        torch.empty(rows, dtype=torch.long, **meta), torch.empty(rows, **meta),
        torch.empty(rows, dtype=torch.long, **meta), torch.empty(rows, dtype=torch.long, **meta),
        torch.empty(rows, k, vocab, **meta) if with_draft_probs else None)
    assert result.token_ids.shape == (rows, k + 1) and result.num_accepted.shape == (rows,)


def test_pack_drafts_pads_to_k():
    tokens, counts = pack_drafts([[5, 6], [], [7, 8, 9]], k=3)
    assert tokens.tolist() == [[5, 6, 0], [0, 0, 0], [7, 8, 9]] and counts.tolist() == [2, 0, 3]
    with pytest.raises(ValueError):
        pack_drafts([[1, 2, 3, 4]], k=3)


# --- the distribution test ------------------------------------------------------------------------------

VOCAB = 6
ROWS = 60_000


def _chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of integer samples against cell probabilities (all > 0)."""
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double().flatten() * samples.numel()
    assert expected.min() >= 5, "too few samples per cell for the chi-square approximation"
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(probs.numel() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))  # the chi-square survival function


def _two_token_model(seed: int) -> dict[str, torch.Tensor]:
    """Target p and draft q of a two-token toy model: a first token, then one conditioned on it."""
    gen = torch.Generator().manual_seed(seed)

    def dist(*shape):
        return (torch.randn(*shape, VOCAB, generator=gen) * 0.8).softmax(-1)

    return {"p0": dist(), "p1": dist(VOCAB), "q0": dist(), "q1": dist(VOCAB)}


def _draw_drafts(model: dict[str, torch.Tensor], seeds: torch.Tensor, output_pos: torch.Tensor,
                 drafter_noise: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two drafts from q: with torch's generator, or as a draft model running the plain sampler with
    the request's seed would (Gumbel-max on the sampler's noise of the same positions)."""
    if drafter_noise == "generator":
        d0 = torch.multinomial(model["q0"], ROWS, replacement=True, generator=gen)
        return d0, torch.multinomial(model["q1"][d0], 1, generator=gen)[:, 0]

    def gumbel_max(q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        noise = -torch.log(-torch.log(hash_uniform(seeds, pos[:, None], VOCAB)[:, 0]))
        return (q.log() + noise).argmax(-1)

    d0 = gumbel_max(model["q0"].expand(ROWS, VOCAB), output_pos)
    return d0, gumbel_max(model["q1"][d0], output_pos + 1)


def _first_two_tokens(model: dict[str, torch.Tensor], with_draft_probs: bool, drafter_noise: str,
                      seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ROWS independent runs (one seed each) of verify rounds until two tokens are out. Rows draft
    0, 1 or 2 tokens from q; temperatures vary (the logits are scaled so that p stays the same)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(ROWS)
    seeds = rows + ROWS * seed
    output_pos = torch.full((ROWS,), 10)
    d0, d1 = _draw_drafts(model, seeds, output_pos, drafter_noise, gen)
    num_drafts = rows % 3
    temperature = torch.tensor([1.0, 0.5, 1.6])[(rows // 3) % 3]
    uniform = torch.full((ROWS, VOCAB), 1.0 / VOCAB)
    probs = torch.stack([model["p0"].expand(ROWS, VOCAB), model["p1"][d0], uniform], dim=1)
    logits = probs.log() * temperature[:, None, None]
    q = torch.stack([model["q0"].expand(ROWS, VOCAB), model["q1"][d0]], dim=1) if with_draft_probs else None
    first = verify_drafts(logits, torch.stack([d0, d1], dim=1), num_drafts, temperature, seeds, output_pos, q)
    x0 = first.token_ids[:, 0]
    # rows that stopped after one token run a round with no drafts for the second
    second_logits = (model["p1"][x0].log() * temperature[:, None])[:, None]
    second = verify_drafts(second_logits, torch.empty(ROWS, 0, dtype=torch.long), torch.zeros(ROWS, dtype=torch.long),
                           temperature, seeds, output_pos + 1)
    x1 = torch.where(first.num_accepted >= 1, first.token_ids[:, 1], second.token_ids[:, 0])
    return x0, x1


def _p_values(with_draft_probs: bool, seed: int, drafter_noise: str = "generator") -> tuple[float, float]:
    """Chi-square p-values of the first token and of the first two tokens against the target."""
    model = _two_token_model(seed)
    x0, x1 = _first_two_tokens(model, with_draft_probs, drafter_noise, seed)
    joint = model["p0"][:, None] * model["p1"]
    return _chi_square_p_value(x0, model["p0"]), _chi_square_p_value(x0 * VOCAB + x1, joint)


@pytest.mark.parametrize("with_draft_probs, drafter_noise", [
    (True, "generator"),
    (True, "sampler"),  # a draft model sampling with the request's own seed: verify's noise must not follow it
    (False, "generator"),
])
def test_sampled_verification_preserves_the_target_distribution(with_draft_probs, drafter_noise):
    first, joint = _p_values(with_draft_probs, seed=11, drafter_noise=drafter_noise)
    assert first > 1e-4 and joint > 1e-4, (first, joint)


def _always_accept(p_draft, q_draft, coin):
    return torch.ones_like(p_draft, dtype=torch.bool)


def _accept_with_q_over_p(p_draft, q_draft, coin):
    return coin * p_draft < q_draft


@pytest.mark.parametrize("replaced, rule", [
    ("accept_drafts", _always_accept),
    ("accept_drafts", _accept_with_q_over_p),
    ("residual_weights", lambda p, q: p),  # on rejection, resample from p instead of max(0, p - q)
    ("_RESIDUAL_STREAM", rejection_sampler.SAMPLER_STREAM),  # the correction drawn with the drafter's own noise
], ids=["always-accept", "min(1,q/p)", "resample-from-p", "residual-on-drafter-noise"])
def test_the_distribution_test_rejects_biased_rules(monkeypatch, replaced, rule):
    monkeypatch.setattr(rejection_sampler, replaced, rule)
    first, joint = _p_values(with_draft_probs=True, seed=11, drafter_noise="sampler")
    assert min(first, joint) < 1e-9, (first, joint)


def test_acceptance_rate_is_the_overlap_of_p_and_q():
    """The first draft is accepted with probability sum(min(p, q)), the rejection-sampling rate."""
    model = _two_token_model(5)
    gen = torch.Generator().manual_seed(5)
    d0 = torch.multinomial(model["q0"], ROWS, replacement=True, generator=gen)
    result = verify_drafts(model["p0"].log().expand(ROWS, 2, VOCAB), d0[:, None], torch.ones(ROWS, dtype=torch.long),
                           torch.ones(ROWS), torch.arange(ROWS), torch.zeros(ROWS, dtype=torch.long),
                           model["q0"].expand(ROWS, 1, VOCAB))
    rate = torch.minimum(model["p0"], model["q0"]).sum().item()
    sigma = (rate * (1 - rate) / ROWS) ** 0.5
    assert abs(result.num_accepted.double().mean().item() - rate) < 5 * sigma


def test_greedy_rows_short_way_equals_the_batched_rule():
    """A batch of greedy rows is accepted on the host (greedy_targets + accept_greedy): the same
    counts and tokens as verify_drafts, drafts right, wrong, missing, and argmax ties included."""
    from graphserve.engine.sample.rejection_sampler import accept_greedy, greedy_targets

    gen = torch.Generator().manual_seed(0)
    b, k, vocab = 6, 4, 50
    logits = torch.randn(b, k + 1, vocab, generator=gen).round(decimals=1)  # ties happen at this rounding
    argmax = logits.argmax(dim=-1)
    drafts = []
    for i in range(b):
        n = i % (k + 1)
        proposal = argmax[i, :n].tolist()
        if i % 2 and n:
            proposal[-1] = (proposal[-1] + 1) % vocab  # the last one wrong
        drafts.append(proposal)
    ids = torch.tensor([d + [0] * (k - len(d)) for d in drafts])
    counts = torch.tensor([len(d) for d in drafts])
    want = verify_drafts(logits, ids, counts, torch.zeros(b), torch.zeros(b, dtype=torch.int64),
                         torch.zeros(b, dtype=torch.int64))
    num_accepted, tokens = accept_greedy(greedy_targets(logits), drafts)
    assert num_accepted == want.num_accepted.tolist()
    assert tokens == [row[:n + 1] for row, n in zip(want.token_ids.tolist(), num_accepted)]
    assert num_accepted == [0, 0, 2, 2, 4, 0]  # right drafts accepted, each run cut at its wrong one

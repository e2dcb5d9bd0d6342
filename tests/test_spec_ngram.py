"""The n-gram (prompt lookup) drafter, engine/spec/ngram.py: the continuation of the longest suffix match,
its most recent occurrence, within k and the n-gram bounds, and its incremental index agreeing with a
brute-force search."""

import random

import pytest

from graphserve.engine.spec.ngram import NgramDrafter


def _propose(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    drafter = NgramDrafter(min_n=min_n, max_n=max_n)
    drafter.add_request("r", tokens)
    return drafter.propose(["r"], [k])[0]


def _brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Scan for the longest n whose suffix n-gram occurs earlier; copy from its latest occurrence,
    the copy running on into its own output where the occurrence overlaps the suffix."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        for start in range(length - n - 1, -1, -1):  # earlier occurrences, latest first
            if tokens[start : start + n] == tokens[length - n :]:
                out = list(tokens)
                for _ in range(k):
                    out.append(out[start + n + len(out) - length])
                return out[length:]
    return []


def test_proposes_the_continuation_of_the_longest_match():
    # the 3-gram [2, 3, 4] occurred after 5; the 2-gram [3, 4] more recently, before 20
    tokens = [5, 2, 3, 4, 10, 11, 3, 4, 20, 21, 2, 3, 4]
    assert _propose(tokens, k=2) == [10, 11]
    assert _propose(tokens, k=2, max_n=2) == [20, 21]


def test_prefers_the_most_recent_occurrence():
    assert _propose([1, 2, 7, 9, 1, 2, 8, 9, 1, 2], k=2) == [8, 9]


def test_proposes_nothing_without_a_match():
    assert _propose([1, 2, 3, 4, 5], k=3) == []
    assert _propose([7], k=3) == []
    assert _propose([], k=3) == []


def test_respects_k_and_the_ngram_bounds():
    tokens = [1, 2, 3, 4, 5, 100, 101, 102, 3, 4, 5, 200, 1, 2, 3, 4, 5]
    assert _propose(tokens, k=3, max_n=5) == [100, 101, 102]  # the 5-gram's occurrence
    assert _propose(tokens, k=3, max_n=3) == [200, 1, 2]  # the 3-gram's, more recent
    assert _propose(tokens, k=1, max_n=5) == [100]
    assert _propose(tokens, k=0, max_n=5) == []
    # only a 1-gram repeats: min_n = 2 proposes nothing
    assert _propose([4, 9, 6, 4], k=2, min_n=1) == [9, 6]
    assert _propose([4, 9, 6, 4], k=2, min_n=2) == []


def test_a_repeating_pattern_is_continued_past_the_end():
    assert _propose([7, 7, 7], k=4) == [7, 7, 7, 7]
    assert _propose([1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]


def test_tracks_appends_and_requests_separately():
    drafter = NgramDrafter(min_n=2, max_n=3)
    drafter.add_request("a", [1, 2, 3])
    drafter.add_request("b", [1, 2, 9])
    assert drafter.propose(["a", "b"], [2, 2]) == [[], []]
    drafter.on_append("a", [1, 2])
    drafter.on_append("b", [5, 1, 2])
    assert drafter.propose(["a", "b"], [2, 3]) == [[3, 1], [9, 5, 1]]
    drafter.on_finish("a")
    with pytest.raises(KeyError):
        drafter.propose(["a"], [2])
    assert drafter.propose(["b"], [1]) == [[9]]


def test_rejects_bad_bounds():
    with pytest.raises(ValueError):
        NgramDrafter(min_n=0, max_n=3)
    with pytest.raises(ValueError):
        NgramDrafter(min_n=3, max_n=2)


def _repetitive_sequence(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random tokens interleaved with copies (some mutated) of earlier stretches."""
    tokens = [rng.randrange(vocab)]
    while len(tokens) < length:
        if rng.random() < 0.5:
            tokens.append(rng.randrange(vocab))
        else:
            start = rng.randrange(len(tokens))
            for token in tokens[start : start + rng.randint(1, 10)]:
                tokens.append(token if rng.random() > 0.1 else rng.randrange(vocab))
    return tokens[:length]


@pytest.mark.parametrize("min_n, max_n", [(1, 4), (2, 5), (3, 3)])
def test_incremental_index_matches_brute_force(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(20):
        tokens = _repetitive_sequence(rng, rng.randint(1, 150), vocab=rng.choice([3, 6, 20]))
        prompt_len = rng.randint(1, len(tokens))
        drafter = NgramDrafter(min_n=min_n, max_n=max_n)
        drafter.add_request("r", tokens[:prompt_len])
        seen = prompt_len
        while True:
            k = rng.randint(0, 6)
            assert drafter.propose(["r"], [k]) == [_brute_force(tokens[:seen], k, min_n, max_n)], (tokens[:seen], k)
            if seen == len(tokens):
                break
            step = rng.randint(1, 5)  # appends come in rounds of accepted tokens
            drafter.on_append("r", tokens[seen : seen + step])
            seen = min(seen + step, len(tokens))

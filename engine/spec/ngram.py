"""N-gram (prompt lookup) drafter: propose what followed the longest recent repeat of the suffix.

For n from max_n down to min_n, the last n tokens are looked up among the earlier n-grams of the
request (prompt and output); the first n that matches wins, and of its earlier occurrences the most
recent one. The drafts are the tokens that followed it. (vLLM's "ngram" method also takes the
longest n, but the earliest occurrence, and rescans the whole sequence every step.)

Cost: each request keeps, per n, a dict from n-gram to the position of the token that followed its
latest occurrence, updated as tokens are appended. A step costs (max_n - min_n + 1) lookups and
O(k) copying per request, whatever the sequence's length; appending a token costs as many inserts.
"""

from __future__ import annotations

from collections.abc import Sequence

from graphserve.engine.spec.drafter import Drafter


class NgramIndex:
    """One request's tokens and, for each n, n-gram -> index of the token after its latest
    earlier occurrence. Only n-grams followed by a token are indexed, so the suffix never matches
    itself."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._next_index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def append(self, token_ids: Sequence[int]) -> None:
        tokens = self.tokens
        for token in token_ids:
            pos = len(tokens)  # the n-grams ending just before `token` are now followed by it
            tokens.append(int(token))
            for n, table in self._next_index.items():
                if pos >= n:
                    table[tuple(tokens[pos - n : pos])] = pos

    def propose(self, k: int) -> list[int]:
        """Up to k tokens continuing the longest suffix match; [] when none matches."""
        tokens = self.tokens
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._next_index[n].get(tuple(tokens[length - n :]))
            if start is not None:
                # An occurrence that overlaps the suffix is a repeating pattern of period length - start:
                # the copy runs on into the tokens it is proposing (as an LZ77 overlapping copy).
                period = length - start
                return [tokens[start + j % period] for j in range(k)]
        return []


class NgramDrafter(Drafter):
    """Prompt-lookup drafting for many requests; costs no device time."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._requests: dict[str, NgramIndex] = {}

    def add_request(self, request_id: str, token_ids: Sequence[int]) -> None:
        index = NgramIndex(self.min_n, self.max_n)
        index.append(token_ids)
        self._requests[request_id] = index

    def on_append(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._requests[request_id].append(token_ids)

    def on_finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def propose(self, request_ids: Sequence[str], max_drafts: Sequence[int]) -> list[list[int]]:
        if len(request_ids) != len(max_drafts):
            raise ValueError(f"{len(request_ids)} requests but {len(max_drafts)} draft limits")
        return [self._requests[rid].propose(k) for rid, k in zip(request_ids, max_drafts)]

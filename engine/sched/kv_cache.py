"""Paged KV cache: the block pool (BlockManager) and the per-layer cache tensors.

Prefix caching: a full block whose KV is computed is registered under a hash chain,
sha256(parent block's hash, its token ids) (engine/sched/prefix_hash.py). A block whose last user ends stays cached
("cached-free": counted as free, evicted least-recently-used only when no truly free
block is left). A new prompt shares the longest run of cached full blocks by reference
count; a hit is checked against the stored token ids, never trusted on the hash alone.
A shared block is never written: only full blocks are shared, and at least the prompt's
last token is always recomputed (into a block of the request's own).

A pool of a windowed group (window W: every layer it serves reads keys p - W < k <= p): a sequence's
blocks wholly before its next query's window are dead for every later query, and drop_out_of_window
gives them back, the dummy block taking their place in the table (docs/architecture.md, KV cache
groups). A prefix hit then needs only the blocks inside the window. Such a pool allocates a prefill's
blocks chunk by chunk: its admission reserves the most it will hold at once (the window and a chunk),
counted as taken, and each chunk draws on that reservation (prefill_blocks, allocate)."""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from graphserve.engine.config import EngineConfig
from graphserve.engine.models.config import ModelArgs
from graphserve.engine.sched.prefix_hash import adapter_root, block_bytes, chain_keys, chain_root, num_prompt_blocks
from graphserve.engine.request import Sequence

# Block 0 is never handed out: padded rows of a CUDA-graph batch and the steps a
# sequence runs past its end write their K/V there.
DUMMY_BLOCK = 0


class BlockManager:
    """Fixed-size blocks with reference counts; sequences own lists of block ids."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False, cache_salt: str = "",
                 window: int | None = None, group: int = 0):
        """group: the KV cache group this pool serves (its index in Sequence.block_tables; KVGroups)."""
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.window = window  # the window of every layer this pool serves (None: full attention)
        self.group = group
        self.ref_counts = [0] * num_blocks
        self.ref_counts[DUMMY_BLOCK] = 1
        self.free_blocks: deque[int] = deque(range(1, num_blocks))
        self.root = chain_root(cache_salt)  # anything else the KV depends on (the model)
        self._by_hash: dict[bytes, int] = {}  # registered full blocks
        self._block_key: dict[int, tuple[bytes, bytes]] = {}  # block -> (its hash, its token ids as int64 bytes)
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # registered, no user; LRU first
        # keys of full blocks an admitted prefill is computing now -> its request id: a request
        # that needs the same block waits for it instead of computing it again
        self._computing: dict[bytes, str] = {}
        # decode rounds launched so far (the engine counts them), and per block that count when it
        # was last freed: a round still running may write a block freed after its launch
        self.rounds_launched = 0
        self.freed_at = [0] * num_blocks
        # a windowed pool: blocks promised to admitted prefills (Sequence.kv_reserved), counted as taken
        self.reserved = 0

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get: truly free plus cached-free (evictable)."""
        return len(self.free_blocks) + len(self._cached_free) - self.reserved

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence holds (the KV that is kept; the metrics' blocks in use)."""
        return self.num_usable_blocks - self.num_free_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so that its first `num_tokens` token slots exist."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_tables[self.group]))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def blocks_to_grow(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks the free count must hold so that seq's first `num_tokens` slots exist (what seq's
        reservation does not cover)."""
        return max(0, self.blocks_needed(seq, num_tokens) - seq.group_reserved[self.group])

    def prefill_blocks(self, seq: Sequence, cached: list[int], max_chunk: int) -> int:
        """Blocks an admission of seq takes from the free count besides the cached ones it shares: its
        prompt's, or in a windowed pool the most its prefill holds at once (the window before a chunk of
        at most max_chunk tokens and that chunk), which admit reserves."""
        total = -(-seq.num_tokens // self.block_size) - len(cached)
        if self.window is None:
            return total
        return min(total, window_blocks(self.window, max_chunk, self.block_size))

    def admit(self, seq: Sequence, cached: list[int], num_blocks: int, num_tokens: int) -> None:
        """Start seq's table with the `cached` blocks and cover its first `num_tokens` slots: all its
        prompt's; in a windowed pool those of its first chunk, with the rest of the `num_blocks` that
        prefill_blocks counted reserved for the next chunks."""
        if cached:
            self.share(seq, cached)
        if self.window is None:
            self.allocate(seq, seq.num_tokens)
            return
        seq.group_reserved[self.group] = num_blocks
        self.reserved += num_blocks
        self.allocate(seq, num_tokens)

    def _unreserve(self, seq: Sequence) -> None:
        self.reserved -= seq.group_reserved[self.group]
        seq.group_reserved[self.group] = 0

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq.block_tables[self.group] to cover `num_tokens` slots, first from seq's reservation. Caller
        checked can_allocate (for what the reservation does not cover)."""
        needed = self.blocks_needed(seq, num_tokens)
        mine = min(needed, seq.group_reserved[self.group])
        seq.group_reserved[self.group] -= mine
        self.reserved -= mine
        for _ in range(needed):
            block = self._take_block()
            self.ref_counts[block] = 1
            seq.block_tables[self.group].append(block)

    def _take_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:  # evict the least recently used cached block
            block, _ = self._cached_free.popitem(last=False)
            self._unregister(block)
        assert self.ref_counts[block] == 0
        return block

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks; first register its full blocks whose KV is computed, so a
        later request (or this one, re-admitted after preemption) can reuse them."""
        self.register(seq)
        self._unreserve(seq)
        for block in reversed(seq.block_tables[self.group]):
            if block != DUMMY_BLOCK:  # (a dropped block's place)
                self._release(block)
        seq.block_tables[self.group] = []
        seq.group_hashes[self.group] = []
        if self.group == 0:  # (the keys being computed are group 0's: KVGroups)
            for key in seq.computing_keys:
                if self._computing.get(key) == seq.request_id:
                    del self._computing[key]
            seq.computing_keys = []

    def _release(self, block: int) -> bool:
        """Drop one reference to `block`; without users it is free (cached-free when registered): True."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.freed_at[block] = self.rounds_launched
            if block in self._block_key:
                self._cached_free[block] = None  # most recently used last
            else:
                self.free_blocks.append(block)
            return True
        return False

    def drop_out_of_window(self, seq: Sequence) -> int:
        """A windowed pool: give back seq's blocks wholly before the window of its next query (at
        position seq.num_computed_tokens), which no later query reads; the dummy block takes their
        place, so the table keeps its length. Registered first, for the prefix cache. During its prefill
        the blocks that became free go to seq's reservation (its next chunk takes them), after it the
        reservation is given up. How many went back."""
        if not seq.in_prefill and seq.group_reserved[self.group]:
            self._unreserve(seq)
        first = self.first_live_block(seq.num_computed_tokens)
        table = seq.block_tables[self.group]
        if first == 0 or not table or table[min(first, len(table)) - 1] == DUMMY_BLOCK:
            return 0  # nothing new before the window (entries before a dummy one are dummy already)
        self.register(seq)
        end = min(first, len(table))
        start = end
        while start > 0 and table[start - 1] != DUMMY_BLOCK:
            start -= 1
        freed = 0
        for i in range(start, end):  # the earliest first: a windowed hit needs the latest, evicted last
            freed += self._release(table[i])
            table[i] = DUMMY_BLOCK
        if seq.in_prefill:  # (a block another sequence shares stays taken: the next chunk may wait for one)
            seq.group_reserved[self.group] += freed
            self.reserved += freed
        return end - start

    def first_live_block(self, position: int) -> int:
        """The first block a query at `position` and every later one reads (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // self.block_size

    # ---- speculative decoding: a verify step writes ahead, then gives back what was rejected ----

    def reserve_draft_slots(self, seq: Sequence, num_drafts: int) -> bool:
        """Grow seq.block_tables[self.group] so that a verify step can write the KV of seq's last token and of
        `num_drafts` drafts after it (positions up to num_tokens - 1 + num_drafts). False, taking
        nothing, when the pool lacks the blocks."""
        needed = self.blocks_needed(seq, seq.num_tokens + num_drafts)
        if not self.can_allocate(needed):
            return False
        self.allocate(seq, seq.num_tokens + num_drafts)
        return True

    def roll_back_drafts(self, seq: Sequence) -> None:
        """After a verify step, once seq's accepted drafts and the token after them are appended:
        the KV of every token but the last is computed (as after a decode step), the slots past it
        hold rejected drafts for the next steps to overwrite, and blocks holding only such slots go
        back to the pool."""
        seq.num_computed_tokens = seq.num_tokens - 1
        self.trim(seq, seq.num_computed_tokens)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past the first `num_tokens` token slots. Those are its own and never
        registered (a registered block is full of computed KV, which a trim never cuts into)."""
        keep = -(-num_tokens // self.block_size)
        assert len(seq.group_hashes[self.group]) <= keep, "trimming a registered block"
        for block in reversed(seq.block_tables[self.group][keep:]):
            assert self.ref_counts[block] == 1 and block not in self._block_key, f"block {block} is shared"
            self._release(block)
        del seq.block_tables[self.group][keep:]

    def last_freed(self, seq: Sequence, start: int, end: int) -> int:
        """The latest rounds_launched at which a block holding seq's positions start..end-1 was freed."""
        bs = self.block_size
        return max(self.freed_at[b] for b in seq.block_tables[self.group][start // bs:(end - 1) // bs + 1])

    # ---- prefix caching ------------------------------------------------------------------

    def register(self, seq: Sequence) -> None:
        """Register seq's full blocks whose every token's KV is computed (they never change
        again). A block whose content another block already holds stays unregistered."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_tables[self.group]))
        hashes = seq.group_hashes[self.group]
        if len(hashes) >= full:
            return
        keys = self._chain(seq, full)
        for i in range(len(hashes), full):
            tokens = seq.block_tokens[i]
            key = keys[i]
            hashes.append(key)
            if self._computing.get(key) == seq.request_id:
                del self._computing[key]
            block = seq.block_tables[self.group][i]
            if block != DUMMY_BLOCK and key not in self._by_hash and block not in self._block_key:
                self._by_hash[key] = block
                self._block_key[block] = (key, tokens)

    def forget_cached_blocks(self) -> None:
        """Empty the prefix cache of blocks no request uses (the engine's warm-up burst's): they
        become truly free, as at start-up."""
        while self._cached_free:
            block, _ = self._cached_free.popitem(last=False)
            self._unregister(block)
            self.free_blocks.append(block)

    def _unregister(self, block: int) -> None:
        key, _ = self._block_key.pop(block)
        if self._by_hash.get(key) == block:
            del self._by_hash[key]

    def prefix_keys(self, seq: Sequence) -> list[bytes]:
        """The hash-chain keys of seq's full blocks before its last token (which is always
        recomputed for the next logits); none without prefix caching."""
        if not self.prefix_caching:
            return []
        count = num_prompt_blocks(seq.num_tokens, self.block_size)
        return self._chain(seq, count)[:count]

    def adopt_prompt_keys(self, seq: Sequence, keys: list[bytes] | None) -> None:
        """Take the prompt keys a front end computed (engine/sched/prefix_hash.py prompt_keys) for a
        new sequence, when they have the right count (a wrong key costs a miss, never wrong KV:
        cached_prefix compares the tokens)."""
        if (self.prefix_caching and keys and not seq.block_keys
                and len(keys) == num_prompt_blocks(seq.num_tokens, self.block_size)):
            seq.block_keys = list(keys)

    def _chain(self, seq: Sequence, count: int) -> list[bytes]:
        """seq's hash-chain keys of at least its first `count` full blocks (and their token
        bytes in seq.block_tokens), each made once: a sequence only appends tokens, so a full
        block's key never changes (a prompt waiting behind a prefill that computes its prefix
        asks again every step)."""
        tokens, keys = seq.block_tokens, seq.block_keys
        if len(tokens) < count:
            tokens += block_bytes(seq.token_ids, len(tokens), count, self.block_size)
        if len(keys) < count:
            root = adapter_root(self.root, seq.lora.lora_id if seq.lora is not None else None)
            keys += chain_keys(keys[-1] if keys else root, tokens[len(keys):count])
        return keys

    def cached_prefix(self, seq: Sequence, keys: list[bytes] | None = None) -> list[int]:
        """The longest run of cached blocks holding seq's first tokens (its prompt, and after
        a preemption what it generated too), checked token by token; a windowed pool's needs only
        the blocks the next query reads (the dummy block before them). `keys`: prefix_keys(seq)."""
        keys = self.prefix_keys(seq) if keys is None else keys
        return self.hit_blocks(seq, keys, self.longest_hit(seq, keys, len(keys)))

    def longest_hit(self, seq: Sequence, keys: list[bytes], limit: int) -> int:
        """The most blocks, at most `limit`, of seq's prefix this pool can serve from its cache: the
        cached run from the start (full attention); a windowed pool's longest L such that the blocks the
        query at L * block_size reads (from first_live_block on) are cached. Searched from the right, as
        vLLM's SlidingWindowManager does: a run of `need` cached blocks ends the search."""
        if self.window is None:
            length = 0
            while length < limit and self._cached_block(seq, keys, length) is not None:
                length += 1
            return length
        need = -(-(self.window - 1) // self.block_size)
        run = 0
        for i in range(limit - 1, -1, -1):
            if self._cached_block(seq, keys, i) is None:
                run = 0
                continue
            run += 1
            if run >= need or i == 0:
                return i + run
        return 0

    def hit_blocks(self, seq: Sequence, keys: list[bytes], length: int) -> list[int]:
        """The table a hit of `length` blocks (one longest_hit accepts) starts seq with: the cached
        blocks, in a windowed pool the dummy block before those the next query reads."""
        first = self.first_live_block(length * self.block_size)
        return [DUMMY_BLOCK] * first + [self._cached_block(seq, keys, j) for j in range(first, length)]

    def _cached_block(self, seq: Sequence, keys: list[bytes], i: int) -> int | None:
        """The cached block holding seq's i-th full block (its tokens checked), or None."""
        block = self._by_hash.get(keys[i])
        return block if block is not None and self._block_key[block][1] == seq.block_tokens[i] else None

    def being_computed(self, key: bytes) -> bool:
        """An admitted prefill is computing the block with this key (it registers it when done)."""
        return key in self._computing

    def mark_computing(self, seq: Sequence, keys: list[bytes]) -> None:
        """seq, just admitted, computes the blocks with these keys (until registered or freed)."""
        for key in keys:
            self._computing.setdefault(key, seq.request_id)
        seq.computing_keys = list(keys)

    def share(self, seq: Sequence, blocks: list[int]) -> None:
        """Start seq's block table with cached blocks (seq holds none yet)."""
        assert not seq.block_tables[self.group]
        for block in blocks:
            if block == DUMMY_BLOCK:  # a windowed pool's dropped place
                continue
            if self.ref_counts[block] == 0:
                del self._cached_free[block]
            self.ref_counts[block] += 1
        seq.block_tables[self.group] = list(blocks)
        seq.group_hashes[self.group] = [seq.block_keys[i] if b == DUMMY_BLOCK else self._block_key[b][0]
                            for i, b in enumerate(blocks)]  # (cached_prefix made the keys)

    def num_reusable(self, blocks: list[int]) -> int:
        """How many of `blocks` are cached-free (sharing them takes them out of the free count)."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)


def window_blocks(window: int, ahead: int, block_size: int) -> int:
    """The most blocks a sequence holds in a pool with this window when it writes `ahead` tokens at once: the
    window's tokens before them and those, wherever the blocks' edges fall (one block more than they fill)."""
    return -(-(window - 1 + ahead) // block_size) + 1


def windowed_hold(window: int, config: EngineConfig) -> int:
    """The most blocks one sequence holds at once in a pool with this window, however long it is: the
    window before a prefill chunk or a round's writes (a decode round ahead of one in flight, or a
    verify step's drafts) and those."""
    ahead = max(config.max_num_batched_tokens, 2 * config.decode_chunk + config.num_speculative_tokens + 1)
    return window_blocks(window, ahead, config.block_size)


def kv_bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * element


def allocate_kv_cache(args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k, v) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (2, args.num_layers, num_blocks, block_size, args.num_kv_heads, args.head_dim)
    pool = torch.zeros(shape, dtype=dtype, device=device)
    return [(pool[0, i], pool[1, i]) for i in range(args.num_layers)]

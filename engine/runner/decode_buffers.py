"""The static device buffers every decode graph reads and writes (inputs, sampling parameters,
grammar masks, sampled tokens), the largest bucket's rows; a bucket's graph sees their first rows.
Padding rows are made inert here (the dummy block, position 0, greedy)."""

from __future__ import annotations

import torch

from graphserve.engine.runner.host_slots import PER_STEP, STAGED, group_buffer_name
from graphserve.engine.runner.model_runner import DecodeState
from graphserve.engine.sample.sampler import SamplingTensors
from graphserve.engine.sched.kv_cache import DUMMY_BLOCK


class DecodeBuffers:
    def __init__(self, rows: int, max_steps: int, table_width: int, vocab_size: int, block_size: int,
                 device: torch.device, lora: bool = False, num_groups: int = 1):
        """lora: the model has LoRA adapter slots, and the graphs read each row's (lora_slots). num_groups:
        the KV cache groups; each one after the first has a step-slot buffer and a block table of its own
        (staged as step_slots<g>, block_tables<g>)."""
        n, dev = rows, device
        self.lora = lora
        self.vocab_size, self.block_size = vocab_size, block_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.input_rows = torch.zeros(n, dtype=torch.int64, device=dev)  # staging only: GraphDecoder._stage_input_ids
        self.step_positions = torch.zeros(max_steps, n, dtype=torch.int64, device=dev)
        self.step_slots = torch.zeros(max_steps, n, dtype=torch.int64, device=dev)
        self.step_context_lens = torch.ones(max_steps, n, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((n, table_width), DUMMY_BLOCK, dtype=torch.int32, device=dev)
        self.group_step_slots = [torch.zeros(max_steps, n, dtype=torch.int64, device=dev) for _ in range(num_groups - 1)]
        self.group_block_tables = [torch.full((n, table_width), DUMMY_BLOCK, dtype=torch.int32, device=dev)
                                   for _ in range(num_groups - 1)]
        self.temperature = torch.zeros(n, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(n, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(n, dtype=torch.float32, device=dev)
        self.min_p = torch.zeros(n, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(n, dtype=torch.int64, device=dev)
        self.output_pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.token_bitmask = torch.full((n, -(-vocab_size // 32)), -1, dtype=torch.int32, device=dev)
        self.mask_rows = torch.zeros(n, dtype=torch.int64, device=dev)  # a round's constrained rows
        self.lora_slots = torch.full((n,), -1, dtype=torch.int32, device=dev)  # each row's LoRA slot, -1: none
        self.logits: torch.Tensor | None = None  # [n, V] (CUDA): the forward graph's output
        self.step = torch.zeros((), dtype=torch.int64, device=dev)
        self.out_tokens = torch.zeros(max_steps, n, dtype=torch.int64, device=dev)
        self.out_logprobs = torch.zeros(max_steps, n, dtype=torch.float32, device=dev)
        self._staged: dict[str, torch.Tensor] | None = None

    def state(self, bucket: int, variant: str) -> DecodeState:
        """Views of a bucket's rows as the runner's decode step takes them; `variant` (cuda_graphs.VARIANTS)
        picks the sampler's path."""
        st = SamplingTensors(
            temperature=self.temperature[:bucket], top_k=self.top_k[:bucket], top_p=self.top_p[:bucket],
            min_p=self.min_p[:bucket], seeds=self.seeds[:bucket], output_pos=self.output_pos[:bucket],
            all_greedy=variant.startswith("greedy"), use_top_filters=variant.startswith("sample"),
            token_bitmask=self.token_bitmask[:bucket] if variant.endswith("_masked") else None)
        return DecodeState(
            input_ids=self.input_ids[:bucket], step_positions=self.step_positions[:, :bucket],
            step_slots=self.step_slots[:, :bucket], step_context_lens=self.step_context_lens[:, :bucket],
            block_tables=self.block_tables[:bucket], sampling=st, step=self.step,
            out_tokens=self.out_tokens[:, :bucket], out_logprobs=self.out_logprobs[:, :bucket],
            lora_slots=self.lora_slots[:bucket] if self.lora else None,
            group_step_slots=tuple(t[:, :bucket] for t in self.group_step_slots),
            group_block_tables=tuple(t[:bucket] for t in self.group_block_tables))

    def staged(self) -> dict[str, torch.Tensor]:
        """The buffers staged from the host each round, by name (a further KV cache group's: step_slots<g>,
        block_tables<g>)."""
        if self._staged is None:
            self._staged = {name: getattr(self, name) for name in STAGED}
            for g, (slots, tables) in enumerate(zip(self.group_step_slots, self.group_block_tables), start=1):
                self._staged[group_buffer_name("step_slots", g)] = slots
                self._staged[group_buffer_name("block_tables", g)] = tables
        return self._staged

    def rows(self, name: str, k: int, b: int) -> torch.Tensor:
        """The first b rows of buffer `name` (and its first k steps, for a per-step one)."""
        buf = self.staged()[name]
        return buf[:k, :b] if name.rstrip("0123456789") in PER_STEP else buf[:b]  # (group_buffer_name)

    def reset_padding(self, start: int, end: int) -> None:
        """Rows start..end-1 become inert: dummy block, position 0, greedy. (A bucket's graph
        reads only its own rows, so rows past the bucket need no reset.)"""
        if start >= end:
            return
        for t, value in ((self.input_ids, 0), (self.temperature, 0.0), (self.seeds, 0), (self.output_pos, 0),
                         (self.min_p, 0.0), (self.top_p, 1.0), (self.top_k, self.vocab_size),
                         (self.block_tables, DUMMY_BLOCK), (self.token_bitmask, -1), (self.lora_slots, -1)):
            t[start:end].fill_(value)
        for t in self.group_block_tables:
            t[start:end].fill_(DUMMY_BLOCK)
        for t, value in ((self.step_positions, 0), (self.step_slots, DUMMY_BLOCK * self.block_size),
                         (self.step_context_lens, 1), *((t, DUMMY_BLOCK * self.block_size) for t in self.group_step_slots)):
            t[:, start:end].fill_(value)

"""ModelRunner: turns scheduled batches into tensors, runs the model, samples.

Prefill runs eagerly (variable length). A decode round runs K steps; each step samples
on the device and feeds the token, position and slot of the next step without a host
round trip. After the round the host reads the [K, B] tokens once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from graphserve.engine.lora.rows import LoraRows
from graphserve.engine.models.attention import AttentionMetadata
from graphserve.engine.sched.kv_cache import DUMMY_BLOCK, BlockManager
from graphserve.engine.sched.kv_groups import KVGroups
from graphserve.engine.models.llama import LlamaModel
from graphserve.engine.runner.prefill_graphs import PrefillGraphs
from graphserve.engine.runner.prefill_inputs import PrefillInputs, padded_rows, prefill_inputs, verify_inputs
from graphserve.engine.request import Sequence, TokenLogprob
from graphserve.engine.sample.sampler import SamplingTensors, build_sampling_tensors, count_output_tokens, sample
from graphserve.engine.sched.scheduler import DecodeRound, PrefillBatch
from graphserve.engine.structured.matchers import StructuredOutputs
from graphserve.kernels.step_bookkeeping import record_step, record_step_ref, step_inputs, step_inputs_ref


# On CUDA, a decode step's bookkeeping (reading its row of the round's positions, slots and context
# lengths; recording the sampled tokens and advancing) runs as kernels/step_bookkeeping.py's two kernels
# instead of their seven torch ops (step_inputs_ref, record_step_ref). H200, interleaved
# (decode_latency.py --fused-step-bookkeeping on|off): Qwen2.5-0.5B batch 1 1,822-1,824 against
# 1,788-1,791 tok/s, batch 8 +1.5%, Llama-3.1-8B batch 1 243.9 against 243.1-243.4.
FUSED_STEP_BOOKKEEPING = True


def _bookkeeping(step: torch.Tensor):
    """(read the step's inputs, record its tokens): the kernels on CUDA, their torch refs elsewhere."""
    if FUSED_STEP_BOOKKEEPING and step.is_cuda:
        return step_inputs, record_step
    return step_inputs_ref, record_step_ref


@dataclass
class StepTokens:
    """What a step produced for one sequence: new tokens and, when asked, their logprobs."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None


@dataclass
class DecodeState:
    """Device tensors a decode round reads and updates step by step."""

    input_ids: torch.Tensor  # [B] int64: the token each row feeds in
    step_positions: torch.Tensor  # [K, B] int64: position of each step's token
    step_slots: torch.Tensor  # [K, B] int64: where its K/V goes (the dummy block once a row is past its end)
    step_context_lens: torch.Tensor  # [K, B] int32
    block_tables: torch.Tensor  # [B, W] int32
    sampling: SamplingTensors
    step: torch.Tensor  # [] int64: index of the current step in the round
    out_tokens: torch.Tensor  # [K, B] int64
    out_logprobs: torch.Tensor  # [K, B] float32
    out_top_ids: torch.Tensor | None = None  # [K, B, N]
    out_top_logprobs: torch.Tensor | None = None
    lora_slots: torch.Tensor | None = None  # [B] int32: each row's LoRA adapter slot, -1: none (LoRA on)
    # KV cache groups after the first (engine/sched/kv_groups.py): each one's step_slots and block_tables
    group_step_slots: tuple[torch.Tensor, ...] = ()
    group_block_tables: tuple[torch.Tensor, ...] = ()


def plan_steps(seqs: list[Sequence], num_steps: int, tables: list[torch.Tensor], block_size: int,
               pending: list[int] | None = None) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Positions, slots (per KV cache group: `tables` [B, W] each) and context lengths of every step of
    a round, [K, B] each, on the host.

    The KV blocks of all K steps were reserved by the scheduler; a row that reaches its end
    (max_tokens) before step K keeps running, writing only into the dummy block. `pending`:
    per sequence, tokens it already generated on the device that the host has not appended
    yet (a round launched before the previous one was collected). (numpy: a handful of tiny
    torch CPU ops would cost more than the arithmetic.)"""
    ahead = np.zeros(len(seqs), dtype=np.int64) if pending is None else np.asarray(pending, dtype=np.int64)
    n = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs)) + ahead
    remaining = np.fromiter((s.num_tokens_left for s in seqs), dtype=np.int64, count=len(seqs)) - ahead
    last = n - 2 + np.minimum(remaining, num_steps)  # last position a row writes for real
    wanted = n[None, :] - 1 + np.arange(num_steps, dtype=np.int64)[:, None]
    positions = np.minimum(wanted, last[None, :])
    slots = []
    for table in tables:
        blocks = np.take_along_axis(table.numpy().astype(np.int64), (positions // block_size).T, axis=1).T
        slots.append(torch.from_numpy(np.where(wanted <= last[None, :], blocks * block_size + positions % block_size,
                                               DUMMY_BLOCK * block_size)))
    return torch.from_numpy(positions), slots, torch.from_numpy((positions + 1).astype(np.int32))


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_manager: KVGroups | BlockManager, device: torch.device, eos_ids: tuple[int, ...],
                 structured: StructuredOutputs | None = None, prefill_graphs: PrefillGraphs | None = None,
                 decode_table_width: int | None = None, lora: bool = False):
        """structured: the grammar matchers, when the engine has any. prefill_graphs: CUDA graphs of
        short prefills (captured by the caller). decode_table_width: the decode graphs' block-table
        width, which eager rounds then take too: the decode attention splits by it
        (kernels/decode_attention.pick_num_splits), so an eager round gives the graphs' greedy tokens.
        lora: the model has LoRA adapter slots; each step tells it every row's (Sequence.lora_slot).
        block_manager: the KV cache groups (a BlockManager: one group of every layer), whose tables
        each step's metadata carries, each layer reading its group's."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_manager.block_size
        if isinstance(block_manager, BlockManager):
            block_manager = KVGroups.single(block_manager, len(kv_caches))
        self.blocks = block_manager
        self.num_groups = block_manager.num_groups
        self.layer_groups = block_manager.layout.layer_groups if self.num_groups > 1 else ()
        self.device = device
        self.eos_ids = eos_ids
        self.vocab_size = model.args.vocab_size
        self.structured = structured
        self.prefill_graphs = prefill_graphs
        self.decode_table_width = decode_table_width
        self.lora = lora
        self.num_graph_prefills = 0  # prefill steps that replayed a graph
        self.num_overtaking_prefills = 0  # of them, on the priority stream
        self._last_prefill: torch.cuda.Event | None = None  # recorded after the last prefill's forward

    def token_bitmask(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The grammar masks of `seqs` (host, [B, ceil(V/32)] int32), or None if none is constrained."""
        return self.structured.bitmask(seqs) if self.structured is not None else None

    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _block_tables(self, seqs: list[Sequence], width: int | None = None, group: int = 0) -> torch.Tensor:
        """KV cache group `group`'s [B, width or the longest table] int32, short rows padded with the dummy
        block (host tensor)."""
        width = width or max(len(s.block_tables[group]) for s in seqs)
        return torch.tensor([s.block_tables[group] + [DUMMY_BLOCK] * (width - len(s.block_tables[group]))
                             for s in seqs], dtype=torch.int32)

    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch, overtake: bool = False) -> dict[str, StepTokens]:
        """Compute KV for each chunk; sample the first token of every sequence whose
        prefill completes (unless it asked for 0 tokens). Fills seq.prompt_logprobs.
        Through a prefill CUDA graph when one holds the batch and no prompt logprobs are asked;
        `overtake` (the engine checked it is safe): that graph and the sampling run on the
        graphs' priority stream, ahead of the decode rounds queued on the current one."""
        inputs = prefill_inputs(batch, self.block_size, self.num_groups)
        inputs.lora_slots = self._lora_slots(batch.seqs)
        bucket = self.prefill_graph_bucket(batch)
        stream = self.prefill_graphs.stream if bucket is not None and overtake else None
        if stream is None:
            return self._prefill(batch, inputs, bucket)
        if self._last_prefill is not None:  # the KV and static buffers of the prefills before it
            stream.wait_event(self._last_prefill)
        try:
            with torch.cuda.stream(stream):
                return self._prefill(batch, inputs, bucket)
        finally:  # what runs after it on the current stream (the rounds it joins) sees its KV
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.num_overtaking_prefills += 1

    def prefill_graph_bucket(self, batch: PrefillBatch) -> int | None:
        """The prefill graph that runs `batch`, or None: it runs eagerly (too long, prompt logprobs)."""
        graphs = self.prefill_graphs
        if graphs is None or any(s.params.prompt_logprobs is not None or s.lora_slot >= 0 for s in batch.seqs):
            return None  # (the graphs hold no LoRA products)
        return graphs.bucket_for(sum(batch.chunk_lens), len(batch.seqs))

    def _prefill(self, batch: PrefillBatch, inputs: PrefillInputs, bucket: int | None) -> dict[str, StepTokens]:
        graphs = self.prefill_graphs
        if bucket is not None:
            last_logits = graphs.run(inputs, bucket)  # [B, V]: every sequence's last token
            self.num_graph_prefills += 1
        else:
            hidden = self._prefill_forward(inputs)
        if self.device.type == "cuda":
            self._last_prefill = torch.cuda.Event()
            self._last_prefill.record()
        cu = inputs.cu_seqlens.tolist()
        for seq, start, n in zip(batch.seqs, cu, batch.chunk_lens):
            if bucket is None and seq.params.prompt_logprobs is not None:
                self._prompt_logprobs(seq, hidden[start:start + n], seq.num_computed_tokens)
            seq.num_computed_tokens += n

        done = [i for i, seq in enumerate(batch.seqs)
                if not seq.in_prefill and seq.num_tokens_left > 0]
        if not done:
            return {}
        seqs = [batch.seqs[i] for i in done]
        if bucket is not None:
            logits = last_logits if len(done) == len(batch.seqs) else last_logits[self._tensor(done, torch.int64)]
        else:
            logits = self.model.compute_logits(hidden[self._tensor([cu[i + 1] - 1 for i in done], torch.int64)])
        st = build_sampling_tensors(seqs, self.vocab_size, self.eos_ids, self.device,
                                    token_bitmask=self.token_bitmask(seqs))
        out = sample(logits, st)
        tokens = out.tokens.tolist()
        logprobs = out.logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        results = {}
        for i, seq in enumerate(seqs):
            results[seq.request_id] = self._step_tokens(seq, [tokens[i]], [logprobs[i]],
                                                        [top_ids[i]] if top_ids else None,
                                                        [top_lps[i]] if top_lps else None)
        return results

    @torch.inference_mode()
    def warm_up_eager_prefill(self) -> None:
        """Run the eager prefill path and the greedy sampler once on dummy tokens, so that Triton
        compiles their kernels at start-up and not during the first requests (measured on an H200:
        ~0.45 s added to the first requests' time to first token). Two sequences of 129 and 7 tokens,
        written only into the dummy block."""
        from graphserve.kernels.sampling import greedy_sample

        lens = np.minimum([129, 7], self.model.cos_sin.shape[0]).astype(np.int64)  # within the rotary table
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
        cu = np.zeros(len(lens) + 1, dtype=np.int32)
        cu[1:] = np.cumsum(lens)
        width = -(-int(lens.max()) // self.block_size)
        inputs = PrefillInputs(np.zeros(len(positions), dtype=np.int64), positions,
                               DUMMY_BLOCK * self.block_size + positions % self.block_size, lens,
                               lens.astype(np.int32), cu, np.full((len(lens), width), DUMMY_BLOCK, dtype=np.int32))
        inputs.group_tables = [(inputs.slots, inputs.block_tables)] * (self.num_groups - 1)
        if self.lora:  # the LoRA kernels of prefills (their tiles name no slot: they compile, then return)
            inputs.lora_slots = np.full(len(lens), -1, dtype=np.int32)
        hidden = self._prefill_forward(inputs, warm_up=True)
        logits = self.model.compute_logits(hidden[self._tensor(inputs.last_rows, torch.int64)])
        greedy_sample(logits)
        allowed = torch.full((len(lens), -(-logits.shape[1] // 32)), -1, dtype=torch.int32, device=self.device)
        greedy_sample(logits, allowed)  # the variant of rows under a grammar
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], drafts: list[list[int]],
               num_speculative_tokens: int | None = None) -> torch.Tensor:
        """Score each decoding sequence's last token and its drafts in one eager forward pass over the
        paged KV (speculative decoding's verify step), writing their KV at positions num_tokens - 1
        onwards. Returns float32 logits [B, k + 1, V]: position j of row i scores the token after
        seqs[i]'s tokens and drafts[i][:j]; positions past len(drafts[i]) are 0. k is num_speculative_tokens, or else the
        most drafts of any row. The caller reserved the slots (BlockManager.reserve_draft_slots) and,
        once it knows what was accepted, rolls the rest back (BlockManager.roll_back_drafts). Nothing
        here changes the sequences."""
        k = max(map(len, drafts), default=0) if num_speculative_tokens is None else num_speculative_tokens
        if any(len(proposal) > k for proposal in drafts):
            raise ValueError(f"more than k = {k} drafts in a row")
        inputs = verify_inputs(seqs, drafts, self.block_size, self.num_groups)
        inputs.lora_slots = self._lora_slots(seqs)
        logits = self.model.compute_logits(self._prefill_forward(inputs))  # [T, V]
        rows = torch.from_numpy(padded_rows(inputs.query_lens, k + 1)).to(self.device)
        out = logits.new_zeros(len(seqs) * (k + 1), logits.shape[1]).index_copy_(0, rows, logits)
        return out.view(len(seqs), k + 1, logits.shape[1])

    def _lora_slots(self, seqs: list[Sequence]) -> np.ndarray | None:
        """Each sequence's LoRA adapter slot (-1: none), or None when the model has no slots."""
        if not self.lora:
            return None
        return np.fromiter((s.lora_slot for s in seqs), dtype=np.int32, count=len(seqs))

    def _prefill_forward(self, inputs: PrefillInputs, warm_up: bool = False) -> torch.Tensor:
        """The eager forward pass of a packed prefill batch: hidden states [T, D]."""
        dev = self.device
        lora = None
        if inputs.lora_slots is not None:
            lora = LoraRows.for_segments(inputs.lora_slots, inputs.query_lens, dev, keep_base=warm_up)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=torch.from_numpy(inputs.slots).to(dev),
            block_tables=torch.from_numpy(inputs.block_tables).to(dev),
            context_lens=torch.from_numpy(inputs.context_lens).to(dev),
            cu_seqlens_q=torch.from_numpy(inputs.cu_seqlens).to(dev),
            max_seqlen_q=int(inputs.query_lens.max()),
            query_lens_host=inputs.query_lens.tolist(),
            context_lens_host=inputs.context_lens.tolist(),
            lora=lora,
        ).with_groups(self.layer_groups, [(torch.from_numpy(slots).to(dev), torch.from_numpy(tables).to(dev))
                                          for slots, tables in inputs.group_tables])
        return self.model(torch.from_numpy(inputs.input_ids).to(dev), torch.from_numpy(inputs.positions).to(dev),
                          meta, self.kv_caches)

    def _step_tokens(self, seq, tokens, logprobs, top_ids, top_lps) -> StepTokens:
        if seq.params.logprobs is None:
            return StepTokens(tokens)
        n = seq.params.logprobs
        top = [list(zip(ids[:n], lps[:n])) for ids, lps in zip(top_ids, top_lps)] if n else [[] for _ in tokens]
        return StepTokens(tokens, logprobs, top)

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, start: int) -> None:
        """Logprob of each prompt token given the ones before it (echo + logprobs)."""
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        num_prompt = seq.num_prompt_tokens
        if len(seq.prompt_logprobs) >= num_prompt:
            return  # recomputed after a preemption: already known
        logprobs = self.model.compute_logits(hidden).log_softmax(dim=-1)
        targets = seq.token_ids[start + 1:start + 1 + hidden.shape[0]]
        n_top = seq.params.prompt_logprobs
        rows = [j for j in range(len(targets)) if start + 1 + j < num_prompt]
        if not rows:
            return
        lp = logprobs[rows]
        chosen = lp.gather(1, self._tensor([targets[j] for j in rows], torch.int64)[:, None]).squeeze(1).tolist()
        top_lp, top_id = lp.topk(n_top, dim=-1) if n_top else (None, None)
        for r, j in enumerate(rows):
            top = list(zip(top_id[r].tolist(), top_lp[r].tolist())) if n_top else []
            seq.prompt_logprobs.append(TokenLogprob(targets[j], chosen[r], top))

    def prepare_decode(self, rnd: DecodeRound) -> DecodeState:
        """Host-built tensors for an eager round."""
        seqs, k = rnd.seqs, rnd.num_steps
        tables = [self._block_tables(seqs, self.decode_table_width, g) for g in range(self.num_groups)]
        positions, slots, context_lens = plan_steps(seqs, k, tables, self.block_size)
        st = build_sampling_tensors(seqs, self.vocab_size, self.eos_ids, self.device,
                                    token_bitmask=self.token_bitmask(seqs))
        b, dev = len(seqs), self.device
        state = DecodeState(
            input_ids=self._tensor([s.last_token_id for s in seqs], torch.int64),
            step_positions=positions.to(dev), step_slots=slots[0].to(dev), step_context_lens=context_lens.to(dev),
            block_tables=tables[0].to(dev),
            group_step_slots=tuple(t.to(dev) for t in slots[1:]), group_block_tables=tuple(t.to(dev) for t in tables[1:]),
            sampling=st,
            step=torch.zeros((), dtype=torch.int64, device=dev),
            out_tokens=torch.zeros(k, b, dtype=torch.int64, device=dev),
            out_logprobs=torch.zeros(k, b, dtype=torch.float32, device=dev),
            lora_slots=self._tensor(self._lora_slots(seqs), torch.int32) if self.lora else None,
        )
        if st.num_logprobs:
            state.out_top_ids = torch.zeros(k, b, st.num_logprobs, dtype=torch.int64, device=dev)
            state.out_top_logprobs = torch.zeros(k, b, st.num_logprobs, dtype=torch.float32, device=dev)
        return state

    def decode_step(self, state: DecodeState) -> None:
        """One decode step, entirely on the device: no host sync, no shape change."""
        self.decode_sample(state, self.decode_forward(state))

    def decode_forward(self, state: DecodeState) -> torch.Tensor:
        """The model part of a decode step: the logits [B, V] in the model's dtype."""
        read, _ = _bookkeeping(state.step)
        pos, slots, context_lens = read(state.step, state.step_positions, state.step_slots, state.step_context_lens)
        meta = AttentionMetadata(is_prefill=False, slot_mapping=slots, block_tables=state.block_tables,
                                 context_lens=context_lens,
                                 lora=LoraRows.for_rows(state.lora_slots) if state.lora_slots is not None else None)
        if state.group_step_slots:  # the further KV cache groups' slots of this step (no host sync: graph-safe)
            step = state.step[None]
            meta.with_groups(self.layer_groups, [(step_slots.index_select(0, step)[0], tables) for step_slots, tables
                                                 in zip(state.group_step_slots, state.group_block_tables)])
        hidden = self.model(state.input_ids, pos, meta, self.kv_caches)
        return self.model.compute_logits(hidden, dtype=None)  # sample() upcasts if it must

    def decode_sample(self, state: DecodeState, logits: torch.Tensor) -> None:
        """The sampling part of a decode step: the tokens, fed into the next step."""
        out = sample(logits, state.sampling)
        if state.out_top_ids is not None:  # at this step's row: before record advances the step
            step = state.step[None]
            state.out_top_ids.index_copy_(0, step, out.top_ids[None])
            state.out_top_logprobs.index_copy_(0, step, out.top_logprobs[None])
        _, record = _bookkeeping(state.step)
        record(state.step, out.tokens, out.logprobs, state.out_tokens, state.out_logprobs, state.input_ids,
               state.sampling.output_pos)
        count_output_tokens(state.sampling, out.tokens)

    @torch.inference_mode()
    def decode(self, rnd: DecodeRound, end_early: Callable[[], bool] | None = None) -> dict[str, StepTokens]:
        """A round of rnd.num_steps steps, or fewer where `end_early` (asked between two steps)
        says to stop: each sequence then gets the tokens of the steps that ran."""
        state = self.prepare_decode(rnd)
        rows = self.structured.constrained_rows(rnd.seqs) if self.structured is not None else []
        steps = rnd.num_steps
        for i in range(rnd.num_steps):
            if i and end_early is not None and end_early():
                steps = i
                break
            if i and rows:
                self.next_masks(rnd.seqs, rows, state.out_tokens[i - 1], state.sampling.token_bitmask)
            self.decode_step(state)
        return self.collect(rnd, state, steps)

    def next_masks(self, seqs: list[Sequence], rows: list[int], tokens: torch.Tensor,
                   token_bitmask: torch.Tensor) -> None:
        """Between two steps of a round, synchronously: the constrained rows' matchers take the
        tokens just sampled (`tokens`, [B]) and their next masks go into `token_bitmask`."""
        index = torch.tensor(rows, device=tokens.device)
        masks = torch.empty(len(rows), self.structured.words, dtype=torch.int32)
        self.structured.advance(seqs, rows, tokens.index_select(0, index).tolist(), masks)
        token_bitmask.index_copy_(0, index.to(token_bitmask.device), masks.to(token_bitmask.device))

    def collect(self, rnd: DecodeRound, state: DecodeState, steps: int | None = None) -> dict[str, StepTokens]:
        """The round's single device-to-host transfer, then per-sequence token lists (of its
        first `steps` steps; None: all)."""
        b = len(rnd.seqs)
        top_ids = state.out_top_ids[:steps, :b] if state.out_top_ids is not None else None
        top_lps = state.out_top_logprobs[:steps, :b] if state.out_top_ids is not None else None
        return self.tokens_by_seq(rnd.seqs, state.out_tokens[:steps, :b], state.out_logprobs[:steps, :b], top_ids,
                                  top_lps)

    def tokens_by_seq(self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor,
                      top_ids: torch.Tensor | None = None,
                      top_lps: torch.Tensor | None = None) -> dict[str, StepTokens]:
        """Per-sequence token lists from [K, B] (and [K, B, N]) outputs, row i = seqs[i]."""
        tokens_l = tokens.T.tolist()
        logprobs_l = logprobs.T.tolist()
        top_ids_l = top_ids.transpose(0, 1).tolist() if top_ids is not None else None
        top_lps_l = top_lps.transpose(0, 1).tolist() if top_lps is not None else None
        return {
            seq.request_id: self._step_tokens(seq, tokens_l[i], logprobs_l[i], top_ids_l[i] if top_ids_l else None,
                                              top_lps_l[i] if top_lps_l else None)
            for i, seq in enumerate(seqs)
        }

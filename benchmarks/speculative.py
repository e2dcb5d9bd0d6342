"""Speculative decoding on a GPU with the acceptance rate controlled: batch decode tok/s with speculation
off and on, for real model shapes with random weights (where real drafts would almost never be right).

    python benchmarks/speculative.py --models qwen2.5-0.5b llama-3.1-8b --quantization none fp8 \
        --batches 1 8 64 --k 2 4 6 --alphas 0.5 0.7 0.9 --out $OUT/speculative.json

Per model and batch, a plain run (speculation off, the engine's overlapped K-step rounds) records each
request's greedy continuation. Then, per (k, alpha), the engine speculates with a benchmark-only drafter
(ForcedDrafter, below) that proposes the recorded continuation and corrupts each proposed token with
probability 1 - alpha, so a verify step accepts a leading run of drafts as a drafter of per-token
acceptance alpha would: mean tokens per verify step (1 - alpha^(k+1)) / (1 - alpha). The tokens must
equal the plain run's; where the verify step's rounding (another row count than plain decoding's)
turns a greedy near-tie the other way, the recorded continuation no longer applies after that token,
so `same_tokens` and the measured accepted length are reported beside the expected one.

With --draft-model NAME (e.g. llama-3.2-1b for llama-3.1-8b) the engine also loads that draft model
(speculative_method "draft"), and a last arm per batch (k and alpha: --draft-k, --draft-alpha) runs
it: ForcedDraftModel asks the draft model for its k tokens each step (its prefill catch-up and k-step
round are paid in full) and then proposes the recorded continuation corrupted as above instead, since
a random draft model would never agree with a random target. As the engine runs a draft model (arm
"engine"), its round is launched and not waited for, and the forced drafts are copied to the device
behind it for the verify step to read there; `draft_ms_per_propose` is then the host's part. Arms of
--draft-arms: "host" (the drafts read on the host before the verify step, `draft_ms_per_propose` the
whole round).

On random bf16 weights the logits of a big model are flat enough that the verify step's rounding (at
another row count than plain decoding's) turns a near-tie the other way within the first tokens (the
8B on an H200, 2026-12-05: same tokens 0/B, acceptance nil), so by default (--acceptance forced) the
acceptance decisions themselves are forced for greedy rows: each draft is accepted with probability
alpha as long as the ones before it were (speculative_decoder.accept_greedy replaced), the token after the
run is the target's. The device does the same work per step as with drafts that are right that
often; the tokens are not the plain run's. --acceptance match compares drafts with the target.

Decode tok/s = batch * new_tokens / (T(prompt + 1 + new_tokens) - T(prompt + 1 token)), best of
--repeats, fresh prompts per batch, prefix caching off (as decode_latency.py).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from measure import copy_bandwidth, run_info, write_json  # noqa: E402
from workload import provenance, resolve_model  # noqa: E402

from graphserve.engine.spec.drafter import DeviceDrafts, Drafter  # noqa: E402


class ForcedDrafter(Drafter):
    """Proposes each request's recorded greedy continuation, each token replaced by another with
    probability 1 - alpha. Requests are known by their prompt (the first prompt_len tokens)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], prompt_len: int, alpha: float,
                 vocab_size: int, seed: int = 0):
        self.continuations = continuations
        self.prompt_len = prompt_len
        self.alpha = alpha
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.state: dict[str, list] = {}  # request id -> [its continuation, output tokens so far]

    def add_request(self, request_id: str, token_ids: Sequence[int]) -> None:
        prompt = tuple(token_ids[:self.prompt_len])
        self.state[request_id] = [self.continuations[prompt], len(token_ids) - self.prompt_len]

    def on_append(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.state[request_id][1] += len(token_ids)

    def on_finish(self, request_id: str) -> None:
        self.state.pop(request_id, None)

    def propose(self, request_ids: Sequence[str], max_drafts: Sequence[int]) -> list[list[int]]:
        out = []
        for rid, n in zip(request_ids, max_drafts):
            continuation, done = self.state[rid]
            out.append([t if self.rng.random() < self.alpha else (t + 1 + self.rng.randrange(self.vocab_size - 1))
                        % self.vocab_size for t in continuation[done:done + n]])
        return out


class ForcedDraftModel(Drafter):
    """The draft model's work each step, then the forced drafts in place of its tokens. The draft
    model keeps the KV of the accepted ones as if they had been its own (the same work: its round fed
    as many tokens), so its catch-up is a right draft's: one token after a round that was accepted
    whole."""

    def __init__(self, draft: Drafter, forced: ForcedDrafter, on_device: bool = True):
        self.draft, self.forced = draft, forced
        self.on_device = on_device  # False: the drafts reach the host before the verify step (the "host" arm)
        self.propose_s = 0.0
        self.proposes = 0
        self.forced_fed: dict[str, list[int]] = {}  # the forced drafts the draft model's round is taken to feed

    def add_request(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.draft.add_request(request_id, token_ids)
        self.forced.add_request(request_id, token_ids)

    def on_append(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.draft._read_round()  # records the drafts its round fed; the forced ones take their place
        if request_id in self.draft.fed and request_id in self.forced_fed:
            self.draft.fed[request_id] = self.forced_fed.pop(request_id)
        self.draft.on_append(request_id, token_ids)
        self.forced.on_append(request_id, token_ids)

    def on_finish(self, request_id: str) -> None:
        self.draft.on_finish(request_id)
        self.forced.on_finish(request_id)

    def propose(self, request_ids: Sequence[str], max_drafts: Sequence[int]) -> list[list[int]]:
        start = time.perf_counter()
        self.draft.propose(request_ids, max_drafts)  # its tokens reach the host: the round is done
        self.propose_s += time.perf_counter() - start
        self.proposes += 1
        proposals = self.forced.propose(request_ids, max_drafts)
        self._feed_forced(request_ids, proposals, read=True)
        return proposals

    def propose_on_device(self, request_ids: Sequence[str], max_drafts: Sequence[int]) -> DeviceDrafts | None:
        """The draft model's round launched, not waited for; the forced drafts copied to the device
        behind it, where the verify step reads them."""
        if not self.on_device:
            return None
        start = time.perf_counter()
        launched = self.draft.propose_on_device(request_ids, max_drafts)
        self.propose_s += time.perf_counter() - start
        self.proposes += 1
        if launched is None:
            return None
        proposals = self.forced.propose(request_ids, max_drafts)
        self._feed_forced(request_ids, proposals, read=False)
        tokens = torch.zeros(len(request_ids), self.draft.k, dtype=torch.int64)
        for row, proposal in enumerate(proposals):
            tokens[row, :len(proposal)] = torch.tensor(proposal, dtype=torch.int64)
        tokens = tokens.pin_memory().to(launched.tokens.device, non_blocking=True)
        return DeviceDrafts([len(p) for p in proposals], list(range(len(request_ids))), tokens)

    def _feed_forced(self, request_ids: Sequence[str], proposals: list[list[int]], read: bool) -> None:
        """As if the draft model had proposed (and so fed) these tokens: the same catch-up as a right
        draft's. In place of what its round fed: now (`read`: the round was read), else once it is
        read (on_append)."""
        self.forced_fed = {rid: proposal[:self.draft.k - 1] for rid, proposal in zip(request_ids, proposals)}
        for rid in request_ids if read else []:
            if rid in self.draft.fed:
                self.draft.fed[rid] = self.forced_fed.pop(rid)


def forced_acceptance(alpha: float, seed: int = 0):
    """speculative_decoder.accept_greedy's stand-in: a leading run of drafts, each accepted with probability
    alpha, then the target's token after the run."""
    rng = random.Random(seed)

    def accept(targets: list[list[int]], drafts: list[list[int]]) -> tuple[list[int], list[list[int]]]:
        num_accepted, tokens = [], []
        for row, proposal in zip(targets, drafts):
            n = next((j for j in range(len(proposal)) if rng.random() >= alpha), len(proposal))
            num_accepted.append(n)
            tokens.append(list(proposal[:n]) + [row[n]])
        return num_accepted, tokens

    return accept


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_decode(llm, prompts: list[list[int]], new_tokens: int, repeats: int) -> tuple[float, list[list[int]]]:
    """(seconds a decode step of the batch, the tokens of the last full run)."""
    from graphserve import SamplingParams

    def run(n: int):
        sync()
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        sync()
        return time.perf_counter() - start, [o.token_ids for o in outs]

    prefill = min(run(1)[0] for _ in range(repeats))
    best, tokens = float("inf"), None
    for _ in range(repeats):
        elapsed, tokens = run(new_tokens + 1)
        best = min(best, elapsed)
    return (best - prefill) / new_tokens, tokens


class PhaseTimer:
    """Host time per phase of the speculating rounds of one run (a diagnostic arm: the device is
    synchronized at each phase's ends, so its total is not the benchmark's tok/s). Phases: the
    drafter and slot reservation (spec.plan; for a draft model also its catch-up prefill and
    k-step round, each alone), the verify step's input build and graph launch (verify_logits),
    the wait for the device (GPU time not hidden), the argmax read and acceptance, and the engine's
    work outside the round (scheduling, appending tokens, outputs)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.undo: list = []

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def wrap(self, owner, attr: str, phase: str, wait_phase: str | None = None, sync_after: bool = True) -> None:
        """Time owner.attr as `phase`; first wait for the device, as `wait_phase` when given."""
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            sync()
            if wait_phase is not None:
                self.add(wait_phase, time.perf_counter() - start)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if sync_after:
                    sync()
                self.add(phase, time.perf_counter() - start)

        setattr(owner, attr, timed)
        self.undo.append((owner, attr, original))

    def restore(self) -> None:
        for owner, attr, original in reversed(self.undo):
            setattr(owner, attr, original)
        self.undo.clear()


def phase_breakdown(llm, prompts: list[list[int]], new_tokens: int, draft=None) -> dict[str, float]:
    """Milliseconds per speculating round of each phase (PhaseTimer), from one run."""
    from graphserve import SamplingParams
    from graphserve.engine.spec import speculative_decoder

    core = llm.engine.core
    timer = PhaseTimer()
    rounds = [0]
    original_round = core._decode_speculating

    def counted(rnd):
        rounds[0] += 1
        return original_round(rnd)

    core._decode_speculating = counted
    timer.wrap(core.speculation, "plan", "plan: drafts and slots")
    if draft is not None:
        timer.wrap(draft, "_catch_up", "  of which draft catch-up (prefill, or one step)")
        if draft.graphs is not None:
            timer.wrap(draft.graphs, "launch", "  of which draft round launch", sync_after=False)
            timer.wrap(draft.graphs, "collect", "  of which draft round read",
                       wait_phase="  of which draft round device time after launch")
    if core.worker.graphs is not None:
        timer.wrap(core.worker.graphs, "verify_logits", "verify: inputs, copies, graph launch", sync_after=False)
    timer.wrap(speculative_decoder, "greedy_targets", "argmax and read back", wait_phase="verify: device time after launch")
    timer.wrap(speculative_decoder, "accept_greedy", "acceptance on the host")
    try:
        sync()
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=new_tokens + 1, temperature=0, ignore_eos=True))
        sync()
        total = time.perf_counter() - start
    finally:
        timer.restore()
        core._decode_speculating = original_round
    n = max(1, rounds[0])
    out = {phase: s / n * 1e3 for phase, s in timer.seconds.items()}
    out["rounds"] = rounds[0]
    out["wall ms a round (prefill included)"] = total / n * 1e3
    return out


def expected_length(alpha: float, k: int) -> float:
    """Mean tokens a verify step gives when each draft is right with probability alpha, independently."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "llama-3.1-8b"])
    parser.add_argument("--quantization", nargs="+", choices=["none", "fp8"], default=["none"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--k", nargs="+", type=int, default=[2, 4, 6], help="num_speculative_tokens values")
    parser.add_argument("--alphas", nargs="+", type=float, default=[0.5, 0.7, 0.9])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--decode-chunk", type=int, default=8, help="K of the plain decode rounds")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--acceptance", choices=["forced", "match"], default="forced",
                        help="forced: greedy acceptance decisions drawn with probability alpha; match: drafts compared")
    parser.add_argument("--draft-model", default=None, help="a draft model's config name (random weights) or folder")
    parser.add_argument("--draft-quantization", choices=["fp8"], default=None,
                        help="the draft model's quantization (default: the target's)")
    parser.add_argument("--draft-k", type=int, default=4)
    parser.add_argument("--adaptive", action="store_true",
                        help="an arm of k = --draft-k, alpha = --draft-alpha with the engine's default speculative_max_batch")
    parser.add_argument("--draft-only", action="store_true", help="of the speculating arms, the draft model's alone")
    parser.add_argument("--draft-arms", nargs="+", default=["engine"], choices=["engine", "host"],
                        help="the draft model's arms: engine (as the engine runs it), host (its drafts read on the "
                             "host before the verify step)")
    parser.add_argument("--draft-alpha", type=float, default=0.7)
    parser.add_argument("--breakdown", action="store_true",
                        help="after each batch's arms, one diagnostic run of k = --draft-k, alpha = --draft-alpha "
                             "(and the draft model's) timing each phase of a round")
    parser.add_argument("--device", default="cuda", help="cpu: a check of the script (float32, no graphs)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/speculative.json"))
    args = parser.parse_args()

    from graphserve import LLM
    from graphserve.engine.spec import factory as spec_factory, speculative_decoder

    cuda = args.device != "cpu"
    bandwidth = copy_bandwidth()["gb_per_s"] if cuda else None
    rows = []

    def save() -> None:  # after each batch too: a run cut off by its time limit keeps what it measured
        info = run_info("speculative") if cuda else provenance("speculative")
        write_json(args.out, dict(**info, copy_bandwidth_gb_s=bandwidth, prompt_len=args.prompt_len,
                                  new_tokens=args.new_tokens, decode_chunk=args.decode_chunk, repeats=args.repeats,
                                  drafter="ForcedDrafter: the plain run's greedy continuation, each token "
                                          "corrupted with probability 1 - alpha", rows=rows))
    real_accept = speculative_decoder.accept_greedy
    for name in args.models:
        for quant in [None if q == "none" else q for q in dict.fromkeys(args.quantization)]:
            from random_models import CONFIGS, random_model_config

            path = str(random_model_config(name)) if cuda and name in CONFIGS else resolve_model(name)
            draft = args.draft_model
            if draft is not None:
                draft = str(random_model_config(draft)) if cuda and draft in CONFIGS else resolve_model(draft)
            started = time.perf_counter()
            llm = LLM(path, device=args.device, dtype="bfloat16" if cuda else "float32",
                      load_format="dummy" if cuda and name in CONFIGS else "safetensors",
                      max_num_seqs=max(512, *args.batches), decode_chunk=args.decode_chunk,
                      max_model_len=args.prompt_len + args.new_tokens + 64, max_num_batched_tokens=8192,
                      gpu_memory_utilization=args.gpu_memory_utilization, prefix_caching=False,
                      quantization=quant, speculative_method="draft" if draft else "ngram", draft_model=draft,
                      draft_quantization=args.draft_quantization if draft else None,
                      num_speculative_tokens=max(args.k + [args.draft_k]))
            core = llm.engine.core
            spec = core.speculation
            draft_drafter = spec.drafter if draft else None
            label = quant or ("bf16" if cuda else "fp32")
            draft_label = f"draft model {args.draft_model} ({args.draft_quantization or label}), forced"
            print(f"{name} {label}: engine up in {time.perf_counter() - started:.1f}s, max_model_len "
                  f"{core.max_model_len}, {core.block_manager.num_blocks} KV blocks", flush=True)
            gen = torch.Generator().manual_seed(0)
            vocab = core.worker.runner.vocab_size
            for batch in args.batches:
                prompts = torch.randint(100, min(30000, vocab), (batch, args.prompt_len), generator=gen).tolist()
                spec.max_batch = 0  # off: the plain engine
                timed_decode(llm, prompts, 16, 1)  # warm-up
                plain_s, plain_tokens = timed_decode(llm, prompts, args.new_tokens, args.repeats)
                plain = dict(model=name, quantization=label, batch=batch, k=0, alpha=None,
                             ms_per_step=plain_s * 1e3, tokens_per_s=batch / plain_s)
                rows.append(plain)
                print(f"{name:14s} {label:5s} B={batch:<3d} plain          {batch / plain_s:10.1f} tok/s", flush=True)
                continuations = {tuple(p): t for p, t in zip(prompts, plain_tokens)}
                arms = [] if args.draft_only else [(k, alpha, None, None, None) for k in args.k for alpha in args.alphas]
                if draft_drafter is not None:
                    arms += [(args.draft_k, args.draft_alpha, draft_drafter, None, variant) for variant in args.draft_arms]
                if args.adaptive:  # the engine's own choice: rounds over its default batch do not speculate
                    arms += [(args.draft_k, args.draft_alpha, None, spec_factory.default_max_batch(core.device), None)]
                for k, alpha, with_draft, max_batch, variant in arms:
                    spec.max_batch = max_batch  # None: every round speculates
                    spec.k = k
                    forced = ForcedDrafter(continuations, args.prompt_len, alpha, vocab, seed=batch * 100 + k)
                    spec.drafter = forced if with_draft is None else ForcedDraftModel(with_draft, forced,
                                                                                      on_device=variant != "host")
                    if args.acceptance == "forced":
                        speculative_decoder.accept_greedy = forced_acceptance(alpha, seed=batch * 100 + k)
                    if with_draft is not None:
                        with_draft.k = k
                    before = core.stats()
                    step_s, tokens = timed_decode(llm, prompts, args.new_tokens, args.repeats)
                    after = core.stats()
                    verify_rows = after.spec_verify_rows - before.spec_verify_rows
                    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
                    same = sum(a == b for a, b in zip(tokens, plain_tokens))
                    speculative_decoder.accept_greedy = real_accept
                    rows.append(dict(model=name, quantization=label, batch=batch, k=k, alpha=alpha,
                                     ms_per_step=step_s * 1e3, tokens_per_s=batch / step_s,
                                     speedup=plain_s / step_s, acceptance=args.acceptance,
                                     same_tokens=f"{same}/{batch}" if args.acceptance == "match" else None,
                                     mean_accepted_length=1 + accepted / verify_rows if verify_rows else None,
                                     expected_accepted_length=expected_length(alpha, k),
                                     verify_rows=verify_rows, speculative_max_batch=max_batch,
                                     drafter=f"{draft_label}, {variant}" if with_draft is not None else "forced" if max_batch is None
                                     else f"forced, adaptive (speculative_max_batch {max_batch})",
                                     draft_ms_per_propose=None if with_draft is None
                                     else spec.drafter.propose_s / max(1, spec.drafter.proposes) * 1e3))
                    r = rows[-1]
                    length = r["mean_accepted_length"] or float("nan")
                    print(f"{name:14s} {label:5s} B={batch:<3d} k={k} alpha={alpha:.1f} {r['tokens_per_s']:10.1f} "
                          f"tok/s {r['speedup']:5.2f}x  length {length:.2f} (expected "
                          f"{r['expected_accepted_length']:.2f})  same tokens {r['same_tokens'] or '(forced)'}"
                          + ("" if with_draft is None else f"  draft {r['draft_ms_per_propose']:.2f} ms a propose")
                          + ("" if max_batch is None else f"  adaptive (max batch {max_batch})"),
                          flush=True)
                spec.max_batch = None
                if args.breakdown:
                    for with_draft in [None] + ([draft_drafter] if draft_drafter is not None else []):
                        k, alpha = args.draft_k, args.draft_alpha
                        spec.k = k
                        forced = ForcedDrafter(continuations, args.prompt_len, alpha, vocab, seed=batch)
                        spec.drafter = forced if with_draft is None else ForcedDraftModel(with_draft, forced)
                        speculative_decoder.accept_greedy = forced_acceptance(alpha, seed=batch)
                        phases = phase_breakdown(llm, prompts, args.new_tokens, with_draft)
                        speculative_decoder.accept_greedy = real_accept
                        rows.append(dict(model=name, quantization=label, batch=batch, k=k, alpha=alpha,
                                         breakdown_ms=phases, drafter="forced" if with_draft is None
                                         else draft_label))
                        print(f"{name:14s} {label:5s} B={batch:<3d} k={k} alpha={alpha:.1f} "
                              f"{rows[-1]['drafter']} breakdown, ms a round:", flush=True)
                        for phase, ms in phases.items():
                            print(f"    {phase:45s} {ms:8.3f}", flush=True)
                save()
            del llm, core, spec
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()

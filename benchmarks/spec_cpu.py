"""Speculative decoding on CPU: batch-1 decode tok/s of the embedded model with n-gram speculation
off and on (k = 2 and 4), on prompts whose answer copies from the prompt and on an ordinary one.

    python benchmarks/spec_cpu.py [--max-tokens 160] [--k 2 4] [--repeats 3] [--threads N]

Greedy, the chat template, EOS honoured: every setting generates the same tokens (checked), so the
rates compare the same work. Decode tok/s = (tokens - 1) / (time of the request - time of a
max_tokens=1 request with the same prompt), the best of --repeats runs. Acceptance = accepted /
drafted draft tokens; mean accepted length = 1 + accepted / verify rows (tokens per verify pass).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from workload import provenance, write_json  # noqa: E402

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def average_price(items):
    if not items:
        return 0
    return sum(item.price for item in items) / len(items)
'''

PARAGRAPH = ("The museum opens at nine in the morning and closes at five in the afternoon. Tickets cost twelve "
             "dollars for adults and six dollars for children under twelve. Guided tours start every hour from the "
             "main hall, and the café on the second floor serves lunch until three.")

# name -> the user message; the first two answer by copying from the prompt
PROMPTS = {
    "edit_code": "Rename the function total_price to order_total in this code and show the whole code:\n\n" + CODE,
    "repeat_text": "Repeat this paragraph word for word:\n\n" + PARAGRAPH,
    "ordinary": "Write a short story about a robot who learns to paint.",
}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(llm, prompt_ids: list[int], max_tokens: int, repeats: int) -> dict:
    from graphserve import SamplingParams

    def run(n: int):
        return llm.generate([prompt_ids], SamplingParams(max_tokens=n, temperature=0))[0]

    run(8)  # warm-up
    before = llm.engine.stats()
    best, tokens = float("inf"), None
    for _ in range(repeats):
        prefill = timed(lambda: run(1))
        start = time.perf_counter()
        out = run(max_tokens)
        best = min(best, time.perf_counter() - start - prefill)
        tokens = out.token_ids
    after = llm.engine.stats()
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    rows = after.spec_verify_rows - before.spec_verify_rows
    return dict(tokens=len(tokens), decode_tok_s=(len(tokens) - 1) / best,
                acceptance=accepted / drafted if drafted else None,
                mean_accepted_length=1 + accepted / rows if rows else None, token_ids=tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4], help="num_speculative_tokens values")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-chunk", type=int, default=2, help="K of the plain decode rounds (CPU default 2)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from graphserve import LLM

    settings = [("off", {})] + [(f"ngram k={k}", dict(speculative_method="ngram", num_speculative_tokens=k))
                                for k in args.k]
    results: dict[str, dict[str, dict]] = {}
    for label, spec in settings:
        llm = LLM(device="cpu", num_threads=args.threads, decode_chunk=args.decode_chunk, max_model_len=2048,
                  prefix_caching=False, **spec)
        for name, message in PROMPTS.items():
            prompt_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": message}]))
            results.setdefault(name, {})[label] = measure(llm, prompt_ids, args.max_tokens, args.repeats)
        del llm

    print(f"{'prompt':12s}{'setting':12s}{'tokens':>8s}{'tok/s':>8s}{'speedup':>9s}{'accept':>8s}{'len':>6s}")
    for name, by_setting in results.items():
        base = by_setting["off"]
        for label, r in by_setting.items():
            if r["token_ids"] != base["token_ids"]:
                raise SystemExit(f"{name}: {label} generated other tokens than speculation off")
        for label, r in by_setting.items():
            r["speedup"] = r["decode_tok_s"] / base["decode_tok_s"]
            accept = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
            length = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
            print(f"{name:12s}{label:12s}{r['tokens']:8d}{r['decode_tok_s']:8.1f}{r['speedup']:8.2f}x"
                  f"{accept:>8s}{length:>6s}")
        for r in by_setting.values():
            del r["token_ids"]

    result = dict(**provenance("spec_cpu"), threads=args.threads, decode_chunk=args.decode_chunk,
                  max_tokens=args.max_tokens, repeats=args.repeats, model="embedded SmolLM2-135M-Instruct float32",
                  prompts=PROMPTS, results=results)
    out = Path(args.out or ROOT / f"benchmarks/results/spec_cpu-{datetime.date.today()}.json")
    write_json(out, result)


if __name__ == "__main__":
    main()

"""Grammar-constrained decoding (issue 12) through the offline engine API (no HTTP), per
model: what constrained rows cost the batch they are in, what a new grammar costs to
compile, and what the host's mask fill costs per step.

1. Mixed batch: N requests at once (default 64; prompts of 32 random token ids; the free
   ones 256 new tokens, ignore_eos), C of them (default 8, every N/C-th) constrained by a
   json_schema (SCHEMA: nested objects, an array of objects holding an array of enums,
   enums, bounded integers, a boolean, strings with maxLength). A constrained request
   ends when its JSON is complete (the grammar then allows only EOS; random weights fill
   every string to its bound: ~250 tokens) or at --constrained-max-tokens (384, a cap);
   its actual tokens are counted. Output tok/s against the same N requests unconstrained,
   in the same process: ratio = mixed / unconstrained (target >= 0.7, aim 0.9). The
   constrained requests' own tok/s; success per output is a strict JSON parse (no raw
   control characters inside strings) that validates against the schema (the jsonschema
   package where installed, and check_schema here); the lenient parse is reported
   beside it for diagnosis. Greedy, then
   the constrained rows sampled (temperature 1, seeded); the free rows stay greedy and
   their tokens are compared with the unconstrained run's (a request's output must not
   depend on its batch mates).
2. All-constrained: all N constrained, greedy against the unconstrained run, sampled
   against an unconstrained sampled run.
3. Compile cost: one request alone at max_tokens=1 (prefill + first token), submit ->
   finished: with a schema never seen (SCHEMA plus one uniquely named property), with
   the same spec again (cached), and unconstrained; and GrammarCompiler.compile alone for
   a new and a cached schema. Also, once: the first constrained request of the process
   (the compiler's start-up: xgrammar's view of the vocabulary).
4. Mask time: StructuredOutputs.bitmask(seqs) (engine/structured/matchers.py; one call per
   constrained decode round) for 1, 8 and 64 constrained rows, and 8 of a 64-row batch,
   the matchers replaying complete constrained outputs of part 1/2 (topped up with
   seeded random walks through the grammar) token by token; with the engine's
   BatchGrammarMatcher (2 threads) and 1 and 8 threads. Also the engine's own bitmask
   and accept times, measured in situ during every run of parts 1/2 (engine_structured).

Order: one repeat of parts 1/2, then 3 and 4, then the other repeats (--repeats, default
2; the best run of each scenario is reported). The JSON ({"throughput": {"ratios",
"best", "runs", "workload"}, "compile", "mask", provenance, engine config, load and
warm-up times, "skipped"}) is rewritten after every run, so a run cut short keeps what it
measured; runs and parts that would start after --time-budget seconds are skipped.

    python benchmarks/structured_bench.py --model qwen2.5-0.5b --config configs/gpu-h200.toml --out $OUT
    python benchmarks/structured_bench.py --model default --device cpu --num-requests 8 --num-constrained 2 \\
        --max-tokens 16 --repeats 1 --out /tmp/s
    python benchmarks/structured_bench.py --mask-only --model llama-3.1-8b --out /tmp/s   # tokenizer only, CPU

Engine settings as benchmarks/throughput.py: the --config file's [engine] table (default
configs/gpu-h200.toml when CUDA is there, else configs/default.toml), then the flags,
then --set KEY=VALUE. Random-weight models (benchmarks/random_models.py) write random
text, but the grammar makes the constrained output well-formed whatever the logits."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import re
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from workload import make_requests, provenance, resolve_model, vocabulary, write_json  # noqa: E402

from throughput import add_engine_flags, engine_config, stats_delta  # noqa: E402  # the same engine settings


def engine_stats(llm) -> dict:
    try:
        return dataclasses.asdict(llm.engine.stats())
    except Exception as e:  # a changed engine API must not lose the figures
        return {"error": repr(e)}


# An order record: nested objects, an array of objects holding an array of enums, enums,
# bounded integers, a boolean, strings bounded by maxLength (random weights fill every
# string to its bound: with the synthetic tokenizers, 150-260 tokens, the keys and
# punctuation mostly one byte token each).
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "maxLength": 10},
        "status": {"type": "string", "enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "tier": {"type": "string", "enum": ["free", "pro", "enterprise"]},
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 16},
                        "country": {"type": "string", "enum": ["US", "DE", "FR", "JP", "BR"]},
                    },
                    "required": ["city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "tier", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 8},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    "tags": {"type": "array", "maxItems": 2,
                             "items": {"type": "string", "enum": ["fragile", "gift", "bulk", "express"]}},
                },
                "required": ["sku", "qty", "tags"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
        "notes": {"type": "string", "maxLength": 32},
    },
    "required": ["id", "status", "priority", "customer", "items", "gift", "notes"],
    "additionalProperties": False,
}

# warms the compiler (its tokenizer info), the masked graph variants and the sampler; never measured
WARMUP_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                    "maximum": 9}},
                 "required": ["ok", "n"], "additionalProperties": False}


def new_schema(tag: str) -> dict:
    """SCHEMA with one more (required) property named after `tag`: as large, never seen."""
    schema = copy.deepcopy(SCHEMA)
    name = f"ref_{tag}"
    schema["properties"][name] = {"type": "string", "maxLength": 8}
    schema["required"].append(name)
    return schema


# ---- validation -----------------------------------------------------------------------

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def check_schema(value, schema: dict, path: str = "$") -> list[str]:
    """The errors of `value` against `schema`, for the keywords the schemas here use (type,
    enum, const, properties, required, additionalProperties, items, min/maxItems,
    min/maxLength, minimum/maximum, pattern). Used where no jsonschema package is there."""
    errors = []
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        ok = False
        for k in kinds:
            if k == "integer":
                ok |= isinstance(value, int) and not isinstance(value, bool)
            elif k == "number":
                ok |= isinstance(value, (int, float)) and not isinstance(value, bool)
            elif k in _TYPES:
                ok |= isinstance(value, _TYPES[k]) and not (k != "boolean" and isinstance(value, bool))
        if not ok:
            return [f"{path}: {type(value).__name__} is not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in enum")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: {value!r} != const")
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", len(value)):
            errors.append(f"{path}: length {len(value)} > maxLength {schema['maxLength']}")
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: length {len(value)} < minLength {schema['minLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: does not match {schema['pattern']!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > maximum {schema['maximum']}")
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{path}: {len(value)} items > maxItems {schema['maxItems']}")
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: {len(value)} items < minItems {schema['minItems']}")
        if isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                errors += check_schema(item, schema["items"], f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{path}: missing {name!r}")
        for name, item in value.items():
            if name in props:
                errors += check_schema(item, props[name], f"{path}.{name}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unexpected property {name!r}")
    return errors


def make_validator():
    """(name, fn(value, schema) -> list of errors): the jsonschema package where installed,
    else jsonschema_rs, else check_schema above."""
    try:
        import jsonschema

        def validate(value, schema):
            return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(value)]

        from importlib.metadata import version

        return f"jsonschema {version('jsonschema')}", validate
    except ImportError:
        pass
    try:
        import jsonschema_rs

        def validate(value, schema):
            return [str(e) for e in jsonschema_rs.validator_for(schema).iter_errors(value)]

        return "jsonschema_rs", validate
    except ImportError:
        pass
    return "check_schema (structured_bench.py, the keywords its schemas use)", check_schema


_CONTROL = re.compile(r"[\x00-\x1f]")


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)


def check_outputs(texts: list[str], schema: dict, validate) -> dict:
    """How many of `texts` succeed: parse as strict JSON (json.loads: no raw control
    characters in strings, as pydantic and the OpenAI SDK's parse) and validate against
    `schema` (by the validator package and by check_schema). For diagnosis also the lenient
    parse (json.loads(strict=False)) and the outputs with raw control characters (U+0000-001F)
    inside strings."""
    strict = lenient = valid = valid_builtin = control = 0
    failures = []
    for text in texts:
        try:
            value, is_strict = json.loads(text), True
            strict += 1
        except ValueError as exc:
            try:
                value, is_strict = json.loads(text, strict=False), False
            except ValueError:
                failures.append({"text": text[:300], "error": f"json: {exc}"})
                continue
            failures.append({"text": text[:300], "error": f"strict json: {exc}"})
        lenient += 1
        if any(_CONTROL.search(x) for x in _strings(value)):
            control += 1
        errors = validate(value, schema)
        own = check_schema(value, schema)
        valid += is_strict and not errors
        valid_builtin += is_strict and not own
        if errors or own:
            failures.append({"text": text[:300], "errors": (errors or own)[:3]})
    return dict(count=len(texts), parse_json=strict, parse_json_lenient=lenient, with_raw_control_chars=control,
                valid=valid, valid_check_schema=valid_builtin,
                all_valid=bool(texts) and strict == valid == valid_builtin == len(texts), failures=failures[:4])


# ---- timing helpers -------------------------------------------------------------------


def summary(values: list[float], scale: float = 1.0) -> dict:
    if not values:
        return {"n": 0}
    xs = sorted(v * scale for v in values)

    def pct(p):
        return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]

    return dict(n=len(xs), mean=statistics.fmean(xs), p50=pct(0.5), p90=pct(0.9), p99=pct(0.99), max=xs[-1],
                total=sum(xs))


class EngineProbe:
    """Wraps the core's StructuredOutputs.bitmask, .advance and .accept (instance attributes,
    so the runner and the graph decoder, which hold the same object, call the wrappers) to
    time them in situ. bitmask: a prefill's (or an eager round's) masks; advance: one step of
    a round, on the mask feed's worker thread (accept the tokens just sampled, fill the next masks)."""

    def __init__(self, structured):
        self.structured = structured
        self.mask_calls: list[tuple[float, int, int]] = []  # (seconds, constrained rows, batch rows)
        self.accept_s = 0.0
        self.accept_calls = 0
        self.advance_calls: list[tuple[float, int]] = []  # (seconds, rows)
        bitmask, accept, advance = structured.bitmask, structured.accept, structured.advance

        def timed_advance(seqs, rows, tokens, out):
            t = time.perf_counter()
            advance(seqs, rows, tokens, out)
            self.advance_calls.append((time.perf_counter() - t, len(rows)))

        def timed_bitmask(seqs):
            t = time.perf_counter()
            out = bitmask(seqs)
            if out is not None:
                rows = sum(1 for s in seqs if s.request_id in structured.matchers)
                self.mask_calls.append((time.perf_counter() - t, rows, len(seqs)))
            return out

        def timed_accept(request_id, token):
            t = time.perf_counter()
            out = accept(request_id, token)
            if request_id in structured.matchers:
                self.accept_s += time.perf_counter() - t
                self.accept_calls += 1
            return out

        structured.bitmask, structured.accept, structured.advance = timed_bitmask, timed_accept, timed_advance

    def reset(self) -> None:
        self.mask_calls, self.accept_s, self.accept_calls, self.advance_calls = [], 0.0, 0, []

    def report(self) -> dict:
        times = [t for t, _, _ in self.mask_calls]
        rows = sum(r for _, r, _ in self.mask_calls)
        return dict(bitmask_calls=len(times), bitmask_ms=summary(times, 1e3),
                    bitmask_us_per_row=1e6 * sum(times) / rows if rows else None,
                    constrained_rows_mean=rows / len(times) if times else None,
                    advance_calls=len(self.advance_calls),
                    advance_ms=summary([t for t, _ in self.advance_calls], 1e3),
                    advance_us_per_row=(1e6 * sum(t for t, _ in self.advance_calls)
                                        / max(1, sum(r for _, r in self.advance_calls))) if self.advance_calls else None,
                    accept_calls=self.accept_calls,
                    accept_us_per_token=1e6 * self.accept_s / self.accept_calls if self.accept_calls else None)


def sync() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception:
        pass


# ---- running a set of requests --------------------------------------------------------


@dataclasses.dataclass
class Spec:
    prompt: list[int]
    params: object  # SamplingParams
    constrained: bool


def run_set(llm, specs: list[Spec], tag: str, timeout: float) -> dict:
    """Submit all, step until all finish (or the timeout): per request its tokens, text,
    finish reason, first-token and end times (from the submission of the first)."""
    engine = llm.engine
    ids = [f"{tag}-{i}" for i in range(len(specs))]
    index = {rid: i for i, rid in enumerate(ids)}
    tokens: list[list[int]] = [[] for _ in specs]
    texts = [""] * len(specs)
    reasons: list[str | None] = [None] * len(specs)
    first = [None] * len(specs)
    done = [None] * len(specs)
    start = time.perf_counter()
    for rid, spec in zip(ids, specs):
        engine.add_request(rid, spec.prompt, spec.params)
    left = len(specs)
    timed_out = False
    while left:
        for out in engine.step():
            i = index.get(out.request_id)
            if i is None:
                continue
            now = time.perf_counter() - start
            if out.token_ids and first[i] is None:
                first[i] = now
            tokens[i] += out.token_ids
            texts[i] += out.text
            if out.finished and done[i] is None:
                reasons[i], done[i] = out.finish_reason, now
                left -= 1
        if time.perf_counter() - start > timeout:
            timed_out = True
            for i, rid in enumerate(ids):
                if done[i] is None:
                    engine.abort(rid)
            break
    sync()
    elapsed = time.perf_counter() - start
    return dict(elapsed=elapsed, tokens=tokens, texts=texts, reasons=reasons, first=first, done=done,
                timed_out=timed_out)


def scenario_report(llm, probe: EngineProbe, specs: list[Spec], tag: str, timeout: float, validate,
                    schema: dict, baseline: dict | None = None) -> tuple[dict, dict]:
    """Run `specs` and summarize: (report, the raw run)."""
    before = engine_stats(llm)
    probe.reset()
    raw = run_set(llm, specs, tag, timeout)
    after = engine_stats(llm)
    elapsed = raw["elapsed"]
    n_tokens = [len(t) for t in raw["tokens"]]
    con = [i for i, s in enumerate(specs) if s.constrained]
    free = [i for i, s in enumerate(specs) if not s.constrained]
    reasons: dict[str, int] = {}
    for r in raw["reasons"]:
        reasons[str(r)] = reasons.get(str(r), 0) + 1
    rep = dict(requests=len(specs), constrained=len(con), elapsed_s=elapsed, timed_out=raw["timed_out"],
               output_tokens=sum(n_tokens), output_tok_s=sum(n_tokens) / elapsed, finish_reasons=reasons)
    if free:
        end = max(raw["done"][i] or elapsed for i in free)
        rep["free"] = dict(tokens=sum(n_tokens[i] for i in free), last_done_s=end,
                           tok_s=sum(n_tokens[i] for i in free) / end)
    if con:
        end = max(raw["done"][i] or elapsed for i in con)
        c_tokens = [n_tokens[i] for i in con]
        per_req = [n_tokens[i] / (raw["done"][i] - raw["first"][i]) for i in con
                   if raw["done"][i] is not None and raw["first"][i] is not None
                   and raw["done"][i] > raw["first"][i] and n_tokens[i] > 1]
        c_reasons: dict[str, int] = {}
        for i in con:
            c_reasons[str(raw["reasons"][i])] = c_reasons.get(str(raw["reasons"][i]), 0) + 1
        rep["constrained_requests"] = dict(
            tokens=sum(c_tokens), tokens_per_request=summary(c_tokens), last_done_s=end,
            tok_s=sum(c_tokens) / end, per_request_decode_tok_s=summary(per_req),
            first_token_s=summary([raw["first"][i] for i in con if raw["first"][i] is not None]),
            finish_reasons=c_reasons,
            json=check_outputs([raw["texts"][i] for i in con], schema, validate),
            example=raw["texts"][con[0]][:400])
    if baseline is not None and free:
        same = sum(1 for i in free if raw["tokens"][i] == baseline["tokens"][i])
        rep["free_tokens_equal_unconstrained_run"] = f"{same}/{len(free)}"
    stats = stats_delta(before, after) if "error" not in after else after
    rep["engine_stats"] = {k: stats.get(k) for k in ("decode_rounds", "decode_rounds_ahead", "prefill_steps",
                                                     "generation_tokens", "graph_replays", "eager_rounds",
                                                     "num_preemptions", "device_busy_seconds",
                                                     "device_idle_seconds") if k in stats}
    rounds = stats.get("decode_rounds")
    if rounds:
        rep["ms_per_decode_round"] = 1e3 * elapsed / rounds
    if max(n_tokens, default=0):  # all start together: the longest request's tokens ~ the decode steps
        rep["ms_per_step"] = 1e3 * elapsed / max(n_tokens)
    rep["engine_structured"] = probe.report()
    return rep, raw


# ---- the parts ------------------------------------------------------------------------


class Throughput:
    """Parts 1 and 2: the scenarios, run once per repeat (`run`); `summarize` gives the
    best run of each, the ratios and every run; `save(summary)` after every run."""

    def __init__(self, llm, probe, args, prompts, validate, log, skipped, save):
        from graphserve import SamplingParams
        from graphserve.engine.structured.grammar import GrammarSpec

        self.llm, self.probe, self.args, self.validate, self.log = llm, probe, args, validate, log
        self.skipped, self.save = skipped, save
        spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
        n, c = args.num_requests, min(args.num_constrained, args.num_requests)
        self.n, self.c = n, c
        # the constrained rows spread over the batch (every n/c-th), as they would arrive
        self.con_rows = set(range(0, n, max(1, n // c))[:c]) if c else set()

        def free(i, sampled=False):
            return Spec(prompts[i], SamplingParams(max_tokens=args.max_tokens, temperature=1.0 if sampled else 0.0,
                                                   seed=1000 + i if sampled else None, ignore_eos=True), False)

        def constrained(i, sampled=False):
            return Spec(prompts[i], SamplingParams(max_tokens=args.constrained_max_tokens,
                                                   temperature=1.0 if sampled else 0.0,
                                                   seed=2000 + i if sampled else None, grammar=spec), True)

        rows = self.con_rows
        self.scenarios = [
            ("unconstrained", [free(i) for i in range(n)], None),
            ("mixed", [constrained(i) if i in rows else free(i) for i in range(n)], "unconstrained"),
            ("mixed_sampled", [constrained(i, True) if i in rows else free(i) for i in range(n)], "unconstrained"),
            ("all_constrained", [constrained(i) for i in range(n)], None),
            ("unconstrained_sampled", [free(i, True) for i in range(n)], None),
            ("all_constrained_sampled", [constrained(i, True) for i in range(n)], None),
        ]
        if not args.sampled:
            self.scenarios = [sc for sc in self.scenarios if "sampled" not in sc[0]]
        self.runs: dict[str, list[dict]] = {}
        self.raws: dict[str, dict] = {}  # the first run of each scenario: its tokens and texts

    def run(self, rep_i: int, deadline: float) -> None:
        for name, specs, base in self.scenarios:
            if time.perf_counter() > deadline:
                self.skipped.append(f"{name} (repeat {rep_i + 1})")
                continue
            report, raw = scenario_report(self.llm, self.probe, specs, f"{name}-{rep_i}", self.args.timeout,
                                          self.validate, SCHEMA, self.raws.get(base) if base else None)
            self.runs.setdefault(name, []).append(report)
            self.raws.setdefault(name, raw)
            cr = report.get("constrained_requests")
            self.log(f"  {name:24s} {report['elapsed_s']:6.2f}s {report['output_tokens']:6d} tok "
                     f"{report['output_tok_s']:9,.0f} tok/s"
                     + (f" | constrained {cr['tokens']} tok {cr['tok_s']:,.0f} tok/s {cr['finish_reasons']}, json "
                        f"{cr['json']['parse_json']}/{cr['json']['count']} (lenient "
                        f"{cr['json']['parse_json_lenient']}), valid {cr['json']['valid']}" if cr else "")
                     + (f" | free same as unconstrained {report['free_tokens_equal_unconstrained_run']}"
                        if "free_tokens_equal_unconstrained_run" in report else "")
                     + f" | mask {report['engine_structured']['bitmask_ms'].get('mean', 0):.3f} ms/round")
            self.save(self.summarize())

    def summarize(self) -> dict:
        best = {name: max(reps, key=lambda r: r["output_tok_s"]) for name, reps in self.runs.items()}

        def ratio(a, b):
            return best[a]["output_tok_s"] / best[b]["output_tok_s"] if a in best and b in best else None

        ratios = dict(mixed_vs_unconstrained=ratio("mixed", "unconstrained"),
                      mixed_sampled_vs_unconstrained=ratio("mixed_sampled", "unconstrained"),
                      all_constrained_vs_unconstrained=ratio("all_constrained", "unconstrained"),
                      all_constrained_sampled_vs_unconstrained_sampled=ratio("all_constrained_sampled",
                                                                             "unconstrained_sampled"))
        if "mixed" in best and "unconstrained" in best:
            ratios["mixed_free_rows_tok_s_vs_unconstrained"] = (best["mixed"]["free"]["tok_s"]
                                                                / best["unconstrained"]["output_tok_s"])
        mixed = ratios["mixed_vs_unconstrained"]
        ratios["target"] = "mixed_vs_unconstrained >= 0.7 (aim 0.9)"
        ratios["mixed_meets_0_7"] = mixed >= 0.7 if mixed is not None else None
        args = self.args
        workload = dict(num_requests=self.n, num_constrained=self.c, constrained_rows=sorted(self.con_rows),
                        prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                        constrained_max_tokens=args.constrained_max_tokens, repeats=args.repeats,
                        free="ignore_eos, greedy (sampled runs: temperature 1, seeded)",
                        constrained="json_schema, ends with its JSON (EOS), greedy or temperature 1 seeded",
                        schema=SCHEMA)
        return dict(workload=workload, ratios=ratios, best=best, runs=self.runs)

    def constrained_outputs(self) -> list[list[int]]:
        """The complete constrained outputs (greedy), for part 4 to replay."""
        return [raw["tokens"][i] for name in ("all_constrained", "mixed") if (raw := self.raws.get(name))
                for i in range(len(raw["tokens"]))
                if raw["reasons"][i] == "stop" and (name == "all_constrained" or i in self.con_rows)]

    def timed_out(self) -> bool:
        return any(r["timed_out"] for reps in self.runs.values() for r in reps)


def single_latency(llm, prompt, params, tag) -> dict:
    raw = run_set(llm, [Spec(prompt, params, False)], tag, 60.0)
    return dict(latency_s=raw["done"][0] if raw["done"][0] is not None else raw["elapsed"],
                first_token_s=raw["first"][0], reason=raw["reasons"][0], tokens=len(raw["tokens"][0]))


def compile_part(llm, args, prompt_pool, log) -> dict:
    from graphserve import SamplingParams
    from graphserve.engine.structured.grammar import GrammarSpec

    compiler = llm.engine.core.structured.compiler
    trials = args.compile_trials
    pick = iter(prompt_pool)
    run_tag = f"{os.getpid()}-{int(time.time())}"
    rows: dict[str, list[dict]] = {"unconstrained": [], "new_schema": [], "cached_schema": []}
    for t in range(trials):
        rows["unconstrained"].append(single_latency(llm, next(pick), SamplingParams(max_tokens=1, temperature=0),
                                                    f"cu{t}"))
        spec = GrammarSpec("json_schema", json.dumps(new_schema(f"{run_tag}_{t}")))
        rows["new_schema"].append(single_latency(llm, next(pick), SamplingParams(max_tokens=1, temperature=0,
                                                                                 grammar=spec), f"cn{t}"))
        rows["cached_schema"].append(single_latency(llm, next(pick), SamplingParams(max_tokens=1, temperature=0,
                                                                                    grammar=spec), f"cc{t}"))
    # the compiler alone: a never-seen schema, then the same again
    direct_new, direct_cached = [], []
    for t in range(trials):
        spec = GrammarSpec("json_schema", json.dumps(new_schema(f"{run_tag}_direct_{t}")))
        s = time.perf_counter()
        compiler.compile(spec)
        direct_new.append(time.perf_counter() - s)
        s = time.perf_counter()
        compiler.compile(spec)
        direct_cached.append(time.perf_counter() - s)
    out = {name: dict(latency_ms=summary([r["latency_s"] for r in rs], 1e3),
                      first_token_ms=summary([r["first_token_s"] for r in rs if r["first_token_s"] is not None], 1e3),
                      finish_reasons=sorted({str(r["reason"]) for r in rs}))
           for name, rs in rows.items()}
    out["compiler_new_ms"] = summary(direct_new, 1e3)
    out["compiler_cached_ms"] = summary(direct_cached, 1e3)
    med = {k: out[k]["latency_ms"]["p50"] for k in rows}
    out["new_minus_cached_ms_p50"] = med["new_schema"] - med["cached_schema"]
    out["cached_minus_unconstrained_ms_p50"] = med["cached_schema"] - med["unconstrained"]
    out["what"] = ("one request alone, 32-token prompt, max_tokens=1 (prefill + first token): submit -> finished; "
                   "new_schema: the order schema plus one uniquely named property, never seen; cached_schema: "
                   "the same spec again. compiler_*: GrammarCompiler.compile alone")
    log(f"  request latency p50 ms: unconstrained {med['unconstrained']:.1f}, new schema {med['new_schema']:.1f}, "
        f"cached schema {med['cached_schema']:.1f}; compiler alone p50 ms: new {out['compiler_new_ms']['p50']:.1f}, "
        f"cached {out['compiler_cached_ms']['p50']:.2f}")
    return out


def mask_part(compiler, outputs: list[list[int]], rows_list: list[int], steps: int, thread_counts: list[int],
              gap_ms: float, log) -> dict:
    """StructuredOutputs.bitmask for B constrained rows (matchers replaying `outputs`
    round-robin, one token per step), per thread count of the BatchGrammarMatcher; back
    to back, and with `gap_ms` of busy host time between calls (as the core thread spends
    waiting for the device's step, so the matcher's worker threads have gone idle)."""
    import xgrammar as xgr

    from graphserve.engine.structured.grammar import GrammarSpec
    from graphserve.engine.structured.matchers import StructuredOutputs

    compiled = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    result: dict = dict(what="ms per StructuredOutputs.bitmask(seqs) call (one per constrained decode round), "
                             "matchers replaying constrained outputs token by token (accept not timed); "
                             "'8_of_64': 8 constrained rows in a 64-row batch; N@Tthreads: BatchGrammarMatcher "
                             "max_threads T (the engine's is 2; a single row never uses it); '+gap': "
                             f"{gap_ms:g} ms of busy host time between calls, as between decode rounds",
                        outputs_replayed=len(outputs), output_tokens=summary([len(o) for o in outputs]),
                        vocab_words=-(-compiler.vocab_size // 32), cases={})
    if not outputs:
        result["error"] = "no complete constrained output to replay"
        return result
    cases = [(str(b), b, b) for b in rows_list]
    if 64 in rows_list and 8 in rows_list:
        cases.append(("8_of_64", 8, 64))
    for gap in ([0.0, gap_ms / 1e3] if gap_ms > 0 else [0.0]):
        for threads in thread_counts:
            for name, n_con, n_rows in cases:
                if n_con == 1 and threads != thread_counts[0]:
                    continue  # one row: fill_next_token_bitmask directly, no threads
                so = StructuredOutputs(compiler, max_rows=n_rows)
                if threads != 2:  # the engine's own BatchGrammarMatcher has max_threads=2
                    so._batch_matcher = xgr.BatchGrammarMatcher(max_threads=threads)
                seqs = [types.SimpleNamespace(request_id=f"m{i}") for i in range(n_rows)]
                con_idx = list(range(0, n_rows, n_rows // n_con))[:n_con]
                replay = {}
                for k, i in enumerate(con_idx):
                    so.matchers[seqs[i].request_id] = xgr.GrammarMatcher(compiled)
                    replay[seqs[i].request_id] = outputs[k % len(outputs)]
                times, live = [], []
                for step in range(steps):
                    alive = [rid for rid, toks in replay.items() if step < len(toks)]
                    if not alive:
                        break
                    for rid in list(so.matchers):
                        if rid not in alive:
                            so.release(rid)
                    if gap:
                        until = time.perf_counter() + gap
                        while time.perf_counter() < until:
                            pass
                    t = time.perf_counter()
                    so.bitmask(seqs)
                    times.append(time.perf_counter() - t)
                    live.append(len(alive))
                    for rid in alive:
                        so.matchers[rid].accept_token(replay[rid][step])
                key = f"{name}@{threads}threads" + ("+gap" if gap else "")
                s = summary(times, 1e3)
                s["constrained_rows_mean"] = statistics.fmean(live) if live else 0
                s["us_per_row"] = 1e3 * s["total"] / sum(live) if live else None
                result["cases"][key] = s
                log(f"  bitmask {key:22s}: {s.get('mean', 0):.3f} ms/call mean, p50 {s.get('p50', 0):.3f}, "
                    f"p99 {s.get('p99', 0):.3f} ms, {s['us_per_row'] or 0:.1f} us/row over {s['n']} steps")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b",
                        help="a random_models config (qwen2.5-0.5b, llama-3.1-8b), 'default' (the embedded model) "
                             "or a model folder")
    parser.add_argument("--config", default=None, help="engine settings file (a path or a name in configs/)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-constrained", type=int, default=8, help="of them, in the mixed batch")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256, help="of the free requests (ignore_eos)")
    parser.add_argument("--constrained-max-tokens", type=int, default=384,
                        help="of the constrained ones, a cap: they end with their JSON (150-260 tokens with random "
                             "weights); one cut by it is counted as finish 'length' and fails the JSON check")
    parser.add_argument("--repeats", type=int, default=2, help="of each throughput scenario (best one reported)")
    parser.add_argument("--no-sampled", dest="sampled", action="store_false",
                        help="skip the sampled variants (temperature 1, seeded)")
    parser.add_argument("--compile-trials", type=int, default=5)
    parser.add_argument("--mask-rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--mask-steps", type=int, default=200, help="at most, per mask case")
    parser.add_argument("--mask-gap-ms", type=float, default=2.0,
                        help="busy host time between bitmask calls in the '+gap' cases (0: none)")
    parser.add_argument("--mask-threads", type=int, nargs="+", default=None,
                        help="BatchGrammarMatcher threads to try (default: 2, the engine's, and 1, 8 where the "
                             "machine has the cores)")
    parser.add_argument("--mask-only", action="store_true",
                        help="only the mask part, on CPU, with the model's tokenizer and no weights; the outputs "
                             "to replay come from a fixed seeded random walk through the grammar")
    parser.add_argument("--seed", type=int, default=0, help="of the prompts")
    parser.add_argument("--timeout", type=float, default=120.0, help="per throughput scenario")
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="skip parts that would start after this many seconds (0: no limit)")
    add_engine_flags(parser)
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="the scenarios reuse one prompt set: by default later ones hit the prefix cache")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any EngineConfig field")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for the JSON")
    parser.add_argument("--name", default=None, help="JSON file name (default structured-MODEL.json)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    deadline = t0 + args.time_budget if args.time_budget > 0 else float("inf")
    cpus = os.cpu_count() or 1
    threads = args.mask_threads or sorted({2, 1} | ({8} if cpus >= 8 else set()))

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    label = args.model if args.model not in (None, "", "default") else "default"
    name = args.name or f"structured-{Path(label).name}.json"
    validator_name, validate = make_validator()
    report = dict(**provenance("structured_bench"), model=args.model, validator=validator_name, skipped=[])

    if args.mask_only:
        return mask_only(args, report, threads, log, name)

    model = resolve_model(args.model)
    config_path, config = engine_config(args, model)
    vocab_size, specials = vocabulary(model)
    n_prompts = args.num_requests + 3 * args.compile_trials + 8
    prompts = [r.prompt for r in make_requests(n_prompts, args.prompt_len, args.prompt_len, vocab_size, specials,
                                               args.seed)]
    report.update(model_path=str(model) if model else None, config_file=str(config_path),
                  engine_config=dataclasses.asdict(config))
    log(f"{args.model}: engine {config}")

    from graphserve import LLM, SamplingParams
    from graphserve.engine.structured.grammar import GrammarSpec

    started = time.perf_counter()
    llm = LLM(**dataclasses.asdict(config))
    report["engine_load_s"] = time.perf_counter() - started
    core = llm.engine.core
    graphs = getattr(core, "graphs", None)
    report["graph_capture_s"] = getattr(graphs, "capture_seconds", None)
    log(f"engine loaded in {report['engine_load_s']:.1f}s (graph capture {report['graph_capture_s']})")
    probe = EngineProbe(core.structured)
    out_path = Path(args.out) / name

    # warm-up (not measured): prefill/decode paths, the compiler's tokenizer info, the
    # masked graph variants, the sampler, and SCHEMA compiled once (the throughput runs
    # measure decoding, not compilation; part 3 measures that)
    warm_pool = prompts[args.num_requests:]
    t = time.perf_counter()
    llm.generate(warm_pool[:4], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    report["warmup_unconstrained_s"] = time.perf_counter() - t
    t = time.perf_counter()
    first = llm.generate(warm_pool[4], SamplingParams(max_tokens=1, temperature=0,
                                                      grammar=GrammarSpec("json_schema", json.dumps(WARMUP_SCHEMA))))
    report["first_grammar_ever_s"] = time.perf_counter() - t  # includes xgrammar's tokenizer info
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    llm.generate(warm_pool[5:8], [SamplingParams(max_tokens=24, temperature=0, grammar=grammar),
                                  SamplingParams(max_tokens=24, temperature=1.0, seed=7, grammar=grammar),
                                  SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)])
    report["warmup_s"] = time.perf_counter() - started - report["engine_load_s"]
    log(f"warm-up {report['warmup_s']:.1f}s; first grammar-constrained request ever (compiler start-up "
        f"included) {1e3 * report['first_grammar_ever_s']:.0f} ms, finish {first[0].finish_reason}")

    # 1 + 2: throughput, first repeat; then 3 and 4 (cheap), then the other repeats
    def save(part):
        report["throughput"] = part
        write_json(out_path, report)

    tp = Throughput(llm, probe, args, prompts[:args.num_requests], validate, log, report["skipped"], save)
    log("throughput (mixed, all-constrained, against unconstrained), repeat 1:")
    tp.run(0, deadline)

    # 3: compile cost
    if time.perf_counter() < deadline:
        log("compile cost:")
        report["compile"] = compile_part(llm, args, prompts[args.num_requests + 8:], log)
        write_json(out_path, report)
    else:
        report["skipped"].append("compile")

    # 4: mask time, the host's CPU, matchers replaying the constrained outputs above
    if time.perf_counter() < deadline:
        log(f"mask fill ({cpus} CPUs):")
        distinct = [list(t) for t in dict.fromkeys(tuple(o) for o in tp.constrained_outputs())][:16]
        walks = random_walks(core.structured.compiler, 16 - len(distinct), args.seed) if len(distinct) < 16 else []
        report["mask"] = mask_part(core.structured.compiler, distinct + walks, args.mask_rows, args.mask_steps,
                                   threads, args.mask_gap_ms, log)
        report["mask"]["replayed"] = (f"{len(distinct)} distinct complete constrained outputs of the runs above, "
                                      f"{len(walks)} seeded random walks through the grammar")
        write_json(out_path, report)
    else:
        report["skipped"].append("mask")

    for rep_i in range(1, args.repeats):
        log(f"throughput, repeat {rep_i + 1}:")
        tp.run(rep_i, deadline)
    report["throughput"] = tp.summarize()
    r = report["throughput"]["ratios"]
    log(f"ratios (best of {args.repeats}): mixed/unconstrained {fmt(r['mixed_vs_unconstrained'])}, mixed sampled "
        f"{fmt(r['mixed_sampled_vs_unconstrained'])}, all-constrained {fmt(r['all_constrained_vs_unconstrained'])}, "
        f"all-constrained sampled/unconstrained sampled {fmt(r['all_constrained_sampled_vs_unconstrained_sampled'])}")
    report["total_s"] = time.perf_counter() - t0
    write_json(out_path, report)
    return 1 if tp.timed_out() else 0


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def random_walks(compiler, n: int, seed: int, max_len: int = 2000) -> list[list[int]]:
    """`n` token sequences the grammar accepts, to its end: at each step a seeded random
    allowed token (as a random-weight model's sampling would pick)."""
    import random

    import numpy as np
    import xgrammar as xgr

    from graphserve.engine.structured.grammar import GrammarSpec

    compiled = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    rng = random.Random(seed)
    mask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
    walks = []
    for _ in range(n):
        m = xgr.GrammarMatcher(compiled)
        toks = []
        while not m.is_terminated() and len(toks) < max_len:
            m.fill_next_token_bitmask(mask)
            bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:compiler.vocab_size]
            allowed = np.flatnonzero(bits)
            tok = int(allowed[rng.randrange(len(allowed))])
            if not m.accept_token(tok):
                raise RuntimeError(f"the matcher rejected token {tok}, which its own mask allowed")
            toks.append(tok)
        walks.append(toks)
    return walks


def mask_only(args, report, threads, log, name) -> int:
    """Part 4 alone: the model's tokenizer, no weights, no device. One torch thread, as
    the engine core sets when it drives a GPU (torch's own threads would fill the mask)."""
    import torch

    torch.set_num_threads(1)
    from graphserve.engine.structured.grammar import GrammarCompiler

    model = args.model
    if model in (None, "", "default"):
        from graphserve.engine.model_files.default_model import ensure_default_model

        folder = Path(ensure_default_model())
    else:
        from random_models import CONFIGS, models_root, write_tokenizer

        folder = models_root() / model if model in CONFIGS else Path(model)
        if model in CONFIGS and not (folder / "tokenizer.json").is_file():
            write_tokenizer(folder, model)
    cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else None
    if cfg is None:
        from random_models import CONFIGS

        cfg = CONFIGS[model]
    eos = cfg.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos]
    compiler = GrammarCompiler(folder, cfg["vocab_size"], eos)
    walks = random_walks(compiler, 16, args.seed)
    log(f"{len(walks)} random walks through the schema: {summary([len(w) for w in walks])}")
    report["mask"] = mask_part(compiler, walks, args.mask_rows, args.mask_steps, threads, args.mask_gap_ms, log)
    report["mask"]["replayed"] = "seeded random walks through the grammar (uniform over allowed tokens)"
    write_json(Path(args.out) / name.replace("structured-", "structured-mask-"), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

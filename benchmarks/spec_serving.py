"""Speculative decoding through the server (issue 40): the same input-grounded chat prompts
(benchmarks/data/input_grounded_prompts.json: repeat, quote, correct, reformat, rename in code, convert
to a list/table/JSON, extract sentences, change case of a passage in the prompt) served with n-gram
speculation off and on, at 1 and 8 streams; TPOT, output tok/s, acceptance, and the outputs compared.

    python benchmarks/spec_serving.py --out benchmarks/results/spec_serving
    python benchmarks/spec_serving.py --streams 1 --max-tokens 32 --limit 4 --out /tmp/spec   # a smoke run

Arguments this script does not know (and everything after `--`) are passed to `graphserve serve` in
both runs (e.g. --device cpu, --model PATH; left out: the embedded SmolLM2-135M-Instruct, the
default config).

Runs: the server is launched (tests/live_server.py's ServerProcess, as benchmarks/serving.py does)
with speculation off, then again with `--speculative-method ngram --num-speculative-tokens K` (--k),
the other flags the same. In each, after two unmeasured warm-up requests (another prompt), every
prompt goes once through `POST /v1/chat/completions` (stream, stream_options.include_usage,
return_token_ids, temperature 0, max_tokens = --max-tokens, EOS honoured) at each --streams C: a
closed loop of C streams spread over min(P, C) client processes (P = --client-procs), each stream
sending its next prompt when the previous one ends. The C = 1 level comes first, so later levels
find the prompts in the prefix cache: compare TTFT only between off and on at the same C.

Figures per level (speculation off / on x C):
- TTFT: request sent -> the first SSE event carrying generated tokens;
- TPOT per request: (time of the last event carrying tokens - time of the first) / (tokens - 1),
  tokens = usage.completion_tokens; mean and p50 over the requests;
- output tok/s: sum of completion tokens / level wall time (first request sent to last ended);
- from /metrics, deltas over the level: graphserve_spec_draft_tokens, _spec_accepted_tokens,
  _spec_verify_rows; acceptance = accepted / drafted, mean accepted length = 1 + accepted / verify rows.
Outputs: per C, each prompt's token ids with speculation on must equal those with it off (greedy);
a mismatch is an error (listed in the JSON under mismatches, printed, exit code 1). Off at C > 1
against off at C = 1 is recorded too (batch_mismatches, not an error): a batch may round differently
from batch 1 without any speculation, which tells a batching difference from a speculation one.
Writes spec_serving.json (--name) and the two server logs to --out."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
for _p in (str(ROOT), str(BENCH), str(ROOT / "tests")):  # tests/: live_server
    if _p not in sys.path:
        sys.path.insert(0, _p)
from serving import client_process, percentile, scrape, server_processes  # noqa: E402
from sse_client import EventStream  # noqa: E402
from workload import provenance, write_json  # noqa: E402

PROMPTS = BENCH / "data" / "input_grounded_prompts.json"
SPEC_COUNTERS = ("graphserve_spec_draft_tokens", "graphserve_spec_accepted_tokens", "graphserve_spec_verify_rows",
                 "graphserve_generation_tokens", "graphserve_decode_rounds", "graphserve_prefix_cache_hits")


def load_prompts(path: Path) -> list[dict]:
    """[{"name", "messages"}] from the data file; an entry may also be a plain user message (str)."""
    out = []
    for i, entry in enumerate(json.loads(path.read_text())):
        if isinstance(entry, str):
            entry = {"name": f"prompt{i}", "messages": [{"role": "user", "content": entry}]}
        out.append(entry)
    return out


# ---- one client process --------------------------------------------------------------------------------------

async def _one_request(http: httpx.AsyncClient, body: dict, rec: dict) -> None:
    """Stream one chat completion; fill `rec` (text, token_ids, ttft, tpot, latency, tokens, events,
    finish_reason, error)."""
    perf = time.perf_counter
    start = perf()
    first = last = None
    text, ids = [], []
    tokens = events = 0
    finish = None
    stream = EventStream(http, "/v1/chat/completions", body)
    async for now, payload in stream.events():
        for choice in payload.get("choices") or ():
            content = (choice.get("delta") or {}).get("content") or ""
            new_ids = choice.get("token_ids") or []
            text.append(content)
            ids.extend(new_ids)
            if new_ids or content:  # an event carrying generated tokens
                events += 1
                first = now if first is None else first
                last = now
            finish = choice.get("finish_reason") or finish
        usage = payload.get("usage")
        if usage:
            tokens = usage.get("completion_tokens", 0)
    end = perf()
    rec.update(text="".join(text), token_ids=ids, ttft=(first - start) if first is not None else None,
               latency=end - start, tokens=tokens, events=events, finish_reason=finish, error=stream.error,
               tpot=(last - first) / (tokens - 1) if first is not None and tokens > 1 else None)


async def _client_async(job: dict, conn) -> None:
    limits = httpx.Limits(max_connections=job["streams"] + 4, max_keepalive_connections=job["streams"] + 4,
                          keepalive_expiry=4.0)
    async with httpx.AsyncClient(base_url=job["url"], limits=limits,
                                 timeout=httpx.Timeout(job["timeout"], connect=60.0)) as http:
        await asyncio.gather(*(http.get("/health") for _ in range(job["streams"])), return_exceptions=True)
        conn.send("ready")
        t0, deadline = conn.recv()  # time.monotonic() values: the same clock in every process
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        started = time.monotonic()
        records: list[dict] = []

        async def stream_loop(queue: list) -> None:  # closed loop: the next prompt when one ends
            while queue:
                index, messages = queue.pop()
                rec = {"index": index}
                records.append(rec)
                body = {"model": job["model_name"], "messages": messages, "max_tokens": job["max_tokens"],
                        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                        "return_token_ids": True}
                await _one_request(http, body, rec)

        queue = list(reversed(job["requests"]))
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.gather(*(stream_loop(queue) for _ in range(job["streams"]))),
                                   timeout=max(1.0, deadline - time.monotonic()))
        except (asyncio.TimeoutError, TimeoutError):
            timed_out = True
        ended = time.monotonic()
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    conn.send(dict(records=[r for r in records if "latency" in r], started=started, ended=ended, cpu_s=cpu,
                   timed_out=timed_out))


# ---- one level -------------------------------------------------------------------------------------------------

def run_level(url: str, model_name: str, prompts: list[dict], streams: int, procs: int, max_tokens: int,
              timeout: float) -> dict:
    """Every prompt once, C = `streams` closed-loop streams over min(procs, C) client processes.
    At C = 1 that is one process, as it must be: one stream is one sequence of requests."""
    ctx = mp.get_context("spawn")
    active = max(1, min(procs, streams))
    requests = [(i, p["messages"]) for i, p in enumerate(prompts)]
    jobs = [dict(url=url, model_name=model_name, max_tokens=max_tokens, timeout=timeout + 30,
                 streams=streams // active + (1 if w < streams % active else 0), requests=requests[w::active])
            for w in range(active)]
    before = scrape(url, {}, SPEC_COUNTERS)
    pipes, workers, results = [], [], []
    for job in jobs:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=client_process, args=(job, child, _client_async), daemon=True)
        proc.start()
        child.close()
        pipes.append(parent)
        workers.append(proc)
    try:
        for pipe in pipes:
            if not pipe.poll(120):
                raise RuntimeError("a client process did not start within 120 s")
            if (msg := pipe.recv()) != "ready":
                raise RuntimeError(f"client process: {msg}")
        t0 = time.monotonic() + 0.1
        for pipe in pipes:
            pipe.send((t0, t0 + timeout))
        for pipe in pipes:
            if not pipe.poll(timeout + 60):
                raise RuntimeError("a client process did not report within the level timeout")
            msg = pipe.recv()
            if "fatal" in msg:
                raise RuntimeError(f"client process failed: {msg['fatal']}")
            results.append(msg)
    finally:
        for proc in workers:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    after = scrape(url, {}, SPEC_COUNTERS)
    records = sorted((r for res in results for r in res["records"]), key=lambda r: r["index"])
    for r in records:
        r["name"] = prompts[r["index"]]["name"]
    ok = [r for r in records if r["error"] is None]
    wall = max(res["ended"] for res in results) - min(res["started"] for res in results)
    out_tokens = sum(r["tokens"] for r in ok)
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    counters = {k: after[k] - before.get(k, 0.0) for k in after} if before is not None and after else {}
    drafted = counters.get("graphserve_spec_draft_tokens", 0.0)
    accepted = counters.get("graphserve_spec_accepted_tokens", 0.0)
    rows = counters.get("graphserve_spec_verify_rows", 0.0)
    return dict(streams=streams, client_procs=active, num_prompts=len(prompts), completed=len(ok),
                errors=len(records) - len(ok), unfinished=len(prompts) - len(records),
                timed_out=any(res["timed_out"] for res in results),
                error_samples=sorted({r["error"] for r in records if r["error"]})[:3],
                wall_s=wall, output_tokens=out_tokens, output_tok_s=out_tokens / wall if wall > 0 else None,
                tpot_mean_s=statistics.fmean(tpot) if tpot else None, tpot_p50_s=percentile(tpot, 50),
                tpot_p99_s=percentile(tpot, 99), ttft_mean_s=statistics.fmean(ttft) if ttft else None,
                ttft_p50_s=percentile(ttft, 50),
                events_per_token=sum(r["events"] for r in ok) / out_tokens if out_tokens else None,
                client_cpu_fraction_max=max(res["cpu_s"] / max(1e-9, res["ended"] - res["started"])
                                            for res in results),
                server_counters=counters or None, spec_draft_tokens=drafted, spec_accepted_tokens=accepted,
                spec_verify_rows=rows, acceptance=accepted / drafted if drafted else None,
                mean_accepted_length=1 + accepted / rows if rows else None, requests=records)


def fmt(label: str, row: dict) -> str:
    ms = lambda v: f"{v * 1e3:7.1f}" if v is not None else "      -"  # noqa: E731
    acc = f"{row['acceptance']:.3f}" if row["acceptance"] is not None else "-"
    length = f"{row['mean_accepted_length']:.2f}" if row["mean_accepted_length"] is not None else "-"
    return (f"{label:5s} C={row['streams']:<3d} P={row['client_procs']:<2d} {row['completed']:3d} ok "
            f"{row['errors']} err {row['wall_s']:7.1f}s {row['output_tokens']:6d} tok {row['output_tok_s'] or 0:7.1f} "
            f"tok/s  TPOT mean/p50 {ms(row['tpot_mean_s'])}{ms(row['tpot_p50_s'])} ms  TTFT p50 "
            f"{ms(row['ttft_p50_s'])} ms  acceptance {acc} ({row['spec_accepted_tokens']:.0f}/"
            f"{row['spec_draft_tokens']:.0f}) mean accepted length {length}"
            + (f"\n    errors: {row['error_samples']}" if row["error_samples"] else ""))


def compare(a: dict, b: dict) -> dict | None:
    """None where two requests' outputs are the same (token ids, or the text where ids are missing),
    else where they part."""
    if a["error"] or b["error"]:
        return dict(name=a["name"], reason=f"request failed: {a['error'] or b['error']}")
    if a["token_ids"] and b["token_ids"]:
        x, y = a["token_ids"], b["token_ids"]
        if x == y:
            return None
        at = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        return dict(name=a["name"], by="token_ids", first_difference_at_token=at, tokens=[len(x), len(y)],
                    ids_from_there=[x[at:at + 8], y[at:at + 8]], texts=[a["text"], b["text"]])
    if a["text"] == b["text"]:
        return None
    at = next((i for i, (u, v) in enumerate(zip(a["text"], b["text"])) if u != v), None)
    at = min(len(a["text"]), len(b["text"])) if at is None else at
    return dict(name=a["name"], by="text", first_difference_at_char=at, texts=[a["text"], b["text"]])


# ---- main ------------------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default=str(PROMPTS), help="the prompt file")
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8], help="concurrency levels C")
    parser.add_argument("--k", type=int, default=4, help="--num-speculative-tokens of the speculating server")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--client-procs", type=int, default=4, help="client processes P (as serving.py)")
    parser.add_argument("--config", default="default", help="server config")
    parser.add_argument("--level-timeout", type=float, default=900.0, help="seconds per level")
    parser.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for the server")
    parser.add_argument("--out", default=str(BENCH / "results"), help="folder for the JSON and server logs")
    parser.add_argument("--name", default="spec_serving", help="file name stem")
    args, server_extra = parser.parse_known_args()
    server_extra = [a for a in server_extra if a != "--"]

    from live_server import ServerProcess

    prompts = load_prompts(Path(args.prompts))[:args.limit]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    streams = sorted(set(args.streams))
    settings = [("off", []), ("on", ["--speculative-method", "ngram", "--num-speculative-tokens", str(args.k)])]
    runs: dict[str, dict] = {}
    failure = None
    for label, flags in settings:
        server = ServerProcess(["--config", args.config, *server_extra, *flags])
        command = shlex.join(server.process.args)
        print(f"launched ({label}): {command}", flush=True)
        levels: list[dict] = []
        runs[label] = dict(server_command=command, levels=levels)
        try:
            started = time.perf_counter()
            server.wait_ready(args.server_timeout)
            runs[label]["server_ready_s"] = time.perf_counter() - started
            runs[label]["server_processes"] = server_processes(server.log)
            model_name = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
            warm = [dict(name="warm-up", messages=[{"role": "user", "content": "Name three colors of the rainbow."}])]
            run_level(server.url, model_name, warm * 2, 1, 1, 16, 120)  # not measured
            for c in streams:
                row = run_level(server.url, model_name, prompts, c, args.client_procs, args.max_tokens,
                                args.level_timeout)
                levels.append(row)
                print(fmt(label, row), flush=True)
        except Exception as e:
            failure = f"{label}: {type(e).__name__}: {e}"
            failure = failure if len(failure) < 4000 else failure[:1000] + " ... " + failure[-3000:]
            print(f"benchmark failed: {failure}", flush=True)
        finally:
            server.terminate()
            try:
                runs[label]["server_exit_code"] = server.wait(60)
            except Exception:
                server.stop()
                runs[label]["server_exit_code"] = "killed after 60 s"
            (out_dir / f"{args.name}.{label}.server.log").write_text(server.log)
        if failure:
            break

    # the outputs: on against off at each C (an error), off at C against off at the lowest C (recorded)
    by = {(label, row["streams"]): {r["index"]: r for r in row["requests"]}
          for label, run in runs.items() for row in run["levels"]}
    mismatches, batch_mismatches, summary = [], [], []
    for c in streams:
        off, on = by.get(("off", c)), by.get(("on", c))
        if off is None or on is None:
            continue
        for i in range(len(prompts)):
            if i not in off or i not in on:
                mismatches.append(dict(streams=c, name=prompts[i]["name"], reason="no result"))
            elif (diff := compare(off[i], on[i])) is not None:
                mismatches.append(dict(streams=c, **diff))
        if c != streams[0] and (base := by.get(("off", streams[0]))) is not None:
            batch_mismatches += [dict(streams=[streams[0], c], **d) for i in range(len(prompts))
                                 if i in base and i in off and (d := compare(base[i], off[i])) is not None]
        row_off = next(r for r in runs["off"]["levels"] if r["streams"] == c)
        row_on = next(r for r in runs["on"]["levels"] if r["streams"] == c)
        ratio = lambda a, b: a / b if a and b else None  # noqa: E731
        per_prompt = [off[i]["tpot"] / on[i]["tpot"] for i in range(len(prompts))
                      if i in off and i in on and off[i]["tpot"] and on[i]["tpot"]]
        summary.append(dict(streams=c, tpot_mean_off_over_on=ratio(row_off["tpot_mean_s"], row_on["tpot_mean_s"]),
                            tpot_p50_off_over_on=ratio(row_off["tpot_p50_s"], row_on["tpot_p50_s"]),
                            tpot_per_prompt_off_over_on_p50=percentile(per_prompt, 50),
                            output_tok_s_on_over_off=ratio(row_on["output_tok_s"], row_off["output_tok_s"]),
                            acceptance=row_on["acceptance"], mean_accepted_length=row_on["mean_accepted_length"],
                            identical=sum(1 for m in mismatches if m["streams"] == c) == 0))
    for s in summary:
        f = lambda v, spec=".2f": format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"C={s['streams']}: TPOT off/on mean {f(s['tpot_mean_off_over_on'])}x, p50 "
              f"{f(s['tpot_p50_off_over_on'])}x (per prompt p50 {f(s['tpot_per_prompt_off_over_on_p50'])}x); "
              f"output tok/s on/off {f(s['output_tok_s_on_over_off'])}x; acceptance {f(s['acceptance'], '.3f')}, "
              f"mean accepted length {f(s['mean_accepted_length'])}; outputs "
              f"{'identical' if s['identical'] else 'DIFFER'}", flush=True)
    for m in mismatches:
        where = (f"token {m['first_difference_at_token']} (of {m['tokens']})" if m.get("by") == "token_ids"
                 else f"char {m.get('first_difference_at_char')}" if m.get("by") else m.get("reason"))
        print(f"MISMATCH C={m['streams']} {m['name']}: on differs from off at {where}", flush=True)
        if m.get("texts"):
            at = len(_common_prefix(*m["texts"]))
            for label, text in zip(("off", "on "), m["texts"]):
                print(f"    {label}: ...{text[max(0, at - 40):at + 60]!r}", flush=True)
    for m in batch_mismatches:
        print(f"note: off at C={m['streams'][1]} differs from off at C={m['streams'][0]} for {m['name']} "
              f"(batch numerics, no speculation)", flush=True)

    report = dict(**provenance("spec_serving"), prompts_file=str(Path(args.prompts).resolve().relative_to(ROOT))
                  if Path(args.prompts).resolve().is_relative_to(ROOT) else args.prompts,
                  prompt_names=[p["name"] for p in prompts], num_prompts=len(prompts), streams=streams,
                  num_speculative_tokens=args.k, max_tokens=args.max_tokens, client_procs=args.client_procs,
                  config=args.config, server_extra=server_extra,
                  request=dict(endpoint="/v1/chat/completions", temperature=0.0, stream=True, ignore_eos=False,
                               return_token_ids=True),
                  definitions=dict(ttft="request sent -> first SSE event carrying generated tokens",
                                   tpot="(last event carrying tokens - first such event) / (completion_tokens - 1)",
                                   output_tok_s="sum of completion tokens / level wall time",
                                   acceptance="delta spec_accepted_tokens / delta spec_draft_tokens (/metrics)",
                                   mean_accepted_length="1 + delta spec_accepted_tokens / delta spec_verify_rows"),
                  summary=summary, mismatches=mismatches, batch_mismatches=batch_mismatches, failure=failure,
                  runs=runs)
    write_json(out_dir / f"{args.name}.json", report)
    incomplete = any(r["errors"] or r["unfinished"] or r["timed_out"] for run in runs.values() for r in run["levels"])
    return 1 if failure or mismatches or incomplete else 0


def _common_prefix(a: str, b: str) -> str:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return a[:i]


if __name__ == "__main__":
    sys.exit(main())

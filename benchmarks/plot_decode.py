"""Plot decode_latency.py results as decode-throughput curves: one panel per model, output
tokens/s against batch (both log scales), one line per (quantization, decode_chunk K) of the
CUDA-graph rows (K: the run's --k), plus each quantization's bandwidth limit: the tok/s a step
would reach if it only read its bytes (weights + the KV cache at that batch) at the copy
bandwidth measured in the same run (tokens_per_s / roofline_fraction). Runs without a measured
bandwidth (--device cpu) get no limit line.

    python benchmarks/plot_decode.py decode_curve.json [more.json ...] [-o out.png]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _series(report: dict) -> dict[tuple, dict[int, dict]]:
    """(model, quantization, decode_chunk, prefix_caching) -> {batch: row} of the run's graph rows
    at its --k (the first row of a batch: the batch rows come before the batch-1 K sweep)."""
    rows = [r for r in report.get("rows", []) if r.get("engine") == "graphs" and r.get("tensor_parallel_size", 1) == 1]
    k = report.get("decode_chunk")
    if k is None:  # written before decode_chunk was recorded: the K of the rows at batch > 1
        k = next((r["decode_chunk"] for r in rows if r["batch"] > 1), rows[0]["decode_chunk"] if rows else None)
    out: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        if r["decode_chunk"] == k:
            key = (r["model"], r.get("quantization") or "bf16", k, r.get("prefix_caching"))
            out.setdefault(key, {}).setdefault(r["batch"], r)
    return out


def plot(reports: dict | list[dict], path: Path | str, names: list[str] | None = None) -> None:
    """names: a label per report (its file), shown in the legend when there is more than one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    reports = [reports] if isinstance(reports, dict) else reports
    names = names or [f"run {i + 1}" for i in range(len(reports))]
    series = [_series(rep) for rep in reports]
    models = list(dict.fromkeys(key[0] for s in series for key in s))
    if not models:
        raise SystemExit("no graph rows in the JSON (decode_latency.py's engine == 'graphs')")
    fig, axes = plt.subplots(1, len(models), figsize=(max(8.0, 6.5 * len(models)), 5.2), squeeze=False)
    quants = list(dict.fromkeys(key[1] for s in series for key in s))
    colors = {q: f"C{i}" for i, q in enumerate(quants)}
    markers = "osD^v<>"
    for ax, model in zip(axes[0], models):
        batches_seen: set[int] = set()
        no_limit = []  # runs of this model without a measured bandwidth
        for n, (report, by_key, name) in enumerate(zip(reports, series, names)):
            keys = [key for key in by_key if key[0] == model]
            caching_values = {key[3] for key in keys}
            limits_drawn = set()
            for key in keys:
                _, quant, k, caching = key
                points = sorted(by_key[key].items())
                batches = [b for b, _ in points]
                batches_seen.update(batches)
                label = f"{quant} graphs K={k}"
                if len(caching_values) > 1:
                    label += " pc-" + ("on" if caching else "off")
                if len(reports) > 1:
                    label = f"{name}: {label}"
                ax.plot(batches, [r["tokens_per_s"] for _, r in points], marker=markers[n % len(markers)], ls="-",
                        color=colors[quant], label=label)
                # the bandwidth limit depends on the bytes only: one line per quantization and run
                limit = [(b, r["tokens_per_s"] / r["roofline_fraction"]) for b, r in points
                         if r.get("roofline_fraction")]
                if not limit and name not in no_limit:
                    no_limit.append(name)
                if limit and (quant, n) not in limits_drawn:
                    limits_drawn.add((quant, n))
                    bw = report.get("copy_bandwidth_gb_s")
                    label = f"{quant} bandwidth limit" + (f" ({bw:,.0f} GB/s)" if bw else "")
                    if len(reports) > 1:
                        label = f"{name}: {label}"
                    ax.plot([b for b, _ in limit], [t for _, t in limit], ls="--", lw=1, color=colors[quant],
                            label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if batches_seen:
            lo, hi = min(batches_seen), max(batches_seen)
            ticks = [2 ** i for i in range(int(math.log2(lo)), int(math.ceil(math.log2(hi))) + 1)]
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(t) for t in ticks])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_xlim(ticks[0] / 1.3, ticks[-1] * 1.3)
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 10 else f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        y0, y1 = ax.get_ylim()
        # label the 2..9 ticks too where the axis spans less than two decades
        ax.yaxis.set_minor_formatter(plain if y1 / y0 < 100 else matplotlib.ticker.NullFormatter())
        ax.tick_params(axis="y", which="minor", labelsize=7)
        if no_limit:
            ax.text(0.99, 0.01, "no bandwidth limit line: copy bandwidth not measured"
                    + (f" ({', '.join(no_limit)})" if len(reports) > 1 else " (CPU run)"),
                    transform=ax.transAxes, ha="right", va="bottom", fontsize=7, color="0.4")
        ax.set_xlabel("batch (concurrent sequences decoding)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(model)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    gpus = list(dict.fromkeys(str(rep.get("gpu") or "CPU") for rep in reports))
    dates = list(dict.fromkeys(str(rep.get("date", "?"))[:10] for rep in reports))
    first = reports[0]
    fig.suptitle(f"graphserve decode throughput (benchmarks/decode_latency.py)\n{', '.join(gpus)}, {', '.join(dates)}; "
                 f"prompt {first.get('prompt_len')} + {first.get('new_tokens')} new tokens per sequence",
                 fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+")
    parser.add_argument("-o", "--output", default=None, help="PNG (default: the first JSON's name with .png)")
    args = parser.parse_args()
    reports = [json.loads(Path(p).read_text()) for p in args.json]
    plot(reports, args.output or Path(args.json[0]).with_suffix(".png"), [Path(p).stem for p in args.json])


if __name__ == "__main__":
    main()

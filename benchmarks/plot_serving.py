"""Plot serving.py results: output tok/s vs concurrency (with throughput.py's offline figure
when known), TTFT p50/p99 and TPOT p50/p99 (+ ITL p99) vs concurrency. Closed-loop levels
with the base client process count are the lines; the doubling-check run (2P client
processes) is a separate marker; the Poisson run is annotated.

    python benchmarks/plot_serving.py serving-qwen2.5-0.5b.json [more.json ...] [-o out.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(reports: dict | list[dict], path: Path | str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = [reports] if isinstance(reports, dict) else reports
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax_tps, ax_ttft, ax_tpot = axes
    for n, report in enumerate(reports):
        color = f"C{n}"
        label = report.get("model") or "?"
        rows = report.get("levels", [])
        base = sorted((r for r in rows if r["mode"] == "closed" and not r.get("doubling_check")
                       and r["output_tok_s"]), key=lambda r: r["concurrency"])
        if not base:
            continue
        cs = [r["concurrency"] for r in base]
        ms = lambda key: [(r[key] or float("nan")) * 1e3 for r in base]  # noqa: E731
        procs = report.get("client_procs", base[-1]["client_procs"])
        ax_tps.plot(cs, [r["output_tok_s"] for r in base], "o-", color=color, label=f"{label} (P={procs})")
        for r in rows:
            if r.get("doubling_check") and r["output_tok_s"]:
                ax_tps.plot([r["concurrency"]], [r["output_tok_s"]], "s", color=color, mfc="none", ms=10,
                            label=f"{label} (2P={r['client_procs']})")
            if r["mode"] == "poisson" and r["output_tok_s"]:
                ax_tps.annotate(f"Poisson {r['request_rate']:.1f} req/s: {r['output_tok_s']:,.0f}",
                                (cs[-1], r["output_tok_s"]), fontsize=7, color=color,
                                xytext=(-120, -14 - 10 * n), textcoords="offset points")
        if report.get("offline_output_tok_s"):
            ax_tps.axhline(report["offline_output_tok_s"], color=color, ls=":", lw=1,
                           label=f"{label} offline (throughput.py)")
        ax_ttft.plot(cs, ms("ttft_p50_s"), "o-", color=color, label=f"{label} p50")
        ax_ttft.plot(cs, ms("ttft_p99_s"), "^--", color=color, label=f"{label} p99")
        ax_tpot.plot(cs, ms("tpot_p50_s"), "o-", color=color, label=f"{label} TPOT p50")
        ax_tpot.plot(cs, ms("tpot_p99_s"), "^--", color=color, label=f"{label} TPOT p99")
        ax_tpot.plot(cs, ms("itl_p99_s"), "x:", color=color, label=f"{label} ITL p99")
    for ax, title, unit in ((ax_tps, "output tokens/s", "tok/s"), (ax_ttft, "time to first token", "ms"),
                            (ax_tpot, "time per output token", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams (closed loop)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax_ttft.set_yscale("log")
    ax_tpot.set_yscale("log")
    fig.suptitle("graphserve serving benchmark (benchmarks/serving.py)", fontsize=10)
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
    plot(reports, args.output or Path(args.json[0]).with_suffix(".png"))


if __name__ == "__main__":
    main()

"""Plot speculative.py results: decode tok/s against the acceptance rate alpha, one panel per
(model, quantization, batch), one line per k, the plain engine's tok/s as a dashed line and the
draft-model arm as a point.

    python benchmarks/plot_speculative.py speculative.json [more.json ...] [-o out.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def panels(rows: list[dict]) -> dict[tuple, dict]:
    """(model, quantization, batch) -> {"plain": tok/s, "k": {k: [(alpha, tok/s)]}, "draft": [...]}
    of the timed rows (breakdown rows left out)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        if "tokens_per_s" not in r:
            continue
        panel = out.setdefault((r["model"], r["quantization"], r["batch"]), {"plain": None, "k": {}, "draft": []})
        if r["k"] == 0:
            panel["plain"] = r["tokens_per_s"]
        elif r.get("drafter", "forced") == "forced":
            panel["k"].setdefault(r["k"], []).append((r["alpha"], r["tokens_per_s"]))
        else:
            panel["draft"].append((r["alpha"], r["tokens_per_s"], r["k"], r["drafter"]))
    return out


def plot(rows: list[dict], path: Path | str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_panel = panels(rows)
    if not by_panel:
        raise SystemExit("no timed rows in the JSON")
    keys = sorted(by_panel, key=lambda key: (key[0], key[1], key[2]))
    cols = min(5, len(keys))
    nrows = -(-len(keys) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 3.2 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        panel = by_panel[key]
        for i, (k, points) in enumerate(sorted(panel["k"].items())):
            points.sort()
            ax.plot([a for a, _ in points], [t for _, t in points], marker="o", color=f"C{i}", label=f"k = {k}")
        if panel["plain"] is not None:
            ax.axhline(panel["plain"], color="black", linestyle="--", linewidth=1, label="speculation off")
        for j, (alpha, tps, k, drafter) in enumerate(panel["draft"]):
            ax.plot([alpha], [tps], marker="*", markersize=12, linestyle="none", color=f"C{5 + j}",
                    label=f"{drafter.removesuffix(', forced')}, k = {k}")
        ax.set_title(f"{key[0]} {key[1]}, batch {key[2]}", fontsize=9)
        ax.set_xlabel("alpha (each draft right with probability)", fontsize=8)
        ax.set_ylabel("decode tok/s", fontsize=8)
        tops = [t for pts in panel["k"].values() for _, t in pts] + [t for _, t, _, _ in panel["draft"]]
        ax.set_ylim(0, 1.15 * max(tops + [panel["plain"] or 0]))
        ax.set_xlim(0.45, 0.95)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+")
    parser.add_argument("-o", "--out", default="speculative.png")
    args = parser.parse_args()
    reports = [json.loads(Path(p).read_text()) for p in args.reports]
    rows = [r for rep in reports for r in rep["rows"]]
    gpus = sorted({rep.get("gpu") or "CPU" for rep in reports})
    dates = sorted({(rep.get("date") or "")[:10] for rep in reports})
    plot(rows, args.out, title=f"benchmarks/speculative.py: {', '.join(gpus)}, {', '.join(dates)}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

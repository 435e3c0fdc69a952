"""One plot of several bench/chat.py results (an A/B run in one command): normalized latency p90
against output tokens/s, one line per file, labelled by the record's `tag` field (added by hand
when a result is renamed for bench/results) or else the file's name.

    python bench/ab_plot.py A.json B.json --out AB.png
"""
import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="bench/chat.py JSON files")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, path in enumerate(args.results):
        record = json.loads(Path(path).read_text())
        rows = [r for r in record["rows"] if r.get("system") == "batchmaker" and "error" not in r]
        points = sorted((r["tokens_per_s"], r["norm_latency_p90_ms"], r["roofline_fraction"]) for r in rows)
        label = record.get("tag", Path(path).stem)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        for x, y, fraction in points:
            ax.annotate(f"{fraction:.3f}", (x, y), fontsize=7, textcoords="offset points",
                        xytext=(4, 4 - 12 * i), color=f"C{i}")
    ax.set_xlabel("output tokens/s (points: fraction of the roofline)")
    ax.set_ylabel("normalized latency p90 (ms/token)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title(Path(args.out).stem, fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()

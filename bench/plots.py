"""The plots of bench/wmt.py and bench/treebank.py results (Fig. 2.7 with spreads), from the result
record alone, so that a JSON redraws without rerunning:

- left: p90 latency against the offered rate, the same rates for every system; the line is the
  median over repeats, the bar its min-max; the SLO dashed;
- middle: achieved throughput against the offered rate (the diagonal is keeping up);
- right: sustainable throughput per system (median, min-max bar) beside the peak under overload
  (hatched: a secondary number, taken where latency is unbounded).

    python bench/plots.py bench/results/wmt-lstm-fp16-....json      # redraw the PNG beside it
"""
import argparse
import json
from pathlib import Path


def plot(fig, record: dict) -> None:
    lat, thr, bars = fig.subplots(1, 3, gridspec_kw={"width_ratios": [3, 3, 2]})
    systems = {k: v for k, v in record["systems"].items() if v.get("curve")}
    for k, (name, r) in enumerate(systems.items()):
        x = [c["offered_rate"] for c in r["curve"]]
        for ax, key in ((lat, "p90_ms"), (thr, "achieved")):
            mid = [_num(c[key]["median"]) for c in r["curve"]]
            low = [m - _num(c[key]["min"]) for m, c in zip(mid, r["curve"])]
            high = [_num(c[key]["max"]) - m for m, c in zip(mid, r["curve"])]
            ax.errorbar(x, mid, yerr=[low, high], fmt="o-", color=f"C{k}", label=name, markersize=3, capsize=2)
    slo = record.get("slo", {}).get("p90_ms")
    if slo:
        lat.axhline(slo, color="gray", linestyle="--", linewidth=1, label=f"SLO p90 {slo:g} ms")
    top = max((c["offered_rate"] for r in systems.values() for c in r["curve"]), default=1.0)
    thr.plot([0, top], [0, top], color="gray", linewidth=0.8, linestyle=":")
    lat.set(xlabel="offered rate (req/s)", ylabel="p90 latency (ms)", yscale="log")
    thr.set(xlabel="offered rate (req/s)", ylabel="achieved (req/s)")
    lat.set_title(record.get("title", ""), fontsize=8)
    lat.legend(fontsize=6)
    names = [n for n in systems if systems[n].get("sustainable")]
    for i, name in enumerate(names):
        for offset, key, hatch in ((-0.2, "sustainable", None), (0.2, "peak_under_overload", "//")):
            s = systems[name][key]
            bars.bar(i + offset, s["median"], width=0.4, color=f"C{list(systems).index(name)}", hatch=hatch,
                     alpha=0.5 if hatch else 0.9, yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]], capsize=2)
    bars.set_xticks(range(len(names)), names, rotation=30, fontsize=7, ha="right")
    bars.set_ylabel("req/s: sustainable | peak under overload (hatched)", fontsize=7)
    fig.set_size_inches(14, 4.2)


def _num(value) -> float:
    return float("inf") if value is None else value  # (JSON keeps infinite latencies as null)


def plotter(record: dict):
    """The plot function for common.write_results, or None where matplotlib is missing (the GPU
    machine may lack it: redraw from the JSON with this script)."""
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        return None
    return lambda fig: plot(fig, record)


def main() -> None:
    parser = argparse.ArgumentParser(description="redraw the PNG of bench/wmt.py or bench/treebank.py results")
    parser.add_argument("json", nargs="+")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for path in map(Path, parser.parse_args().json):
        fig = plt.figure()
        plot(fig, json.loads(path.read_text()))
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=110)
        plt.close(fig)
        print(f"wrote {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()

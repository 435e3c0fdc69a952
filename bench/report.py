"""The README's tables from bench/wmt.py and bench/treebank.py result files: per system its
sustainable throughput (median and min-max over repeats) and peak under overload, and per
comparison the ratios with their conservative ranges and targets.

    python bench/report.py bench/results/wmt-lstm-fp16-wmt-NVIDIA-H100-80GB-HBM3-2026-11-26.json ...
"""
import argparse
import json
from pathlib import Path


def _k(x) -> str:
    return "—" if x is None else f"{x / 1000:.1f}K" if x >= 1000 else f"{x:.0f}"


def _ratio(r: dict | None, digits: int = 2) -> str:
    if not r:
        return "—"
    return f"{r['median']:.{digits}f}x ({r['min']:.{digits}f}-{r['max']:.{digits}f})"


def _met(row: dict | None, sign: str) -> str:
    if not row or row.get("target") is None:
        return ""
    return f" {'✓' if row['met'] else '✗'} (target {sign} {row['target']:.3g})"


def peak_under_overload(system: dict) -> dict:
    """Per repeat, the most completions counted in one window (bench/protocol.summarize_system's
    definition; recomputed from the points, so that results written before it read the same)."""
    peaks = [max(p.get("completions_in_window", p["achieved"]) for p in r["curve"] + (r["search"] or {}).get("points", []))
             for r in system["repeats"]]
    return {"median": sorted(peaks)[len(peaks) // 2], "min": min(peaks), "max": max(peaks)}


def systems_table(record: dict) -> list[str]:
    lines = ["| system | sustainable req/s, median (min-max) | peak under overload (secondary) | configuration |",
             "|---|---|---|---|"]
    for name, r in record["systems"].items():
        s, p = r.get("sustainable"), peak_under_overload(r)
        config = {k: v for k, v in (r.get("config") or {}).items() if k in ("pick", "max_batch", "max_in_flight",
                                                                          "max_trees", "bucket_width", "batches")}
        lines.append(f"| {name} | {_k(s['median'])} ({_k(s['min'])}-{_k(s['max'])}) | {_k(p['median'])} "
                     f"({_k(p['min'])}-{_k(p['max'])}) | {json.dumps(config) if config else ''} |")
    return lines


def comparisons_table(record: dict) -> list[str]:
    lines = ["| BatchMaker vs | sustainable throughput ratio | p90 ratio at half the baseline's sustainable rate |",
             "|---|---|---|"]
    for c in record["comparisons"].values():
        baseline = c["baseline"]
        half = c.get("p90_at_half")
        p90 = (f"{_ratio(half, 3)} at {_k(half['rate'])}/s, {half['p90_ms'][c['ours']]['median']:.1f} vs "
               f"{half['p90_ms'][baseline]['median']:.1f} ms{_met(half, '≤')}") if half else "—"
        label = baseline if c["ours"] == "batchmaker" else f"{c['ours']} vs {baseline}"  # (replicas against r1)
        lines.append(f"| {label} | {_ratio(c['sustainable'])}{_met(c['sustainable'], '≥')} | {p90} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", nargs="+")
    for path in map(Path, parser.parse_args().json):
        record = json.loads(path.read_text())
        limits = record["device_limits"]
        print(f"### {record['title']} — {record['device']}, {record['date'][:10]} (`{path.name}`)")
        print(f"SLO p90 {record['slo']['p90_ms']:g} ms; {record['protocol']['repeats']} repeats; device: "
              f"{limits['copy_bytes_per_s'] / 1e9:.0f} GB/s copy, {limits['matmul_flops_per_s'] / 1e12:.3g} "
              f"TFLOP/s {limits['matmul_dtype']}; generator ceiling {record.get('generator', {}).get('ratio', 0):.1f}x "
              f"the best system\n")
        print("\n".join(systems_table(record)), "\n")
        print("\n".join(comparisons_table(record)), "\n")


if __name__ == "__main__":
    main()

"""How much the cellular-batching policy can be worth when arithmetic is the limit (issue 35).

If no system paid any host cost, sustainable throughput would be set by the cell-rows (rows x
steps) each computes per request, so (a baseline's rows per request) / (the engine's) bounds the
ratio of their sustainable throughputs; a target above that bound is out of reach of the policy
against that baseline, whatever the host engineering. This runs each workload's systems through
the runners' own machinery (bench/wmt.py, bench/treebank.py, bench/runner.py: the same factories,
warm-up, load generator and measure) at a few offered rates and reads their cell-rows counters
(bench/baselines/cell_rows.py; the engine's `stats()["cell_rows"]`) against the cell-rows the
offered requests need. Counts come in three accountings: `computed` (this device's launches),
`graphed` (the same batches as the GPU path launches them: CUDA graphs padded to their sizes;
the accounting of the GPU targets) and `padded` (every row of a batch for every step: unpacked
bucketing as in the paper's MXNet/TF). A combined bound weights each cell kind by its weights'
multiply-adds per row (embeddings aside) at the run's size and at the GPU runs' (the runners'
default hidden size and vocabulary). bench/policy_analytic.py gives the same from the datasets.

    python bench/policy_bound.py --device cpu --hidden 256 --trees ../shared/data/sst/train.txt
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import policy_analytic as analytic  # noqa: E402
import runner  # noqa: E402
import treebank  # noqa: E402
import wmt  # noqa: E402
from baselines.cell_rows import COLUMNS  # noqa: E402
from baselines.trees import tree_tuples  # noqa: E402
from common import write_results  # noqa: E402
from loadgen import LoadGenerator  # noqa: E402

from batchmaker import build_model  # noqa: E402
from batchmaker.core.scheduler import SchedulerConfig  # noqa: E402
from batchmaker.unfolders.trees import parse_trees  # noqa: E402

ACCOUNTINGS = ("computed", "graphed", "padded")
TARGETS = {"lstm": wmt.TARGETS["lstm"]["sustainable"], "seq2seq": wmt.TARGETS["seq2seq"]["sustainable"],
           "treelstm": treebank.TARGETS["graph-batching"]["sustainable"]}


class Workload:
    """One runner's systems, requests and what each request needs, from the runner's own args."""

    def __init__(self, name: str, argv: list[str], caps: list[int]):
        self.name = name
        if name == "treelstm":
            self.args = treebank.parser().parse_args(argv + ["--tune-caps", *map(str, caps)])
            data = treebank.trees(self.args)
            self.requests = [("treelstm", {"tree": t}) for t in data]
            arrays, ok, _ = parse_trees(data, self.args.vocab)
            assert len(ok) == len(data)
            self.trees = tree_tuples(arrays)
            leaves = arrays.num_leaves.astype(np.int64)
            self.needs = {"leaf": leaves, "internal": leaves - 1}
            make, tuning = treebank.factories(self.args)
            self.systems = {runner.ENGINE: make[runner.ENGINE], **tuning["graph-batching"],
                            runner.ABLATION: make[runner.ABLATION]}
            self.strong = list(tuning["graph-batching"])
        else:
            self.args = wmt.parse_args(argv + ["--model", name])
            pairs = wmt.dataset(self.args)
            self.requests = wmt.requests(self.args, pairs)
            lengths = np.array([len(s) for s, _ in pairs], dtype=np.int64)
            limits = np.array([r[1].get("max_len", 0) for r in self.requests], dtype=np.int64)
            self.needs = {"lstm": lengths} if name == "lstm" else {"encoder": lengths, "decoder": limits}
            make, tuning = wmt.factories(self.args)
            self.systems = {runner.ENGINE: make[runner.ENGINE], **tuning["bucketing"],
                            "bucketing-paper": make["bucketing-paper"], runner.ABLATION: make[runner.ABLATION]}
            self.strong = list(tuning["bucketing"])

    def measure(self, rates: list[float]) -> dict:
        """Each system at each rate (one repeat): its points with their cell-rows."""
        args = self.args
        protocol = runner.protocol_of(args)
        device = args.device.split(":")[0]
        slo = treebank.SLOS[device] if self.name == "treelstm" else wmt.SLOS[(self.name, device)]
        out = {}
        with LoadGenerator(args.mode, self.requests) as gen:
            for name, make in self.systems.items():
                print(f"== {self.name}: {name}", file=sys.stderr, flush=True)
                server, config = make()
                with runner.started(name, server, config, args.mode, runner.submit_path(args)) as system:
                    runner.warm_up(system, gen, self.requests, args.warmup)
                    measure = runner.measurer(system, gen, self.requests, protocol, slo, self.needs)
                    points = [measure(rate, 0) for rate in rates]
                out[name] = {"config": runner.plain(system.config), "points": [brief(p) for p in points]}
        return out


def brief(point: dict) -> dict:
    c = point["counters"]
    return {"offered_rate": point["offered_rate"], "achieved": point["achieved"],
            "p90_ms": point["latency_ms"]["p90"], "sustained": point["sustained"], "num_offered": point["num_offered"],
            "needed": point["cell_rows_needed"], "cell_rows": {kind(k): v for k, v in c.get("cell_rows", {}).items()},
            "batches": c.get("batches", {})}


def kind(cell_type: str) -> str:
    """The engine's "model/cell" names as the baselines' cell kinds."""
    return cell_type.rpartition("/")[2]


def per_request(points: list[dict]) -> dict:
    """Per cell: each accounting's rows per offered request, needed rows, padding fraction of each
    (1 - needed / rows), mean rows per launch (computed / launches), over all of a system's points."""
    offered = sum(p["num_offered"] for p in points)
    out = {}
    for cell in points[0]["needed"]:
        needed = sum(p["needed"][cell] for p in points)
        rows = {a: sum(p["cell_rows"].get(cell, {}).get(a, 0) for p in points) for a in COLUMNS}
        row = {"needed": needed / offered, **{a: rows[a] / offered for a in ACCOUNTINGS}}
        row["padding"] = {a: 1 - needed / rows[a] if rows[a] else None for a in ACCOUNTINGS}
        row["mean_rows_per_launch"] = rows["computed"] / rows["launches"] if rows["launches"] else None
        row["launches_per_request"] = rows["launches"] / offered
        out[cell] = row
    return out


def macs_per_row(name: str, hidden: int, embed: int | None, vocab: int) -> dict[str, int]:
    """Weight elements a row multiplies, per cell (2-D parameters other than embeddings)."""
    with torch.device("meta"):
        model = build_model(name, hidden=hidden, embed=embed or hidden, vocab=vocab)
    return {c: sum(p.numel() for n, p in cell.named_parameters() if p.dim() == 2 and "embedding" not in n)
            for c, cell in model.cells.items()}


def bound(ours: dict, theirs: dict, weights: dict[str, dict]) -> dict:
    """theirs / ours per cell and accounting, and weighted by each set of macs per row."""
    out = {}
    for a in ACCOUNTINGS:
        row = {cell: theirs[cell][a] / ours[cell][a] for cell in ours if ours[cell][a]}
        for label, w in weights.items():
            row[f"weighted_{label}"] = (sum(w[c] * theirs[c][a] for c in ours) / sum(w[c] * ours[c][a] for c in ours))
        out[a] = row
    return out


def analytic_bounds(work: Workload, batches: dict[str, float], weights: dict) -> dict:
    """The dataset-only cross-check: per baseline batch (its cap, and its measured mean batch)."""
    args = work.args
    needs = work.needs
    if work.name == "treelstm":
        ours = analytic.tree_engine_rows(needs)
        rows = {f"graph-batching cap {cap}": analytic.graph_batching_rows(work.trees, int(cap))
                for cap in sorted(set(batches.values()))}
    else:
        ours = analytic.engine_rows(needs, SchedulerConfig().max_round_steps)
        limits = needs.get("decoder")
        lengths = needs["lstm" if work.name == "lstm" else "encoder"]
        rows = {f"bucketing batch {b}": analytic.bucketing_rows(lengths, limits, args.bucket_width, int(b))
                for b in sorted(set(batches.values()))}
    n = len(work.requests)
    scale = lambda r: {c: {k: v / n for k, v in d.items()} for c, d in r.items()}  # noqa: E731
    ours, rows = scale(ours), {k: scale(v) for k, v in rows.items()}
    return {"engine": ours, "baselines": rows, "bound": {k: bound(ours, v, weights) for k, v in rows.items()}}


def report(work: Workload, measured: dict, weights: dict) -> dict:
    systems = {name: per_request(m["points"]) for name, m in measured.items()}
    ours = systems[runner.ENGINE]
    bounds = {name: bound(ours, s, weights) for name, s in systems.items() if name != runner.ENGINE}
    # the analytic check's batches: the strong baselines' caps, and their measured mean batches
    if work.name == "treelstm":
        caps = {name: measured[name]["config"]["max_trees"] for name in work.strong}
    else:
        caps = {"cap": work.args.max_batch} | {name: round(mean_batch(measured[name]["points"])) for name in work.strong}
    return {"per_request": systems, "bound": bounds, "target": TARGETS[work.name], "strong_baselines": work.strong,
            "mean_batch": {name: mean_batch(m["points"]) for name, m in measured.items()},
            "analytic": analytic_bounds(work, caps, weights)}


def mean_batch(points: list[dict]) -> float | None:
    """Requests per batch (a baseline) over the points: batches' sizes weighted by their number."""
    b = [p["batches"]["batch"] for p in points if "batch" in p["batches"]]
    return sum(x["num"] * x["mean_size"] for x in b) / sum(x["num"] for x in b) if b else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--workloads", nargs="+", default=["lstm", "seq2seq", "treelstm"])
    parser.add_argument("--lstm-rates", type=float, nargs="+", default=[500, 1800])
    parser.add_argument("--seq2seq-rates", type=float, nargs="+", default=[15, 40])
    parser.add_argument("--tree-rates", type=float, nargs="+", default=[400, 1400])
    parser.add_argument("--trees", default="sample", help="as bench/treebank.py's --trees")
    parser.add_argument("--caps", type=int, nargs="+", default=[256, 512], help="graph batching's tree caps")
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--seq2seq-duration", type=float, default=4.0)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    common = ["--device", args.device, "--hidden", str(args.hidden), "--warmup", str(args.warmup),
              "--warm", "0.25", "--min-window-requests", "1", "--repeats", "1"]
    rates = {"lstm": args.lstm_rates, "seq2seq": args.seq2seq_rates, "treelstm": args.tree_rates}
    out = {"settings": vars(args), "workloads": {}}
    for name in args.workloads:
        duration = args.seq2seq_duration if name == "seq2seq" else args.duration
        argv_w = common + ["--duration", str(duration), "--rates", *map(str, rates[name])]
        work = Workload(name, argv_w + (["--trees", args.trees] if name == "treelstm" else []), args.caps)
        runner.numerics(work.args)
        model = "treelstm" if name == "treelstm" else name
        gpu = wmt.parser().get_default("hidden"), wmt.parser().get_default("vocab")
        weights = {"run": macs_per_row(model, args.hidden, None, work.args.vocab),
                   "gpu": macs_per_row(model, gpu[0], None, gpu[1])}
        measured = work.measure(rates[name])
        out["workloads"][name] = {"rates": rates[name], "macs_per_row": weights, "systems": measured,
                                  **report(work, measured, weights)}
        for line in summary(name, out["workloads"][name]):
            print(line)
    path = write_results("policy-bound" + (f"-{args.tag}" if args.tag else ""), args.device, out)
    print(f"wrote {path}")
    return 0


def summary(name: str, w: dict) -> list[str]:
    lines = [f"{name}: target {w['target']}x"]
    for system, cells in w["per_request"].items():
        for cell, r in cells.items():
            lines.append(f"  {system:22s} {cell:9s} needed {r['needed']:7.2f}  computed {r['computed']:7.2f}  "
                         f"graphed {r['graphed']:7.2f}  padded {r['padded']:7.2f}  rows/launch "
                         f"{r['mean_rows_per_launch'] or 0:7.1f}")
    for system, b in w["bound"].items():
        lines.append(f"  bound vs {system:22s} " + "  ".join(
            f"{a} " + " ".join(f"{k}={v:.3f}" for k, v in b[a].items()) for a in ACCOUNTINGS))
    return lines


if __name__ == "__main__":
    sys.exit(main())

"""TreeLSTM on SST at max batch 64: the engine's nodes/s, with and without materialized cells (CUDA
graphs per cell type and padded batch, batchmaker/materialized.py), against the GPU-bound limit.

    python bench/gpu_treelstm.py                  # h=1024, embed 1024, vocab 30000, fp16, like bench/treebank.py
    python bench/gpu_treelstm.py --hidden 256 --trees 1000

(a) limit: the leaf and the internal cell (the model's own modules) at batch 64 on static inputs,
    `--graph-steps` calls captured in one CUDA graph and replayed back to back: nodes/s per cell
    type, and for the SST mix (time per node weighted by the sample's leaf/internal counts). The
    same for one materialized task (gather + cell + scatter from the static index) replayed back
    to back: what the engine's graphs cost on the GPU.
(b) engine: `--trees` SST sample trees submitted at once to an Engine with one CUDA worker, after
    a warm-up run of the same size (which captures the graphs and grows the pools); nodes/s =
    nodes / (last result - first submit), with cuda_graphs on and off in the same run, the manager
    loop's time in stages (bench/gpu_engine.py's Timers) and the capture counts and time.
"""
import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import replay_windows, write_results  # noqa: E402
from gpu_engine import batch_histogram, instrument  # noqa: E402

from batchmaker import Engine, EngineConfig, build_model  # noqa: E402
from batchmaker.materialized import MaterializedCells  # noqa: E402
from batchmaker.model import CellType  # noqa: E402
from batchmaker.state import StateMemory  # noqa: E402
from batchmaker.unfolders.common import as_dtype  # noqa: E402
from batchmaker.unfolders.trees import load_sst_sample, num_leaves, parse_tree  # noqa: E402


# (a) the limit ----------------------------------------------------------------------------------

def time_replays(graph: torch.cuda.CUDAGraph, calls_per_graph: int, replays: int) -> float:
    """Median µs per call over five windows of `replays` back-to-back replays."""
    return float(np.median(replay_windows(graph, calls_per_graph, replays)))


def cell_alone_us(cell, inputs: dict, steps: int, replays: int) -> float:
    """µs per call of the cell on static inputs, `steps` calls per graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            cell(**inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            cell(**inputs)
    return time_replays(graph, steps, replays)


def materialized_task_us(cell_type: CellType, cell, batch: int, replays: int, device) -> float:
    """µs per replay of one materialized task at `batch` (real rows in a pool of 4096)."""
    memory = StateMemory(device)
    m = MaterializedCells({id(cell_type): cell}, memory)
    s = m.slices(cell_type)
    sig = cell_type.cell.signature
    for spec in (*sig.inputs.values(), *sig.outputs.values()):
        pool = memory.pool(spec.shape, spec.dtype)
        while pool.capacity < 4096:
            pool.alloc()
        pool.ensure_capacity()
    g = torch.Generator().manual_seed(0)
    index = m.host_index(cell_type, batch)
    for name in sig.inputs:
        index[s.reads[name]] = (torch.randperm(2000, generator=g)[:batch] + 1).numpy()
    for name in s.values:
        index[s.reads[name]] = 0
        index[s.values[name]] = (torch.randint(3, 1000, (batch,), generator=g)).numpy()
    for k, name in enumerate(sig.outputs):
        index[s.writes[name]] = np.arange(batch) + 3000 + k * batch
    with torch.inference_mode():
        m.load(cell_type, batch, index)
        m.run(cell_type, batch)
        torch.cuda.synchronize()
        return time_replays(m.graph(cell_type, batch), 1, replays)


def cell_limits(model, cell_types: dict[str, CellType], counts: dict[str, int], args, device) -> dict:
    b = args.max_batch
    g = torch.Generator().manual_seed(0)
    out = {}
    with torch.inference_mode():
        for name, cell_type in cell_types.items():
            cell = copy.deepcopy(model.cells[name]).to(device).eval()
            sig = cell.signature
            inputs = {}
            for k, spec in sig.inputs.items():
                if spec.is_integer:
                    inputs[k] = torch.randint(3, spec.high, (b,), generator=g).to(device)
                else:
                    inputs[k] = (torch.randn((b, *spec.shape), generator=g) * 0.5).to(device, spec.dtype)
            alone = cell_alone_us(cell, inputs, args.graph_steps, args.replays)
            task = materialized_task_us(cell_type, cell, b, args.replays, device)
            out[name] = {"cell_us": alone, "cell_nodes_per_s": b / alone * 1e6,
                         "materialized_task_us": task, "materialized_nodes_per_s": b / task * 1e6}
            print(f"{name:9s} cell in a graph {alone:6.1f} µs = {b / alone * 1e6:.3g} nodes/s; materialized "
                  f"task (gather + cell + scatter) {task:6.1f} µs = {b / task * 1e6:.3g} nodes/s", flush=True)
    num_nodes = sum(counts.values())
    for key in ("cell", "materialized"):
        us_per_node = sum(counts[n] * out[n][f"{key}_us" if key == "cell" else "materialized_task_us"] / b
                          for n in counts) / num_nodes
        out[f"sst_mix_{key}_nodes_per_s"] = 1e6 / us_per_node
    print(f"SST mix limit: {out['sst_mix_cell_nodes_per_s']:.3g} nodes/s (cells alone), "
          f"{out['sst_mix_materialized_nodes_per_s']:.3g} (materialized tasks)", flush=True)
    return out


# (b) the engine ---------------------------------------------------------------------------------

def run_trees(engine: Engine, trees: list[str]) -> tuple[float, list]:
    t0 = time.perf_counter()
    futures = [engine.submit("treelstm", {"tree": t}) for t in trees]
    results = [f.result(timeout=300) for f in futures]
    return time.perf_counter() - t0, results


def engine_run(model, trees: list[str], num_nodes: int, graphs: bool, device) -> tuple[dict, list]:
    config = EngineConfig(devices=(str(device),), max_requests=1 << 20, cuda_graphs=graphs)
    engine = Engine([model], config).start()
    try:
        (worker,) = engine.workers
        m = worker.materialized
        warm_s, _ = run_trees(engine, trees)  # captures graphs, grows pools to the run's peak
        warm = {"wall_s": warm_s, "num_captures": m.num_captures if m else 0,
                "capture_s": m.capture_s if m else 0.0}
        timers = instrument(engine)
        if m is not None:  # inside worker.execute: the index copy, and the replay
            timers.wrap(m, "load", "materialized.load (pinned index copy)")
            timers.wrap(m, "run", "materialized.run (graph replay)")
        captures, capture_s = warm["num_captures"], warm["capture_s"]
        before = engine.stats()
        wall, results = run_trees(engine, trees)
        after = engine.stats()
        hist = batch_histogram(before, after)
        num_tasks = sum(hist.values())
        out = {
            "cuda_graphs": graphs, "num_trees": len(trees), "num_nodes": num_nodes, "wall_s": wall,
            "nodes_per_s": num_nodes / wall, "trees_per_s": len(trees) / wall,
            "num_tasks": num_tasks, "mean_batch": num_nodes / num_tasks, "batch_histogram": hist,
            "warm_up_run": warm,
            "captures_in_run": (m.num_captures - captures) if m else 0,
            "capture_s_in_run": (m.capture_s - capture_s) if m else 0.0,
            "replays_total": m.num_replays if m else 0,
            "time_in_stages": timers.report(wall),
        }
        print(f"engine, graphs {'on ' if graphs else 'off'}: {num_nodes} nodes in {wall:.2f} s = "
              f"{out['nodes_per_s']:.3g} nodes/s, {num_tasks} tasks, mean batch {out['mean_batch']:.1f}; "
              f"warm-up captures {warm['num_captures']} in {warm['capture_s']:.2f} s, in run "
              f"{out['captures_in_run']}", flush=True)
        for key, t in out["time_in_stages"].items():
            print(f"  {key:45s} {t['total_ms']:9.1f} ms  {t['share_of_wall']:6.1%}  {t['calls']:7d} calls  "
                  f"{t['us_per_call']:8.1f} µs/call")
        return out, [r.outputs["h"] for r in results]
    finally:
        engine.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--embed", type=int, default=None, help="default: --hidden")
    parser.add_argument("--vocab", type=int, default=30000)
    parser.add_argument("--dtype", default="fp16")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--trees", type=int, default=4000, help="trees per engine run (the sample, repeated)")
    parser.add_argument("--graph-steps", type=int, default=16)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print("gpu_treelstm.py: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # one numeric policy
    dtype = as_dtype(args.dtype)
    model = build_model("treelstm", vocab=args.vocab, embed=args.embed or args.hidden, hidden=args.hidden,
                        dtype=dtype, seed=args.seed, max_batch=args.max_batch)
    sample = load_sst_sample()
    trees = [sample[i % len(sample)] for i in range(args.trees)]
    leaves = [num_leaves(parse_tree(t, args.vocab)) for t in trees]
    counts = {"leaf": sum(leaves), "internal": sum(n - 1 for n in leaves)}
    num_nodes = sum(counts.values())
    cell_types = {name: CellType(f"treelstm/{name}", cell, 0, model.batch_sizes[name])
                  for name, cell in model.cells.items()}
    settings = {**vars(args), "dtype": str(dtype), "tf32": False, "node_counts": counts}
    limits = cell_limits(model, cell_types, counts, args, device)
    engine, outputs = {}, {}
    for graphs in (True, False):
        key = "graphs" if graphs else "eager"
        engine[key], outputs[key] = engine_run(model, trees, num_nodes, graphs, device)
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outputs["graphs"], outputs["eager"]))
    limit = limits["sst_mix_cell_nodes_per_s"]
    ratios = {f"{key}_over_limit": e["nodes_per_s"] / limit for key, e in engine.items()}
    ratios["graphs_over_eager"] = engine["graphs"]["nodes_per_s"] / engine["eager"]["nodes_per_s"]
    ratios["graphs_over_materialized_limit"] = (engine["graphs"]["nodes_per_s"]
                                                / limits["sst_mix_materialized_nodes_per_s"])
    print("ratios:", {k: round(v, 3) for k, v in ratios.items()}, f"max |h graphs - h eager| = {diff:.3g}")
    payload = {"settings": settings, "cell_limits": limits, "engine": engine, "ratios": ratios,
               "target": "engine >= 0.5x the GPU-bound limit of its cells (SST mix, batch 64)",
               "max_abs_diff_graphs_vs_eager": diff}
    path = write_results("gpu_treelstm", str(device), payload, plot=lambda fig: _plot(fig, limits, engine))
    print(f"wrote {path}")
    return 0


def _plot(fig, limits: dict, engine: dict) -> None:
    left, right = fig.subplots(1, 2)
    bars = {"leaf cell\n(graph)": limits["leaf"]["cell_nodes_per_s"],
            "internal cell\n(graph)": limits["internal"]["cell_nodes_per_s"],
            "SST mix\ncells": limits["sst_mix_cell_nodes_per_s"],
            "SST mix\nmaterialized": limits["sst_mix_materialized_nodes_per_s"],
            "engine\ngraphs": engine["graphs"]["nodes_per_s"], "engine\neager": engine["eager"]["nodes_per_s"]}
    left.barh(range(len(bars)), list(bars.values()), color=["C0"] * 4 + ["C3", "C1"])
    left.set_yticks(range(len(bars)), list(bars), fontsize=7)
    left.set_xscale("log")
    left.set_xlabel("nodes/s")
    limit = limits["sst_mix_cell_nodes_per_s"]
    left.set_title(f"engine / limit: graphs {engine['graphs']['nodes_per_s'] / limit:.3f}, "
                   f"eager {engine['eager']['nodes_per_s'] / limit:.3f}", fontsize=8)
    stages = [k for k in engine["graphs"]["time_in_stages"]
              if k.startswith(("loop.admit", "worker.", "scheduler.", "processor.", "materialized."))]
    for i, (key, e) in enumerate(engine.items()):
        us = [e["time_in_stages"].get(k, {}).get("total_ms", 0) * 1e3 / e["num_nodes"] for k in stages]
        right.barh(np.arange(len(stages)) + 0.4 * i, us, height=0.4, label=key)
    right.set_yticks(np.arange(len(stages)) + 0.2, stages, fontsize=6)
    right.set_xlabel("µs per node (manager thread, inclusive)")
    right.legend(fontsize=7)


if __name__ == "__main__":
    sys.exit(main())

"""The engine at saturation against the GPU-bound limit of its own cells (issue 10's ratio).

    python bench/gpu_engine.py                          # LSTM h=1024 fp16 b_max 512, WMT-like lengths
    python bench/gpu_engine.py --model treelstm --trees FILE --max-batch 64
    python bench/gpu_engine.py --device cpu --hidden 64 --vocab 1000 --requests 2000   # a smoke run

limit: the model's cells at batch b_max, `--graph-steps` chained steps captured in one CUDA graph
and replayed back to back (LSTM: torch's nn.LSTMCell on a static input, the figure issue 5 used;
TreeLSTM: the leaf and internal cells, mixed as SST trees mix them); cell-steps (nodes) per second.
engine: `--requests` requests submitted at once (a backlog, so every task is as full as the
engine makes it), cell-steps per second from the first submit to the last result, with the
manager's stage timers (engine.stats()["stage_ms"]) per request and per cell-step.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import replay_windows, write_results  # noqa: E402

from batchmaker import Engine, EngineConfig, SchedulerConfig, build_model  # noqa: E402
from batchmaker.data import read_trees, wmt_sentences  # noqa: E402
from batchmaker.unfolders.common import as_dtype  # noqa: E402
from batchmaker.unfolders.trees import load_sst_sample, num_leaves, parse_tree  # noqa: E402


def graph_us(step, steps: int, replays: int) -> float:
    """µs per call of `step()` captured `steps` times in one CUDA graph (median of 5 windows)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            step()
    return float(np.median(replay_windows(graph, steps, replays)))


@torch.inference_mode()
def limit(model, args, device) -> dict:
    """Cell-steps per second of the cells alone at batch b_max (CUDA graphs)."""
    if device.type != "cuda":
        return {"cell_steps_per_s": None}
    b, g = args.max_batch, torch.Generator().manual_seed(0)
    if args.model == "lstm":
        cell = model.cells["lstm"].to(device)
        x = cell.embedding(torch.randint(3, args.vocab, (b,), generator=g).to(device))
        h = torch.randn(b, args.hidden, generator=g).to(device, x.dtype)
        c = torch.randn(b, args.hidden, generator=g).to(device, x.dtype)
        us = graph_us(lambda: cell.lstm(x, (h, c)), args.graph_steps, args.replays)
        return {"step_us": us, "cell_steps_per_s": b / us * 1e6}
    leaf, internal = model.cells["leaf"].to(device), model.cells["internal"].to(device)
    tok = torch.randint(3, args.vocab, (b,), generator=g).to(device)
    states = [torch.randn(b, args.hidden, generator=g).to(device, leaf.iou.weight.dtype) for _ in range(4)]
    leaf_us = graph_us(lambda: leaf(token=tok), args.graph_steps, args.replays)
    internal_us = graph_us(lambda: internal(*states), args.graph_steps, args.replays)
    per_node = (leaf_us + internal_us) / (2 * b)  # SST trees: n leaves and n - 1 internal nodes
    return {"leaf_us": leaf_us, "internal_us": internal_us, "cell_steps_per_s": 1e6 / per_node}


def requests(args) -> tuple[list[dict], int]:
    """The requests, and the cell-steps (tree nodes) they hold."""
    if args.model == "lstm":
        sentences = wmt_sentences(args.requests, args.vocab, seed=args.seed)
        return [{"tokens": s} for s in sentences], sum(map(len, sentences))
    trees = read_trees(args.trees) if args.trees else load_sst_sample()
    picked = [trees[i % len(trees)] for i in range(args.requests)]
    return [{"tree": t} for t in picked], sum(2 * num_leaves(parse_tree(t, args.vocab)) - 1 for t in picked)


def engine_run(model, args, device) -> dict:
    config = EngineConfig(devices=(str(device),), max_requests=1 << 22,
                          scheduler=SchedulerConfig(max_round_steps=args.round_steps))
    engine = Engine([model], config)
    profiler = None
    if args.cprofile:  # the manager thread's step(), while the timed requests run
        import cProfile
        profiler, step = cProfile.Profile(), engine.step

        def profiled_step():
            if not profiler_on[0]:
                return step()
            profiler.enable()
            try:
                return step()
            finally:
                profiler.disable()
        engine.step = profiled_step
    profiler_on = [False]
    with engine:
        warm, _ = requests(argparse.Namespace(**{**vars(args), "requests": args.warmup}))
        for f in [engine.submit(args.model, r) for r in warm]:
            f.result(300)
        reqs, cell_steps = requests(args)
        before = engine.stats()
        profiler_on[0] = True
        start = time.perf_counter()
        futures = [engine.submit(args.model, r) for r in reqs]
        submitted = time.perf_counter()
        for f in futures:
            f.result(600)
        wall = time.perf_counter() - start
        profiler_on[0] = False
        after = engine.stats()
    stage_ms = {k: after["stage_ms"][k] - before["stage_ms"][k] for k in after["stage_ms"]}
    tasks = after["num_tasks"] - before["num_tasks"]
    manager_ms = stage_ms["admit"] + stage_ms["complete"] + stage_ms["schedule"]
    top = _top_functions(profiler) if profiler is not None else None
    return {"cprofile_manager": top, "wall_s": wall, "submit_s": submitted - start, "num_requests": len(reqs),
            "cell_steps": cell_steps,
            "cell_steps_per_s": cell_steps / wall, "requests_per_s": len(reqs) / wall, "tasks": tasks,
            "mean_batch": cell_steps / max(tasks, 1), "stage_ms": stage_ms,
            "manager_us_per_request": manager_ms * 1e3 / len(reqs),
            "manager_us_per_cell_step": manager_ms * 1e3 / cell_steps,
            "stage_us_per_request": {k: v * 1e3 / len(reqs) for k, v in stage_ms.items()},
            "submit_us_per_request": (submitted - start) * 1e6 / len(reqs)}


def _top_functions(profiler, limit: int = 30) -> list[dict]:
    import io
    import pstats
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = [{"function": f"{path.rsplit('/', 2)[-1] if '/' in path else path}:{line}({fn})", "calls": nc,
             "tottime_ms": tt * 1e3, "cumtime_ms": ct * 1e3} for (path, line, fn), (cc, nc, tt, ct, _) in stats.stats.items()]
    rows.sort(key=lambda r: r["tottime_ms"], reverse=True)
    for r in rows[:limit]:
        print(f"  {r['tottime_ms']:9.1f} ms self {r['cumtime_ms']:9.1f} ms cum {r['calls']:8d}  {r['function']}")
    return rows[:limit]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="lstm", choices=["lstm", "treelstm"])
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="fp16")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=30000)
    parser.add_argument("--max-batch", type=int, default=None, help="b_max (default: 512 LSTM, 64 TreeLSTM)")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--trees", default=None, help="TreeLSTM: a file of bracketed trees (default: the SST sample)")
    parser.add_argument("--round-steps", type=int, default=SchedulerConfig.max_round_steps, help="steps per chain round")
    parser.add_argument("--graph-steps", type=int, default=16)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cprofile", action="store_true", help="profile the manager's step() during the timed run")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    args.max_batch = args.max_batch or (512 if args.model == "lstm" else 64)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    sizes = dict(vocab=args.vocab, embed=args.hidden, hidden=args.hidden, dtype=as_dtype(args.dtype),
                 max_batch=args.max_batch)
    result = {"limit": limit(build_model(args.model, **sizes), args, device)}
    result["engine"] = engine_run(build_model(args.model, **sizes), args, device)
    bound = result["limit"]["cell_steps_per_s"]
    result["engine_over_limit"] = result["engine"]["cell_steps_per_s"] / bound if bound else None
    e = result["engine"]
    print(f"{args.model}: engine {e['cell_steps_per_s']:.3g} cell-steps/s ({e['requests_per_s']:.0f} req/s, mean batch "
          f"{e['mean_batch']:.0f}); limit {bound and f'{bound:.3g}'}; ratio {result['engine_over_limit']}; manager "
          f"{e['manager_us_per_request']:.1f} µs/request, {e['manager_us_per_cell_step']:.2f} µs/cell-step; stages "
          f"{ {k: round(v, 2) for k, v in e['stage_us_per_request'].items()} } µs/request", flush=True)
    name = f"gpu_engine-{args.model}" + (f"-{args.tag}" if args.tag else "")
    print("wrote", write_results(name, args.device, {"settings": vars(args), **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What BatchMaker itself costs: scheduling and bookkeeping per task and per node, with a no-op cell.

The cell returns its state unchanged, so what is measured is the engine, not arithmetic. Requests are
chains of L nodes (LSTM-like: the state h flows from step to step, one host token per step).

With --chains each request is one chain node (`g.add_chain`, batchmaker/chain.py) instead of L
nodes: the same cell steps, bookkept per chain group step instead of per node.

(a) end to end: an Engine with one CPU worker runs R = k*B requests submitted at once; wall time over
    engine.stats()["num_tasks"] and over the number of nodes.
(b) breakdown: the engine's pieces driven from one thread (no worker thread), each phase timed:
    admit     processor.admit: unfold, validate host inputs, partition, enqueue
    schedule  scheduler.schedule (Algorithm 1 + dependency update) + processor.on_submit
    plan      worker.plan: row allocation, staging of host tokens, index building
    execute   worker.execute: gather -> cell -> scatter on CPU torch
    complete  worker.finish + scheduler.complete + processor.complete

    python bench/overhead.py            # sweep B = 8..1024 (about a minute on 2 cores)
    python bench/overhead.py --quick    # B = 64 and 512, fewer steps: a smoke run
"""
import argparse
import gc
import random
import subprocess
import time
from concurrent.futures import Future, wait

import torch

from batchmaker import Cell, Engine, EngineConfig, Model, Signature, TensorSpec
from batchmaker.model import CellType
from batchmaker.request import Request
from batchmaker.request_processor import RequestProcessor
from batchmaker.scheduler import Scheduler
from batchmaker.worker import Worker
from common import RESULTS, write_results

PHASES = ("admit", "schedule", "plan", "execute", "complete")
VOCAB = 1000


class NoOpCell(Cell):
    """One int64 token and a float (1,) state in, the state out unchanged: compute ~ 0."""

    def __init__(self):
        super().__init__()
        self.signature = Signature(
            inputs={"token": TensorSpec((), torch.int64, high=VOCAB), "h": TensorSpec((1,))},
            outputs={"h": TensorSpec((1,))},
        )

    def forward(self, token: torch.Tensor, h: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": h}  # h: [B, 1]


def chain_unfold(inputs: dict, g) -> dict:
    node = g.add("noop", token=inputs["tokens"][0], h=None)  # None: zero initial state
    for token in inputs["tokens"][1:]:
        node = g.add("noop", token=token, h=node["h"])
    return {"h": node["h"]}


def chain_group_unfold(inputs: dict, g) -> dict:
    node = g.add_chain("noop", steps={"token": inputs["tokens"]}, carry={"h": "h"}, h=None)
    return {"h": node["h"]}


def batch_sizes(b: int) -> tuple[int, ...]:
    """(1, 2, 4, .., b): every power of two below b, then b."""
    return tuple(1 << i for i in range((b - 1).bit_length())) + (b,)


CHAINS = False  # set by --chains


def make_model(b: int) -> Model:
    unfold = chain_group_unfold if CHAINS else chain_unfold
    return Model("noop", {"noop": NoOpCell()}, unfold, batch_sizes={"noop": batch_sizes(b)})


def make_inputs(num_requests: int, length: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"tokens": [rng.randrange(VOCAB) for _ in range(length)]} for _ in range(num_requests)]


def run_engine(b: int, inputs: list[dict]) -> dict:
    """(a): wall time of the whole run, from the first submit to the last result."""
    with Engine([make_model(b)], EngineConfig(devices=("cpu",), max_requests=1 << 20)) as engine:
        start = time.perf_counter_ns()
        futures = [engine.submit("noop", x) for x in inputs]
        wait(futures)
        wall_ns = time.perf_counter_ns() - start
        assert all(f.exception() is None for f in futures)
        stats = engine.stats()
    return {"wall_ns": wall_ns, "num_tasks": stats["num_tasks"], "batch_sizes": stats["batch_sizes"]}


def run_breakdown(b: int, inputs: list[dict]) -> dict:
    """(b): the manager loop's steps, called directly in one thread, each phase timed."""
    model = make_model(b)
    cell_type = CellType("noop/noop", model.cells["noop"], 0, batch_sizes(b))
    scheduler = Scheduler([cell_type])
    peers: list[Worker] = []
    worker = Worker(0, torch.device("cpu"), {id(cell_type): model.cells["noop"].eval()}, peers)
    peers.append(worker)
    processor = RequestProcessor(scheduler, worker.read, worker.release)
    ns = dict.fromkeys(PHASES, 0)
    clock = time.perf_counter_ns
    futures, num_tasks = [], 0

    t = clock()
    for i, x in enumerate(inputs):
        request = Request(i, "noop", x, Future())
        futures.append(request.future)
        processor.admit(request, model, {"noop": cell_type})
    ns["admit"] += clock() - t
    while processor.requests:
        t0 = clock()
        tasks = scheduler.schedule(worker.id)
        for task in tasks:
            processor.on_submit(task)
        t1 = clock()
        for task in tasks:
            task.handle = worker.plan(task)
            worker.num_in_flight += 1
        t2 = clock()
        with torch.inference_mode():
            for task in tasks:
                worker.execute(task)
        t3 = clock()
        for task in tasks:
            worker.finish(task)
            scheduler.complete(task)
            processor.complete(task)
        t4 = clock()
        assert tasks, "nothing schedulable while requests are live"
        num_tasks += len(tasks)
        for phase, dt in zip(PHASES[1:], (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            ns[phase] += dt
    assert all(f.done() and f.exception() is None for f in futures)
    assert worker.memory.num_rows_used == 0 and scheduler.num_ready == 0  # nothing leaked
    return {"ns": ns, "num_tasks": num_tasks}


def collected(run, b: int, inputs: list[dict]) -> dict:
    """Start each run from a collected heap (the graphs of the last run hold reference cycles)."""
    gc.collect()
    return run(b, inputs)


def measure(b: int, args) -> dict:
    """Best of the repeats (noise only adds time, as in timeit) for (a) and for each phase of (b);
    as µs per task, per node, per request."""
    inputs = make_inputs(args.requests_per_batch * b, args.length, seed=b)
    num_nodes = len(inputs) * args.length
    engine_runs = [collected(run_engine, b, inputs) for _ in range(args.repeats)]
    breakdowns = [collected(run_breakdown, b, inputs) for _ in range(args.repeats)]
    num_tasks = breakdowns[0]["num_tasks"]
    phase_ns = {p: min(r["ns"][p] for r in breakdowns) for p in PHASES}
    wall_ns = min(r["wall_ns"] for r in engine_runs)
    engine_tasks = engine_runs[0]["num_tasks"]
    return {
        "batch": b,
        "num_requests": len(inputs),
        "num_nodes": num_nodes,
        "engine": {
            "num_tasks": engine_tasks,
            "us_per_task": wall_ns / 1e3 / engine_tasks,
            "us_per_node": wall_ns / 1e3 / num_nodes,
            "nodes_per_s": num_nodes / (wall_ns / 1e9),
            "batch_sizes": engine_runs[0]["batch_sizes"],
        },
        "breakdown": {
            "num_tasks": num_tasks,
            "us_per_task": {p: phase_ns[p] / 1e3 / num_tasks for p in PHASES},
            "us_per_node": {p: phase_ns[p] / 1e3 / num_nodes for p in PHASES},
            "admit_us_per_request": phase_ns["admit"] / 1e3 / len(inputs),
            "total_us_per_node": sum(phase_ns.values()) / 1e3 / num_nodes,
        },
    }


def print_table(rows: list[dict]) -> None:
    head = f"{'B':>5} {'tasks':>5} | {'engine µs/task':>14} {'µs/node':>8} |"
    print(head + "".join(f" {p:>9}" for p in PHASES) + f" {'sum':>8}  (breakdown: µs/task; µs/node)")
    for r in rows:
        e, d = r["engine"], r["breakdown"]
        per_task = "".join(f" {d['us_per_task'][p]:9.1f}" for p in PHASES)
        per_node = "".join(f" {d['us_per_node'][p]:9.2f}" for p in PHASES)
        print(f"{r['batch']:5d} {e['num_tasks']:5d} | {e['us_per_task']:14.1f} {e['us_per_node']:8.2f} |"
              f"{per_task} {sum(d['us_per_task'].values()):8.1f}")
        print(f"{'':5} {'':5} | {'':14} {'':8} |{per_node} {d['total_us_per_node']:8.2f}")


def plot(rows: list[dict], title: str):
    def draw(fig):
        batches = [r["batch"] for r in rows]
        for i, unit in enumerate(("us_per_task", "us_per_node")):
            ax = fig.add_subplot(1, 2, i + 1)
            for p in PHASES:
                ax.plot(batches, [r["breakdown"][unit][p] for r in rows], marker="o", label=p)
            ax.plot(batches, [r["engine"][unit] for r in rows], "k--", marker="s", label="engine (a)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("max batch B")
            ax.set_ylabel("µs per task" if i == 0 else "µs per node")
            ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.suptitle(title, fontsize=10)
    return draw


def git_state() -> str:
    """The commit measured, '+dirty' when batchmaker/ has uncommitted changes (they change the numbers)."""
    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=RESULTS).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "batchmaker") else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--length", type=int, default=24, help="nodes per request (L)")
    parser.add_argument("--requests-per-batch", type=int, default=4, help="R = this * B")
    parser.add_argument("--repeats", type=int, default=5, help="best of this many runs")
    parser.add_argument("--no-gc", action="store_true", help="disable Python's cyclic GC (its share)")
    parser.add_argument("--no-save", action="store_true", help="print only (e.g. under cProfile)")
    parser.add_argument("--quick", action="store_true", help="B = 64, 512; L = 8; R = B; 1 repeat")
    parser.add_argument("--chains", action="store_true", help="one chain node per request (chain groups)")
    args = parser.parse_args()
    global CHAINS
    CHAINS = args.chains
    if args.quick:
        args.sizes, args.length, args.requests_per_batch, args.repeats = [64, 512], 8, 1, 1
    torch.set_num_threads(1)  # the worker runs tiny ops; intra-op threads only add noise
    run_breakdown(8, make_inputs(8, 4))  # warm-up: torch dispatch, allocator
    if args.no_gc:
        gc.disable()  # collected() still clears cycles between runs
    rows = []
    for b in args.sizes:
        rows.append(measure(b, args))
        print(f"B={b}: done", flush=True)
    print_table(rows)
    if args.no_save:
        return
    config = {"length": args.length, "requests_per_batch": args.requests_per_batch, "repeats": args.repeats,
              "cell": "no-op (h -> h), token int64 high=1000, h float32 (1,)", "torch_threads": 1,
              "gc": "disabled" if args.no_gc else "enabled", "git": git_state(),
              "requests": "one chain node each (chain groups)" if args.chains else "one node per step"}
    name = "overhead" + ("-chains" if args.chains else "") + ("-nogc" if args.no_gc else "")
    title = (f"BatchMaker overhead: no-op cell, one CPU worker, Python GC {config['gc']}"
             + (", chain groups" if args.chains else ""))
    path = write_results(name, "cpu", {"config": config, "rows": rows}, plot(rows, title))
    print(f"wrote {path} (+ .png)")


if __name__ == "__main__":
    main()

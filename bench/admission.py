"""The engine's per-request host cost for chain requests (LSTM-like, one `g.add_chain` node each).

The manager's steps are driven from one thread (no worker thread, no manager thread), and the
phases a request pays for itself are timed, in µs per request:

    submit    Engine.submit on the client thread: checks, Future, Request, admission count, inbox
    admit     Engine._admit: drain the inbox, processor.admit (unfold, check tokens, add_chain,
              partition, scheduler.enqueue)
    complete  processor.complete over every task (finish the request: resolve outputs,
              future.set_result and its done callback, free the request's rows)

and, for context (other owners' code): `run` = scheduler.schedule + worker.plan + execute +
processor.on_submit, `finish` = worker.finish + scheduler.complete, both per request too.

Models: `noop` (bench/overhead.py's no-op cell, one chain node per request) and `lstm`
(build_model("lstm", hidden=64, embed=64, vocab=1000) on CPU). Each round submits N requests of
`--length` tokens; best of `--repeats` rounds per phase. The collector runs as in the engine:
gc.freeze() after start-up, enabled during the round (cycles are collected between rounds).

    python bench/admission.py                           # both models, N = 512, L = 24, best of 9
                                                        # (prints; writes bench/results/admission-*.json)
    python bench/admission.py --model lstm --profile admit   # cProfile of one phase (top functions)
"""
import argparse
import cProfile
import gc
import pstats
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
from overhead import VOCAB, NoOpCell, chain_group_unfold, git_state  # noqa: E402

from batchmaker import Engine, EngineConfig, Model, build_model  # noqa: E402
from batchmaker.worker import Worker  # noqa: E402

PHASES = ("submit", "admit", "run", "finish", "complete")


def make_model(name: str) -> Model:
    if name == "noop":
        return Model("noop", {"noop": NoOpCell()}, chain_group_unfold, batch_sizes={"noop": (1, 512)})
    return build_model("lstm", hidden=64, embed=64, vocab=VOCAB)


def driven_engine(model: Model) -> Engine:
    """An Engine whose manager steps this script calls itself, with a synchronous CPU Worker."""
    engine = Engine([model], EngineConfig(max_requests=1 << 20))
    cells = {id(ct): ct.cell.eval() for cts in engine.cell_types.values() for ct in cts.values()}
    engine.workers.append(Worker(0, torch.device("cpu"), cells, engine.workers))
    engine._thread = threading.current_thread()  # submit() accepts while "running"
    return engine


def run_round(engine: Engine, inputs: list[dict], profile: str | None = None) -> dict[str, int]:
    """One round: submit every input, admit them, run to the end; ns per phase."""
    clock = time.perf_counter_ns
    name = next(iter(engine.models))
    worker, scheduler, processor = engine.workers[0], engine.scheduler, engine.processor
    profiler = cProfile.Profile() if profile else None
    ns = dict.fromkeys(PHASES, 0)

    def timed(phase, fn, *args):
        if profile == phase:
            profiler.enable()
        t = clock()
        out = fn(*args)
        ns[phase] += clock() - t
        if profile == phase:
            profiler.disable()
        return out

    futures = timed("submit", lambda: [engine.submit(name, x) for x in inputs])
    engine._wake.clear()  # as the manager loop does before it drains the inbox
    timed("admit", engine._admit)
    while processor.requests:
        tasks = timed("run", schedule_and_run, engine)
        assert tasks, "nothing schedulable while requests are live"
        timed("finish", lambda: [(worker.finish(t), scheduler.complete(t)) for t in tasks])
        timed("complete", lambda: [processor.complete(t) for t in tasks])
    assert all(f.done() and f.exception() is None for f in futures)
    assert worker.memory.num_rows_used == 0 and engine.num_accepted == engine.num_finished
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return ns


def schedule_and_run(engine: Engine) -> list:
    worker = engine.workers[0]
    tasks = engine.scheduler.schedule(worker.id)
    for task in tasks:  # as Engine._schedule with a CPUWorker, minus the thread
        task.handle = worker.plan(task)
        worker.num_in_flight += 1
        engine.processor.on_submit(task)
    with torch.inference_mode():
        for task in tasks:
            worker.execute(task)
    return tasks


def measure(model_name: str, args) -> dict:
    engine = driven_engine(make_model(model_name))
    rng = random.Random(0)
    inputs = [{"tokens": [rng.randrange(VOCAB) for _ in range(args.length)]} for _ in range(args.requests)]
    run_round(engine, inputs[:64])  # warm-up: torch dispatch, allocator, admission caches
    gc.collect()
    gc.freeze()  # as Engine.start: models and torch leave the collector's view
    rounds = []
    for _ in range(args.repeats):
        gc.collect()
        rounds.append(run_round(engine, inputs))
    best = {p: min(r[p] for r in rounds) / 1e3 / len(inputs) for p in PHASES}
    gc.unfreeze()
    return {"model": model_name, "requests": len(inputs), "length": args.length, "us_per_request": best,
            "own_us_per_request": best["submit"] + best["admit"] + best["complete"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["noop", "lstm", "both"], default="both")
    parser.add_argument("--requests", type=int, default=512, help="N requests per round")
    parser.add_argument("--length", type=int, default=24, help="tokens per request")
    parser.add_argument("--repeats", type=int, default=9, help="best of this many rounds")
    parser.add_argument("--profile", choices=["submit", "admit", "complete"], help="cProfile one round's phase")
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = ["noop", "lstm"] if args.model == "both" else [args.model]
    if args.profile:
        engine = driven_engine(make_model(models[0]))
        rng = random.Random(0)
        inputs = [{"tokens": [rng.randrange(VOCAB) for _ in range(args.length)]} for _ in range(args.requests)]
        run_round(engine, inputs[:64])
        gc.freeze()
        run_round(engine, inputs, profile=args.profile)
        return
    print(f"µs per request, best of {args.repeats} rounds of {args.requests} requests x {args.length} tokens")
    print(f"{'model':>6} |" + "".join(f" {p:>9}" for p in PHASES) + " | submit+admit+complete")
    rows = []
    for name in models:
        rows.append(r := measure(name, args))
        print(f"{name:>6} |" + "".join(f" {r['us_per_request'][p]:9.2f}" for p in PHASES)
              + f" | {r['own_us_per_request']:9.2f}", flush=True)
    if not args.no_save:
        config = {"requests": args.requests, "length": args.length, "repeats": args.repeats, "torch_threads": 1,
                  "gc": "enabled, gc.freeze() after warm-up", "git": git_state()}
        print(f"wrote {write_results('admission', 'cpu', {'config': config, 'rows': rows})}")


if __name__ == "__main__":
    main()

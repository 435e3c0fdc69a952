"""The manager thread's cost per request with the device taken out: a CPU worker whose tasks
compute nothing (rounds record zeros, fetched rows are zeros), so that what is timed is
admission, forming, launching (here: handing the task to the null worker) and completion alone,
on any machine (issue 10's budget; issue 35's per-stage µs).

    python bench/manager.py                                   # LSTM, 40,000 WMT-like requests
    python bench/manager.py --model seq2seq --requests 20000  # decodes run to max_len = source length
    python bench/manager.py --model treelstm --trees ../shared/data/sst/train.txt --max-batch 512
    python bench/manager.py --per-turn 256 --repeats 3 --json out.json

--per-turn N: N requests are submitted before each Engine.step() (arrivals spread over the
manager's turns, as under steady load; 0: all at once). The caller drives Engine.step() (no
manager thread; nothing competes for the GIL). --root: import batchmaker from that tree (to time
another commit with this same script). Prints requests/s, submit µs per request (the caller's
side) and the manager's stage timers per request; with --json, every repeat's numbers.
"""
import argparse
import json
import sys
import time
from pathlib import Path


def null_round(self, task) -> None:
    import numpy as np
    import torch
    task.recorded = {name: np.zeros((task.num_steps, task.batch), dtype=np.int64) for name in task.record}
    task.fetched = {name: torch.zeros(len(rows), 8) for name, rows in task.fetch.items()}


def null_step(self, task) -> None:
    import torch
    task.fetched = {name: torch.zeros(len(lanes), 8) for name, lanes in task.fetch.items()}


def workload(args) -> tuple[str, dict, list[dict], list[dict]]:
    """(model name, its options, warm-up requests, timed requests)."""
    from batchmaker.data import read_trees, wmt_sentences
    if args.model == "treelstm":
        from batchmaker.unfolders.trees import load_sst_sample
        trees = read_trees(args.trees) if args.trees else load_sst_sample()
        pick = [trees[i % len(trees)] for i in range(args.requests + 2000)]
        reqs = [{"tree": t} for t in pick]
        return "treelstm", {"max_batch": args.max_batch}, reqs[args.requests:], reqs[:args.requests]
    warm, timed = (wmt_sentences(n, 1000, seed=s) for n, s in ((2000, 1), (args.requests, 0)))
    if args.model == "lstm":
        return "lstm", {"max_batch": args.max_batch}, [{"tokens": s} for s in warm], [{"tokens": s} for s in timed]
    as_req = lambda s: {"tokens": s, "max_len": min(len(s), 50)}  # (bench/wmt.py's target length)
    return "seq2seq", {"max_batch_encoder": args.max_batch, "max_batch_decoder": args.max_batch // 2}, \
        [as_req(s) for s in warm], [as_req(s) for s in timed]


def run_once(engine, name: str, requests: list[dict], per_turn: int) -> dict:
    """Submit `requests` (per_turn before each step), step until all are done."""
    before, start, submit_s = engine.stats()["stage_ms"], time.perf_counter(), 0.0
    futures = []
    chunk = per_turn or len(requests)
    for a in range(0, len(requests), chunk):
        t = time.perf_counter()
        futures += [engine.submit(name, r) for r in requests[a:a + chunk]]
        submit_s += time.perf_counter() - t
        engine.step()
    for f in futures:  # (in order: one check per future, not a pass over all per step)
        while not f.done():
            engine.step()
        f.result(0)
    wall = time.perf_counter() - start
    after = engine.stats()["stage_ms"]
    n = len(requests)
    stage = {k: round((after[k] - before[k]) * 1e3 / n, 3) for k in after}
    stage["manager"] = round(stage["admit"] + stage["complete"] + stage["schedule"], 3)
    return {"requests_per_s": round(n / wall), "submit_us": round(submit_s * 1e6 / n, 3), "stage_us": stage}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="lstm", choices=["lstm", "seq2seq", "treelstm"])
    ap.add_argument("--requests", type=int, default=40000)
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--round-steps", type=int, default=None, help="SchedulerConfig.max_round_steps")
    ap.add_argument("--trees", default=None, help="a bracket file (default: the shipped SST sample)")
    ap.add_argument("--per-turn", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help="import batchmaker from here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, args.root)
    import torch

    from batchmaker import Engine, EngineConfig, SchedulerConfig, build_model
    from batchmaker.exec.rounds import RoundRunner
    from batchmaker.exec.steps import StepRunner
    RoundRunner.execute, StepRunner.execute = null_round, null_step
    name, options, warm, timed = workload(args)
    steps = args.round_steps or SchedulerConfig.max_round_steps
    config = EngineConfig(devices=("cpu",), max_requests=1 << 22, scheduler=SchedulerConfig(max_round_steps=steps))
    engine = Engine([build_model(name, hidden=8, embed=8, vocab=1000, **options)], config)
    engine.start(thread=False)
    runs = []
    print("batchmaker from", Path(sys.modules["batchmaker"].__file__).parent.parent, flush=True)
    try:
        with torch.inference_mode():
            run_once(engine, name, warm, args.per_turn)
            for _ in range(args.repeats):
                runs.append(run_once(engine, name, timed, args.per_turn))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        engine.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

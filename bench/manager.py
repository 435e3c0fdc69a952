"""The manager thread's cost per LSTM request with the device taken out: a CPU worker whose rounds
compute nothing (their fetched rows are zeros), so that what is timed is admission, forming and
completion alone, on any machine (issue 10's budget: 5 µs per request).

    python bench/manager.py                       # 40,000 WMT-like requests submitted at once
    python bench/manager.py --round-steps 20 --inline

--inline: the caller drives Engine.step() (no manager thread; nothing competes for the GIL).
Prints requests/s, submit µs per request (the caller's side) and the manager's stage timers.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from batchmaker import Engine, EngineConfig, SchedulerConfig, build_model  # noqa: E402
from batchmaker.data import wmt_sentences  # noqa: E402
from batchmaker.exec.rounds import RoundRunner  # noqa: E402


def null_execute(self, task) -> None:
    task.recorded = {name: np.zeros((task.num_steps, task.batch), dtype=np.int64) for name in task.record}
    task.fetched = {name: torch.zeros(len(rows), 8) for name, rows in task.fetch.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40000)
    ap.add_argument("--round-steps", type=int, default=SchedulerConfig.max_round_steps)
    ap.add_argument("--inline", action="store_true", help="drive Engine.step() from this thread")
    args = ap.parse_args(argv)
    RoundRunner.execute = null_execute
    config = EngineConfig(devices=("cpu",), max_requests=1 << 22,
                          scheduler=SchedulerConfig(max_round_steps=args.round_steps))
    engine = Engine([build_model("lstm", hidden=8, vocab=1000)], config)
    engine.start(thread=not args.inline)

    def wait(futures):
        if args.inline:
            for f in futures:  # (in order: one check per future, not a pass over all per step)
                while not f.done():
                    engine.step()
        for f in futures:
            f.result(600)

    try:
        wait([engine.submit("lstm", {"tokens": s}) for s in wmt_sentences(2000, 1000, seed=1)])
        requests = [{"tokens": s} for s in wmt_sentences(args.requests, 1000, seed=0)]
        before, start = engine.stats()["stage_ms"], time.perf_counter()
        futures = [engine.submit("lstm", r) for r in requests]
        submitted = time.perf_counter()
        wait(futures)
        wall = time.perf_counter() - start
        after = engine.stats()["stage_ms"]
    finally:
        engine.stop()
    stage = {k: (after[k] - before[k]) * 1e3 / args.requests for k in after}
    manager = stage["admit"] + stage["complete"] + stage["schedule"]
    print(f"{args.requests / wall:,.0f} requests/s; submit {(submitted - start) * 1e6 / args.requests:.2f} µs "
          f"per request (caller); manager {manager:.2f} µs per request:",
          {k: round(v, 2) for k, v in stage.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

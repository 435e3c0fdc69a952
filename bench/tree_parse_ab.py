"""Two checkouts' batch tree parser (parse_trees on bracket strings), interleaved batch by batch
in one process: µs per tree, the best of --repeats per batch, and the ratio per pass.

    git worktree add --detach /tmp/base COMMIT
    python bench/tree_parse_ab.py --before /tmp/base --after . --trees FILE --json out.json

Run it with glibc's heap trimming off (MALLOC_TRIM_THRESHOLD_ and MALLOC_MMAP_THRESHOLD_ large),
as the engine's busy heap is: in a process that only parses, each batch's freed arrays go back to
the system and the next batch's page faults (~190 a batch of 128) cost more than the parsing.
"""
import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import numpy as np


def load(root: str):
    """parse_trees of the checkout at root (each checkout's batchmaker imported on its own)."""
    for name in [n for n in sys.modules if n == "batchmaker" or n.startswith("batchmaker.")]:
        del sys.modules[name]
    sys.path.insert(0, str(Path(root).resolve()))
    try:
        return importlib.import_module("batchmaker.core.tree_input").parse_trees
    finally:
        sys.path.pop(0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--trees", required=True, help="a bracket file, one tree a line")
    ap.add_argument("--batch", type=int, default=128, help="trees a call (the engine admits ~128 a turn here)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    parsers = {"before": load(args.before), "after": load(args.after)}
    with open(args.trees, encoding="utf-8") as f:
        trees = [line.strip() for line in f if line.strip()]
    batches = [trees[i:i + args.batch] for i in range(0, len(trees) - args.batch + 1, args.batch)]
    seconds = {side: np.zeros((args.repeats, len(batches))) for side in parsers}
    for r in range(args.repeats):
        for i, batch in enumerate(batches):
            for side in ("before", "after") if (r + i) % 2 == 0 else ("after", "before"):
                start = time.perf_counter()
                parsers[side](batch, args.vocab)
                seconds[side][r, i] = time.perf_counter() - start
    per_tree = {side: s.min(axis=0).sum() / (len(batches) * args.batch) * 1e6 for side, s in seconds.items()}
    per_pass = (seconds["before"].sum(axis=1) / seconds["after"].sum(axis=1)).round(3).tolist()
    result = {"args": vars(args), "trees": len(batches) * args.batch,
              "us_per_tree_best": {k: round(v, 3) for k, v in per_tree.items()},
              "ratio": round(per_tree["before"] / per_tree["after"], 3), "ratio_per_pass": per_pass}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

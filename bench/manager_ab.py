"""Two checkouts' manager cost per request, alternated in one command (bench/manager.py run in a
fresh process per checkout, model and round, checkouts in turn), with the medians and ranges of
every stage per checkout and model in one JSON.

    git worktree add --detach /tmp/base COMMIT
    python bench/manager_ab.py --before /tmp/base --after . --rounds 5 --trees FILE --json out.json
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = {"lstm": ["--requests", "40000", "--per-turn", "256"],
             "seq2seq": ["--requests", "20000", "--per-turn", "256"],
             "treelstm": ["--requests", "15000", "--per-turn", "128"]}


def one(root: str, model: str, trees: str | None, repeats: int) -> list[dict]:
    extra = ["--trees", trees] if model == "treelstm" and trees else []
    out = subprocess.run([sys.executable, str(HERE / "manager.py"), "--model", model, "--root", root,
                          "--repeats", str(repeats), *WORKLOADS[model], *extra],
                         check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def summary(runs: list[dict]) -> dict:
    stages = runs[0]["stage_us"].keys()
    return {k: {"median": round(statistics.median(r["stage_us"][k] for r in runs), 2),
                "min": min(r["stage_us"][k] for r in runs), "max": max(r["stage_us"][k] for r in runs)}
            for k in stages}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default=str(HERE.parent))
    ap.add_argument("--models", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3, help="processes per checkout and model, alternated")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes per process")
    ap.add_argument("--trees", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    runs = {side: {m: [] for m in args.models} for side in ("before", "after")}
    for r in range(args.rounds):
        for model in args.models:
            for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                got = one(str(Path(getattr(args, side)).resolve()), model, args.trees, args.repeats)
                runs[side][model] += got
                print(side, model, json.dumps(got[-1]["stage_us"]), flush=True)
    result = {"args": vars(args), "workloads": WORKLOADS,
              "summary": {side: {m: summary(v) for m, v in by.items()} for side, by in runs.items()}, "runs": runs}
    for model in args.models:
        b, a = (result["summary"][s][model]["manager"]["median"] for s in ("before", "after"))
        print(f"{model}: manager µs per request, median {b} -> {a} ({b / a:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The replicas' front before and after a change, in one command: bench/front_cost.py's runs of
replicas (submit, front thread and front process CPU µs per request, at saturation and under paced
arrivals) alternately with two source trees, each with its own PYTHONPATH, `--repeats` times.

    git worktree add --detach /tmp/base <commit>
    python bench/front_ab.py --base /tmp/base --repeats 3 --new-min-turns 0

Writes every run and the medians per tree to bench/results/front_ab-cpu-*.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

HERE = Path(__file__).resolve().parent


def run_once(tree: Path, args, extra: list[str]) -> dict:
    """One bench/front_cost.py run (this tree's bench) with `tree`'s batchmaker."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        command = [sys.executable, str(HERE / "front_cost.py"), "--only-replicas", "--json", str(out),
                   "--replicas", *map(str, args.replicas), "--requests", str(args.requests),
                   "--rates", *map(str, args.rates), "--duration", str(args.duration), *extra]
        subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=str(tree)), stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["runs"]


def commit(tree: Path) -> str:
    """The tree's commit (+ "-dirty" with uncommitted changes to tracked files)."""
    return subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty", "--abbrev=12"],
                          capture_output=True, text=True, check=True).stdout.strip()


def medians(runs: list[dict]) -> dict:
    """Per replica count: the burst's and each paced rate's µs per request, median over runs."""
    table = {}
    for key in runs[0]:
        burst = {k: statistics.median(r[key]["burst"][k] for r in runs) for k in ("submit_us", "thread_us", "process_us", "rate")}
        paced = {str(int(p["offered"])): {k: statistics.median(r[key]["paced"][i][k] for r in runs)
                                          for k in ("thread_us", "process_us")}
                 for i, p in enumerate(runs[0][key]["paced"])}
        table[key] = {"burst": burst, "paced": paced}
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the tree before (a git worktree)")
    parser.add_argument("--new", type=Path, default=HERE.parent, help="the tree after (default: this one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--requests", type=int, default=60000)
    parser.add_argument("--rates", type=float, nargs="+", default=[5000, 20000])
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--new-min-turns", type=float, nargs="*", default=[],
                        help="also run the new tree with these ReplicasConfig.min_turn values")
    args = parser.parse_args(argv)
    trees = {"base": args.base.resolve(), "new": args.new.resolve()}
    variants = {"base": (trees["base"], []), "new": (trees["new"], [])}
    variants.update({f"new, min_turn={m:g}": (trees["new"], ["--min-turn", str(m)]) for m in args.new_min_turns})
    runs: dict[str, list] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        for name, (tree, extra) in variants.items():  # alternately
            runs[name].append(run_once(tree, args, extra))
            print(f"repeat {repeat} {name}: {json.dumps(medians(runs[name][-1:]))}", flush=True)
    record = {"commits": {name: commit(tree) for name, tree in trees.items()},
              "medians": {name: medians(r) for name, r in runs.items()}, "runs": runs}
    print(json.dumps(record["medians"], indent=1))
    print(f"wrote {write_results('front_ab', 'cpu', record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

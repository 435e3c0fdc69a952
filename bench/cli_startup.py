"""Start-up time of the command line: `batchmaker --help` and `batchmaker client health --timeout
0.5` against a running `batchmaker serve`, each in a fresh process, best of N; and whether either
imports torch (`python -X importtime`). The goal (issue 13) is under 1 s on a 2-core machine,
which means neither may import torch (about 2 s alone).

    python bench/cli_startup.py             # best of 5 runs
    python bench/cli_startup.py --runs 10
"""
import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402  (imports torch, in this process only)


def cli() -> list[str]:
    """The console script a user runs; `python -m` where it is not installed."""
    script = shutil.which("batchmaker")
    return [script] if script else [sys.executable, "-m", "batchmaker.serving.cli"]


def timed(argv: list[str], runs: int) -> dict:
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=120)
        seconds.append(time.perf_counter() - start)
    return {"best_s": min(seconds), "median_s": statistics.median(seconds), "runs_s": seconds}


def imports_torch(args: list[str]) -> bool:
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "batchmaker.serving.cli", *args],
                         capture_output=True, text=True, timeout=120)
    return any(line.rpartition("|")[2].strip() == "torch" for line in run.stderr.splitlines())


def start_server(address: str) -> subprocess.Popen:
    server = subprocess.Popen([*cli(), "--log-level", "warning", "serve", "--models", "lstm", "--set", "hidden=8",
                               "--set", "embed=8", "--address", address])
    deadline = time.monotonic() + 120
    while subprocess.run([*cli(), "client", "health", "--address", address, "--timeout", "1"],
                         capture_output=True).returncode != 0:
        if time.monotonic() > deadline or server.poll() is not None:
            server.kill()
            raise SystemExit("the server did not start")
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per command; the best is reported")
    args = parser.parse_args()
    address = f"ipc://{tempfile.mkdtemp(prefix='bm-cli-')}/s"
    commands = {"help": ["--help"], "client_health": ["client", "health", "--address", address, "--timeout", "0.5"]}
    server = start_server(address)
    try:
        results = {name: timed([*cli(), *argv], args.runs) | {"imports_torch": imports_torch(argv)}
                   for name, argv in commands.items()}
    finally:
        server.terminate()
        server.wait(60)
    for name, r in results.items():
        print(f"batchmaker {' '.join(commands[name][:2])}: best {r['best_s']:.3f} s, median {r['median_s']:.3f} s "
              f"of {args.runs}; imports torch: {r['imports_torch']}")
    payload = {"cli": [Path(part).name for part in cli()], "runs": args.runs, "goal_s": 1.0, "commands": commands, **results}
    print(f"wrote {write_results('cli_startup', 'cpu', payload)}")


if __name__ == "__main__":
    main()

"""What the OpenAI-compatible HTTP path costs per streamed token, against the ZeroMQ path, on one
`batchmaker serve --http` process (one engine behind both).

The same streams (C concurrent, each `--tokens` tokens, EOS ignored) go over three paths, in
shuffled order each repeat: ZeroMQ with token ids (`tokens`: the protocol's floor), ZeroMQ with
text (`prompt`: the engine decodes the text), and HTTP (/v1/completions, server-sent events:
detokenized and cut at stop strings by the front). Measured: the server process's CPU time per
streamed token (/proc, user + system: what the path costs the server, whatever the client), the
wall time and tokens/s, and the gaps between a stream's tokens as the client sees them. The load
generator is this process: a light aiohttp reader (or, `--client openai`, the openai async client);
with `--processes N`, N processes of their own (started once, each with its own ZeroMQ client and
event loop), each sending its share of a round's streams at the same signal (the issue's setting:
the load apart from the server, the openai client as users run it).

With `--base TREE` two servers run side by side, this tree's and TREE's (a git worktree of the
commit before a change, its own PYTHONPATH), and every repeat runs each (server, path) pair once in
shuffled order: a before/after in one command. The load generators' CPU per token is measured too
(on a machine with few cores, a client that cannot keep up bunches the tokens it reads).

    python bench/http_overhead.py                         # the tiny checkpoint, CPU (bench/tiny_checkpoint.py)
    python bench/http_overhead.py --checkpoint /models/Llama-2-7b-hf --devices cuda:0 \\
        --concurrency 1 64 256 --tokens 256 --client openai --processes 4        # the GPU run
    git worktree add --detach /tmp/base <commit>; python bench/http_overhead.py --base /tmp/base ...
"""
import argparse
import asyncio
import multiprocessing
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
from tiny_checkpoint import save_tiny_chat_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Cellular batching serves"
PATHS = ("zmq-tokens", "zmq-text", "http")


def start_server(checkpoint: str, devices: str, num_blocks: int,
                 tree: Path | None = None) -> tuple[subprocess.Popen, str, str]:
    """`batchmaker serve` with --http on a free port, run in `tree` (its batchmaker first on the
    path; default this checkout); (process, ZeroMQ address, HTTP url)."""
    address = f"ipc://{tempfile.mkdtemp(prefix='bm-http-')}/s"
    tree = (tree or ROOT).resolve()  # (`python -m` puts the working directory first on the path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "batchmaker.serving.cli", "serve", "--models", "llama",
                             "--set", f"llama.checkpoint={checkpoint}", "--set", f"llama.num_blocks={num_blocks}",
                             "--devices", devices, "--address", address, "--http", "127.0.0.1:0"],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tree)
    for line in proc.stderr:
        found = re.search(r"OpenAI-compatible HTTP API on (http://\S+)", line)
        if found:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # (keep the pipe drained)
            return proc, address, found[1]
    raise RuntimeError(f"the server exited ({proc.wait()})")


def cpu_seconds(pid: int) -> float:
    """CPU time of the process's threads: schedstat's nanoseconds where the kernel keeps them (the
    server's threads live as long as it does), else utime + stime in clock ticks (10 ms)."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks.iterdir()) / 1e9
    except (FileNotFoundError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def zmq_round(client, concurrency: int, tokens: int, ids: list[int] | None, first_seed: int = 0) -> list[list[float]]:
    """Arrival instants of `concurrency` streams sent at once: of every token (`ids`), or, with the
    text prompt (`ids` None), of every piece of text, as over HTTP (a token that ends inside a
    character, or a special token, brings none: ~27% of the tiny tokenizer's ids, sampled at
    random, do, so a text stream's gaps span two iterations that often)."""
    arrivals = [[] for _ in range(concurrency)]
    prompt = {"prompt": PROMPT} if ids is None else {"tokens": ids}

    def arrived(partial: dict, a: list) -> None:
        if ids is not None or partial.get("text"):
            a.append(time.perf_counter())
    futures = [client.submit("llama", {**prompt, "max_new_tokens": tokens, "ignore_eos": True,
                                       "seed": first_seed + i, "temperature": 1.0},
                             on_partial=lambda partial, a=arrivals[i]: arrived(partial, a))
               for i in range(concurrency)]
    for f in futures:
        f.result(600)
    return arrivals


async def http_round(url: str, concurrency: int, tokens: int, client_kind: str,
                     first_seed: int = 0) -> list[list[float]]:
    body = {"model": "llama", "prompt": PROMPT, "max_tokens": tokens, "stream": True, "temperature": 1.0}
    if client_kind == "openai":
        import openai

        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)

        async def one(i: int) -> list[float]:
            stream = await client.completions.create(**body, seed=first_seed + i, extra_body={"ignore_eos": True})
            return [time.perf_counter() async for c in stream if c.choices and c.choices[0].text]
        try:
            return list(await asyncio.gather(*(one(i) for i in range(concurrency))))
        finally:
            await client.close()
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(i: int) -> list[float]:
            async with session.post(f"{url}/v1/completions", json={**body, "seed": first_seed + i,
                                                                   "ignore_eos": True}) as reply:
                assert reply.status == 200, await reply.text()
                return [time.perf_counter() async for line in reply.content
                        if line.startswith(b"data: {") and b'"text":""' not in line]
        return list(await asyncio.gather(*(one(i) for i in range(concurrency))))


def generator(pipe, targets: list[tuple[str, str]], client_kind: str, tokens: int, ids: list[int]) -> None:
    """A load-generator process: runs its share of each round it is sent ((server, path, streams,
    first seed); None: stop) against targets[server] (ZeroMQ address, HTTP url) and sends back
    the streams' token arrival instants (time.perf_counter: the system's monotonic clock,
    comparable across processes)."""
    from batchmaker.serving.client import Client

    clients = [Client(address, timeout=600) for address, _ in targets]
    try:
        pipe.send("ready")
        while (work := pipe.recv()) is not None:
            server, path, streams, first_seed = work
            if path == "http":
                arrivals = asyncio.run(http_round(targets[server][1], streams, tokens, client_kind, first_seed))
            else:
                arrivals = zmq_round(clients[server], streams, tokens, ids if path == "zmq-tokens" else None,
                                     first_seed)
            pipe.send(arrivals)
    finally:
        for client in clients:
            client.close()


class Generators:
    """N load-generator processes: a round's streams split among them, sent at once."""

    def __init__(self, n: int, targets: list[tuple[str, str]], client_kind: str, tokens: int, ids: list[int]):
        context = multiprocessing.get_context("spawn")
        self.pipes, self.processes = [], []
        for _ in range(n):
            mine, theirs = context.Pipe()
            process = context.Process(target=generator, args=(theirs, targets, client_kind, tokens, ids), daemon=True)
            process.start()
            self.pipes.append(mine)
            self.processes.append(process)
        for pipe in self.pipes:
            assert pipe.recv() == "ready"

    def round(self, server: int, path: str, concurrency: int) -> list[list[float]]:
        shares = [concurrency // len(self.pipes) + (i < concurrency % len(self.pipes)) for i in range(len(self.pipes))]
        busy = [(pipe, share) for pipe, share in zip(self.pipes, shares) if share]
        first = 0
        for pipe, share in busy:
            pipe.send((server, path, share, first))
            first += share
        return [stream for pipe, _ in busy for stream in pipe.recv()]

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.processes)

    def close(self) -> None:
        for pipe, process in zip(self.pipes, self.processes):
            pipe.send(None)
            process.join(30)


def measure(path: str, run_round, pid: int, rounds: int, num_tokens: int, load_cpu) -> dict:
    """`rounds` rounds that generate `num_tokens` in all (every stream its max: EOS is ignored);
    the gaps are between the tokens (ZeroMQ token ids) or the pieces of text (HTTP, ZeroMQ text)
    a client receives: compare HTTP's with ZeroMQ text's. `load_cpu()`: the load generator's CPU
    seconds so far."""
    cpu, load, start = cpu_seconds(pid), load_cpu(), time.perf_counter()
    gaps = []
    for _ in range(rounds):
        for arrivals in run_round():
            gaps += [b - a for a, b in zip(arrivals, arrivals[1:])]
    wall, cpu, load = time.perf_counter() - start, cpu_seconds(pid) - cpu, load_cpu() - load
    gaps.sort()
    return {"path": path, "tokens": num_tokens, "wall_s": wall, "server_cpu_s": cpu,
            "server_cpu_us_per_token": cpu / num_tokens * 1e6,
            "load_cpu_us_per_token": load / num_tokens * 1e6, "tokens_per_s": num_tokens / wall,
            "gap_p50_ms": gaps[len(gaps) // 2] * 1e3, "gap_p90_ms": gaps[int(len(gaps) * 0.9)] * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="a HF Llama directory with tokenizer.json (default: the tiny one, built now)")
    p.add_argument("--devices", default="cpu")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--min-tokens", type=int, default=2048, help="tokens per measurement (rounds repeat to reach it)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--client", choices=["aiohttp", "openai"], default="aiohttp")
    p.add_argument("--processes", type=int, default=0, help="load-generator processes (0: this one)")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    p.add_argument("--base", type=Path, help="a tree before a change: its server runs beside this one's (A/B)")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    checkpoint = args.checkpoint or str(save_tiny_chat_model(Path(tempfile.mkdtemp(prefix="tiny-chat-"))))

    from batchmaker.serving.client import Client

    trees = ["new"] + (["base"] if args.base else [])
    servers = [start_server(checkpoint, args.devices, args.num_blocks)]
    runs, generators, clients = [], None, []
    try:
        if args.base:
            servers.append(start_server(checkpoint, args.devices, args.num_blocks, args.base))
        clients = [Client(address, timeout=600) for _, address, _ in servers]
        ids = _prompt_ids(checkpoint)  # (the ids the text prompt gives: the same work on every path)
        load_cpu = lambda: cpu_seconds(os.getpid())  # noqa: E731
        if args.processes:
            generators = Generators(args.processes, [(a, u) for _, a, u in servers], args.client, args.tokens, ids)
            load_cpu = generators.cpu_seconds
        time.sleep(2.0)
        rounds_of = {"zmq-tokens": lambda s, c: (lambda: zmq_round(clients[s], c, args.tokens, ids)),
                     "zmq-text": lambda s, c: (lambda: zmq_round(clients[s], c, args.tokens, None)),
                     "http": lambda s, c: (lambda: asyncio.run(http_round(servers[s][2], c, args.tokens, args.client)))}
        if generators is not None:
            rounds_of = {path: lambda s, c, path=path: (lambda: generators.round(s, path, c)) for path in PATHS}
        pairs = [(s, path) for s in range(len(servers)) for path in args.paths]
        for c in args.concurrency:
            rounds = max(1, -(-args.min_tokens // (c * args.tokens)))
            for s in range(len(servers)):
                rounds_of["http"](s, c)()  # warm: the first iterations of a new batch shape
            for repeat in range(args.repeats):
                for s, path in random.Random(repeat * 1000 + c).sample(pairs, len(pairs)):
                    run = measure(path, rounds_of[path](s, c), servers[s][0].pid, rounds, rounds * c * args.tokens,
                                  load_cpu)
                    runs.append({"tree": trees[s], "concurrency": c, "repeat": repeat, **run})
                    print(f"c={c:4d} {trees[s]:4s} {path:10s} {run['server_cpu_us_per_token']:8.1f} µs CPU/token "
                          f"{run['tokens_per_s']:9.1f} tok/s  gap p50 {run['gap_p50_ms']:.2f} "
                          f"p90 {run['gap_p90_ms']:.2f} ms", flush=True)
    finally:
        if generators is not None:
            generators.close()
        for client in clients:
            client.close()
        for proc, _, _ in servers:
            proc.terminate()
            proc.wait(60)
    summary = [row for tree in trees for row in _summary([r for r in runs if r["tree"] == tree], tree,
                                                          args.concurrency, args.paths)]
    for row in summary:
        print(row)
    write_results("http-overhead" + (f"-{args.tag}" if args.tag else ""), args.devices.split(",")[0],
                  {"machine": f"{os.cpu_count()} cores ({args.devices}), server and load generator share them",
                   "load_generator": f"{args.processes} processes" if args.processes else "this process",
                   "checkpoint": args.checkpoint or "bench/tiny_checkpoint.py (2 layers, hidden 64, vocab 480)",
                   "client": args.client, "tokens_per_stream": args.tokens,
                   "trees": {"new": _commit(ROOT),
                             **({"base": _commit(args.base)} if args.base else {})},
                   "summary": summary, "runs": runs},
                  plot=lambda fig: _plot(fig, summary))


def _commit(tree: Path) -> str:
    """The tree's commit (+ "-dirty" with uncommitted changes to tracked files)."""
    return subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty", "--abbrev=12"],
                          capture_output=True, text=True).stdout.strip()


def _prompt_ids(checkpoint: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json")).encode(PROMPT).ids


def _summary(runs: list[dict], tree: str, concurrencies: list[int], paths: list[str]) -> list[dict]:
    """Medians per (concurrency, path) of one tree's runs, and HTTP's against ZeroMQ's token ids."""
    rows = []
    keys = ("server_cpu_us_per_token", "load_cpu_us_per_token", "tokens_per_s", "gap_p50_ms", "gap_p90_ms")
    for c in concurrencies:
        of = {path: [r for r in runs if r["concurrency"] == c and r["path"] == path] for path in paths}
        med = {path: {k: statistics.median(r[k] for r in mine) for k in keys} for path, mine in of.items()}
        row = {"tree": tree, "concurrency": c, "median": med,
               "runs": {path: {k: [round(r[k], 2) for r in mine] for k in keys[2:]} for path, mine in of.items()}}
        if "http" in med and "zmq-tokens" in med:
            row["http_tokens_per_s_over_zmq_tokens"] = med["http"]["tokens_per_s"] / med["zmq-tokens"]["tokens_per_s"]
            row["http_extra_us_per_token_vs_zmq_tokens"] = \
                med["http"]["server_cpu_us_per_token"] - med["zmq-tokens"]["server_cpu_us_per_token"]
        if "http" in med and "zmq-text" in med:  # (both gaps between pieces of text)
            row["http_gap_p90_over_zmq_text"] = med["http"]["gap_p90_ms"] / med["zmq-text"]["gap_p90_ms"]
        rows.append(row)
    return rows


def _plot(fig, summary: list[dict]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    for tree in dict.fromkeys(row["tree"] for row in summary):
        rows = [row for row in summary if row["tree"] == tree]
        for path in rows[0]["median"]:
            ax.plot([row["concurrency"] for row in rows], [row["median"][path]["tokens_per_s"] for row in rows],
                    marker="o", linestyle="-" if tree == "new" else "--", label=f"{path} ({tree})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tokens/s (median)")
    ax.set_title("HTTP (SSE) vs ZeroMQ streaming, one server process each")
    ax.legend()


if __name__ == "__main__":
    main()

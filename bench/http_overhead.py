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

    python bench/http_overhead.py                         # the tiny checkpoint, CPU (bench/tiny_checkpoint.py)
    python bench/http_overhead.py --checkpoint /models/Llama-2-7b-hf --devices cuda:0 \\
        --concurrency 1 64 256 --tokens 256 --client openai --processes 4        # the GPU run
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

PROMPT = "Cellular batching serves"
PATHS = ("zmq-tokens", "zmq-text", "http")


def start_server(checkpoint: str, devices: str, num_blocks: int) -> tuple[subprocess.Popen, str, str]:
    """`batchmaker serve` with --http on a free port; (process, ZeroMQ address, HTTP url)."""
    address = f"ipc://{tempfile.mkdtemp(prefix='bm-http-')}/s"
    proc = subprocess.Popen([sys.executable, "-m", "batchmaker.serving.cli", "serve", "--models", "llama",
                             "--set", f"llama.checkpoint={checkpoint}", "--set", f"llama.num_blocks={num_blocks}",
                             "--devices", devices, "--address", address, "--http", "127.0.0.1:0"],
                            stderr=subprocess.PIPE, text=True)
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
    """Token arrival instants of `concurrency` streams sent at once (`ids` None: the text prompt)."""
    arrivals = [[] for _ in range(concurrency)]
    prompt = {"prompt": PROMPT} if ids is None else {"tokens": ids}
    futures = [client.submit("llama", {**prompt, "max_new_tokens": tokens, "ignore_eos": True,
                                       "seed": first_seed + i, "temperature": 1.0},
                             on_partial=lambda partial, a=arrivals[i]: a.append(time.perf_counter()))
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


def generator(pipe, address: str, url: str, client_kind: str, tokens: int, ids: list[int]) -> None:
    """A load-generator process: runs its share of each round it is sent ((path, streams, first
    seed); None: stop) and sends back the streams' token arrival instants (time.perf_counter: the
    system's monotonic clock, comparable across processes)."""
    from batchmaker.serving.client import Client

    with Client(address, timeout=600) as client:
        pipe.send("ready")
        while (work := pipe.recv()) is not None:
            path, streams, first_seed = work
            if path == "http":
                arrivals = asyncio.run(http_round(url, streams, tokens, client_kind, first_seed))
            else:
                arrivals = zmq_round(client, streams, tokens, ids if path == "zmq-tokens" else None, first_seed)
            pipe.send(arrivals)


class Generators:
    """N load-generator processes: a round's streams split among them, sent at once."""

    def __init__(self, n: int, address: str, url: str, client_kind: str, tokens: int, ids: list[int]):
        context = multiprocessing.get_context("spawn")
        self.pipes, self.processes = [], []
        for _ in range(n):
            mine, theirs = context.Pipe()
            process = context.Process(target=generator, args=(theirs, address, url, client_kind, tokens, ids),
                                      daemon=True)
            process.start()
            self.pipes.append(mine)
            self.processes.append(process)
        for pipe in self.pipes:
            assert pipe.recv() == "ready"

    def round(self, path: str, concurrency: int) -> list[list[float]]:
        shares = [concurrency // len(self.pipes) + (i < concurrency % len(self.pipes)) for i in range(len(self.pipes))]
        busy = [(pipe, share) for pipe, share in zip(self.pipes, shares) if share]
        first = 0
        for pipe, share in busy:
            pipe.send((path, share, first))
            first += share
        return [stream for pipe, _ in busy for stream in pipe.recv()]

    def close(self) -> None:
        for pipe, process in zip(self.pipes, self.processes):
            pipe.send(None)
            process.join(30)


def measure(path: str, run_round, pid: int, rounds: int, num_tokens: int) -> dict:
    """`rounds` rounds that generate `num_tokens` in all (every stream its max: EOS is ignored);
    the gaps are between the pieces of text a client receives (a token that ends inside a
    character sends nothing over HTTP: its text comes with the next)."""
    cpu, start = cpu_seconds(pid), time.perf_counter()
    gaps = []
    for _ in range(rounds):
        for arrivals in run_round():
            gaps += [b - a for a, b in zip(arrivals, arrivals[1:])]
    wall, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
    gaps.sort()
    return {"path": path, "tokens": num_tokens, "wall_s": wall, "server_cpu_s": cpu,
            "server_cpu_us_per_token": cpu / num_tokens * 1e6, "tokens_per_s": num_tokens / wall,
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
    p.add_argument("--tag", default="")
    args = p.parse_args()
    checkpoint = args.checkpoint or str(save_tiny_chat_model(Path(tempfile.mkdtemp(prefix="tiny-chat-"))))

    from batchmaker.serving.client import Client

    proc, address, url = start_server(checkpoint, args.devices, args.num_blocks)
    runs, generators = [], None
    try:
        with Client(address, timeout=600) as client:
            ids = _prompt_ids(checkpoint)  # (the ids the text prompt gives: the same work on every path)
            if args.processes:
                generators = Generators(args.processes, address, url, args.client, args.tokens, ids)
            idle = cpu_seconds(proc.pid)
            time.sleep(2.0)
            idle_rate = (cpu_seconds(proc.pid) - idle) / 2.0
            rounds_of = {"zmq-tokens": lambda c: (lambda: zmq_round(client, c, args.tokens, ids)),
                         "zmq-text": lambda c: (lambda: zmq_round(client, c, args.tokens, None)),
                         "http": lambda c: (lambda: asyncio.run(http_round(url, c, args.tokens, args.client)))}
            if generators is not None:
                rounds_of = {path: lambda c, path=path: (lambda: generators.round(path, c)) for path in PATHS}
            for c in args.concurrency:
                rounds = max(1, -(-args.min_tokens // (c * args.tokens)))
                rounds_of["http"](c)()  # warm: the first iterations of a new batch shape
                for repeat in range(args.repeats):
                    for path in random.Random(repeat * 1000 + c).sample(PATHS, len(PATHS)):
                        run = measure(path, rounds_of[path](c), proc.pid, rounds, rounds * c * args.tokens)
                        runs.append({"concurrency": c, "repeat": repeat, **run})
                        print(f"c={c:4d} {path:10s} {run['server_cpu_us_per_token']:8.1f} µs CPU/token "
                              f"{run['tokens_per_s']:9.1f} tok/s  gap p50 {run['gap_p50_ms']:.2f} ms", flush=True)
    finally:
        if generators is not None:
            generators.close()
        proc.terminate()
        proc.wait(60)
    summary = _summary(runs, args.concurrency)
    for row in summary:
        print(row)
    write_results("http-overhead" + (f"-{args.tag}" if args.tag else ""), args.devices.split(",")[0],
                  {"machine": f"{os.cpu_count()} cores ({args.devices}), server and load generator share them",
                   "load_generator": f"{args.processes} processes" if args.processes else "this process",
                   "checkpoint": args.checkpoint or "bench/tiny_checkpoint.py (2 layers, hidden 64, vocab 480)",
                   "client": args.client, "tokens_per_stream": args.tokens, "server_idle_cpu_s_per_s": idle_rate,
                   "summary": summary, "runs": runs},
                  plot=lambda fig: _plot(fig, summary))


def _prompt_ids(checkpoint: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json")).encode(PROMPT).ids


def _summary(runs: list[dict], concurrencies: list[int]) -> list[dict]:
    """Medians per (concurrency, path), and HTTP's extra server CPU per token over each ZeroMQ path."""
    rows = []
    for c in concurrencies:
        med = {path: {k: statistics.median(r[k] for r in runs if r["concurrency"] == c and r["path"] == path)
                      for k in ("server_cpu_us_per_token", "tokens_per_s", "gap_p50_ms", "gap_p90_ms")}
               for path in PATHS}
        spread = {path: [round(r["server_cpu_us_per_token"], 1) for r in runs
                         if r["concurrency"] == c and r["path"] == path] for path in PATHS}
        rows.append({"concurrency": c, "median": med, "server_cpu_us_per_token_runs": spread,
                     "http_extra_us_per_token_vs_zmq_tokens":
                         med["http"]["server_cpu_us_per_token"] - med["zmq-tokens"]["server_cpu_us_per_token"],
                     "http_extra_us_per_token_vs_zmq_text":
                         med["http"]["server_cpu_us_per_token"] - med["zmq-text"]["server_cpu_us_per_token"],
                     "http_tokens_per_s_over_zmq_tokens":
                         med["http"]["tokens_per_s"] / med["zmq-tokens"]["tokens_per_s"]})
    return rows


def _plot(fig, summary: list[dict]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    xs = [row["concurrency"] for row in summary]
    for path in PATHS:
        ax.plot(xs, [row["median"][path]["server_cpu_us_per_token"] for row in summary], marker="o", label=path)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("server CPU µs per streamed token (median)")
    ax.set_title("HTTP (SSE) vs ZeroMQ streaming, one server process")
    ax.legend()


if __name__ == "__main__":
    main()

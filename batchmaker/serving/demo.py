"""`batchmaker demo`: a server in this process on the shipped models and data, driven over ZeroMQ
by the client at a Poisson load, then a table per model (latency percentiles, throughput, batch).
The models: the LSTM, Seq2Seq and TreeLSTM at hidden 128, and a tiny seeded Llama that generates
(sampled, seeded) continuations of WMT-like prompts.
"""
import random
import sys
import time
from concurrent.futures import wait

import torch

from batchmaker.data import wmt_sentences
from batchmaker.engine import Engine
from batchmaker.engine_config import EngineConfig
from batchmaker.registry import build_model
from batchmaker.serving.client import Client
from batchmaker.serving.server import Server, ServerConfig
from batchmaker.unfolders.trees import load_sst_sample

MODELS = ("lstm", "seq2seq", "treelstm", "llama")
# Small enough for a laptop CPU; the paper's sizes (hidden 1024) are what bench/ runs on the GPU.
DEMO_SIZES = dict(vocab=30000, embed=128, hidden=128)
# tiny-llama: 2 layers, hidden 64, vocab 512, 256 positions. A KV cache of its own size (by
# default a decoder takes 90% of a GPU's free memory); iterations of up to 128 tokens.
DEMO_OPTIONS = {"lstm": DEMO_SIZES, "seq2seq": DEMO_SIZES, "treelstm": DEMO_SIZES,
                "llama": dict(preset="tiny-llama", seed=0, num_blocks=1024, max_tokens=128)}
LLAMA_VOCAB, LLAMA_MAX_PROMPT, LLAMA_NEW_TOKENS = 512, 64, 16


def demo_requests(num: int, seed: int) -> dict[str, list[dict]]:
    """`num` requests per model: WMT-like sentences (Seq2Seq decodes as many tokens as it read,
    since its seeded weights never emit EOS), trees from the shipped SST sample, and prompts the
    Llama continues by LLAMA_NEW_TOKENS tokens (fewer if it samples EOS), each with its own seed."""
    rng = random.Random(seed)
    sentences = wmt_sentences(2 * num, vocab=DEMO_SIZES["vocab"], seed=seed)
    prompts = wmt_sentences(num, vocab=LLAMA_VOCAB, seed=seed + 1)
    trees = load_sst_sample()
    return {
        "lstm": [{"tokens": s} for s in sentences[:num]],
        "seq2seq": [{"tokens": s, "max_len": min(len(s), 50)} for s in sentences[num:]],
        "treelstm": [{"tree": rng.choice(trees)} for _ in range(num)],
        "llama": [{"tokens": p[:LLAMA_MAX_PROMPT], "max_new_tokens": LLAMA_NEW_TOKENS, "temperature": 0.8,
                   "top_p": 0.95, "seed": seed * num + i} for i, p in enumerate(prompts)],
    }


def run_demo(duration: float, rate: float, device: str | None, seed: int) -> int:
    device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    models = [build_model(name, **DEMO_OPTIONS[name]) for name in MODELS]
    requests = demo_requests(int(duration * rate * 1.5) + 10, seed)
    print(f"batchmaker demo: lstm, seq2seq, treelstm (hidden {DEMO_SIZES['hidden']}) and llama (tiny-llama, "
          f"{LLAMA_NEW_TOKENS} new tokens) on {device}; Poisson arrivals, {rate:g} requests/s per model for "
          f"{duration:g} s, over ZeroMQ")
    with Engine(models, EngineConfig(devices=(device,))) as engine, \
            Server(engine, ServerConfig("tcp://127.0.0.1:*")) as server, \
            Client(server.address, timeout=max(60.0, 3 * duration)) as client:
        print(f"server on {server.address}")
        sent = drive(client, requests, duration, rate, seed)
        elapsed = time.perf_counter() - sent["start"]
        stats = client.stats()
    print_table(sent["futures"], elapsed, stats)
    return 0 if all(f.exception() is None for _, f in sent["futures"]) else 1


def drive(client: Client, requests: dict[str, list[dict]], duration: float, rate: float, seed: int) -> dict:
    """Open loop: one Poisson stream of `rate * len(models)` arrivals, each a random model; then
    the drain until every request is answered."""
    rng = random.Random(seed)
    names, futures, used = list(requests), [], {name: 0 for name in requests}
    progress = Progress(duration)
    start = time.perf_counter()
    next_arrival = start
    while (now := time.perf_counter()) < start + duration:
        if now >= next_arrival:
            name = rng.choice(names)
            futures.append((name, client.submit(name, requests[name][used[name] % len(requests[name])])))
            used[name] += 1
            next_arrival += rng.expovariate(rate * len(names))
        progress.show(now - start, futures)
        time.sleep(max(0.0, min(next_arrival, progress.next_show) - time.perf_counter()))
    pending = [f for _, f in futures]
    while pending:  # the drain: requests sent near the end are still running
        progress.show(time.perf_counter() - start, futures)
        pending = list(wait(pending, timeout=max(0.0, progress.next_show - time.perf_counter())).not_done)
    progress.show(time.perf_counter() - start, futures, final=True)
    return {"start": start, "futures": futures}


def print_table(futures: list, elapsed: float, stats: dict) -> None:
    print(f"{'model':10} {'requests':>8} {'errors':>6} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
          f"{'req/s':>7} {'mean batch':>10}")
    for name in MODELS:
        mine = [f for n, f in futures if n == name]
        ok = sorted(f.result().timing.latency * 1e3 for f in mine if f.exception() is None)
        at = lambda q: ok[min(len(ok) - 1, int(q * len(ok)))] if ok else float("nan")  # noqa: E731
        sizes = {int(k.rsplit(":", 1)[1]): v for k, v in stats["batch_sizes"].items() if k.startswith(name + "/")}
        mean_batch = sum(s * v for s, v in sizes.items()) / max(1, sum(sizes.values()))
        print(f"{name:10} {len(mine):8d} {len(mine) - len(ok):6d} {at(0.5):8.1f} {at(0.9):8.1f} {at(0.99):8.1f} "
              f"{len(ok) / elapsed:7.1f} {mean_batch:10.1f}")
    generated = sum(len(f.result().outputs["tokens"]) for n, f in futures if n == "llama" and f.exception() is None)
    print(f"llama: {generated} tokens generated, {generated / elapsed:.0f} tokens/s; its batch counts the tokens "
          "of an iteration (prompt chunks and one per decoding request)")


class Progress:
    """A bar redrawn in place on a terminal; a plain line every few seconds otherwise (a log file
    would get one endless line of carriage returns)."""

    def __init__(self, duration: float, stream=None):
        self.duration = duration
        self.stream = sys.stderr if stream is None else stream
        self.is_terminal = self.stream.isatty()
        self.every = 0.2 if self.is_terminal else 5.0  # seconds between updates
        self.next_show = 0.0  # perf_counter instant of the next update
        self.drained_shown = False  # (the drain's last update and the final one would both say so)

    def show(self, elapsed: float, futures: list, final: bool = False) -> None:
        now = time.perf_counter()
        if now < self.next_show and not final:
            return
        self.next_show = now + self.every
        done, sent = sum(f.done() for _, f in futures), len(futures)
        drained = elapsed >= self.duration and done == sent
        if drained and self.drained_shown and not self.is_terminal:  # (a terminal's last redraw ends the line)
            return
        self.drained_shown = drained
        if elapsed < self.duration:
            phase = f"{elapsed:5.1f}/{self.duration:g} s"
        else:  # the drain: requests sent near the end are still running
            phase = f"load done, {'drained' if done == sent else 'draining'} at {elapsed:.1f} s"
        if not self.is_terminal:
            print(f"  {phase}  {done}/{sent} done", file=self.stream, flush=True)
            return
        bar = "#" * int(40 * min(1.0, elapsed / self.duration))
        end = "\n" if final else ""
        print(f"\r  [{bar:40}] {phase}  {done}/{sent} done\033[K", end=end, file=self.stream, flush=True)

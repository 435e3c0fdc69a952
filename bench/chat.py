"""Chat serving on one GPU: a ShareGPT-like workload (Pensieve Table 3.2 statistics), each turn sent
with its whole history (stateless), Poisson arrivals (with --stateful: as conversations whose KV
cache is kept across turns, bench/chat_stateful.py). BatchMaker against HF transformers'
continuous batching and static batching, in one run, with the same random weights.

    python bench/chat.py --device cuda:0 --preset llama-2-7b --dtype bf16

Reports per system and rate: output tokens/s, normalized latency (latency / output tokens) p50/p90,
and for BatchMaker the roofline of the iterations it ran: sum over iterations of max(bytes read /
copy bandwidth, FLOPs / matmul peak), bytes = weights (an untied embedding table left out: only its
tokens' rows are read) + K/V of every context token read, FLOPs = 2 x parameters x tokens (the LM head's:
x sampled tokens; + attention), over the wall time; the bound on that fraction for
iterations whose projections and attention run one after the other (`roofline_fraction_bound`);
and where the wall time went (`device`): the iterations' spans on the GPU (events around each),
graphed and eager apart, each with its roofline over its span, and the fraction the GPU was busy. The decode step alone (one request's
tokens, and B requests decoding together at a fixed context) is timed against the same floor.
"""
import argparse
import gc
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import chat_stateful  # noqa: E402
from bench.common import triton_compiles, write_results  # noqa: E402
from bench.chat_roofline import (device_time, head_parameters, iteration_floor, roofline,  # noqa: E402
                                 saturated_window)
from bench.device_limits import measure as measure_limits  # noqa: E402
from bench.turn_profile import profile_window  # noqa: E402

from bench.workload import INPUT, OUTPUT, TURNS  # noqa: E402


def conversations(n_requests: int, max_context: int, seed: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of each turn, whole history included, in arrival order
    (conversations interleaved at random)."""
    rng = np.random.default_rng(seed)
    turns = []
    while len(turns) < n_requests:
        history = 0
        for _ in range(rng.geometric(1 / TURNS)):
            new = max(1, int(rng.lognormal(np.log(INPUT) - 0.5, 1.0)))
            out = max(1, min(1024, max_context // 4, int(rng.lognormal(np.log(OUTPUT) - 0.5, 1.0))))
            prompt = max(1, min(history + new, max_context - out))
            turns.append((prompt, out))
            history = prompt + out
    rng.shuffle(turns)
    return turns[:n_requests]


def poisson(n: int, rate: float, seed: int) -> np.ndarray:
    if rate == float("inf"):
        return np.zeros(n)
    return np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n))


def summarize(system: str, rate: float, work, latencies: list[float], span: float) -> dict:
    outputs = np.array([o for _, o in work])
    norm = np.array(latencies) / outputs
    return {"system": system, "rate": rate, "requests": len(work), "output_tokens": int(outputs.sum()),
            "tokens_per_s": float(outputs.sum() / span), "wall_s": span,
            "norm_latency_p50_ms": float(np.percentile(norm, 50) * 1e3),
            "norm_latency_p90_ms": float(np.percentile(norm, 90) * 1e3)}


# BatchMaker ------------------------------------------------------------------------------------
def run_batchmaker(engine, work, prompts, rate, seed) -> tuple[dict, list]:
    runner = next(iter(engine.workers[0].iterations.values()))
    runner.trace = []
    gen = engine.structured["llama"]
    before = chat_stateful.engine_counters(engine, gen)
    compiled = len(triton_compiles().kernels)
    arrivals = poisson(len(work), rate, seed)
    done_at, futures = {}, []
    start = time.perf_counter()
    for i, ((p, o), at) in enumerate(zip(work, arrivals)):
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        f = engine.submit("llama", {"tokens": prompts[i], "max_new_tokens": o, "ignore_eos": True})
        f.add_done_callback(lambda f, i=i: done_at.__setitem__(i, time.perf_counter()))
        futures.append(f)
    for f in futures:
        assert len(f.result(600).outputs["tokens"]) > 0
    end = max(done_at.values())
    latencies = [done_at[i] - (start + arrivals[i]) for i in range(len(work))]
    trace, runner.trace = runner.trace, None
    row = summarize("batchmaker", rate, work, latencies, end - start)
    row["window"] = saturated_window(trace, start, arrivals, rate, work, latencies)
    row["engine"] = chat_stateful.engine_delta(before, chat_stateful.engine_counters(engine, gen))
    row["engine"]["extra_tokens"] = row["engine"]["tokens"] - sum(p + o - 1 for p, o in work)  # recomputed
    row["triton_kernels"] = triton_compiles().kernels[compiled:]  # compiled mid-run: the host stalled for each
    row["trace"] = {"tokens": [r.tokens for r in trace], "context": [r.context for r in trace],
                    "pairs": [r.pairs for r in trace], "seqs": [r.seqs for r in trace],
                    "graphed": [int(r.graphed) for r in trace],
                    "ms": [None if r.seconds is None else round(r.seconds * 1e3, 3) for r in trace]}
    return row, trace


def decode_steps(engine, batch: int, context: int, steps: int, vocab: int) -> float:
    """Median seconds between request 0's streamed tokens once all `batch` requests have had
    their prompts prefilled (so that every iteration measured is `batch` decodes and nothing else)."""
    stamps: dict[int, list[float]] = {i: [] for i in range(batch)}
    rng = np.random.default_rng(batch)
    futures = [engine.submit("llama", {"tokens": rng.integers(1, vocab, context).tolist(), "max_new_tokens": steps,
                                       "ignore_eos": True},
                             on_partial=lambda p, i=i: stamps[i].append(time.perf_counter()))
               for i in range(batch)]
    for f in futures:
        f.result(600)
    all_decoding = max(s[0] for s in stamps.values())
    gaps = np.diff([t for t in stamps[0] if t > all_decoding])
    return float(np.median(gaps))


# HF transformers -----------------------------------------------------------------------------------
def hf_model(lm, config):
    """HF's model of the config's family (LlamaForCausalLM, Qwen2ForCausalLM, ...) sharing our
    weights (q/k/v and gate/up are views of our fused ones, or whole where HF fuses them too)."""
    import transformers
    from batchmaker.cells.checkpoint import hf_names
    from batchmaker.cells.decoder_config import to_hf
    from batchmaker.cells.rotary_layout import to_rotary_layout
    hf_config = transformers.AutoConfig.for_model(**to_hf(config))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    state = {}
    for name, tensor in lm.state_dict().items():
        names = hf_names(config, name)
        tensor = to_rotary_layout(config, name, tensor, inverse=True)  # (partial rotary: the checkpoint's rows)
        for hf_name, part in zip(names, _split(tensor, names, config)):
            state[hf_name] = part
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = hf.load_state_dict(state, assign=True, strict=False).missing_keys
    assert not missing, f"HF parameters without our weights: {missing}"
    device = lm.embed_tokens.weight.device
    with torch.device(device):  # (buffers are not in the state dict: made again off the meta device)
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_config)
        if getattr(hf.model.embed_tokens, "embed_scale", None) is not None:  # (Gemma's, in transformers 5)
            hf.model.embed_tokens.embed_scale = torch.tensor(hf_config.hidden_size ** 0.5)
    assert not any(b.is_meta for b in hf.buffers()), [n for n, b in hf.named_buffers() if b.is_meta]
    return hf.to(device).eval()


def _split(tensor, names, config):
    if len(names) == 1:
        return [tensor]
    if len(names) == 3:
        q = config.num_heads * config.head_dim
        kv = config.num_kv_heads * config.head_dim
        return list(tensor.split([q, kv, kv], 0))
    return list(tensor.chunk(2, 0))


def run_hf_continuous(hf, work, prompts, rate, seed) -> dict:
    from transformers import GenerationConfig
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max(o for _, o in work), eos_token_id=-1)
    manager = hf.init_continuous_batching(generation_config=cfg)
    manager.start()
    arrivals = poisson(len(work), rate, seed)
    done_at = {}

    def collect():
        while len(done_at) < len(work):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done_at[result.request_id] = time.perf_counter()

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    start = time.perf_counter()
    for i, ((p, o), at) in enumerate(zip(work, arrivals)):
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        manager.add_request(prompts[i], request_id=f"r{i}", max_new_tokens=o)
    collector.join(timeout=900)
    manager.stop(block=True)
    latencies = [done_at[f"r{i}"] - (start + arrivals[i]) for i in range(len(work))]
    return summarize("hf-continuous", rate, work, latencies, max(done_at.values()) - start)


def run_hf_static(hf, work, prompts, batch: int) -> dict:
    """Request-level batching: `batch` requests padded together, run to the longest output."""
    latencies, start = [], time.perf_counter()
    for b in range(0, len(work), batch):
        group = list(range(b, min(b + batch, len(work))))
        longest = max(work[i][0] for i in group)
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(group):  # left padding
            ids[row, longest - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, longest - len(prompts[i]):] = 1
        n = max(work[i][1] for i in group)
        dev = hf.device
        hf.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        latencies += [time.perf_counter() - start] * len(group)  # all arrived at 0
    return summarize(f"hf-static-b{batch}", float("inf"), work, latencies, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rates", default="2,8,inf", help="requests/s for BatchMaker (inf: all at once)")
    ap.add_argument("--hf-rates", default="1,inf", help="requests/s for HF continuous batching")
    ap.add_argument("--hf-requests", type=int, default=64)
    ap.add_argument("--static-batch", type=int, default=32)
    ap.add_argument("--systems", nargs="+", default=["batchmaker", "hf-continuous", "hf-static"])
    ap.add_argument("--max-tokens", type=int, default=512, help="BatchMaker's token budget per iteration")
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--steps", default="1,64,256", help="decode-step batches to time at context --step-context")
    ap.add_argument("--step-context", type=int, default=336)
    ap.add_argument("--bandwidth", type=float, default=None,
                    help="copy bandwidth (bytes/s) for the roofline; by default this device's, measured at the start")
    ap.add_argument("--peak", type=float, default=None,
                    help="matmul peak (FLOP/s) for the roofline; by default this device's, measured at the start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-up", type=int, default=64,
                    help="BatchMaker serves this many of the requests, unmeasured, before the first rate (a cold "
                         "engine's first run read 0.44 of the roofline instead of 0.52 on an H200)")
    ap.add_argument("--prefill-graph-tokens", type=int, default=None,
                    help="KVSettings.prefill_graph_tokens (graphed iterations with prompt chunks up to it; 0: none)")
    ap.add_argument("--profile-seconds", type=float, default=0.0,
                    help="then serve the requests once more, all at once, the first this many seconds under "
                         "torch.profiler: kernels by name")
    ap.add_argument("--tensor-parallel", type=int, default=1,
                    help="ranks on consecutive GPUs from --device; the roofline then counts every rank's bandwidth "
                         "and peak (the whole model's bytes and FLOPs over tp x each)")
    ap.add_argument("--pipeline-parallel", type=int, default=1,
                    help="stages on consecutive GPUs from --device, counted in the roofline as --tensor-parallel's "
                         "ranks are; the iterations' spans (`device`) are stage 0's")
    chat_stateful.add_arguments(ap)
    args = ap.parse_args(argv)
    ranks = args.tensor_parallel * args.pipeline_parallel
    if ranks > 1 and any(s.startswith("hf") for s in args.systems):
        ap.error("--tensor-parallel, --pipeline-parallel: BatchMaker only (--systems batchmaker)")
    from batchmaker import Engine, EngineConfig
    from batchmaker.cells.decoder_config import PRESETS, num_parameters
    from batchmaker.registry import build_model
    torch.backends.cuda.matmul.allow_tf32 = False
    config = PRESETS[args.preset]
    t0 = time.perf_counter()
    num_blocks = None
    if args.stateful:  # a fixed GPU tier, as Pensieve's evaluation
        from batchmaker.cells.decoder_cell import kv_bytes_per_block
        from batchmaker.unfolders.common import as_dtype
        per_block = kv_bytes_per_block(config, 16, as_dtype(args.dtype))
        num_blocks = int(args.kv_gib * 2**30 // per_block)
    model = build_model("llama", preset=args.preset, dtype=args.dtype, device=args.device, seed=args.seed,
                        max_tokens=args.max_tokens, max_seqs=args.max_seqs, max_new_tokens=1024,
                        num_blocks=num_blocks, tensor_parallel=args.tensor_parallel,
                        pipeline_parallel=args.pipeline_parallel)
    if args.prefill_graph_tokens is not None:
        cell = model.cells["decoder"]
        cell.kv = replace(cell.kv, prefill_graph_tokens=args.prefill_graph_tokens)
    lm = model.cells["decoder"].lm
    itemsize = lm.embed_tokens.weight.element_size()
    params = num_parameters(config)
    print(f"built {args.preset} in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.stateful:
        chat_stateful.run(args, model, config, write_results)
        return
    work = conversations(args.requests, config.max_positions, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    prompts = [rng.integers(1, config.vocab_size, p).tolist() for p, _ in work]
    limits = measure_limits(args.device, lm.embed_tokens.weight.dtype)  # (the roofline's: bench/device_limits.py)
    args.bandwidth = (args.bandwidth or limits.copy_bytes_per_s) * ranks  # (summed over the ranks)
    args.peak = (args.peak or limits.matmul_flops_per_s) * ranks
    read = params - head_parameters(config)[1]  # the parameters an iteration reads
    floor_s = read * itemsize / args.bandwidth
    rows, steps, profile = [], [], None

    def save() -> None:  # after each system: a run cut short keeps what it measured
        payload = {"preset": args.preset, "dtype": args.dtype, "tensor_parallel": args.tensor_parallel,
                   "pipeline_parallel": args.pipeline_parallel,
                   "parameters": params, "weight_floor_ms": floor_s * 1e3,
                   "device_limits": limits.as_dict(), "bandwidth": args.bandwidth, "peak": args.peak,
                   "workload": {"requests": len(work), "mean_prompt": float(np.mean([p for p, _ in work])),
                                "mean_output": float(np.mean([o for _, o in work]))},
                   "decode_steps": steps, "rows": rows, "profile": profile}

        def plot(fig):
            ax = fig.add_subplot(1, 1, 1)
            for system in dict.fromkeys(r["system"] for r in rows if "error" not in r):
                pts = sorted((r["tokens_per_s"], r["norm_latency_p90_ms"]) for r in rows if r["system"] == system
                             and "error" not in r)
                ax.plot(*zip(*pts), marker="o", label=system)
            ax.set_xlabel("output tokens/s")
            ax.set_ylabel("normalized latency p90 (ms/token)")
            ax.set_yscale("log")
            ax.legend()
            ax.set_title(f"{args.preset} {args.dtype}, ShareGPT-like, stateless")
        tp = f"-tp{args.tensor_parallel}" if args.tensor_parallel > 1 else ""
        tp += f"-pp{args.pipeline_parallel}" if args.pipeline_parallel > 1 else ""
        print(write_results(f"chat-{args.preset}{tp}", args.device, payload, plot), flush=True)

    hf = hf_model(lm, config) if any(s.startswith("hf") for s in args.systems) else None
    hf_work, hf_prompts = work[:args.hf_requests], prompts[:args.hf_requests]
    if "hf-continuous" in args.systems:
        for rate in [float(r) for r in args.hf_rates.split(",")]:
            try:
                rows.append(run_hf_continuous(hf, hf_work, hf_prompts, rate, args.seed))
            except Exception as e:  # an API difference between transformers versions: say so, go on
                rows.append({"system": "hf-continuous", "rate": rate, "error": f"{type(e).__name__}: {e}"})
            print(rows[-1], flush=True)
        save()
    if "hf-static" in args.systems:
        rows.append(run_hf_static(hf, hf_work, hf_prompts, args.static_batch))
        print(rows[-1], flush=True)
        save()
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    if "batchmaker" in args.systems:
        started = time.perf_counter()
        engine = Engine([model], EngineConfig(devices=(args.device,))).start()  # (compiles, captures graphs)
        print(f"engine started in {time.perf_counter() - started:.1f} s", flush=True)
        try:
            for batch in [int(b) for b in args.steps.split(",") if b]:
                prefill_iterations = -(-batch * args.step_context // max(1, args.max_tokens - batch))
                step = decode_steps(engine, batch, args.step_context, 48 + prefill_iterations, config.vocab_size)
                ctx = args.step_context + 24  # mid-way through the measured steps
                floor = max((read * itemsize + batch * ctx * 2 * config.num_layers * config.num_kv_heads
                             * config.head_dim * itemsize) / args.bandwidth, 2 * read * batch / args.peak)
                steps.append({"batch": batch, "context": ctx, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
                              "vs_floor": step / floor})
                print(steps[-1], flush=True)
            if args.warm_up:  # the first requests compile kernels for new shapes: not in a measured window
                run_batchmaker(engine, work[:args.warm_up], prompts[:args.warm_up], float("inf"), args.seed)
            for rate in [float(r) for r in args.rates.split(",")]:
                row, trace = run_batchmaker(engine, work, prompts, rate, args.seed)
                ideal = roofline(trace, config, params, itemsize, args.bandwidth, args.peak)
                serial = roofline(trace, config, params, itemsize, args.bandwidth, args.peak, serial=True)
                row.update(iterations=len(trace), roofline_s=ideal, roofline_fraction=ideal / row["wall_s"],
                           serial_roofline_s=serial, roofline_fraction_bound=ideal / serial,
                           mean_tokens_per_iteration=float(np.mean([r.tokens for r in trace])),
                           device=device_time(trace, row["wall_s"], lambda r: iteration_floor(
                               r, config, params, itemsize, args.bandwidth, args.peak)))
                rows.append(row)
                print({k: v for k, v in row.items() if k != "trace"}, flush=True)
            if args.profile_seconds:
                profile = profile_window(engine, work, prompts, args.profile_seconds)  # (bench/turn_profile.py)
                print(profile, flush=True)
        finally:
            engine.stop()
        del engine
        torch.cuda.empty_cache()
        save()


if __name__ == "__main__":
    main()

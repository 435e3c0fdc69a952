"""The offloading executor on one GPU (issue 34), against HF Accelerate's `device_map` offload in
the same command: a Llama-2-13B-sized model in bf16 with random weights (drawn on the GPU and
kept in pinned host memory: no checkpoint on disk), `offload=auto` under a GPU budget, prompts of
`--prompt` tokens and `--new` generated tokens.

For each of `--batches` (a run of that many prompts) the search picks the policy (block at most
that many, and the share of layers whose weights stay on the GPU, `weights_gpu`; printed with its
predicted decode step), the largest run's policy again at each share of `--shares` (the others
equal: what keeping layers resident buys), and one hand-picked policy (`--other`) runs too: for each, generated tokens/s, the block's time, its prefill alone (a block of one token) and
so the decode step ((block - prefill) / (new - 1)), each against the cost model's prediction
(issue: within 20%), the bytes each kind of move carried and the GPU's peak memory (the budget
steers the search; the executor does not enforce it). Then the same policies with 4-bit weights
(`--compress weights`, Triton's expansion; or `kv`, `both` where the policies keep the cache on the
host; greedy agreement with bf16 recorded; the cost model does not count compression, so no
prediction). Then, on one layer's four matrices, Triton's expansion
+ matmul against the fused `linear4` at a few row counts (what would choose `dequant=fused`).
The record is rewritten after each policy (a run cut short keeps what it measured). Policies that
keep the same layers on the GPU share one executor; in bf16 every executor takes the same host
model (a 4-bit one is drawn again per share: its codes replace the model's tensors). Without
`--shares` (bench/gpu.sh passes none, to keep its time limit) the comparison at share 0 is the
earlier runs' (bench/results/README.md). A host cache is attended in decode steps on the GPU after a
move or on the CPU where it lives (FlexGen's delegation, `Placement.cpu_attention`): the search
picks by prediction, `--cpu-attention on|off` forces it, and `--flip-attention` reruns the largest
run's policy with the other way (the A/B; its tokens' agreement with the chosen policy's recorded);
`--other` takes `+cpu_attention` among what is offloaded (without `--gpu-cap`, an A/B run's record is
offload-attention-*.json, beside the day's offload-*.json).

The anchor runs in a second command, processes of its own (both build a 26 GB model on the host):
`--anchor PROBE` runs HF Accelerate's probe (../shared/probes/offload_probe.py, copied to .probes/
for the GPU machine; skipped with a message where missing) at the same settings and adds it to
today's record of the device, with our tokens/s over its (bench/offload_anchor.py).

`--gpu-cap C` (the issue's headline): both sides under one process-wide cap of C GiB on what the
allocator reserves (weights, KV cache, activations, workspace together), set before anything is
allocated; our search's budget is the cap, with the executor's own count of the device
(exec/offload_memory.py); each policy's predicted and measured peaks (allocated, reserved) are
recorded, and a policy out of memory under the cap is recorded as its failure. Each bf16 row
gives the policy's bound (the slowest of host link, host memory and GPU, exec/offload_auto.bound)
and the measured tokens/s over it (the issue: >= 0.7). `--curve NB...` reruns the largest run's
policy at these numbers of GPU batches per block (FlexGen's block size = gpu batch x num batches;
its Table 2), everything else the same. The record is offload-cap-*.json; the anchor under the cap
tries `--anchor-batches` and our best over Accelerate's best is recorded (the issue: >= 10x).

    python bench/offload.py --preset llama-2-13b --gpu-memory 12 --batches 8 64 --prompt 512 --new 32
    python bench/offload.py --preset llama-2-13b --gpu-memory 12 --batches 8 64 --prompt 512 --new 32 \
        --anchor .probes/offload_probe.py
    python bench/offload.py --preset llama-2-13b --gpu-cap 16 --batches 256 --curve 1 2 --no-compress
    python bench/offload.py --preset llama-2-13b --gpu-cap 16 --anchor .probes/offload_probe.py --anchor-batches 16 24 32
"""
import argparse
import gc
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.capped_probe import apply_cap  # noqa: E402
from bench.common import write_results  # noqa: E402
from bench.offload_anchor import anchor  # noqa: E402
from bench.offload_dequant import time_dequant  # noqa: E402
from bench.offload_model import fits_host, host_budget, is_cuda, random_model, weight_floor  # noqa: E402
from bench.offload_names import parse_policy, placement_name, variant_of  # noqa: E402
from batchmaker.cells.decoder import DecoderLM  # noqa: E402
from batchmaker.cells.decoder_config import PRESETS  # noqa: E402
from batchmaker.exec.offload import OffloadConfig, OffloadExecutor  # noqa: E402
from batchmaker.exec.offload_auto import bound, choose, host_bytes, measure, predict  # noqa: E402
from batchmaker.exec.offload_memory import CUDA_RESERVE  # noqa: E402
from batchmaker.exec.offload_weights import default_dequant  # noqa: E402

GIB = 1 << 30
DTYPE = torch.bfloat16


def sync(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def timed(executor: OffloadExecutor, prompts: list, num_tokens: int):
    sync(str(executor.device))
    start = time.perf_counter()
    tokens, moved = executor.generate_block(prompts, num_tokens)  # (ends with its one host sync)
    return time.perf_counter() - start, tokens, moved


def memory(args) -> dict:
    """How the search and the predictions count memory here: a GPU's reserve held back and its host
    storage pinned; the weights' host copy (random_model's arena) already taken out of `host_budget`,
    or, for a model larger than the host (`args.streamed_only`), the streamed layers' arena counted by
    the search (None)."""
    cuda = is_cuda(args.device)
    return {"reserve": CUDA_RESERVE if cuda else 0.0, "pinned": cuda,
            "host_weights": None if args.streamed_only else 0.0}


def peaks(executor: OffloadExecutor) -> dict:
    if not executor.is_cuda:
        return {"peak_gib": None, "peak_reserved_gib": None}
    return {"peak_gib": torch.cuda.max_memory_allocated(executor.device) / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(executor.device) / GIB}


def run_policy(executor: OffloadExecutor, prompts: list, args, config, rates) -> dict:
    """One block of `prompts`: the block, its prefill alone, the prediction, the bound, what moved, the peaks."""
    c = executor.config
    row = {"gpu_batch": c.gpu_batch, "num_batches": c.num_batches, "block": len(prompts),
           "offloaded": placement_name(c.placement), "weights_gpu": c.placement.weights_gpu,
           "cpu_attention": c.placement.cpu_attention,
           "resident_layers": executor.num_resident, "compress": c.compress,
           "dequant": (c.dequant or default_dequant(executor.device)) if c.compress else None}
    # the cost model's prediction and bound (a 4-bit one with its codes counted), also for a policy that fails
    p = predict(config, DTYPE, rates, c.placement, c.gpu_batch, c.num_batches, args.prompt, args.new, **memory(args),
                compress=c.compress)
    row["predicted"] = {"seconds": p.block_seconds, "prefill_seconds": p.prefill_seconds,
                        "step_seconds": p.step_seconds, "tokens_per_s": c.block * args.new / p.block_seconds,
                        "device_gib": p.footprint.device / GIB, "host_gib": p.footprint.host / GIB}
    b = bound(config, DTYPE, rates, c.placement, c.gpu_batch, c.num_batches, args.prompt, args.new, c.compress)
    row["bound"] = {"tokens_per_s": b.tokens_per_s, "binding": b.binding, "link_seconds": b.link,
                    "host_memory_seconds": b.host_memory, "gpu_seconds": b.gpu, "cpu_seconds": b.cpu,
                    "host_seconds": b.host}  # (each (prefill, decode step))
    if executor.is_cuda:
        torch.cuda.reset_peak_memory_stats(executor.device)
    try:
        executor.generate_block(prompts, 2)  # (warm-up: the prompt's and a decode step's kernels compiled (a resident
        # 4-bit layer's few-row gemv4 runs in decode steps only), cuBLAS, the block's pinned host cache allocated once)
        prefill, _, _ = timed(executor, prompts, 1)
        seconds, tokens, moved = timed(executor, prompts, args.new)
    except torch.OutOfMemoryError as e:  # (under a cap: this policy's failure, not the run's)
        row.update(failed="out of memory", message=str(e).splitlines()[0], tokens=None, **peaks(executor))
        print(f"  out of memory: {row['message']}", flush=True)
        return row
    row.update(seconds=seconds, prefill_seconds=prefill, step_seconds=(seconds - prefill) / (args.new - 1),
               tokens_per_s=len(prompts) * args.new / seconds, **peaks(executor),
               moved_gb={k: v / 1e9 for k, v in moved.bytes.items()}, tokens=tokens)
    row["weight_floor_seconds"] = weight_floor(config, rates, executor.num_resident, c.compresses_weights, DTYPE)
    row["step_over_weight_floor"] = row["step_seconds"] / row["weight_floor_seconds"]
    row["step_measured_over_predicted"] = row["step_seconds"] / p.step_seconds
    row["step_within_20_percent"] = abs(row["step_measured_over_predicted"] - 1) <= 0.2  # (the bar)
    row["measured_over_predicted"] = seconds / p.block_seconds
    row["over_bound"] = row["tokens_per_s"] / b.tokens_per_s
    row["meets_0.7_of_bound"] = row["over_bound"] >= 0.7  # (the bar, for the chosen policy)
    print(f"  {row['tokens_per_s']:8.2f} tokens/s: block {seconds:.2f} s, prefill {prefill:.2f} s, decode step "
          f"{row['step_seconds'] * 1e3:.1f} ms" + (f" (predicted {row['predicted']['step_seconds'] * 1e3:.1f} ms, "
                                                    f"{row['predicted']['device_gib']:.2f} GiB; bound "
                                                    f"{row['bound']['tokens_per_s']:.1f} tokens/s by the "
                                                    f"{row['bound']['binding']}: {row['over_bound']:.2f} of it)"
                                                    if "predicted" in row else "")
          + f", device peak {row['peak_gib'] or 0:.2f} GiB (reserved {row['peak_reserved_gib'] or 0:.2f})", flush=True)
    return row


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = [x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return {"tokens": sum(same) / len(same), "whole_prompts": sum(ra == rb for ra, rb in zip(a, b)) / len(a)}


def plot(record: dict):
    def draw(fig):
        curve = record.get("curve") or []
        bars, fit, *grow = fig.subplots(1, 3 if curve else 2, gridspec_kw={"width_ratios": [3, 2, 2][:2 + bool(curve)]})
        systems = [(name, row["tokens_per_s"], "C1" if row["compress"] else "C0")
                   for name, row in record["systems"].items() if "failed" not in row]
        systems += [(f"accelerate B={b}", row["tokens_per_s"], "C3")
                    for b, row in record["accelerate"].get("batches", {}).items() if "tokens_per_s" in row]
        names, values, colors = zip(*systems) if systems else ((), (), ())
        bars.bar(range(len(names)), values, color=colors)
        bars.set_xticks(range(len(names)), names, rotation=35, fontsize=6, ha="right")
        bars.set(ylabel="generated tokens/s", yscale="log", title=record["title"])
        bars.title.set_fontsize(8)
        if grow:  # FlexGen's Table 2: tokens/s against the block size
            ran = [r for r in curve if "tokens_per_s" in r]
            grow[0].plot([r["block"] for r in ran], [r["tokens_per_s"] for r in ran], "o-", label="measured")
            grow[0].plot([r["block"] for r in curve], [r["predicted"]["tokens_per_s"] for r in curve], "x--",
                         label="cost model")
            grow[0].plot([r["block"] for r in curve], [r["bound"]["tokens_per_s"] for r in curve], ":", label="bound")
            grow[0].set(xlabel=f"block (gpu batch {curve[0]['gpu_batch']} x num batches)", ylabel="tokens/s",
                        xscale="log")
            grow[0].legend(fontsize=6)
        rows = [(n, r) for n, r in record["systems"].items() if "predicted" in r and "step_seconds" in r]
        for k, (name, row) in enumerate(rows):
            fit.scatter(row["predicted"]["step_seconds"] * 1e3, row["step_seconds"] * 1e3, color=f"C{k % 10}", label=name)
        if rows:
            top = max(max(r["step_seconds"], r["predicted"]["step_seconds"]) * 1e3 for _, r in rows)
            for scale, style in ((1.0, "-"), (1.2, ":"), (0.8, ":")):
                fit.plot([0, top * 1.1], [0, top * 1.1 * scale], color="gray", linestyle=style, linewidth=0.8)
            fit.set(xlabel="predicted decode step (ms)", ylabel="measured decode step (ms)")
            fit.legend(fontsize=5)
        fig.set_size_inches(15 if curve else 12, 4.5)
    return draw


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-2-13b")
    ap.add_argument("--gpu-memory", type=float, default=12.0, help="GiB: the device budget of offload=auto")
    ap.add_argument("--gpu-cap", type=float, default=None, help="GiB: a process-wide cap on the GPU's memory, set "
                    "before anything is allocated, and the search's budget (both sides; replaces --gpu-memory)")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64], help="prompts in a run (the block's bound)")
    ap.add_argument("--max-batches", type=int, default=64, help="the search's most GPU batches in a block")
    ap.add_argument("--curve", type=int, nargs="*", default=[],
                    help="the largest run's policy again at these numbers of GPU batches per block")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--other", default="4x2:weights+cache+hidden", help="a hand-picked policy: "
                    "GBSxNB:offloaded[@weights_gpu], e.g. 4x2:weights+cache+hidden@0.3 ('' for none)")
    ap.add_argument("--shares", type=float, nargs="*", default=[],
                    help="the largest run's auto policy again with these weights_gpu (0: every layer streamed)")
    ap.add_argument("--cpu-attention", choices=("auto", "on", "off"), default="auto", help="a host cache's decode "
                    "attention: on the CPU (on), on the GPU after a move (off), or as the search predicts faster")
    ap.add_argument("--flip-attention", action="store_true", help="the largest run's policy again with its host "
                    "cache's attention the other way (an A/B beside it)")
    ap.add_argument("--no-compress", action="store_true", help="skip the 4-bit runs")
    ap.add_argument("--compress", choices=("weights", "kv", "both"), default="weights",
                    help="what the 4-bit runs compress (kv, both: the policies must keep the cache on the host)")
    ap.add_argument("--dequant-rows", type=int, nargs="*", default=[1, 8, 64, 4096])
    ap.add_argument("--anchor", metavar="PROBE", help="instead: run this Accelerate probe (offload_probe.py) at "
                    "the same settings and add it to today's record (processes of their own: host memory)")
    ap.add_argument("--anchor-batches", type=int, nargs="+", default=[16, 24, 32],
                    help="under --gpu-cap: the anchor's batches, each in its own process, smallest first")
    ap.add_argument("--probe-preset", default="13b")
    ap.add_argument("--probe-new", type=int, default=None, help="the anchor's new tokens (default: --new)")
    ap.add_argument("--probe-timeout", type=float, default=300.0, help="seconds per anchor process")
    ap.add_argument("--streamed-only", action="store_true", help="the host holds only the streamed layers, each "
                    "policy's resident ones drawn on the device (automatic where the model does not fit the host)")
    ap.add_argument("--tag", default="", help="names the record: offload-cap-TAG-<device>-<date>.json (the anchor "
                    "takes the same tag to find it)")
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args(argv)
    args.probe_new = args.probe_new or args.new
    args.record = ("offload-cap" if args.gpu_cap else "offload-attention" if args.flip_attention else "offload") + \
        (f"-{args.tag}" if args.tag else "")
    if args.gpu_cap:
        args.gpu_memory = args.gpu_cap
    if args.new < 2:
        ap.error("--new must be at least 2 (the decode step is measured from the block minus its prefill)")
    return args


def describe(choice) -> dict:
    """A search's choice as the record keeps it."""
    return {"policy": choice.policy.__dict__, "describe": choice.describe(), "compress": choice.compress,
            "predicted_step_seconds": choice.step_seconds, "predicted_tokens_per_s": choice.tokens_per_s,
            "predicted_device_gib": choice.footprint.device / GIB, "predicted_host_gib": choice.footprint.host / GIB}


def make_prompts(config, count: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, config.vocab_size) for _ in range(length)] for _ in range(count)]


def ours(args) -> None:
    """Every policy on the executor; the record is rewritten after each, so that a run cut short keeps
    what it measured."""
    device, config = args.device, PRESETS[args.preset]
    if is_cuda(device):
        if args.gpu_cap:  # (before CUDA starts: the allocator reads its settings, expandable segments, then)
            apply_cap(args.gpu_cap, torch.device(device).index or 0)
        torch.cuda.set_device(device)
    rates = measure(device, DTYPE, config=config)
    print(f"rates: host->device {rates.ctog / 1e9:.1f} GB/s, device->host {rates.gtoc / 1e9:.1f} GB/s, "
          f"matmul {rates.mm_flops / 1e12:.0f} TFLOP/s, CPU attention {rates.cpu_flops / 1e9:.1f} GFLOP/s "
          f"({rates.cpu_threads} threads), host memory {rates.host_memory / 1e9:.1f} GB/s, device memory "
          f"{rates.device_memory / 1e9:.0f} GB/s, host per (GPU batch, layer) {rates.unit_seconds * 1e6:.0f} µs",
          flush=True)
    policies = {}  # name -> (gpu_batch, num_batches, placement, prompts in the run)
    policies4 = {}  # the same for the 4-bit runs: the search's choice for --compress (auto-B* only)
    choices = {}
    args.streamed_only = args.streamed_only or not fits_host(config, device)
    if args.streamed_only:
        print(f"{args.preset} does not fit the host beside a block: only its streamed layers live there, each "
              "policy's resident layers drawn on the device (a share's model per group of policies)", flush=True)
    host = host_budget(config, device, args.streamed_only)
    for b in args.batches:
        choice = choose(config, DTYPE, rates, args.gpu_memory * GIB, host, args.prompt, args.new, max_gpu_batch=b,
                        max_batches=min(b, args.max_batches), max_block=b, **memory(args),
                        cpu_attention={"auto": None, "on": True, "off": False}[args.cpu_attention])
        print(f"B={b}: {choice.describe()}", flush=True)
        choices[f"auto-B{b}"] = describe(choice)
        policies[f"auto-B{b}"] = (choice.policy.gpu_batch, choice.policy.num_batches, choice.placement,
                                  choice.policy.block)
        if not args.no_compress:  # (the search's policy for the 4-bit runs: its codes counted, on the link too)
            choice = choose(config, DTYPE, rates, args.gpu_memory * GIB, host, args.prompt, args.new, max_gpu_batch=b,
                            max_batches=min(b, args.max_batches), max_block=b, **memory(args), compress=args.compress)
            print(f"B={b}, 4-bit {args.compress}: {choice.describe()}", flush=True)
            choices[f"auto-B{b}-4bit"] = describe(choice)
            policies4[f"auto-B{b}"] = (choice.policy.gpu_batch, choice.policy.num_batches, choice.placement,
                                       choice.policy.block)
    chosen = f"auto-B{max(args.batches)}"
    gbs, nb, placement, b = policies[chosen]
    for share in args.shares:
        if placement.weights and share != placement.weights_gpu:
            policies[f"{chosen}-weights_gpu{share:g}"] = (gbs, nb, replace(placement, weights_gpu=share), b)
    if args.flip_attention and placement.cache:
        flipped = replace(placement, cpu_attention=not placement.cpu_attention)
        policies[f"{chosen}-cpu_attention-{'on' if flipped.cpu_attention else 'off'}"] = (gbs, nb, flipped, b)
    for n in args.curve:
        if n != nb:
            policies[f"curve-nb{n}"] = (gbs, n, placement, gbs * n)
    if args.other:
        gbs, nb, placement = parse_policy(args.other)
        policies[f"other-{gbs}x{nb}-{placement_name(placement)}"] = (gbs, nb, placement, gbs * nb)
    prompts = make_prompts(config, max(b for *_, b in [*policies.values(), *policies4.values()]), args.prompt)
    budget = f"gpu cap {args.gpu_cap:g}GiB" if args.gpu_cap else f"gpu_memory={args.gpu_memory:g}GiB"
    title = (f"{args.preset} bf16, offload=auto {budget}, prompt {args.prompt}, new {args.new}, "
             f"{torch.cuda.get_device_name(device) if is_cuda(device) else 'CPU'}")
    record = {"title": title, "preset": args.preset, "dtype": "bfloat16", "prompt": args.prompt, "new": args.new,
              "gpu_memory_gib": args.gpu_memory, "gpu_cap_gib": args.gpu_cap,
              "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "host_gib": host_bytes() / GIB,
              "host_budget_gib": host / GIB,
              "host_holds": "the streamed layers" if args.streamed_only else "the whole model",
              "rates": rates.__dict__, "choices": choices, "chosen": chosen,
              "systems": {}, "accelerate": {}}
    tokens = {}
    for is_compressed in (False, True)[:1 if args.no_compress else 2]:
        lm = None
        these = policies4 if is_compressed else policies
        groups = {}  # (the weights' placement) -> the policies that share one host copy of the model
        for name, (_, _, placement, _) in these.items():
            groups.setdefault((placement.weights, placement.weights_gpu), []).append(name)
        for runs in groups.values():
            if lm is None or is_compressed or args.streamed_only:  # (bf16: one host model for every group; 4-bit
                # codes replace its tensors; a model larger than the host: one per share, its resident layers there)
                lm = None
                gc.collect()
                start = time.perf_counter()
                resident = these[runs[0]][2].num_resident(config.num_layers) if args.streamed_only else 0
                lm = random_model(config, device, resident=resident)
                print(f"drew {args.preset} on the host in {time.perf_counter() - start:.1f} s", flush=True)
            run_group(lm, runs, these, is_compressed, prompts, args, config, rates, record, tokens)
        del lm
        gc.collect()
    if args.dequant_rows:
        print("4-bit weights: expand + matmul against the fused projection (linear4)", flush=True)
        record["dequant"] = time_dequant(config, args.dequant_rows, device)
    print(write_results(args.record, device, record, plot=plot(record)), flush=True)


def summarize(record: dict) -> None:
    """The block-size curve (the chosen policy's row among its points) and our best bf16 run."""
    chosen = record["systems"].get(record["chosen"])
    points = [row for name, row in record["systems"].items() if name.startswith("curve-")]
    if points and chosen:
        record["curve"] = sorted(points + [chosen], key=lambda row: row["num_batches"])
    ran = {name: row for name, row in record["systems"].items() if "tokens_per_s" in row and not row["compress"]}
    if ran:
        name = max(ran, key=lambda n: ran[n]["tokens_per_s"])
        record["best"] = {"name": name, "tokens_per_s": ran[name]["tokens_per_s"]}


def run_group(lm: DecoderLM, names: list[str], policies: dict, is_compressed: bool, prompts: list, args, config,
              rates, record: dict, tokens: dict) -> None:
    """Policies that keep the same layers' weights on the GPU, one executor over the host model `lm`
    (a bf16 one's host tensors stay as they are: the next group's executor takes them again)."""
    start = time.perf_counter()
    gbs, nb, placement, _ = policies[names[0]]
    first = OffloadExecutor(lm, args.device, adopt=args.streamed_only, config=OffloadConfig(gbs, nb, placement,
                                                           compress=args.compress if is_compressed else None))
    print(f"executor{' (4-bit)' if is_compressed else ''}: {first.num_resident} of {first.num_layers} layers' weights "
          f"on the GPU, built in {time.perf_counter() - start:.1f} s", flush=True)
    for name in names:
        gbs, nb, placement, b = policies[name]
        executor = first.with_block(gbs, nb, placement)
        key = name + ("-4bit" if is_compressed else "")
        print(f"{key}: gpu_batch {gbs} x {nb}, {placement_name(placement)} on the host, {b} prompts", flush=True)
        row = run_policy(executor, prompts[:b], args, config, rates)
        tokens[key] = row.pop("tokens")
        if tokens[key] is None:  # (out of memory: what it held goes back before the next policy)
            gc.collect()
            torch.cuda.empty_cache()
        elif is_compressed and tokens.get(name):
            row["agreement_with_bf16"] = agreement(tokens[key], tokens[name])
        elif variant_of(name) and tokens.get(variant_of(name)):  # (another share: the same tokens; the attention: ~)
            row["agreement_with_chosen"] = agreement(tokens[key], tokens[variant_of(name)])
        record["systems"][key] = row
        summarize(record)
        write_results(args.record, args.device, record)
    del first, executor
    gc.collect()
    if is_cuda(args.device):
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.anchor:
        anchor(args, plot)
    else:
        ours(args)


if __name__ == "__main__":
    main()

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
earlier runs' (bench/results/README.md).

The anchor runs in a second command, a process of its own (both build a 26 GB model on the host):
`--anchor PROBE` runs HF Accelerate's probe (../shared/probes/offload_probe.py, copied to .probes/
for the GPU machine; skipped with a message where missing) at the same budget, batches, prompt and
new tokens, and adds it to today's record of the device, with our tokens/s over its.

    python bench/offload.py --preset llama-2-13b --gpu-memory 12 --batches 8 64 --prompt 512 --new 32
    python bench/offload.py --preset llama-2-13b --gpu-memory 12 --batches 8 64 --prompt 512 --new 32 \
        --anchor .probes/offload_probe.py
"""
import argparse
import datetime
import gc
import json
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common  # noqa: E402
from bench.common import device_name, write_results  # noqa: E402
from batchmaker.cells.decoder import INIT_STD, DecoderLM, empty_decoder, materialize  # noqa: E402
from batchmaker.cells.decoder_config import PRESETS  # noqa: E402
from batchmaker.core.zigzag import Placement  # noqa: E402
from batchmaker.exec.offload import OffloadConfig, OffloadExecutor  # noqa: E402
from batchmaker.exec.offload_auto import choose, host_bytes, measure, predict  # noqa: E402
from batchmaker.exec.offload_weights import default_dequant  # noqa: E402
from batchmaker.kernels.compress4 import compress, expand, linear4  # noqa: E402

GIB = 1 << 30
DTYPE = torch.bfloat16


def is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def sync(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def random_model(config, device: str, seed: int = 0) -> DecoderLM:
    """The model on the host: normal(0, INIT_STD) weights drawn on the device a tensor at a time,
    norms at 1 (biases 0). Seconds for 13B, where drawing on the CPU takes minutes. The layers'
    matrices are views of one pinned allocation beside a GPU (torch's host allocator rounds each
    pinned allocation up to a power of two: for 13B, 25 GB in one allocation, not 160 that round
    to 46 GB); the rest is small."""
    lm = empty_decoder(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    is_matrix = {name: name.startswith("layers.") and p.dim() == 2 for name, p in lm.named_parameters()}
    pool = torch.empty(sum(p.numel() for name, p in lm.named_parameters() if is_matrix[name]), dtype=DTYPE,
                       pin_memory=is_cuda(device))
    offset, state = 0, {}
    for name, p in lm.named_parameters():
        if is_matrix[name]:
            host, offset = pool[offset:offset + p.numel()].view(p.shape), offset + p.numel()
        else:
            host = torch.empty(p.shape, dtype=DTYPE)
        module_name, kind = name.rsplit(".", 1)
        if module_name.endswith("norm"):
            host.fill_(1.0 if kind == "weight" else 0.0)
        else:
            host.copy_(torch.randn(p.shape, generator=generator, device=device, dtype=DTYPE).mul_(INIT_STD))
        state[name] = host
    return materialize(lm, state, "cpu")


def placement_name(p: Placement) -> str:
    """What lives on the host, and the share of the layers' weights kept on the GPU where some is."""
    offloaded = "+".join(k for k, on in (("weights", p.weights), ("cache", p.cache), ("hidden", p.hidden)) if on)
    return (offloaded or "none") + (f"@{p.weights_gpu:.2f}" if p.weights_gpu else "")


def parse_policy(text: str) -> tuple[int, int, Placement]:
    """'4x2:weights+cache+hidden[@0.4]' -> (gpu_batch, num_batches, placement with that weights_gpu)."""
    shape, _, where = text.partition(":")
    where, _, share = where.partition("@")
    gbs, nb = (int(v) for v in shape.split("x"))
    parts = set(where.split("+"))
    return gbs, nb, Placement("weights" in parts, "cache" in parts, "hidden" in parts, float(share or 0))


def timed(executor: OffloadExecutor, prompts: list, num_tokens: int):
    sync(str(executor.device))
    start = time.perf_counter()
    tokens, moved = executor.generate_block(prompts, num_tokens)  # (ends with its one host sync)
    return time.perf_counter() - start, tokens, moved


def run_policy(executor: OffloadExecutor, prompts: list, args, config, rates, is_compressed: bool) -> dict:
    """One block of `prompts`: the block, its prefill alone, the prediction, what moved, the peak."""
    c = executor.config
    executor.generate_block(prompts, 1)  # (warm-up: kernels, cuBLAS, the block's pinned host cache allocated once)
    if executor.is_cuda:
        torch.cuda.reset_peak_memory_stats(executor.device)
    prefill, _, _ = timed(executor, prompts, 1)
    seconds, tokens, moved = timed(executor, prompts, args.new)
    block = len(prompts)
    row = {"gpu_batch": c.gpu_batch, "num_batches": c.num_batches, "block": block,
           "offloaded": placement_name(c.placement), "weights_gpu": c.placement.weights_gpu,
           "resident_layers": executor.num_resident, "compress": c.compress,
           "dequant": (c.dequant or default_dequant(executor.device)) if c.compress else None,
           "seconds": seconds, "prefill_seconds": prefill, "step_seconds": (seconds - prefill) / (args.new - 1),
           "tokens_per_s": block * args.new / seconds,
           "peak_gib": torch.cuda.max_memory_allocated(executor.device) / GIB if executor.is_cuda else None,
           "moved_gb": {k: v / 1e9 for k, v in moved.bytes.items()}, "tokens": tokens}
    if not is_compressed:
        p = predict(config, DTYPE, rates, c.placement, c.gpu_batch, c.num_batches, args.prompt, args.new)
        row["predicted"] = {"seconds": p.block_seconds, "prefill_seconds": p.prefill_seconds,
                            "step_seconds": p.step_seconds, "tokens_per_s": c.block * args.new / p.block_seconds}
        row["step_measured_over_predicted"] = row["step_seconds"] / p.step_seconds
        row["step_within_20_percent"] = abs(row["step_measured_over_predicted"] - 1) <= 0.2  # (the bar)
        row["measured_over_predicted"] = seconds / p.block_seconds
    print(f"  {row['tokens_per_s']:8.2f} tokens/s: block {seconds:.2f} s, prefill {prefill:.2f} s, decode step "
          f"{row['step_seconds'] * 1e3:.1f} ms" + (f" (predicted {row['predicted']['step_seconds'] * 1e3:.1f} ms, "
                                                    f"block {row['predicted']['seconds']:.2f} s)" if "predicted" in row
                                                    else "") + f", device peak {row['peak_gib'] or 0:.2f} GiB", flush=True)
    return row


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = [x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return {"tokens": sum(same) / len(same), "whole_prompts": sum(ra == rb for ra, rb in zip(a, b)) / len(a)}


def device_ms(fn, device: str, repeats: int = 5) -> float:
    fn()  # (compile, warm-up)
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_dequant(config, rows_list: list[int], device: str) -> dict:
    """ms per call on one layer's four matrices: expand into a dense buffer then F.linear, or
    linear4 (the codes expanded tile by tile in registers); the sum over the four per row count."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    shapes = {"qkv": ((config.num_heads + 2 * config.num_kv_heads) * d, h), "o": (h, config.num_heads * d),
              "gate_up": (2 * i, h), "down": (h, i)}
    out = {}
    for rows in rows_list:
        per = {}
        for name, (n, k) in shapes.items():
            c = compress(torch.randn(n, k, device=device, dtype=DTYPE) * INIT_STD, 64, 0)
            dense, x = torch.empty(n, k, device=device, dtype=DTYPE), torch.randn(rows, k, device=device, dtype=DTYPE)
            per[name] = {"expand_matmul_ms": device_ms(lambda: F.linear(x, expand(c, dense)), device),
                         "fused_ms": device_ms(lambda: linear4(x, c), device)}
        total = {key: sum(v[key] for v in per.values()) for key in ("expand_matmul_ms", "fused_ms")}
        out[rows] = {"matrices": per, **total, "faster": min(total, key=total.get).removesuffix("_ms")}
        print(f"  {rows:6d} rows: expand + matmul {total['expand_matmul_ms']:.3f} ms, fused {total['fused_ms']:.3f} ms "
              "(a layer's four matrices)", flush=True)
    return out


PROBE_LINE = re.compile(r"accelerate offload \S+ gpu (\d+) GiB B=(\d+) prompt (\d+) new (\d+): ([\d.]+) s, "
                        r"([\d.]+) generated tok/s")


def run_probe(path: str, args) -> dict:
    """HF Accelerate's offload (the anchor) in its own process, or why it did not run."""
    if not Path(path).is_file():
        reason = f"{path} missing: copy ../shared/probes/offload_probe.py there to run the anchor"
        print(f"skipping the Accelerate anchor: {reason}", flush=True)
        return {"skipped": reason}
    cmd = [sys.executable, path, "--preset", args.probe_preset, "--gpu-gib", str(round(args.gpu_memory)),
           "--batches", ",".join(map(str, args.batches)), "--prompt", str(args.prompt), "--new", str(args.probe_new)]
    print("anchor:", " ".join(cmd), flush=True)
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=args.probe_timeout)
        output, status = done.stdout, done.returncode
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        status = f"timed out after {args.probe_timeout} s"
    print(output, flush=True)
    runs = {int(m[2]): {"seconds": float(m[5]), "tokens_per_s": float(m[6]), "prompt": int(m[3]), "new": int(m[4])}
            for m in PROBE_LINE.finditer(output)}
    link = re.search(r"host->device GB/s: (\{.*\})", output)
    return {"command": " ".join(cmd[1:]), "status": status, "batches": runs,
            "host_to_device_gb_s": link[1] if link else None, "output_tail": output[-2000:]}


def plot(record: dict):
    def draw(fig):
        bars, fit = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
        systems = [(name, row["tokens_per_s"], "C1" if row["compress"] else "C0")
                   for name, row in record["systems"].items()]
        systems += [(f"accelerate B={b}", row["tokens_per_s"], "C3")
                    for b, row in record["accelerate"].get("batches", {}).items()]
        names, values, colors = zip(*systems) if systems else ((), (), ())
        bars.bar(range(len(names)), values, color=colors)
        bars.set_xticks(range(len(names)), names, rotation=35, fontsize=6, ha="right")
        bars.set(ylabel="generated tokens/s", yscale="log", title=record["title"])
        bars.title.set_fontsize(8)
        rows = [(n, r) for n, r in record["systems"].items() if "predicted" in r]
        if not rows:
            return
        for k, (name, row) in enumerate(rows):
            fit.scatter(row["predicted"]["step_seconds"] * 1e3, row["step_seconds"] * 1e3, color=f"C{k}", label=name)
        top = max([r["step_seconds"] * 1e3 for _, r in rows] + [r["predicted"]["step_seconds"] * 1e3 for _, r in rows])
        for scale, style in ((1.0, "-"), (1.2, ":"), (0.8, ":")):
            fit.plot([0, top * 1.1], [0, top * 1.1 * scale], color="gray", linestyle=style, linewidth=0.8)
        fit.set(xlabel="predicted decode step (ms)", ylabel="measured decode step (ms)")
        fit.legend(fontsize=6)
        fig.set_size_inches(12, 4.5)
    return draw


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-2-13b")
    ap.add_argument("--gpu-memory", type=float, default=12.0, help="GiB: the device budget of offload=auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64], help="prompts in a run (the block's bound)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--other", default="4x2:weights+cache+hidden",
                    help="a hand-picked policy: GBSxNB:offloaded[@weights_gpu], e.g. 4x2:weights+cache+hidden@0.3")
    ap.add_argument("--shares", type=float, nargs="*", default=[],
                    help="the largest run's auto policy again with these weights_gpu (0: every layer streamed)")
    ap.add_argument("--no-compress", action="store_true", help="skip the 4-bit runs")
    ap.add_argument("--compress", choices=("weights", "kv", "both"), default="weights",
                    help="what the 4-bit runs compress (kv, both: the policies must keep the cache on the host)")
    ap.add_argument("--dequant-rows", type=int, nargs="*", default=[1, 8, 64, 4096])
    ap.add_argument("--anchor", metavar="PROBE", help="instead: run this Accelerate probe (offload_probe.py) at "
                    "the same settings and add it to today's record (a process of its own: host memory)")
    ap.add_argument("--probe-preset", default="13b")
    ap.add_argument("--probe-new", type=int, default=None, help="the anchor's new tokens (default: --new)")
    ap.add_argument("--probe-timeout", type=float, default=300.0)
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args(argv)
    args.probe_new = args.probe_new or args.new
    if args.new < 2:
        ap.error("--new must be at least 2 (the decode step is measured from the block minus its prefill)")
    return args


def ours(args) -> None:
    """Every policy on the executor; the record is rewritten after each, so that a run cut short keeps
    what it measured."""
    device, config = args.device, PRESETS[args.preset]
    if is_cuda(device):
        torch.cuda.set_device(device)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, config.vocab_size) for _ in range(args.prompt)] for _ in range(max(args.batches))]
    rates = measure(device, DTYPE)
    print(f"rates: host->device {rates.ctog / 1e9:.1f} GB/s, device->host {rates.gtoc / 1e9:.1f} GB/s, "
          f"matmul {rates.mm_flops / 1e12:.0f} TFLOP/s, CPU bmm {rates.cpu_flops / 1e9:.1f} GFLOP/s", flush=True)
    policies = {}  # name -> (gpu_batch, num_batches, placement, prompts in the run)
    choices = {}
    for b in args.batches:
        choice = choose(config, DTYPE, rates, args.gpu_memory * GIB, host_bytes(), args.prompt, args.new,
                        max_gpu_batch=b, max_batches=b, max_block=b)
        print(f"B={b}: {choice.describe()}", flush=True)
        choices[f"auto-B{b}"] = {"policy": choice.policy.__dict__, "describe": choice.describe(),
                                 "predicted_step_seconds": choice.step_seconds,
                                 "predicted_tokens_per_s": choice.tokens_per_s}
        policies[f"auto-B{b}"] = (choice.policy.gpu_batch, choice.policy.num_batches, choice.placement, b)
    gbs, nb, chosen, b = policies[f"auto-B{max(args.batches)}"]
    for share in args.shares:
        if chosen.weights and share != chosen.weights_gpu:
            policies[f"auto-B{b}-weights_gpu{share:g}"] = (gbs, nb, replace(chosen, weights_gpu=share), b)
    gbs, nb, placement = parse_policy(args.other)
    policies[f"other-{gbs}x{nb}-{placement_name(placement)}"] = (gbs, nb, placement, gbs * nb)
    groups = {}  # (the weights' placement) -> the policies that share one host copy of the model
    for name, (_, _, placement, _) in policies.items():
        groups.setdefault((placement.weights, placement.weights_gpu), []).append(name)
    title = (f"{args.preset} bf16, offload=auto gpu_memory={args.gpu_memory:g}GiB, prompt {args.prompt}, new {args.new}, "
             f"{torch.cuda.get_device_name(device) if is_cuda(device) else 'CPU'}")
    record = {"title": title, "preset": args.preset, "dtype": "bfloat16", "prompt": args.prompt, "new": args.new,
              "gpu_memory_gib": args.gpu_memory, "host_gib": host_bytes() / GIB, "rates": rates.__dict__,
              "choices": choices, "chosen": f"auto-B{max(args.batches)}", "systems": {}, "accelerate": {}}
    tokens = {}
    for is_compressed in (False, True)[:1 if args.no_compress else 2]:
        lm = None
        for names in groups.values():
            runs = [n for n in names if not is_compressed or n.startswith("auto-B") and "weights_gpu" not in n]
            for name in [n for n in runs if is_compressed and not _compresses(policies[n][2], args.compress)]:
                print(f"{name}: keeps what --compress {args.compress} compresses on the device, no 4-bit run",
                      flush=True)
                runs.remove(name)
            if not runs:
                continue
            if lm is None or is_compressed:  # (bf16: one host model for every group; 4-bit codes replace its tensors)
                start = time.perf_counter()
                lm = random_model(config, device)
                print(f"drew {args.preset} on the host in {time.perf_counter() - start:.1f} s", flush=True)
            run_group(lm, runs, policies, is_compressed, prompts, args, config, rates, record, tokens)
        del lm
        gc.collect()
    if args.dequant_rows:
        print("4-bit weights: expand + matmul against the fused projection (linear4)", flush=True)
        record["dequant"] = time_dequant(config, args.dequant_rows, device)
    print(write_results("offload", device, record, plot=plot(record)), flush=True)


def _compresses(placement: Placement, what: str) -> bool:
    """Whether the executor takes `compress=what` with `placement` (it compresses what is offloaded)."""
    return (what == "kv" or placement.weights) and (what == "weights" or placement.cache)


def run_group(lm: DecoderLM, names: list[str], policies: dict, is_compressed: bool, prompts: list, args, config,
              rates, record: dict, tokens: dict) -> None:
    """Policies that keep the same layers' weights on the GPU, one executor over the host model `lm`
    (a bf16 one's host tensors stay as they are: the next group's executor takes them again)."""
    start = time.perf_counter()
    gbs, nb, placement, _ = policies[names[0]]
    first = OffloadExecutor(lm, args.device, OffloadConfig(gbs, nb, placement,
                                                           compress=args.compress if is_compressed else None))
    print(f"executor{' (4-bit)' if is_compressed else ''}: {first.num_resident} of {first.num_layers} layers' weights "
          f"on the GPU, built in {time.perf_counter() - start:.1f} s", flush=True)
    for name in names:
        gbs, nb, placement, b = policies[name]
        executor = first.with_block(gbs, nb, placement)
        key = name + ("-4bit" if is_compressed else "")
        print(f"{key}: gpu_batch {gbs} x {nb}, {placement_name(placement)} on the host, {b} prompts", flush=True)
        row = run_policy(executor, prompts[:b], args, config, rates, is_compressed)
        tokens[key] = row.pop("tokens")
        if is_compressed:
            row["agreement_with_bf16"] = agreement(tokens[key], tokens[name])
        elif "-weights_gpu" in name:  # (the same model at another share: every token the same)
            row["agreement_with_chosen"] = agreement(tokens[key], tokens[name.split("-weights_gpu")[0]])
        record["systems"][key] = row
        write_results("offload", args.device, record)
    del first, executor
    gc.collect()
    if is_cuda(args.device):
        torch.cuda.empty_cache()


def anchor(args) -> None:
    """The Accelerate probe at the run's settings, added to today's record of this device (a
    record of its own where there is none)."""
    path = common.RESULTS / f"offload-{device_name(args.device)}-{datetime.date.today().isoformat()}.json"
    record = json.loads(path.read_text()) if path.exists() else {"title": f"{args.preset}: the anchor alone",
                                                                  "systems": {}}
    record["anchor_command"] = "python bench/offload.py " + " ".join(shlex.quote(a) for a in args.argv)
    record["accelerate"] = run_probe(args.anchor, args)
    for b, row in record["accelerate"].get("batches", {}).items():
        mine = record["systems"].get(f"auto-B{b}")
        if mine:
            row["ours_over_accelerate"] = mine["tokens_per_s"] / row["tokens_per_s"]
            print(f"B={b}: ours {mine['tokens_per_s']:.2f} tokens/s, Accelerate {row['tokens_per_s']:.2f}: "
                  f"{row['ours_over_accelerate']:.1f}x", flush=True)
    print(write_results("offload", args.device, record, plot=plot(record)), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.anchor:
        anchor(args)
    else:
        ours(args)


if __name__ == "__main__":
    main()

"""HF Accelerate's `device_map` offload (the anchor of issue 34), run by bench/offload.py --anchor in
processes of its own (each builds the 26 GB model on the host), and added to today's record of
our side with our tokens/s over its.

Without a cap (the earlier runs): the probe once, at our search's weight budget (`--gpu-memory`),
every batch of `--batches` in one process, its KV cache outside the budget.

Under `--gpu-cap C` (the issue's headline): each batch of `--anchor-batches`, smallest first, in a
process of its own under the same process-wide cap as ours (bench/capped_probe.py sets the
fraction, then runs the probe unedited), with the weight budget a competent Accelerate user gives
`device_map` for that batch (`weight_budget_gib`): the cap less what the batch's KV cache and
activations need. A batch that runs out of memory is recorded as such, and the larger ones are
not tried (their cache is larger still). Accelerate's best is the fastest batch that ran.
"""
import datetime
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from bench import common
from bench.capped_probe import OOM_STATUS
from bench.common import device_name, write_results
from batchmaker.cells.decoder_config import PRESETS

GIB = 1 << 30
CAPPED = Path(__file__).resolve().parent / "capped_probe.py"
MARGIN_GIB = 1.5  # the layer Accelerate moves in for each forward (0.6 GiB at 13B), the embedding, the allocator
PROBE_LINE = re.compile(r"accelerate offload \S+ gpu (\d+) GiB B=(\d+) prompt (\d+) new (\d+): ([\d.]+) s, "
                        r"([\d.]+) generated tok/s")
PEAK_LINE = re.compile(r"peak allocated ([\d.]+) GiB reserved ([\d.]+) GiB")


def weight_budget_gib(config, batch: int, prompt: int, new: int, cap_gib: float) -> int:
    """Whole GiB of weights for `device_map` (the probe takes an integer) at `batch` under `cap_gib`:
    the cap less HF's KV cache (K and V of every layer for prompt + new tokens, the model's dtype:
    2 bytes), the prefill's activations (per token: a few hidden-sized tensors and the MLP's three
    intermediate-sized ones) and `MARGIN_GIB`; at least 1 (the embedding on the GPU: with none
    there, Accelerate would run the model on the CPU)."""
    kv = batch * (prompt + new) * 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    activations = batch * prompt * (6 * config.hidden_size + 3 * config.intermediate_size) * 2
    return max(1, int(cap_gib - (kv + activations) / GIB - MARGIN_GIB))


def _run(cmd: list[str], timeout: float) -> tuple[str, int | str]:
    print("anchor:", " ".join(cmd), flush=True)
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        output, status = done.stdout, done.returncode
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        status = f"timed out after {timeout:g} s"
    print(output, flush=True)
    return output, status


def _link(output: str) -> str | None:
    link = re.search(r"host->device GB/s: (\{.*\})", output)
    return link[1] if link else None


def run_probe(path: str, args) -> dict:
    """The probe once at `--gpu-memory` over every batch of `--batches`, no cap (the earlier runs)."""
    cmd = [sys.executable, path, "--preset", args.probe_preset, "--gpu-gib", str(round(args.gpu_memory)),
           "--batches", ",".join(map(str, args.batches)), "--prompt", str(args.prompt), "--new", str(args.probe_new)]
    output, status = _run(cmd, args.probe_timeout)
    runs = {int(m[2]): {"seconds": float(m[5]), "tokens_per_s": float(m[6]), "prompt": int(m[3]), "new": int(m[4])}
            for m in PROBE_LINE.finditer(output)}
    return {"command": " ".join(cmd[1:]), "status": status, "batches": runs, "host_to_device_gb_s": _link(output),
            "output_tail": output[-2000:]}


def run_capped(path: str, args) -> dict:
    """Each of `--anchor-batches`, smallest first, in its own process under `--gpu-cap`."""
    config, rows, link = PRESETS[args.preset], {}, None
    for batch in sorted(args.anchor_batches):
        if any(row.get("out_of_memory") for row in rows.values()):
            rows[batch] = {"skipped": "a smaller batch ran out of memory under the cap"}
            continue
        weights = weight_budget_gib(config, batch, args.prompt, args.probe_new, args.gpu_cap)
        cmd = [sys.executable, str(CAPPED), "--cap-gib", f"{args.gpu_cap:g}", path, "--preset", args.probe_preset,
               "--gpu-gib", str(weights), "--batches", str(batch), "--prompt", str(args.prompt), "--new",
               str(args.probe_new)]
        output, status = _run(cmd, args.probe_timeout)
        row = {"weight_budget_gib": weights, "command": " ".join(cmd[1:]), "status": status,
               "out_of_memory": status == OOM_STATUS, "output_tail": output[-1500:]}
        for m in PROBE_LINE.finditer(output):
            row.update(seconds=float(m[5]), tokens_per_s=float(m[6]))
        if peak := PEAK_LINE.search(output):
            row.update(peak_allocated_gib=float(peak[1]), peak_reserved_gib=float(peak[2]))
        link = link or _link(output)
        rows[batch] = row
    ran = {b: row for b, row in rows.items() if "tokens_per_s" in row}
    best = max(ran, key=lambda b: ran[b]["tokens_per_s"]) if ran else None
    return {"cap_gib": args.gpu_cap, "weight_budget": f"the cap less the batch's KV cache and prefill activations "
            f"and {MARGIN_GIB} GiB (weight_budget_gib)", "batches": rows, "host_to_device_gb_s": link,
            "best": {"batch": best, "tokens_per_s": ran[best]["tokens_per_s"]} if ran else None}


def anchor(args, plot) -> None:
    """The anchor at the run's settings, added to today's record of this device (`args.record`: the
    capped run's or the earlier one's), a record of its own where there is none."""
    path = common.RESULTS / f"{args.record}-{device_name(args.device)}-{datetime.date.today().isoformat()}.json"
    record = json.loads(path.read_text()) if path.exists() else {"title": f"{args.preset}: the anchor alone",
                                                                  "systems": {}}
    record["anchor_command"] = "python bench/offload.py " + " ".join(shlex.quote(a) for a in args.argv)
    if not Path(args.anchor).is_file():
        reason = f"{args.anchor} missing: copy ../shared/probes/offload_probe.py there to run the anchor"
        print(f"skipping the Accelerate anchor: {reason}", flush=True)
        record["accelerate"] = {"skipped": reason}
    elif args.gpu_cap:
        record["accelerate"] = run_capped(args.anchor, args)
        compare_best(record)
    else:
        record["accelerate"] = run_probe(args.anchor, args)
        for b, row in record["accelerate"]["batches"].items():
            if mine := record["systems"].get(f"auto-B{b}"):
                row["ours_over_accelerate"] = mine["tokens_per_s"] / row["tokens_per_s"]
                print(f"B={b}: ours {mine['tokens_per_s']:.2f} tokens/s, Accelerate {row['tokens_per_s']:.2f}: "
                      f"{row['ours_over_accelerate']:.1f}x", flush=True)
    print(write_results(args.record, args.device, record, plot=plot(record)), flush=True)


def compare_best(record: dict) -> None:
    """Our best tokens/s over Accelerate's best under the same cap (the issue: >= 10x)."""
    ours, theirs = record.get("best"), record["accelerate"].get("best")
    if not ours or not theirs:
        print("no comparison: one side has no run that finished under the cap", flush=True)
        return
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
    record["ours_over_accelerate_best"] = {"ratio": ratio, "meets_10x": ratio >= 10, "ours": ours["name"],
                                           "accelerate_batch": theirs["batch"]}
    print(f"best under the cap: ours {ours['tokens_per_s']:.2f} tokens/s ({ours['name']}), Accelerate "
          f"{theirs['tokens_per_s']:.2f} (B={theirs['batch']}): {ratio:.1f}x", flush=True)

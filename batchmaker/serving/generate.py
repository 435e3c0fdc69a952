"""`batchmaker generate`: offline batch generation (greedy) from a JSON-lines file of prompts to a
JSON-lines file of results (serving/prompt_file.py), resumable, with progress on stderr.

Without `--set offload=...` the prompts run through the engine (cellular batching, as `serve`
runs them). With it, through FlexGen's offloading executor (exec/offload.py): `offload=auto`
measures the machine and picks the policy (exec/offload_auto.py, printed with its prediction);
`offload=weights+cache+hidden` (any of the three, or `none`) names what lives on the host, and
`+cpu_attention` (with the cache) attends over the host cache on the CPU in decode steps.
`gpu_memory=12GiB` bounds the device pool for auto; `gpu_batch=` and `num_batches=` override the
policy's block, `weights_gpu=0.4` its share of offloaded weights kept on the device (the first 40%
of the layers, never moved; core/zigzag.py `Placement`); `compress=weights|kv|both` keeps the layers'
weights (offloaded or not: `compress=weights` alone runs the executor with everything on the
device, the weights as 4-bit codes there), the host's KV cache or both as 4-bit codes (FlexGen's
group-wise quantization; a 4-bit cache on the device is not built), and
`dequant=reference|expand|fused` says how they meet the compute (default: Triton's kernels on a
GPU, the PyTorch twins elsewhere; exec/offload_weights.py, exec/offload_resident.py,
exec/offload_cache.py). These keys are the command's own; the rest of
--set goes to the model.
"""
import logging
import os
import re
import sys
import time
from dataclasses import replace

from batchmaker.serving.cli_models import UsageError
from batchmaker.serving.prompt_file import OutputFile, PromptRecord, finished_ids, read_prompts

log = logging.getLogger("batchmaker")
GENERATE_KEYS = ("offload", "gpu_memory", "gpu_batch", "num_batches", "weights_gpu", "compress", "dequant")
MODEL_KEYS = ("preset", "checkpoint", "seed", "dtype")  # what the offloading path builds the model from
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)


def run_generate(args) -> int:
    name = args.models.strip()
    if "," in name or ":" in name:
        raise UsageError(f"--models {name}: generate runs one registered decoder (llama or opt)")
    if args.max_new_tokens < 1 or (args.max_prompts is not None and args.max_prompts < 1):
        raise UsageError("--max-new-tokens and --max-prompts must be at least 1")
    own, model_items = split_settings(args.set, name)
    records = read_prompts(args.input, args.max_new_tokens)
    done = finished_ids(args.output)
    pending = [r for r in records if r.id not in done]
    log.info("%d prompts in %s, %d already in %s, %d to generate", len(records), args.input, len(done),
             args.output, len(pending))
    if args.max_prompts is not None:
        pending = pending[:args.max_prompts]
    if not pending:
        return 0
    progress = Progress(len(pending))
    out = OutputFile(args.output)
    try:
        if own.get("offload", "none") == "none" and not set(GENERATE_KEYS[2:]) & set(own):
            _run_engine(name, model_items, args.devices, pending, out, progress)
        else:
            _run_offloaded(name, model_items, args.devices, own, pending, out, progress)
    finally:
        out.close()
        progress.end()
    return 0


def split_settings(items: list[str], name: str) -> tuple[dict, list[str]]:
    """(the command's own keys, converted; the --set items left for the model)."""
    own, rest = {}, []
    for item in items:
        key, _, text = item.partition("=")
        scope, _, bare = key.strip().rpartition(".")
        if bare not in GENERATE_KEYS or scope not in ("", name):
            rest.append(item)
            continue
        own[bare] = _convert(bare, text.strip())
    return own, rest


def _convert(key: str, text: str):
    if key == "offload":
        parts = set(text.split("+"))
        if text not in ("auto", "none") and not parts <= {"weights", "cache", "hidden", "cpu_attention"}:
            raise UsageError(f"--set offload={text}: expected auto, none, or weights, cache, hidden (and "
                             "cpu_attention) joined by +")
        if "cpu_attention" in parts and "cache" not in parts:
            raise UsageError(f"--set offload={text}: cpu_attention attends over the cache on the host: add cache")
        return text
    if key == "compress":
        if text not in ("weights", "kv", "both"):
            raise UsageError(f"--set compress={text}: expected weights, kv or both (4-bit weights, offloaded or "
                             "resident; the host's KV cache; or both)")
        return text
    if key == "dequant":
        if text not in ("reference", "expand", "fused"):
            raise UsageError(f"--set dequant={text}: expected reference, expand or fused")
        return text
    if key == "weights_gpu":
        try:
            share = float(text)
        except ValueError:
            share = -1.0
        if not 0.0 <= share <= 1.0:
            raise UsageError(f"--set weights_gpu={text}: expected a share in [0, 1] (of the layers' weights kept "
                             "on the device)")
        return share
    if key == "gpu_memory":
        match = _SIZE.fullmatch(text)
        if not match:
            raise UsageError(f"--set gpu_memory={text}: expected a size such as 12GiB or 512MiB")
        unit = (match.group(2) or "B").upper().replace("I", "")
        return float(match.group(1)) * 1024 ** "BKMGT".index(unit[0])
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"--set {key}={text}: expected an integer >= 1")
    return int(text)


# the engine ---------------------------------------------------------------------------------
def _run_engine(name: str, items: list[str], devices: str, pending: list[PromptRecord], out: OutputFile,
                progress: "Progress") -> None:
    from batchmaker.engine import Engine
    from batchmaker.engine_config import EngineConfig
    from batchmaker.errors import BatchMakerError
    from batchmaker.serving.cli_models import check_devices, load_models

    devices = check_devices(devices, "--devices")
    engine = Engine(load_models([name], items, devices), EngineConfig(devices=devices))
    window = 256  # requests in flight at once (the engine's admission bound is larger)
    with engine:
        progress.begin()
        for first in range(0, len(pending), window):
            futures = [(r, engine.submit(name, _inputs(r))) for r in pending[first:first + window]]
            for record, future in futures:
                try:
                    result = future.result().outputs
                except BatchMakerError as e:
                    raise UsageError(f"prompt {record.id!r}: {e}") from None
                out.write(record, result["tokens"], result["finish_reason"], result.get("text"))
                progress.add(len(result["tokens"]))


def _inputs(record: PromptRecord) -> dict:
    prompt = {"tokens": record.tokens} if record.tokens is not None else {"prompt": record.prompt}
    return {**prompt, "max_new_tokens": record.max_new_tokens}


# the offloading executor ----------------------------------------------------------------------
def _run_offloaded(name: str, items: list[str], devices: str, own: dict, pending: list[PromptRecord],
                   out: OutputFile, progress: "Progress") -> None:
    import torch
    from batchmaker.serving.cli_models import check_devices
    lm, tokenizer, device = _build(name, items)
    device = check_devices(device or devices, "--devices")[0]
    prompts = [r.tokens if r.tokens is not None else _encode(tokenizer, r) for r in pending]
    threads = torch.get_num_threads()
    try:
        executor = _executor(lm, device, own, len(prompts), max(map(len, prompts)),
                             max(r.max_new_tokens for r in pending))
        _run_blocks(executor, lm, tokenizer, pending, prompts, out, progress)
    finally:
        torch.set_num_threads(threads)


def _run_blocks(executor, lm, tokenizer, pending: list[PromptRecord], prompts: list[list[int]], out: OutputFile,
                progress: "Progress") -> None:
    for record, prompt in zip(pending, prompts):  # (every prompt checked before any runs)
        try:
            executor.check([prompt], [record.max_new_tokens])
        except ValueError as e:
            raise UsageError(f"prompt {record.id!r}: {e}") from None
    progress.begin()
    block, eos = executor.config.block, set(lm.config.eos_token_ids)
    for first in range(0, len(pending), block):
        records = pending[first:first + block]
        generated, _ = executor.generate_block(prompts[first:first + block], [r.max_new_tokens for r in records])
        for record, tokens in zip(records, generated):
            tokens, reason = cut(tokens, eos)
            out.write(record, tokens, reason, tokenizer.decode(tokens) if record.prompt is not None else None)
            progress.add(len(tokens))


def cut(tokens: list[int], eos: set) -> tuple[list[int], str]:
    """Tokens up to and including the first EOS ("stop"), else all of them ("length")."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1], "stop"
    return tokens, "length"


def _encode(tokenizer, record: PromptRecord) -> list[int]:
    if tokenizer is None:
        raise UsageError(f"prompt {record.id!r}: a text prompt needs a checkpoint with a tokenizer.json")
    return tokenizer.encode(record.prompt).ids


def _build(name: str, items: list[str]):
    """The decoder on the CPU (its layers become the host copy), its tokenizer, the device --set names."""
    import torch
    from batchmaker.cells.checkpoint import load_tokenizer, read_config
    from batchmaker.cells.decoder_config import PRESETS
    from batchmaker.cells.decoder_source import DecoderSource
    from batchmaker.serving.model_options import SettingError, factory_options, parse_settings

    try:
        options = parse_settings(items, [name])[name]
    except (SettingError, LookupError) as e:
        raise UsageError(str(e)) from None
    ignored = sorted(set(options) - set(MODEL_KEYS) - {"device"})
    if ignored:
        log.warning("with offload, --set %s do not apply (the executor has its own cache)", ", ".join(ignored))
    checkpoint = options.get("checkpoint")
    preset = options.get("preset", factory_options(name)["preset"].default)
    try:
        config = read_config(checkpoint)[0] if checkpoint else PRESETS[preset]
    except KeyError:
        raise UsageError(f"--set preset={preset}: unknown; known: {', '.join(sorted(PRESETS))}") from None
    if config.family != name:
        raise UsageError(f"model {name} serves {name} decoders; {checkpoint or preset} is {config.family}")
    dtype = options.get("dtype")  # (None: the checkpoint's, or float32 for a preset's random weights)
    source = DecoderSource(config, checkpoint, options.get("seed", 0), dtype if checkpoint else dtype or torch.float32)
    return source.build("cpu"), load_tokenizer(checkpoint) if checkpoint else None, options.get("device")


def _executor(lm, device: str, own: dict, num_prompts: int, prompt: int, generate: int):
    import torch
    from batchmaker.core.zigzag import Placement
    from batchmaker.engine_config import choose_cpu_threads
    from batchmaker.exec.offload import OffloadConfig, OffloadExecutor
    from batchmaker.exec.offload_auto import CPU_DEVICE_BYTES, choose, host_bytes, measure
    from batchmaker.exec.offload_memory import CUDA_RESERVE

    if torch.device(device).type == "cpu":  # (torch's threads as the engine picks them for one inline CPU worker)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(choose_cpu_threads(cores, 1, True, None))
    offload = own.get("offload", "none")
    gpu_batch, num_batches = own.get("gpu_batch", 4), own.get("num_batches", 2)
    if offload == "auto":
        dtype = lm.embed_tokens.weight.dtype
        device_bytes = own.get("gpu_memory") or _device_bytes(device) or CPU_DEVICE_BYTES
        is_cuda = torch.device(device).type == "cuda"  # (a GPU's workspace held back, its host storage pinned)
        try:  # (the search counts 4-bit codes where compress= asks for them, and keeps a 4-bit cache on the host)
            rates = measure(device, dtype, config=lm.config)  # (the host's cost per unit on this model's family)
            choice = choose(lm.config, dtype, rates, device_bytes, host_bytes(), prompt, generate,
                            max_gpu_batch=min(64, num_prompts), max_batches=min(64, num_prompts), max_block=num_prompts,
                            reserve=CUDA_RESERVE if is_cuda else 0.0, pinned=is_cuda, compress=own.get("compress"))
        except ValueError as e:
            raise UsageError(str(e)) from None
        print(choice.describe(), file=sys.stderr, flush=True)
        placement = choice.placement
        gpu_batch = own.get("gpu_batch", choice.policy.gpu_batch)
        num_batches = own.get("num_batches", choice.policy.num_batches)
    else:
        parts = set(offload.split("+")) - {"none"}
        placement = Placement(*(kind in parts for kind in ("weights", "cache", "hidden")),
                              cpu_attention="cpu_attention" in parts)
    try:
        if "weights_gpu" in own:  # (auto's choice overridden: the weights offloaded, that share kept)
            placement = replace(placement, weights=placement.weights or offload == "auto",
                                weights_gpu=own["weights_gpu"])
        config = OffloadConfig(gpu_batch, num_batches, placement, compress=own.get("compress"),
                               dequant=own.get("dequant"))
    except ValueError as e:
        raise UsageError(f"--set weights_gpu, compress, dequant: {e}") from None
    return OffloadExecutor(lm, device, config)


def _device_bytes(device: str) -> float | None:
    import torch
    if torch.device(device).type != "cuda":
        return None
    return float(torch.cuda.mem_get_info(torch.device(device))[0])


class Progress:
    """One line on stderr: prompts done, tokens, tokens/s and the ETA (redrawn on a terminal)."""

    def __init__(self, total: int):
        self.total, self.done, self.tokens, self.start = total, 0, 0, time.perf_counter()
        self.is_terminal = sys.stderr.isatty()

    def begin(self) -> None:
        """Generation starts (after the model is built)."""
        self.start = time.perf_counter()

    def add(self, tokens: int) -> None:
        self.done, self.tokens = self.done + 1, self.tokens + tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        eta = elapsed / self.done * (self.total - self.done)
        line = (f"{self.done}/{self.total} prompts, {self.tokens} tokens, {self.tokens / elapsed:.1f} tokens/s, "
                f"ETA {eta:.0f} s")
        print(("\r" + line) if self.is_terminal else line, end="" if self.is_terminal else "\n", file=sys.stderr,
              flush=True)

    def end(self) -> None:
        if self.is_terminal and self.done:
            print(file=sys.stderr)

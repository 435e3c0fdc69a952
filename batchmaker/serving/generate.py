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
exec/offload_cache.py). These keys (parsed in serving/offload_options.py, which `serve` shares) are
the command's own; the rest of --set goes to the model.
"""
import logging
import sys
import time

from batchmaker.serving.cli_models import UsageError
from batchmaker.serving.offload_options import build_executor, host_model, is_offloaded, split_settings
from batchmaker.serving.prompt_file import OutputFile, PromptRecord, finished_ids, read_prompts

log = logging.getLogger("batchmaker")


def run_generate(args) -> int:
    name = args.models.strip()
    if "," in name or ":" in name:
        raise UsageError(f"--models {name}: generate runs one registered decoder (llama or opt)")
    if args.max_new_tokens < 1 or (args.max_prompts is not None and args.max_prompts < 1):
        raise UsageError("--max-new-tokens and --max-prompts must be at least 1")
    own, model_items = split_settings(args.set, [name])
    own = own[name]
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
        if not is_offloaded(own):
            _run_engine(name, model_items, args.devices, pending, out, progress)
        else:
            _run_offloaded(name, model_items, args.devices, own, pending, out, progress)
    finally:
        out.close()
        progress.end()
    return 0


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
        executor = build_executor(lm, device, own, len(prompts), max(map(len, prompts)),
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
    from batchmaker.offloaded import cut
    progress.begin()
    block, eos = executor.config.block, set(lm.config.eos_token_ids)
    for first in range(0, len(pending), block):
        records = pending[first:first + block]
        generated, _ = executor.generate_block(prompts[first:first + block], [r.max_new_tokens for r in records])
        for record, tokens in zip(records, generated):
            tokens, reason = cut(tokens, eos)
            out.write(record, tokens, reason, tokenizer.decode(tokens) if record.prompt is not None else None)
            progress.add(len(tokens))


def _build(name: str, items: list[str]):
    """The decoder on the CPU, its tokenizer, the device --set names."""
    from batchmaker.serving.model_options import SettingError, parse_settings
    try:
        options = parse_settings(items, [name])[name]
    except (SettingError, LookupError) as e:
        raise UsageError(str(e)) from None
    return (*host_model(name, options), options.get("device"))


def _encode(tokenizer, record: PromptRecord) -> list[int]:
    if tokenizer is None:
        raise UsageError(f"prompt {record.id!r}: a text prompt needs a checkpoint with a tokenizer.json")
    return tokenizer.encode(record.prompt).ids


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

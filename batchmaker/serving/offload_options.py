"""The offload keys of `--set` (`offload`, `gpu_memory`, `gpu_batch`, `num_batches`, `weights_gpu`,
`compress`, `dequant`): parsed and checked once for `batchmaker generate` (serving/generate.py)
and `batchmaker serve` (serving/cli_models.py), and what they build: the decoder on the CPU and
FlexGen's offloading executor over it (exec/offload.py), or, for serve, an OffloadedModel
(batchmaker/offloaded.py) that a block worker runs beside the engine's models.
"""
import logging
import os
import re
import sys
from dataclasses import replace

from batchmaker.serving.cli_models import UsageError

log = logging.getLogger("batchmaker")
OFFLOAD_KEYS = ("offload", "gpu_memory", "gpu_batch", "num_batches", "weights_gpu", "compress", "dequant")
MODEL_KEYS = ("preset", "checkpoint", "seed", "dtype")  # what the offloading path builds the model from
AUTO_PROMPTS = 256  # serve, offload=auto: the most prompts of a block the policy search considers
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)


def split_settings(items: list[str], names: list[str]) -> tuple[dict[str, dict], list[str]]:
    """(per name in `names`, its offload keys converted; the --set items left for the models). A
    bare key applies to every name, `NAME.KEY` to that one."""
    own: dict[str, dict] = {name: {} for name in names}
    rest = []
    for item in items:
        key, _, text = item.partition("=")
        scope, _, bare = key.strip().rpartition(".")
        if bare not in OFFLOAD_KEYS or (scope and scope not in own) or not names:
            rest.append(item)
            continue
        value = _convert(bare, text.strip())
        for name in ([scope] if scope else names):
            own[name][bare] = value
    return own, rest


def is_offloaded(own: dict) -> bool:
    """Whether a model's offload keys ask for the offloading executor (offload=none alone does not)."""
    return own.get("offload", "none") != "none" or bool(set(OFFLOAD_KEYS[2:]) & set(own))


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


def host_model(name: str, options: dict, used: tuple[str, ...] = ()):
    """(the decoder built on the CPU from its factory's `options`: its layers become the host
    copy; its tokenizer or None). Options other than MODEL_KEYS, `device` and `used` are warned
    about: the executor has its own cache."""
    import torch
    from batchmaker.cells.checkpoint import load_tokenizer, read_config
    from batchmaker.cells.decoder_config import PRESETS
    from batchmaker.cells.decoder_source import DecoderSource
    from batchmaker.serving.model_options import factory_options

    ignored = sorted(set(options) - set(MODEL_KEYS) - {"device"} - set(used))
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
    return source.build("cpu"), load_tokenizer(checkpoint) if checkpoint else None


def build_executor(lm, device: str, own: dict, num_prompts: int, prompt: int, generate: int):
    """The OffloadExecutor of `lm` on `device` as the offload keys `own` say; with offload=auto, the
    policy searched for `num_prompts` prompts of `prompt` tokens generating `generate` each (printed
    on stderr). Sets torch's threads for a CPU device (the caller restores them)."""
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


def offloaded_model(name: str, options: dict, own: dict):
    """A registered decoder served by the offloading executor (batchmaker/offloaded.py), built
    from its factory's `options` (preset, checkpoint, seed, dtype, device, max_new_tokens) and its
    offload keys `own`. offload=auto sizes the policy for blocks of requests that fill the model's
    context (prompt + max_new_tokens = its positions), at most AUTO_PROMPTS of them."""
    import torch
    from batchmaker.offloaded import OffloadedModel
    from batchmaker.serving.model_options import factory_options

    lm, tokenizer = host_model(name, options, used=("max_new_tokens",))
    max_new = options.get("max_new_tokens", factory_options(name)["max_new_tokens"].default)
    threads = torch.get_num_threads()  # (the engine picks its own; the executor's setting is generate's)
    try:
        generate = max(1, min(max_new, lm.config.max_positions - 1))
        executor = build_executor(lm, options.get("device", "cpu"), own, AUTO_PROMPTS,
                                  lm.config.max_positions - generate, generate)
    finally:
        torch.set_num_threads(threads)
    return OffloadedModel(name, executor, tokenizer, max_new, checkpoint=options.get("checkpoint"))

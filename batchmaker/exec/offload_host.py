"""The offloading executor's host cost per unit (issue 34): the seconds of host time one (GPU
batch, layer) of a decode step takes beside the data it moves and the device's compute: the
layer's launches (its forward is some 60 kernels), the slot's moves (a side-stream copy each)
and the sync closing the slot, all issued from Python. The cost model takes it as a per-unit
term (core/offload_policy.py: `Hardware.unit_seconds`), since a block's decode step issues
layers x num_batches units whatever the GPU batch: a small GPU batch pays it for few rows.

`unit_seconds` measures it where it runs: the executor itself (exec/offload.py) over a decoder
of the model's family and head layout shrunk until its compute is negligible (hidden 64, 4
layers), weights, cache and hidden states offloaded (half the layers resident: each kind of
slot), one row per GPU batch; a block of 8 GPU batches generates two counts of tokens and the
difference of their times over the difference of their units is the decode step's time per unit
(the prompt step's and the block's set-up cancel). On a CPU the moves are copies between two CPU
tensors; on a GPU the side streams, launches and syncs are the real ones.
"""
import random
import time
from dataclasses import replace

import torch

from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS, DecoderConfig
from batchmaker.core.zigzag import Placement

PLACEMENT = Placement(True, True, True, weights_gpu=0.5)


def tiny_like(config: DecoderConfig, num_layers: int = 4) -> DecoderConfig:
    """`config`'s family, norms and head grouping at a size whose compute is negligible (a model the
    executor does not run, Gemma's or one with sliding windows: Llama's)."""
    if config.is_gemma or config.attention_windows:
        config = PRESETS["tiny-llama"]
    group = max(1, config.num_heads // max(1, config.num_kv_heads))
    kv_heads = 2 if group > 1 else 4
    return replace(config, hidden_size=64, intermediate_size=128, num_layers=num_layers, num_heads=kv_heads * group,
                   num_kv_heads=kv_heads, head_dim=16, vocab_size=min(config.vocab_size, 512),
                   max_positions=min(config.max_positions, 256))


def unit_seconds(config: DecoderConfig, device, dtype: torch.dtype = torch.float32, gpu_batch: int = 1,
                 num_batches: int = 8, prompt: int = 8, tokens: tuple[int, int] = (2, 10), repeats: int = 3,
                 placement: Placement = PLACEMENT) -> float:
    """Host seconds per (GPU batch, layer) of a decode step of the executor on `device`, over
    `tiny_like(config)` (the best of `repeats` for each count of `tokens`)."""
    from batchmaker.exec.offload import OffloadConfig, OffloadExecutor  # (offload_auto imports this module)
    tiny = tiny_like(config)
    lm = build_decoder(tiny, seed=0, dtype=dtype)
    executor = OffloadExecutor(lm, device, OffloadConfig(gpu_batch, num_batches, placement))
    rng = random.Random(0)
    prompts = [[rng.randrange(tiny.vocab_size) for _ in range(prompt)] for _ in range(gpu_batch * num_batches)]
    executor.generate_block(prompts, tokens[0])  # (warm-up)
    best = []
    for count in tokens:
        seconds = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            executor.generate_block(prompts, count)  # (its tokens' copy to the host is the block's sync)
            seconds = min(seconds, time.perf_counter() - start)
        best.append(seconds)
    units = (tokens[1] - tokens[0]) * tiny.num_layers * num_batches
    return max(best[1] - best[0], 0.0) / units

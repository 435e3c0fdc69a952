"""A 4-bit KV cache on the host (`compress="kv"`, exec/offload_cache.py; FlexGen §5): the tokens
equal those of a reference that attends over its past keys and values round-tripped through 4
bits (groups along the head) and over the current step's as computed, each prompt alone; with
`compress="both"` the weights are round-tripped too. A load and a store carry a quarter of the
fp32 cache's bytes; a cache kept on the device is not compressed."""
import random

import pytest
import torch

from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS
from batchmaker.core.zigzag import Placement
from batchmaker.exec.offload import OffloadConfig, OffloadExecutor
from batchmaker.exec.offload_cache import kv_group
from batchmaker.kernels.compress4 import compress, decompress
from batchmaker.kernels.paged_attention import causal_attention


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(8)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (3, 7, 1, 5, 2)]


def round_trip(x: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    return decompress(compress(x, group, dim))


def kv4_greedy(lm, prompt: list[int], n: int) -> list[int]:
    """The reference: past K and V round-tripped once, the step's own as computed."""
    config = lm.config
    group = kv_group(config.head_dim)
    past: dict[int, tuple] = {}

    def attend(layer: int, q, k, v):
        old_k, old_v = past.get(layer, (k[:0], v[:0]))
        out = causal_attention(q, torch.cat([old_k, k]), torch.cat([old_v, v]), config.attention_scale, None,
                               config.attn_softcap).to(q.dtype)
        past[layer] = (torch.cat([old_k, round_trip(k, group, -1)]), torch.cat([old_v, round_trip(v, group, -1)]))
        return out

    out, feed, position = [], list(prompt), 0
    with torch.no_grad():
        for _ in range(n):
            positions = torch.arange(position, position + len(feed))
            hidden = lm(torch.tensor(feed), positions, attend)
            out.append(int(lm.head(hidden[-1:])[0].argmax()))
            position, feed = position + len(feed), out[-1:]
    return out


def reference(preset: str, n: int, weights_too: bool) -> list[list[int]]:
    lm = build_decoder(PRESETS[preset], seed=3)
    if weights_too:
        with torch.no_grad():
            for p in lm.layers.parameters():
                if p.dim() == 2:
                    p.copy_(round_trip(p, 64, 0))
    return [kv4_greedy(lm, p, n) for p in prompts(PRESETS[preset].vocab_size)]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt"])
@pytest.mark.parametrize("compress_what, placement", [("kv", Placement(True, True, True)),
                                                      ("kv", Placement(False, True, False)),
                                                      ("both", Placement(True, True, False))],
                         ids=["kv-all", "kv-cache-only", "both"])
@pytest.mark.parametrize("gpu_batch, num_batches", [(2, 3), (4, 1)])
def test_tokens_equal_the_round_tripped_cache_reference(preset, compress_what, placement, gpu_batch, num_batches):
    executor = OffloadExecutor(build_decoder(PRESETS[preset], seed=3), "cpu",
                               OffloadConfig(gpu_batch, num_batches, placement, check_buffers=True,
                                             compress=compress_what))
    tokens = executor.generate(prompts(PRESETS[preset].vocab_size), 6)
    assert tokens == reference(preset, 6, weights_too=compress_what == "both")


def test_a_compressed_cache_moves_a_quarter_of_the_bytes():
    config = PRESETS["tiny-llama"]  # (fp32, heads of 16: a group of 16 values takes 8 bytes of codes + 8 of range)
    moved = {}
    for what in (None, "kv"):
        executor = OffloadExecutor(build_decoder(config, seed=3), "cpu",
                                   OffloadConfig(2, 2, Placement(False, True, False), compress=what))
        moved[what] = executor.generate_block(prompts(config.vocab_size)[:4], 5)[1].bytes["cache"]
    assert moved["kv"] * 4 == moved[None] > 0


def test_a_cache_on_the_device_is_not_compressed():
    with pytest.raises(ValueError, match="keeps it on the device"):
        OffloadConfig(placement=Placement(True, False, True), compress="kv")
    with pytest.raises(ValueError, match="'kv' or 'both'"):
        OffloadConfig(compress="cache")

"""Compressed offloaded weights (exec/offload_weights.py) by each way of meeting the compute: the
PyTorch twin (the CPU's default), Triton's expansion into the weight buffer and the projection
fused with the expansion (`linear4`). On the CPU the two kernels' paths fall back to their twins,
and under Triton's interpreter they run the kernels; either way the tokens equal those of the
resident model whose matrices went through the same round trip. Also: an executor of another
block shape over the same host weights (`with_block`) gives what a fresh one gives."""
import random

import pytest
import torch
from helpers import interpreter, run_interpreted

from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS
from batchmaker.core.zigzag import Placement
from batchmaker.exec.offload import OffloadConfig, OffloadExecutor
from batchmaker.exec.offload_resident import round_tripped
from batchmaker.exec.offload_weights import Linear4


def prompts(vocab: int, lengths=(3, 7, 1, 5)) -> list[list[int]]:
    rng = random.Random(6)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def round_tripped_greedy(preset: str, n: int) -> list[list[int]]:
    """The reference: the resident model with its layers' matrices round-tripped through 4 bits,
    each prompt alone, the whole sequence re-run per token."""
    config = PRESETS[preset]
    lm = round_tripped(build_decoder(config, seed=3))
    out = []
    for prompt in prompts(config.vocab_size):
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(lm.dense_logits(torch.tensor(seq))[-1].argmax()))
        out.append(seq[len(prompt):])
    return out


def compressed_executor(preset: str, dequant: str | None, placement=Placement(True, True, True)) -> OffloadExecutor:
    config = OffloadConfig(2, 2, placement, check_buffers=True, compress="weights", dequant=dequant)
    return OffloadExecutor(build_decoder(PRESETS[preset], seed=3), "cpu", config)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt"])
@pytest.mark.parametrize("dequant", [None, "reference", "expand", "fused"])
def test_each_dequant_gives_the_tokens_of_the_round_tripped_model(preset, dequant):
    executor = compressed_executor(preset, dequant)
    assert executor.host_weights.dequant == (dequant or "reference")  # (the CPU's default: the twin)
    is_fused = any(isinstance(m, Linear4) for m in executor.weight_buffers[0].modules())
    assert is_fused == (dequant == "fused")
    tokens = executor.generate(prompts(PRESETS[preset].vocab_size), 6)
    assert tokens == round_tripped_greedy(preset, 6)


@interpreter
def test_the_kernels_in_the_executor_give_the_tokens_of_the_round_tripped_model_interpreted():
    want = round_tripped_greedy("tiny-llama", 4)
    vocab = PRESETS["tiny-llama"].vocab_size
    for dequant in ("expand", "fused"):
        executor = compressed_executor("tiny-llama", dequant, Placement(True, False, False))
        assert executor.generate(prompts(vocab), 4) == want, dequant


def test_the_kernels_in_the_executor_in_the_interpreter():
    run_interpreted(__file__, "test_the_kernels_in_the_executor_give_the_tokens_of_the_round_tripped_model_interpreted",
                    timeout=900)


def test_another_block_shape_over_the_same_host_weights():
    config = PRESETS["tiny-llama"]
    first = OffloadExecutor(build_decoder(config, seed=3), "cpu", OffloadConfig(2, 2, check_buffers=True))
    for gpu_batch, num_batches, placement in ((1, 3, Placement(True, False, True)), (4, 1, Placement(True, True, False))):
        other = first.with_block(gpu_batch, num_batches, placement)
        assert other.host_weights is first.host_weights and other.config.block == gpu_batch * num_batches
        fresh = OffloadExecutor(build_decoder(config, seed=3), "cpu",
                                OffloadConfig(gpu_batch, num_batches, placement, check_buffers=True))
        assert other.generate(prompts(config.vocab_size), 5) == fresh.generate(prompts(config.vocab_size), 5)
    assert first.config.block == 4
    with pytest.raises(ValueError, match="keeps the weights"):
        first.with_block(2, 2, Placement(False, True, True))


def test_a_dequant_needs_compressed_weights_and_a_known_name():
    with pytest.raises(ValueError, match="with compress='weights'"):
        OffloadConfig(dequant="expand")
    with pytest.raises(ValueError, match="one of reference, expand, fused"):
        OffloadConfig(compress="weights", dequant="fast")

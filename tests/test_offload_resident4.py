"""4-bit weights resident on the device (exec/offload_resident.py): with compress="weights" and a
placement that keeps some or all layers' weights on the device, those layers hold 4-bit codes
(Linear4s over one shared scratch), and the tokens equal those of the same model whose matrices went
through the dense round trip, in fp32 and bf16, over prompts of mixed lengths (a prompt step of
more than 16 rows, decode steps of fewer). On the CPU the projections are the twins; under
Triton's interpreter the kernels (gemv4, expand) run."""
import copy
import random

import pytest
import torch
from helpers import interpreter, needs_gpu, run_interpreted
from torch import nn

from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS
from batchmaker.core.zigzag import Placement
from batchmaker.exec.offload import OffloadConfig, OffloadExecutor
from batchmaker.exec.offload_resident import resident_bytes, round_tripped
from batchmaker.exec.offload_weights import Linear4

LENGTHS = (3, 12, 1, 5)  # (gpu_batch 2: a prompt step of 2 x 12 = 24 rows; decode steps of 2)


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(8)
    return [[rng.randrange(vocab) for _ in range(n)] for n in LENGTHS]


def model(preset: str, dtype: torch.dtype, round_trip: bool = False):
    lm = build_decoder(PRESETS[preset], seed=5, dtype=dtype)
    return round_tripped(lm) if round_trip else lm


def tokens(preset: str, dtype: torch.dtype, placement: Placement, compress_weights: bool, n: int = 6,
           dequant: str | None = None) -> tuple[list[list[int]], OffloadExecutor]:
    config = OffloadConfig(2, 2, placement, check_buffers=True, compress="weights" if compress_weights else None,
                           dequant=dequant)
    executor = OffloadExecutor(model(preset, dtype, round_trip=not compress_weights), "cpu", config)
    return executor.generate(prompts(PRESETS[preset].vocab_size), n), executor


PLACEMENTS = [Placement(False, False, False), Placement(False, True, True), Placement(True, True, True, weights_gpu=0.5)]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=["all-resident", "resident-cache-offloaded", "half-resident"])
def test_resident_codes_give_the_tokens_of_the_round_tripped_model(preset, dtype, placement):
    got, executor = tokens(preset, dtype, placement, compress_weights=True)
    want, _ = tokens(preset, dtype, placement, compress_weights=False)
    assert got == want
    resident = executor.resident
    assert len(resident) == placement.num_resident(PRESETS[preset].num_layers) > 0
    linears = [m for m in resident.modules() if isinstance(m, Linear4)]
    assert linears and not any(isinstance(m, nn.Linear) for m in resident.modules())
    assert all(m.scratch is executor.scratch for m in linears)  # (one scratch, for the largest matrix)
    assert executor.scratch.numel() == max(m.codes.shape[0] * m.codes.shape[1] for m in linears)
    assert all(getattr(layer, "one_token", None) is None for layer in resident)


def test_resident_codes_take_about_a_quarter_of_fp16s_bytes():
    _, executor = tokens("tiny-llama", torch.float16, Placement(False, False, False), True, n=1)
    dense = model("tiny-llama", torch.float16).layers
    dense_bytes = sum(t.numel() * t.element_size() for t in dense.parameters())
    assert resident_bytes(executor.resident) < 0.32 * dense_bytes  # (36 of 128 bytes a group, norms dense)


def test_a_device_cache_is_not_compressed():
    with pytest.raises(ValueError, match="not built"):
        OffloadConfig(placement=Placement(False, False, False), compress="kv")
    OffloadConfig(placement=Placement(False, False, False), compress="weights")  # (no error: resident codes)


@interpreter
def test_the_kernels_on_resident_codes_give_the_round_tripped_tokens_interpreted():
    for placement in (Placement(False, False, False), Placement(True, False, False, weights_gpu=0.5)):
        got, executor = tokens("tiny-llama", torch.float32, placement, compress_weights=True, n=4)
        assert got == tokens("tiny-llama", torch.float32, placement, compress_weights=False, n=4)[0], placement


def test_the_kernels_on_resident_codes_in_the_interpreter():
    run_interpreted(__file__, "test_the_kernels_on_resident_codes_give_the_round_tripped_tokens_interpreted",
                    timeout=900)


@pytest.mark.gpu
@needs_gpu
def test_resident_codes_on_the_gpu_give_the_round_tripped_tokens():
    """bf16 on a GPU: gemv4 and expand + F.linear against the round-tripped model (dense cuBLAS):
    sums in another order, so the tokens may part after a near tie; most must agree. The prompt
    step of the first batch (24 rows: expand, bit for bit the twin's matrix, then the same F.linear)
    agrees exactly."""
    placement = Placement(False, False, False)
    lm = model("tiny-llama", torch.bfloat16)
    config = OffloadConfig(2, 2, placement, compress="weights")
    got = OffloadExecutor(copy.deepcopy(lm), "cuda", config).generate(prompts(PRESETS["tiny-llama"].vocab_size), 8)
    twin = OffloadExecutor(copy.deepcopy(lm), "cuda", OffloadConfig(2, 2, placement, compress="weights",
                                                                    dequant="reference"))
    want = twin.generate(prompts(PRESETS["tiny-llama"].vocab_size), 8)
    assert [g[0] for g in got[:2]] == [w[0] for w in want[:2]]  # (the first batch's prompt step: 2 x 12 rows)
    agree = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert agree >= 0.9 * sum(map(len, want)), (got, want)

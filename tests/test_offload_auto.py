"""`offload=auto` (exec/offload_auto.py): the machine's rates are measured (positive, finite); the
policy chosen keeps everything on a device that holds it, moves the weights to the host when they
do not fit, keeping as many whole layers on the device as the budget holds beside the buffers
(`weights_gpu`), counts the model's dtype (a budget that holds bf16 weights but not fp32 ones), and
is said in one line with its prediction, which falls as the share grows. A host cache's decode
attention goes to the CPU where the link is slow beside the CPU and host memory, not where the CPU
is slow; the line says which, forcing either way is honoured, and `predict` agrees with the choice."""
import itertools
import math
from dataclasses import replace

import pytest
import torch

from batchmaker.cells.decoder_config import PRESETS
from batchmaker.core.zigzag import Placement
from batchmaker.exec.offload_auto import Rates, choose, host_bytes, measure, predict

RATES = Rates(ctog=5e9, gtoc=5e9, mm_flops=1e11, cpu_flops=1e9)  # (a CPU's, in round numbers)
SMALL = PRESETS["small-llama"]  # 8 layers of 3.1M parameters: 103 MB in fp32, 51 MB in bf16
MIB = 1 << 20


def test_the_rates_are_measured():
    rates = measure("cpu", torch.float32, copy_bytes=4 * MIB, size=128)
    assert all(0 < v < math.inf for v in rates.__dict__.values())
    assert host_bytes() > 64 * MIB


def test_a_device_that_holds_everything_keeps_everything():
    choice = choose(SMALL, torch.float32, RATES, 64 << 30, 64 << 30, prompt=16, generate=16)
    assert choice.placement == Placement(False, False, False)
    assert choice.policy.block > 1  # (as fast at every block size in the model: the largest is taken)


@pytest.mark.parametrize("dtype, offloaded", [(torch.bfloat16, False), (torch.float32, True)])
def test_weights_that_do_not_fit_go_to_the_host(dtype, offloaded):
    choice = choose(SMALL, dtype, RATES, 100 * MIB, 64 << 30, prompt=16, generate=16)
    assert choice.placement.weights is offloaded
    if offloaded:  # (8 layers of 12.3 MiB, the embedding and head's 16 MiB: two buffers and a batch's working
        # set leave room for some resident layers in 100 MiB)
        resident = choice.placement.num_resident(SMALL.num_layers)
        assert 0 < resident < SMALL.num_layers and choice.placement.weights_gpu == resident / SMALL.num_layers
        assert f"weights_gpu={choice.placement.weights_gpu:.2f}" in choice.describe()
    assert choice.tokens_per_s > 0 and choice.step_seconds > 0
    line = choice.describe()
    assert f"gpu_batch={choice.policy.gpu_batch}" in line and "predicted decode step" in line


def test_nothing_fits_is_a_clear_error():
    with pytest.raises(ValueError, match="no placement"):
        choose(SMALL, torch.float32, RATES, 1 * MIB, 1 * MIB, prompt=16, generate=16)


def test_a_bounded_block_and_the_prediction_of_the_chosen_policy():
    choice = choose(SMALL, torch.float32, RATES, 80 * MIB, 64 << 30, prompt=16, generate=16, max_block=8)
    assert choice.policy.block <= 8
    p = predict(SMALL, torch.float32, RATES, choice.placement, choice.policy.gpu_batch, choice.policy.num_batches,
                prompt=16, generate=16)
    assert p.step_seconds == pytest.approx(choice.step_seconds)
    assert p.block_seconds == pytest.approx(p.prefill_seconds + 15 * p.step_seconds)
    assert choice.policy.block * 16 / p.block_seconds == pytest.approx(choice.tokens_per_s)


def test_the_predicted_step_falls_as_the_share_of_resident_layers_grows():
    steps = [predict(SMALL, torch.float32, RATES, Placement(True, True, True, share), 4, 2, prompt=16,
                     generate=16).step_seconds for share in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert all(a > b for a, b in itertools.pairwise(steps))
    same = predict(SMALL, torch.float32, RATES, Placement(True, True, True, 0.3), 4, 2, prompt=16, generate=16)
    assert same.step_seconds == pytest.approx(steps[1])  # (0.3 of 8 layers: 2 of them, as 0.25)


LLAMA_13B = PRESETS["llama-2-13b"]
GIB = 1 << 30


@pytest.mark.parametrize("rates, on_cpu", [
    (Rates(ctog=4e9, gtoc=4e9, mm_flops=300e12, cpu_flops=200e9, host_memory=100e9), True),  # (a slow link)
    (Rates(ctog=4e9, gtoc=4e9, mm_flops=300e12, cpu_flops=1e9, host_memory=100e9), False),  # (a slow CPU)
])
def test_the_cpus_attention_is_chosen_where_it_is_predicted_faster(rates, on_cpu):
    choice = choose(LLAMA_13B, torch.bfloat16, rates, 16 * GIB, 400 * GIB, prompt=512, generate=32, max_block=64)
    assert choice.placement.cache and choice.placement.cpu_attention is on_cpu
    assert ("decode attention on the CPU" if on_cpu else "moved to the device to attend") in choice.describe()
    p = choice.policy
    predicted = predict(LLAMA_13B, torch.bfloat16, rates, choice.placement, p.gpu_batch, p.num_batches, 512, 32)
    assert predicted.step_seconds == pytest.approx(choice.step_seconds)
    flipped = replace(choice.placement, cpu_attention=not on_cpu)
    other = predict(LLAMA_13B, torch.bfloat16, rates, flipped, p.gpu_batch, p.num_batches, 512, 32)
    assert other.step_seconds > predicted.step_seconds
    for forced in (False, True):
        chosen = choose(LLAMA_13B, torch.bfloat16, rates, 16 * GIB, 400 * GIB, prompt=512, generate=32, max_block=64,
                        cpu_attention=forced)
        assert chosen.placement.cpu_attention is (forced and chosen.placement.cache)


def test_a_policy_chosen_for_4_bit_counts_the_codes_and_keeps_a_4_bit_cache_on_the_host():
    """`choose(compress=...)`: 4-bit weights fit where dense ones do not (the whole model resident,
    by the codes' count), a 4-bit cache always lives on the host (the executor's only place for it)
    and is attended on the device; the prediction of a compressed policy is faster than the same
    policy dense (fewer bytes on the link) and its footprint counts the codes (less host memory)."""
    from batchmaker.exec.offload import OffloadConfig
    budget = 40 * MIB  # (bf16 small-llama is 51 MB: dense, some layers stream; 4-bit, all fit)
    dense = choose(SMALL, torch.bfloat16, RATES, budget, 64 << 30, prompt=16, generate=16)
    weights4 = choose(SMALL, torch.bfloat16, RATES, budget, 64 << 30, prompt=16, generate=16, compress="weights")
    assert dense.placement.weights and not weights4.placement.weights and weights4.compress == "weights"
    assert "4-bit weights" in weights4.describe()
    for compress in ("kv", "both"):
        choice = choose(SMALL, torch.bfloat16, RATES, 64 << 30, 64 << 30, prompt=16, generate=16, compress=compress)
        assert choice.placement.cache and not choice.placement.cpu_attention
        OffloadConfig(choice.policy.gpu_batch, choice.policy.num_batches, choice.placement, compress=compress)
    placement = Placement(True, True, True, 0.25)
    plain, packed = (predict(SMALL, torch.bfloat16, RATES, placement, 4, 2, prompt=16, generate=16, compress=c)
                     for c in (None, "both"))
    assert packed.step_seconds < plain.step_seconds and packed.footprint.host < plain.footprint.host
    with pytest.raises(ValueError, match="compress"):
        choose(SMALL, torch.bfloat16, RATES, budget, 64 << 30, prompt=16, generate=16, compress="all")

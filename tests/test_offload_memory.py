"""What the offloading executor holds (exec/offload_memory.py) and the search that counts it
(exec/offload_auto.choose): the count meets the peaks measured on an H100 for a 13B model; for
random caps, models and rates the search never picks a policy whose predicted device or host
bytes exceed what it was given; the executor's count is stricter than FlexGen's formula (fewer
resident layers under the same budget); the host bytes are what a block run's arena holds
(exec/pinned_arena.py: counted and allocated on the CPU, with and without the pinned allocator's
rounding, one chunk or many), 13B's host cache in 4 GiB chunks; and
a policy's bound is never slower than the cost model's prediction, bound by the link where
compute is free; with the CPU's attention the device holds the prompt's columns in its slots and no
decode step's fp32 cache, the host the CPU's working set; 4-bit weights are counted as the executor
holds them, resident or streamed."""
import math
import random

import pytest
import torch

from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS
from batchmaker.core.offload_policy import search
from batchmaker.core.zigzag import Placement
from batchmaker.exec import pinned_arena
from batchmaker.exec.offload import OffloadConfig, OffloadExecutor
from batchmaker.exec.offload_auto import Rates, bound, choose, hardware, model_shape, predict
from batchmaker.exec.offload_memory import ModelBytes, footprint
from batchmaker.exec.offload_resident import resident_bytes
from batchmaker.exec.pinned_arena import arena_bytes

GIB, MIB = 1 << 30, 1 << 20
H100 = Rates(ctog=53e9, gtoc=52e9, mm_flops=600e12, cpu_flops=116e9, host_memory=60e9)


@pytest.mark.parametrize("gpu_batch, num_batches, cache_on, hidden_on, measured_gib", [
    (8, 1, True, True, 6.51),  # auto-B8 (bench/results/offload-NVIDIA-H100-80GB-HBM3-2026-11-26.json)
    (64, 1, False, True, 14.76),  # auto-B64
    (4, 2, False, False, 2.71),  # other-4x2-weights+cache+hidden
])
def test_the_count_meets_the_13b_peaks_measured_on_an_h100(gpu_batch, num_batches, cache_on, hidden_on, measured_gib):
    model = ModelBytes.of(PRESETS["llama-2-13b"], torch.bfloat16)
    counted = footprint(model, gpu_batch, num_batches, 512, 32, 0.0, cache_on, hidden_on).device / GIB
    assert counted == pytest.approx(measured_gib, rel=0.03)  # (allocated; the reserve covers the rest)


@pytest.mark.parametrize("chunk", [None, 4096, 16384])  # (None: one chunk; 4 KiB: each K | V and hidden state
# an allocation of its own)
@pytest.mark.parametrize("rounds", [False, True])
@pytest.mark.parametrize("placement", [Placement(True, True, True), Placement(False, True, False),
                                       Placement(True, False, True), Placement(True, True, True, cpu_attention=True),
                                       Placement(False, True, False, cpu_attention=True)], ids=str)
def test_the_host_bytes_are_what_a_block_runs_arena_holds(monkeypatch, placement, rounds, chunk):
    arenas = []

    def recording(pin, build, **kwargs):
        arena, built = holding(pin, build, rounds=rounds, **kwargs)
        arenas.append(arena)
        return arena, built
    holding = pinned_arena.holding
    monkeypatch.setattr(pinned_arena, "holding", recording)
    if chunk:
        monkeypatch.setattr(pinned_arena, "CHUNK_BYTES", chunk)
    config, (gbs, nb, prompt, generate) = PRESETS["tiny-llama"], (2, 3, 8, 5)
    executor = OffloadExecutor(build_decoder(config, seed=3), "cpu", OffloadConfig(gbs, nb, placement))
    executor.generate_block([[k + 1] * prompt for k in range(gbs * nb)], generate)
    model = ModelBytes.of(config, torch.float32)
    counted = footprint(model, gbs, nb, prompt, generate, 0.0, not placement.cache, not placement.hidden,
                        pinned=rounds, host_weights=0.0, cpu_attention=placement.cpu_attention).host
    cpu_working = model.decode_attention(gbs, prompt, generate) if placement.cpu_attention else 0  # (not the arena's)
    (arena,) = arenas
    assert counted - cpu_working == arena.reserved > 0


@pytest.mark.parametrize("chunk", [None, 4096, 16384, 40960])  # (4 KiB: each codes tensor a chunk of its own)
@pytest.mark.parametrize("placement", [Placement(True, True, True), Placement(False, True, False)], ids=str)
def test_a_4bit_host_caches_bytes_are_what_its_arena_holds(monkeypatch, placement, chunk):
    """compress="kv": the K and V codes, scales and mins of each (layer, batch), allocated field by
    field (offload_cache.empty_codes_many) in the order the count takes them (`compress_cache`)."""
    arenas = []
    monkeypatch.setattr(pinned_arena, "holding", lambda pin, build, _holding=pinned_arena.holding, **kw: arenas.append(
        _holding(pin, build, rounds=True, **kw)) or arenas[-1])
    if chunk:
        monkeypatch.setattr(pinned_arena, "CHUNK_BYTES", chunk)
    config, (gbs, nb, prompt, generate) = PRESETS["tiny-llama"], (2, 3, 200, 5)  # (codes of 6.5 KB, scales of 3.3)
    executor = OffloadExecutor(build_decoder(config, seed=3), "cpu", OffloadConfig(gbs, nb, placement, compress="kv"))
    executor.generate_block([[k + 1] * prompt for k in range(gbs * nb)], generate)
    model = ModelBytes.of(config, torch.float32)
    count = [footprint(model, gbs, nb, prompt, generate, 0.0, False, not placement.hidden, pinned=pinned,
                       host_weights=0.0, compress_cache=compressed).host
             for pinned, compressed in ((True, True), (False, True), (False, False))]
    ((arena, _),) = arenas
    assert count[0] == arena.reserved > 0 and count[1] < count[2]  # (unrounded: the codes take less than fp32)


def test_13bs_host_cache_takes_4_gib_chunks_not_a_power_of_two_a_tensor():
    """A block of 4 x 32 prompts of 512 + 32: 160 K | V tensors of 356 MB, 12 a chunk, and 4 hidden
    states in the last chunk's room: 14 chunks (56 GiB; a pinned allocation each took 82 GiB)."""
    model = ModelBytes.of(PRESETS["llama-2-13b"], torch.bfloat16)
    used = footprint(model, 32, 4, 512, 32, 0.0, False, False, pinned=True, host_weights=0.0)
    assert used.host == 14 * 4 * GIB
    unpinned = footprint(model, 32, 4, 512, 32, 0.0, False, False, host_weights=0.0)
    assert unpinned.host == 14 * 4 * GIB  # (unpinned chunks of 4 GiB too: the same 14)



@pytest.mark.parametrize("chunk", [None, 8192])  # (None: one chunk; 8 KiB: many, a layer's tensors across them)
@pytest.mark.parametrize("resident", [0, 1])
def test_the_streamed_weights_count_is_what_pinning_them_in_an_arena_holds(monkeypatch, resident, chunk):
    """HostWeights beside a GPU moves a checkpoint's streamed layers into one arena
    (pinned_arena.pin_in_place); the memory model counts that arena (ModelBytes.streamed_weights),
    checked here with unpinned chunks under the pinned rounding, and the values kept."""
    if chunk:
        monkeypatch.setattr(pinned_arena, "CHUNK_BYTES", chunk)
    config = PRESETS["tiny-llama"]
    lm = build_decoder(config, seed=3)
    streamed = [t for layer in lm.layers[resident:] for t in [*layer.parameters(), *layer.buffers()]]
    before = [t.detach().clone() for t in streamed]
    arenas = []
    monkeypatch.setattr(pinned_arena, "holding",
                        lambda pin, build, _holding=pinned_arena.holding: arenas.append(
                            _holding(pin, build, rounds=True)) or arenas[-1])
    arena = pinned_arena.pin_in_place(streamed, pin=False)
    assert arena is arenas[0][0]
    assert all(torch.equal(t, b) for t, b in zip(streamed, before))
    storages = {t.untyped_storage().data_ptr() for t in streamed}
    assert len(storages) == 1 if chunk is None else len(storages) > 1
    counted = ModelBytes.of(config, torch.float32).streamed_weights(config.num_layers - resident, True)
    assert counted == arena.reserved >= len(lm.layers[resident:]) * ModelBytes.of(config, torch.float32).layer


@pytest.mark.parametrize("seed", range(12))
def test_the_search_never_picks_a_policy_over_its_budgets(seed):
    rng = random.Random(seed)
    config = PRESETS[rng.choice(["small-llama", "llama-2-7b", "llama-2-13b"])]
    dtype = rng.choice([torch.bfloat16, torch.float32])
    weights = ModelBytes.of(config, dtype).layer * config.num_layers
    cap = rng.uniform(0.05, 1.5) * weights  # (from less than the buffers to more than the whole model)
    host = rng.uniform(0.5, 4.0) * weights
    rates = Rates(*(v * rng.uniform(0.2, 5) for v in (53e9, 52e9, 600e12, 116e9, 60e9)))
    prompt, generate = rng.choice([16, 128, 512]), rng.choice([4, 32])
    kwargs = {"reserve": rng.choice([0.0, 0.25 * GIB]), "pinned": rng.random() < 0.5,
              "host_weights": rng.choice([None, 0.0])}
    try:
        choice = choose(config, dtype, rates, cap, host, prompt, generate, max_block=rng.choice([None, 64]), **kwargs)
    except ValueError as e:
        assert "no placement" in str(e)
        return
    p = choice.policy
    used = predict(config, dtype, rates, choice.placement, p.gpu_batch, p.num_batches, prompt, generate,
                   **kwargs).footprint
    assert used == choice.footprint
    assert used.device <= cap * (1 + 1e-9) and used.host <= host * (1 + 1e-9)


def test_the_executors_count_keeps_fewer_layers_than_flexgens_formula():
    """FlexGen's peak counts no working set, embedding or head: under a 16 GiB cap it would keep more
    layers on the device than fit (the H100 run of 2026-11-26 peaked 2.8 GiB over its 12 GiB budget)."""
    config, dtype = PRESETS["llama-2-13b"], torch.bfloat16
    ours = choose(config, dtype, H100, 16 * GIB, 100 * GIB, 512, 32, max_block=64, reserve=GIB, pinned=True)
    _, flexgen = search(model_shape(config, 512, 32), hardware(H100, dtype, 16 * GIB, 100 * GIB), step=1.0,
                        max_block=64, kv_to_gpu=True, weight_step=1 / config.num_layers)
    assert 0 < ours.placement.weights_gpu < flexgen.wg
    assert ours.footprint.device <= 16 * GIB


@pytest.mark.parametrize("seed", range(6))
def test_a_bound_is_never_slower_than_the_prediction(seed):
    rng = random.Random(seed)
    config, dtype = PRESETS["llama-2-13b"], torch.bfloat16
    cache = rng.random() < 0.5
    placement = Placement(True, cache, rng.random() < 0.5, rng.choice([0.0, 0.25, 0.5]), cache and rng.random() < 0.5)
    gbs, nb = rng.choice([1, 4, 16]), rng.choice([1, 4, 16])
    b = bound(config, dtype, H100, placement, gbs, nb, 512, 32)
    p = predict(config, dtype, H100, placement, gbs, nb, 512, 32)
    assert b.tokens_per_s >= gbs * nb * 32 / p.block_seconds * (1 - 1e-9)
    assert b.binding in ("link", "host_memory", "gpu") and all(math.isfinite(t) for t in b.link + b.gpu)


def test_with_compute_free_the_link_bounds_and_host_memory_is_the_links_bytes():
    free = Rates(ctog=50e9, gtoc=50e9, mm_flops=1e30, cpu_flops=1e30, host_memory=100e9)
    b = bound(PRESETS["llama-2-13b"], torch.bfloat16, free, Placement(True, True, True), 4, 2, 512, 32)
    assert b.binding == "link"
    # (host memory serves both directions' bytes at twice the link's rate: between half the link's time and all of it)
    assert 0.5 * b.link[1] <= b.host_memory[1] < b.link[1] and b.gpu[1] < 1e-9
    unmeasured = bound(PRESETS["llama-2-13b"], torch.bfloat16, Rates(50e9, 50e9, 1e30, 1e30), Placement(), 4, 2,
                       512, 32)
    assert unmeasured.host_memory == (0.0, 0.0)


@pytest.mark.parametrize("prompt, generate", [(1, 512), (512, 32)])
def test_with_the_cpus_attention_the_slots_hold_the_prompt_and_the_host_the_working_set(prompt, generate):
    model = ModelBytes.of(PRESETS["llama-2-13b"], torch.bfloat16)
    gbs, nb = 8, 2
    moved, on_cpu = (footprint(model, gbs, nb, prompt, generate, 0.0, False, False, pinned=True, cpu_attention=ca)
                     for ca in (False, True))
    slots = 3 * 2 * (model.kv_tensor(gbs, prompt, generate) - model.kv_tensor(gbs, prompt, 1))  # (decode columns)
    working = model.working(gbs, prompt, generate) - model.working(gbs, prompt, generate, decode_attends=False)
    assert moved.device - on_cpu.device == slots + working
    assert (working > 0) is (prompt == 1)  # (a short prompt's decode attention was the device's peak)
    storage = [(model.num_layers * nb, 2 * model.kv_tensor(gbs, prompt, generate)),
               (nb, model.hidden_tensor(gbs, prompt))]
    staging = arena_bytes(storage + [(1, n) for n in model.attention_staging(gbs)], True) - arena_bytes(storage, True)
    assert on_cpu.host - moved.host == model.decode_attention(gbs, prompt, generate) + staging
    kept = footprint(model, gbs, nb, prompt, generate, 0.0, True, False, cpu_attention=True)  # (a cache on the device)
    assert kept == footprint(model, gbs, nb, prompt, generate, 0.0, True, False)


@pytest.mark.parametrize("placement", [Placement(False, True, True), Placement(True, True, True, weights_gpu=0.5),
                                       Placement(True, True, True)], ids=str)
def test_4bit_weights_are_counted_as_the_executor_keeps_them(placement):
    """compress="weights": resident layers as their codes (exec/offload_resident.py) and one scratch
    of the largest matrix, weight buffers dense beside their codes' staging, the host copy as codes."""
    config = PRESETS["tiny-llama"]
    executor = OffloadExecutor(build_decoder(config, seed=3), "cpu", OffloadConfig(2, 2, placement, compress="weights"))
    model = ModelBytes.of(config, torch.float32)
    resident = placement.num_resident(config.num_layers)
    assert resident * model.layer4 == resident_bytes(executor.resident)
    if resident:
        assert executor.scratch.numel() * 4 == model.largest_matrix
    if resident < config.num_layers:
        staged = sum(s.nbytes for s in executor.host_weights.staging[0] if s is not None)
        assert staged == model.staging4
        host = sum(t.nbytes for layer in executor.host_weights.layers for t in layer)
        assert host == (config.num_layers - resident) * model.layer4
    args = (model, 2, 2, 8, 4, placement.weights_gpu if placement.weights else 1.0, True, True)
    dense, packed = footprint(*args), footprint(*args, compress_weights=True)
    buffers = 2 * (model.layer + model.staging4) if resident < config.num_layers else 0
    want = resident * model.layer4 + (model.largest_matrix if resident else 0) + buffers
    dense_weights = resident * model.layer + (2 * model.layer if resident < config.num_layers else 0)
    assert packed.device - dense.device == want - dense_weights
    assert packed.host - dense.host == (config.num_layers - resident) * (model.layer4 - model.layer)

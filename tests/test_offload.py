"""FlexGen's offloading executor (exec/offload.py) on the CPU, over two memory pools (host storage
and device buffers as separate tensors): its greedy tokens equal the same model resident (each
prompt alone through `dense_logits`) and transformers' for a saved checkpoint, every token, for
several block shapes and every placement, prompts of different lengths left-padded in a batch;
it carries out exactly the zig-zag schedule's operations, a layer's weights cross once per step
of the block; a share of resident layers (`weights_gpu`, dense or 4-bit) changes no token and
only the streamed layers cross; and no compute reads a buffer the schedule is done with (each one is filled with
NaN then), a check that does catch a schedule missing one load. With `cpu_attention` (decode attention
on the CPU over the host cache) the tokens are the same, fp32 and bf16, and a decode step moves q, k,
v and the output, never the cache."""
import itertools
import random
from dataclasses import replace

import pytest
import torch

import batchmaker.exec.offload as offload
from batchmaker.cells.checkpoint import load_checkpoint
from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS
from batchmaker.core.zigzag import Placement, zigzag
from batchmaker.exec.offload import OffloadConfig, OffloadExecutor
from batchmaker.exec.offload_resident import round_tripped
from batchmaker.kernels.compress4 import compress

PLACEMENTS = [Placement(*p) for p in itertools.product((True, False), repeat=3)] + \
    [Placement(weights, True, hidden, cpu_attention=True) for weights, hidden in itertools.product((True, False), repeat=2)]


def placement_id(p: Placement) -> str:
    return f"w{int(p.weights)}c{int(p.cache)}h{int(p.hidden)}" + ("-cpu" if p.cpu_attention else "")


def resident_greedy(lm, prompt: list[int], n: int) -> list[int]:
    """The reference: one prompt alone, the whole sequence re-run through the resident model per token."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(lm.dense_logits(torch.tensor(seq))[-1].argmax()))
    return seq[len(prompt):]


def random_prompts(lengths, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-opt"])
def family(request):
    config = PRESETS[request.param]
    prompts = random_prompts([3, 7, 1, 5, 9, 2, 4], config.vocab_size, seed=1)
    reference = build_decoder(config, seed=3)
    return config, prompts, [resident_greedy(reference, p, 6) for p in prompts]


@pytest.mark.parametrize("gpu_batch, num_batches", [(1, 1), (2, 3), (3, 2), (4, 1), (2, 4)])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=placement_id)
def test_tokens_equal_the_resident_model(family, gpu_batch, num_batches, placement):
    config, prompts, want = family
    executor = OffloadExecutor(build_decoder(config, seed=3), "cpu",
                               OffloadConfig(gpu_batch, num_batches, placement, check_buffers=True))
    assert executor.generate(prompts, 6) == want


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt"])
def test_tokens_equal_transformers_for_a_saved_checkpoint(tmp_path, preset):
    pytest.importorskip("transformers")
    from test_decoder_models import save_hf
    from test_generation import hf_greedy
    hf = save_hf(PRESETS[preset], tmp_path)
    prompts = random_prompts([6, 2, 11, 4, 1], 512, seed=2)
    executor = OffloadExecutor(load_checkpoint(tmp_path), "cpu", OffloadConfig(2, 3, check_buffers=True))
    assert executor.generate(prompts, 8) == [hf_greedy(hf, p, 8) for p in prompts]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=placement_id)
def test_it_carries_out_the_zigzag_operations(placement):
    config = PRESETS["tiny-llama"]
    executor = OffloadExecutor(build_decoder(config), "cpu", OffloadConfig(2, 3, placement))
    prompts = random_prompts([4, 2, 5, 3, 1], config.vocab_size, seed=4)
    _, moved = executor.generate_block(prompts, 5)
    assert moved.ops == zigzag(config.num_layers, 3, 5, placement)
    layer_bytes = sum(p.numel() * p.element_size() for p in build_decoder(config).layers.parameters())
    assert moved.bytes["weights"] == (5 * layer_bytes if placement.weights else 0)  # (once a step, not a batch)
    rows, width, heads = 3 * 2, 5, config.num_kv_heads * config.head_dim
    cache_out = config.num_layers * rows * (width + 4) * heads * 2 * 4  # each column stored once (K and V, fp32)
    cache_in = config.num_layers * rows * sum(width + s - 1 for s in range(1, 5)) * heads * 2 * 4
    if placement.cpu_attention:  # (the prompt's columns stored; each decode step's q, k, v down and output up)
        assert moved.bytes["cache"] == config.num_layers * rows * width * heads * 2 * 4
        per_token = (2 * config.num_heads + 2 * config.num_kv_heads) * config.head_dim * 4
        assert moved.bytes["attention"] == config.num_layers * rows * 4 * per_token
        return
    assert moved.bytes["cache"] == (cache_out + cache_in if placement.cache else 0)
    assert moved.bytes["attention"] == 0


@pytest.mark.parametrize("placement", [Placement(True, True, True), Placement(True, False, False)], ids=placement_id)
def test_compressed_weights_give_the_tokens_of_the_round_tripped_model(placement):
    """compress='weights': each matrix crosses as 4-bit codes; the reference is the resident model
    with its layers' matrices replaced by their round trip through kernels/compress4.py."""
    config = PRESETS["tiny-llama"]
    reference = round_tripped(build_decoder(config, seed=3))
    prompts = random_prompts([3, 7, 1, 5], config.vocab_size, seed=6)
    executor = OffloadExecutor(build_decoder(config, seed=3), "cpu",
                               OffloadConfig(2, 2, placement, check_buffers=True, compress="weights"))
    tokens, moved = executor.generate_block(prompts, 6)
    assert tokens == [resident_greedy(reference, p, 6) for p in prompts]
    plain = 6 * sum(p.numel() * 4 for p in reference.layers.parameters())  # (fp32, once a step)
    assert 0.12 * plain < moved.bytes["weights"] < 0.16 * plain  # (36 bytes a group of 64 instead of 256, + norms)


@pytest.mark.parametrize("gpu_batch, num_batches", [(2, 3), (5, 1)])
@pytest.mark.parametrize("compress_what", [None, "weights"])
@pytest.mark.parametrize("share", [0.0, 0.4, 0.7, 1.0])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt"])
def test_a_share_of_resident_layers_gives_the_resident_models_tokens(preset, share, compress_what, gpu_batch,
                                                                      num_batches):
    """weights_gpu: the first floor(share x 3) layers keep their weights on the device (loaded once,
    dense, round-tripped with 4-bit weights), the others stream as before: the tokens are the
    resident model's (the round-tripped one's), only streamed layers cross, once a step."""
    config = replace(PRESETS[preset], num_layers=3)
    reference = build_decoder(config, seed=3)
    if compress_what:
        round_tripped(reference)
    prompts = random_prompts([3, 7, 1, 5, 2], config.vocab_size, seed=8)
    placement = Placement(True, True, False, weights_gpu=share)
    executor = OffloadExecutor(build_decoder(config, seed=3), "cpu",
                               OffloadConfig(gpu_batch, num_batches, placement, check_buffers=True,
                                             compress=compress_what))
    tokens, moved = executor.generate_block(prompts, 5)
    assert tokens == [resident_greedy(reference, p, 5) for p in prompts]
    assert moved.ops == zigzag(3, num_batches, 5, placement)
    streamed = {0.0: 3, 0.4: 2, 0.7: 1, 1.0: 0}[share]
    kept = [compress(p, 64, dim=0).nbytes if compress_what and p.dim() == 2 else p.numel() * 4
            for p in build_decoder(config).layers[0].parameters()]  # (what a layer's load moves: codes or fp32)
    assert moved.bytes["weights"] == 5 * streamed * sum(kept)


@pytest.mark.parametrize("seed", range(6))
def test_cpu_attention_gives_the_resident_models_tokens_in_bf16(seed):
    """Random block shapes and placements: the CPU attends over the host cache with the device path's
    math, so the bf16 tokens are those of the same bf16 model with everything on the device."""
    rng = random.Random(seed)
    config = replace(PRESETS[rng.choice(["tiny-llama", "tiny-opt"])], num_layers=3)
    prompts = random_prompts([rng.randint(1, 9) for _ in range(rng.randint(1, 8))], config.vocab_size, seed=seed)
    gpu_batch, num_batches = rng.randint(1, 4), rng.randint(1, 3)
    resident = OffloadExecutor(build_decoder(config, seed=3, dtype=torch.bfloat16), "cpu",
                               OffloadConfig(gpu_batch, num_batches, Placement(False, False, False)))
    placement = Placement(rng.random() < 0.5, True, rng.random() < 0.5, cpu_attention=True)
    if placement.weights:
        placement = replace(placement, weights_gpu=rng.choice([0.0, 0.4, 1.0]))
    executor = OffloadExecutor(build_decoder(config, seed=3, dtype=torch.bfloat16), "cpu",
                               OffloadConfig(gpu_batch, num_batches, placement, check_buffers=True))
    assert executor.generate(prompts, 5) == resident.generate(prompts, 5)


def test_a_schedule_missing_an_attention_operation_is_refused(monkeypatch):
    config = PRESETS["tiny-llama"]

    def missing_one(*args, **kwargs):
        ops = zigzag(*args, **kwargs)
        ops.remove(next(op for op in ops if op.kind == "cpu_attend"))
        return ops
    monkeypatch.setattr(offload, "zigzag", missing_one)
    executor = OffloadExecutor(build_decoder(config), "cpu", OffloadConfig(2, 1, Placement(cpu_attention=True)))
    with pytest.raises(AssertionError, match="cpu_attend"):
        executor.generate([[1, 2], [3]], 3)


def test_a_schedule_missing_a_load_is_caught_by_the_nan_check(monkeypatch):
    """One layer, one batch a block: the buffer a load would fill still holds what it would bring
    (each step reuses it), so a missing load goes unseen unless the buffer is poisoned once stored."""
    config = replace(PRESETS["tiny-llama"], num_layers=1)
    prompts = random_prompts([3, 4, 2, 5], config.vocab_size, seed=5)
    reference = build_decoder(config, seed=3)
    want = [resident_greedy(reference, p, 4) for p in prompts]

    def missing_one(*args, **kwargs):
        ops = zigzag(*args, **kwargs)
        ops.remove(next(op for op in ops if op.kind == "load_cache" and op.step == 2))
        return ops
    monkeypatch.setattr(offload, "zigzag", missing_one)
    for check, same in ((False, True), (True, False)):
        executor = OffloadExecutor(build_decoder(config, seed=3), "cpu", OffloadConfig(4, 1, check_buffers=check))
        assert (executor.generate(prompts, 4) == want) is same


def test_each_prompt_gets_its_own_count_up_to_the_last_position():
    """A block runs its largest count; a long prompt with a small count stops at the model's last
    position (its extra tokens dropped), and the others' tokens are unchanged."""
    config = replace(PRESETS["tiny-opt"], max_positions=24)  # (OPT: positions past the table would fail)
    reference = build_decoder(config, seed=3)
    prompts = [random_prompts([20], config.vocab_size, seed=7)[0], [5, 6]]
    executor = OffloadExecutor(build_decoder(config, seed=3), "cpu", OffloadConfig(2, 1))
    tokens, _ = executor.generate_block(prompts, [4, 15])
    assert tokens == [resident_greedy(reference, prompts[0], 4), resident_greedy(reference, prompts[1], 15)]


def test_bad_inputs_are_refused():
    config = PRESETS["tiny-llama"]
    executor = OffloadExecutor(build_decoder(config), "cpu", OffloadConfig(2, 2))
    with pytest.raises(ValueError, match="1 to 4 prompts"):
        executor.generate_block([[1]] * 5, 2)
    with pytest.raises(ValueError, match="token ids"):
        executor.generate_block([[1], []], 2)
    with pytest.raises(ValueError, match="token ids"):
        executor.generate_block([[config.vocab_size]], 2)
    with pytest.raises(ValueError, match="positions"):
        executor.generate_block([[1] * 250], 10)
    with pytest.raises(ValueError, match="num_tokens"):
        executor.generate_block([[1]], 0)
    with pytest.raises(ValueError, match=">= 1"):
        OffloadConfig(0, 2)
    with pytest.raises(ValueError, match="'weights', 'kv' or 'both'"):
        OffloadConfig(compress="cache")
    OffloadConfig(placement=Placement(False, True, True), compress="weights")  # (no error: 4-bit codes resident,
    # tests/test_offload_resident4.py)
    with pytest.raises(ValueError, match="dense host cache"):
        OffloadConfig(placement=Placement(cpu_attention=True), compress="kv")
    with pytest.raises(ValueError, match="keeps the weights where they are"):
        executor.with_block(2, 2, Placement(True, True, True, weights_gpu=0.5))
    with pytest.raises(ValueError, match="Gemma"):
        OffloadExecutor(build_decoder(replace(config, layer_windows=(8, 8))), "cpu")

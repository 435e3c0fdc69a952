"""The padding of an iteration to a CUDA graph's shape (core/iteration_shapes.py `pad`): padded
tokens and sequences write only the scratch block and leave the real ones' outputs as they are,
so an iteration with prompt chunks computes the same padded as unpadded (run here eagerly on the
CPU, tiny Llama and OPT, fp32); and the shapes the graphs are keyed by (`GraphShapes.of`)."""
import dataclasses

import numpy as np
import pytest
import torch

from batchmaker.core.iteration_plan import GraphShape, IterationPlan
from batchmaker.core.iteration_shapes import pad, pad_alone
from test_generation import checkpoint, engine_for  # noqa: F401 (a fixture)


def iteration(runner, rng) -> IterationPlan:
    """The plan of one mixed iteration: 5 new tokens after 20 cached positions, a first chunk of
    3 prompt tokens (it does not sample yet) and one decode token at position 9."""
    bs, vocab = runner.module.block_size, runner.config.vocab_size
    new, start = np.array([5, 3, 1]), np.array([20, 0, 9])
    table = np.zeros((3, runner.max_blocks), dtype=np.int64)
    table[0, :2], table[1, 0], table[2, 0] = [1, 2], 3, 4
    row = np.repeat(np.arange(3), new)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(start, new)])
    query_start = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    return IterationPlan.of(
        tokens=rng.integers(0, vocab, new.sum()), positions=positions, kv_slots=table[row, positions // bs] * bs + positions % bs,
        token_slots=np.full(new.sum(), runner.scratch_slot), query_start=query_start, context_lens=start + new,
        block_tables=table, sample_token=query_start[[1, 3]] - 1, sample_slots=np.array([0, 2]), seeds=np.zeros(2),
        counters=np.zeros(2), top_k=np.zeros(2), temperature=np.zeros(2), top_p=np.ones(2), max_query_len=5)


@pytest.fixture
def runner(checkpoint):
    """The iteration runner of a CPU engine on the tiny checkpoint (started without a thread: nothing steps it)."""
    family, path, _ = checkpoint
    engine, _ = engine_for(path, family, num_blocks=25, max_seqs=4, max_tokens=48)
    try:
        yield next(iter(engine.workers[0].iterations.values()))
    finally:
        engine.stop()


def test_a_padded_iteration_computes_what_the_unpadded_one_does(runner):
    plan = iteration(runner, np.random.default_rng(5))
    cache = runner.cache
    torch.manual_seed(0)
    cache.k.normal_(), cache.v.normal_()  # (a context for the cached positions to attend to)
    before = cache.k.clone(), cache.v.clone(), runner.last_token.clone()

    def run(host, max_query_len):
        cache.k.copy_(before[0]), cache.v.copy_(before[1]), runner.last_token.copy_(before[2])
        t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in host.items()}
        with torch.inference_mode():
            chosen = runner._forward(t, max_query_len, True, None).clone()
        return chosen, cache.k.clone(), cache.v.clone(), runner.last_token.clone()

    plain = run(plan.arrays(), 5)
    padded_plan = pad(plan, GraphShape(16, 8, None, False), runner.scratch_slot, runner.module.block_size)
    assert padded_plan.num_tokens == 16 and padded_plan.num_seqs == 8 and padded_plan.max_query_len == 16
    assert padded_plan.query_start[-1] == 16 and padded_plan.num_samples == 8
    padded = run(padded_plan.arrays(), 16)
    assert padded[0][:2].tolist() == plain[0].tolist()  # the real samples first, the same tokens
    real = np.zeros(cache.num_blocks * runner.module.block_size, dtype=bool)
    real[plan.kv_slots] = True
    for i in (1, 2):  # K, V
        flat = [c.flatten(1, 2) for c in (before[i - 1], plain[i], padded[i])]  # [layers, slots, ...]
        torch.testing.assert_close(flat[2][:, real], flat[1][:, real], rtol=1e-5, atol=1e-5)
        untouched = torch.from_numpy(~real)
        untouched[:runner.module.block_size] = False  # the scratch block: the padding's
        assert torch.equal(flat[2][:, untouched], flat[0][:, untouched])
    keep = torch.ones(len(before[2]), dtype=torch.bool)
    keep[runner.scratch_slot] = False
    assert torch.equal(padded[3][keep], plain[3][keep])


def test_padding_alone_and_its_errors(runner):
    bs = runner.module.block_size
    alone = pad_alone(GraphShape(4, 4, None, True), runner.scratch_slot, bs, runner.max_blocks)  # a decode graph's warm-up
    assert alone.query_start.tolist() == [0, 1, 2, 3, 4] and alone.positions.tolist() == [0] * 4
    assert (alone.kv_slots == 0).all() and (alone.token_slots == runner.scratch_slot).all()
    plan = iteration(runner, np.random.default_rng(1))
    with pytest.raises(ValueError, match="cannot pad"):
        pad(plan, GraphShape(16, 3, None, False), runner.scratch_slot, bs)  # padded tokens need a padded sequence
    with pytest.raises(ValueError, match="cannot pad"):
        pad(plan, GraphShape(8, 4, None, False), runner.scratch_slot, bs)  # fewer tokens than there are


def test_graph_shapes(runner):
    assert runner.shapes.of(3, 3, True, 9) is None  # (a CPU worker: eagerly)
    shapes = dataclasses.replace(runner.shapes, enabled=True)  # (the shapes alone: nothing is captured here)
    short, bucket = shapes.short_context, shapes.bucket

    def shape(seqs, tokens, longest, decode=False):
        return shapes.of(seqs, tokens, decode, longest)
    assert shape(3, 3, 9, decode=True) == (4, 4, short, True)  # decode: the short bound or none
    assert shape(3, 3, short + 1, decode=True) == (4, 4, None, True)
    bound = short if short < shapes.table_width else None  # prompt chunks: a power of two below the table's width
    assert shape(2, 9, 30) == (16, bucket(3), bound, False)  # 7 padded tokens: a padded sequence
    assert shape(3, 16, 30) == (16, bucket(3), bound, False)  # no padded tokens: none needed
    assert shape(4, 9, 30) is None  # a padded sequence would not fit the batch sizes
    shapes = dataclasses.replace(shapes, table_width=4096)  # (a wider table: contexts bound by powers of two)
    assert short == 512 and [shape(2, 9, n)[2] for n in (30, 513, 1000, 2049, 4000)] == [512, 1024, 1024, None, None]
    most = shapes.prefill_graph_tokens
    assert shape(1, most, 30)[0] == most and shape(1, most + 1, 30) is None  # long prompt chunks: eagerly
    assert [shape(1, n, 30)[0] for n in (17, 100, 128, 129, 300, 449)] == [32, 128, 128, 192, 320, 512]
    # (powers of two while padding is cheap, then steps of 64)


@pytest.mark.parametrize("value", [-1, 1.5, True, "512"])
def test_prefill_graph_tokens_must_be_a_count(value):
    from batchmaker.cells.decoder_cell import KVSettings
    assert KVSettings(prefill_graph_tokens=0).prefill_graph_tokens == 0  # (0: prompt chunks eagerly)
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        KVSettings(prefill_graph_tokens=value)


def test_the_kv_cache_leaves_headroom_on_a_nearly_full_gpu(monkeypatch):
    """KV blocks on a CUDA device: the fraction of the free memory, but never closer to full than
    the headroom (more for a decoder split over processes, and room for sampling and RoPE's cos | sin
    table); no room at all is a MemoryError that says what to set. (torch.cuda.mem_get_info stubbed: no
    GPU here.)"""
    from batchmaker.cells.decoder_cell import DecoderCell, KVSettings, kv_bytes_per_block, sampling_bytes
    from batchmaker.cells.decoder_config import PRESETS
    from batchmaker.cells.decoder_source import DecoderSource
    from batchmaker.cells.llama import LlamaLM
    config = PRESETS["tiny-llama"]
    per_block = kv_bytes_per_block(config, 16, torch.float32)
    gib = 1 << 30
    free = {}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 * gib))

    def blocks(free_gib, tensor_parallel=1, **kv):
        free["bytes"] = int(free_gib * gib)
        cell = DecoderCell(LlamaLM(config), KVSettings(**kv), tensor_parallel, DecoderSource(config))
        return cell.num_blocks_on(torch.device("cuda", 0))
    sampling = 256 * config.vocab_size * 48  # (KVSettings.max_seqs rows of the vocabulary's logits)
    assert sampling_bytes(256, config.vocab_size) == sampling
    reserved = sampling + config.max_positions * config.head_dim * 4  # (and the fp32 model's cos | sin table)
    assert blocks(60) == int(60 * gib * 0.9) // per_block  # plenty free: the fraction binds
    assert blocks(10) == (8 * gib - reserved) // per_block  # 10 GiB free: 2 GiB and those left, not 1
    assert blocks(10, tensor_parallel=2) == (6 * gib - reserved) // per_block  # the communicators' share too
    assert blocks(10, gpu_headroom=0, gpu_headroom_ranks=0) == int(10 * gib * 0.9) // per_block
    assert 0.4 * gib < sampling_bytes(256, 256_000) < 0.6 * gib  # (Gemma 2's vocabulary: one chunk of rows)
    with pytest.raises(MemoryError, match="gpu_headroom"):
        blocks(1.5)
    with pytest.raises(ValueError, match="gpu_headroom"):
        KVSettings(gpu_headroom=-1)


def test_the_work_lists_of_a_padded_iteration_name_each_row_once(runner):
    """What a graphed mixed iteration hands its attention (`_with_work`): every token's row in
    exactly one item, within the lists' capacity for the shape."""
    from batchmaker.kernels.attention_work import capacity
    from batchmaker.kernels.paged_attention import _pow2, pick_config
    padded = pad(iteration(runner, np.random.default_rng(2)), GraphShape(32, 8, None, False), runner.scratch_slot,
                 runner.module.block_size)  # a padded sequence of 23
    arrays = padded.arrays()
    sizes = capacity(32, 8, runner.group, 32)
    lists = runner._with_work(arrays, 32, 32, sizes, exact=True)
    small, large = lists["attn_small"], lists["attn_large"]
    assert lists["work_counts"] == (len(small), len(large)) and len(small) <= sizes[0] and 0 < len(large) <= sizes[1]
    starts, block_m = arrays["query_start"], pick_config(32, _pow2(runner.group)).block_m
    rows = [r for item in small for r in range(starts[item >> 16], starts[(item >> 16) + 1])]
    for item in large:
        seq, tile = item >> 16, item & 0xFFFF
        rows += range(starts[seq] + tile * block_m, min(starts[seq] + (tile + 1) * block_m, starts[seq + 1]))
    assert sorted(rows) == list(range(32))
    assert runner._with_work(arrays, 32, 32, None) is arrays  # (no lists: one launch)
    with pytest.raises(ValueError, match="overflow"):
        runner._with_work(arrays, 32, 32, (1, 1))


@pytest.mark.parametrize("seed", range(4))
def test_packed_columns_start_16_byte_aligned_and_do_not_overlap(seed):
    """Every array of an iteration's packed buffer starts on 16 bytes, whatever the batch's shape
    (Triton compiles a kernel variant per pointer alignment: shapes must not move it)."""
    from batchmaker.exec.iteration_buffers import _NARROW, column_layout
    rng = np.random.default_rng(seed)
    sizes = {name: int(rng.integers(0, 300)) for name in ("tokens", "query_start", "context_lens", "block_tables",
                                                          "temperature", "attn_small", "attn_large", "seeds")}
    columns, total = column_layout(sizes)
    end = 0
    for name, (start, size, words) in columns.items():
        assert start % 2 == 0 and start >= end  # (int64 words: an even word is 16 bytes)
        assert size == sizes[name] and words * 8 >= size * (4 if name in _NARROW else 8)
        end = start + words
    assert end <= total and total % 2 == 0

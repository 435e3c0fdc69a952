"""Tensor parallelism (cells/tensor_parallel.py): a model split over ranks computes what the whole
model computes. Here the ranks are threads of one process, summing through a barrier (the
collectives' arithmetic, without processes); tests/test_tensor_parallel_engine.py runs them as
processes over gloo through the engine."""
import threading
from dataclasses import replace

import pytest
import torch

from batchmaker.cells.decoder import build_decoder, empty_decoder, materialize
from batchmaker.cells.decoder_config import PRESETS
from batchmaker.cells.tensor_parallel import (TensorCut, TensorParallel, check_shardable, install, shard_config,
                                               shard_state)

CONFIGS = {
    "llama-gqa": PRESETS["tiny-llama"],  # 4 heads, 2 kv heads
    "llama-mha": replace(PRESETS["tiny-llama"], num_kv_heads=4),
    "llama-one-kv": replace(PRESETS["tiny-llama"], num_kv_heads=1),  # fewer kv heads than ranks: replicated
    "llama-odd-vocab": replace(PRESETS["tiny-llama"], vocab_size=509, tie_word_embeddings=True),
    "llama-biases": replace(PRESETS["tiny-llama"], attention_bias=True, mlp_bias=True),
    "opt": PRESETS["tiny-opt"],
}


class ThreadGroup:
    """The ranks of one group as threads: each collective adds (or joins) every rank's part in rank
    order, so every rank gets the same bits."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.parts = [None] * size

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.parts[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.parts)
        self.barrier.wait()
        return parts


class ThreadTP(TensorParallel):
    def __init__(self, rank: int, size: int, vocab_size: int, group: ThreadGroup):
        super().__init__(rank, size, vocab_size, group)

    def all_reduce(self, x):
        parts = self.group.exchange(self.rank, x)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return x.copy_(total)

    def gather_logits(self, logits):
        return torch.cat(self.group.exchange(self.rank, logits), dim=-1)[:, :self.vocab_size]


def shards(lm, size: int) -> list:
    group, full = ThreadGroup(size), lm.config
    state = lm.state_dict()
    return [install(materialize(empty_decoder(shard_config(full, size)), shard_state(state, full, r, size), "cpu"),
                    ThreadTP(r, size, full.vocab_size, group), full) for r in range(size)]


def run_ranks(models: list, fn) -> list:
    out = [None] * len(models)

    def rank(r):
        out[r] = fn(models[r])
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(o is not None for o in out), "a rank did not finish"
    return out


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_sharded_model_computes_the_whole_models_logits(name, size):
    config = CONFIGS[name]
    lm = build_decoder(config, seed=3)
    with torch.no_grad():  # (biases and norms away from their initial 0 and 1)
        for n, p in lm.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    tokens = torch.randint(0, config.vocab_size, (11,), generator=torch.Generator().manual_seed(1))
    want = lm.dense_logits(tokens)
    got = run_ranks(shards(lm, size), lambda m: m.dense_logits(tokens))
    for r, logits in enumerate(got):
        assert logits.shape == want.shape
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5, msg=f"rank {r}")
        assert torch.equal(logits, got[0])  # every rank the same bits: they sample the same tokens


def test_each_rank_holds_its_slices_only():
    config = CONFIGS["llama-gqa"]
    lm = build_decoder(config, seed=0)
    full = sum(p.numel() for n, p in lm.named_parameters() if "norm" not in n)
    parts = [sum(t.numel() for n, t in shard_state(lm.state_dict(), config, r, 2).items() if "norm" not in n)
             for r in range(2)]
    assert parts[0] == parts[1] and sum(parts) == full  # (no replicated weight but the norms)
    local = shard_config(config, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 64, 256)


@pytest.mark.parametrize("size, field, value, message", [
    (3, "num_heads", 4, "num_heads"),
    (2, "num_kv_heads", 3, "num_kv_heads"),  # (num_heads 6 below: 3 kv heads neither divide nor are split by 2)
    (2, "intermediate_size", 129, "intermediate_size"),
    (0, None, None, "number of ranks"),
])
def test_configs_ranks_cannot_split_are_refused(size, field, value, message):
    config = PRESETS["tiny-llama"]
    if field == "num_kv_heads":
        config = replace(config, num_heads=6, num_kv_heads=3)
    elif field is not None:
        config = replace(config, **{field: value})
    with pytest.raises(ValueError, match=message):
        check_shardable(config, size)


@pytest.mark.parametrize("name", ["llama-gqa", "llama-one-kv", "llama-odd-vocab", "opt"])
def test_each_rank_builds_its_slices_of_the_same_random_model(name):
    """A rank draws every parameter whole, one at a time, and keeps its cut (cells/decoder.py
    build_decoder): the slices of the model one process would build, and nothing more."""
    config = CONFIGS[name]
    whole = build_decoder(config, seed=7).state_dict()
    for rank in range(2):
        shard = build_decoder(config, seed=7, cut=TensorCut(rank, 2)).state_dict()
        want = shard_state(whole, config, rank, 2)
        assert shard.keys() == want.keys()
        for n, t in shard.items():
            assert torch.equal(t, want[n]), n
            assert t.untyped_storage().nbytes() == t.nbytes, f"{n} keeps the whole parameter alive"


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_each_rank_reads_its_slices_of_a_checkpoint(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    from batchmaker.cells.checkpoint import load_checkpoint
    from batchmaker.cells.decoder_config import to_hf
    config = replace(PRESETS[f"tiny-{family}"], vocab_size=509)  # (not a multiple of the ranks: padded rows)
    torch.manual_seed(3)
    hf_class = transformers.LlamaForCausalLM if family == "llama" else transformers.OPTForCausalLM
    hf_config = (transformers.LlamaConfig if family == "llama" else transformers.OPTConfig)(**to_hf(config))
    hf_class(hf_config).eval().save_pretrained(tmp_path)
    whole = load_checkpoint(tmp_path)
    for rank in range(2):
        shard = load_checkpoint(tmp_path, cut=TensorCut(rank, 2)).state_dict()
        want = shard_state(whole.state_dict(), whole.config, rank, 2)
        for n, t in shard.items():
            assert torch.equal(t, want[n]), n

"""Tensor parallelism of a decoder (Megatron; ORCA's intra-layer parallelism): each of `size` ranks
holds a slice of every layer, and four collectives per layer pass keep them one model.

  q | k | v, gate | up   column-parallel: each rank projects its query heads (and their kv heads)
                         and its share of the MLP's inner width
  o, down (fc2)          row-parallel: each rank's partial output, then one all-reduce; a bias is
                         added by rank 0 only
  token embedding        vocab-parallel: each rank embeds the tokens in its rows (others zero),
                         then one all-reduce
  LM head                vocab-parallel: each rank's logits for its rows, then an all-gather, so
                         every rank samples the same tokens from the same logits
Norms, positions and rotary tables are replicated. Where there are fewer kv heads than ranks, the
kv heads are replicated: rank r keeps the kv head its query heads read. Each rank's KV cache
holds its own kv heads, so a rank's model is an ordinary DecoderLM of the shard's config
(`shard_config`) with a `TensorParallel` installed (`install`).
"""
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from batchmaker.cells.decoder_config import DecoderConfig


def check_shardable(config: DecoderConfig, size: int) -> None:
    """A typed refusal, when the model is built, of a config `size` ranks cannot split."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel: expected a number of ranks >= 1, got {size!r}")
    if config.num_heads % size:
        raise ValueError(f"tensor_parallel={size}: num_heads ({config.num_heads}) is not a multiple of it")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel={size}: num_kv_heads ({kv}) must divide it or be a multiple of it")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel={size}: intermediate_size ({config.intermediate_size}) is not a multiple of it")


def shard_config(config: DecoderConfig, size: int) -> DecoderConfig:
    """What one rank computes: its heads, kv heads, MLP width and vocabulary rows."""
    check_shardable(config, size)
    return replace(config, num_heads=config.num_heads // size, num_kv_heads=max(1, config.num_kv_heads // size),
                   intermediate_size=config.intermediate_size // size, vocab_size=-(-config.vocab_size // size),
                   shards=size)


def _kv_heads(config: DecoderConfig, rank: int, size: int) -> tuple[int, int]:
    """The kv heads [first, last) rank `rank` keeps."""
    kv = config.num_kv_heads
    if kv >= size:
        return rank * kv // size, (rank + 1) * kv // size
    head = (rank * config.num_heads // size) // (config.num_heads // kv)  # (replicated: the one its q heads read)
    return head, head + 1


def shard_state(state: dict[str, Tensor], config: DecoderConfig, rank: int, size: int) -> dict[str, Tensor]:
    """Rank `rank`'s slices of a full model's state dict (names as cells/llama.py and cells/opt.py have them)."""
    c, d = config, config.head_dim
    hq = c.num_heads // size
    k0, k1 = _kv_heads(c, rank, size)
    inner = c.intermediate_size // size
    vocab = -(-c.vocab_size // size)
    out = {}
    for name, t in state.items():
        kind = name.rsplit(".", 1)[-1]
        if ".qkv_proj." in name:  # [q | k | v] rows
            q, k, v = t.split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d])
            t = torch.cat([q[rank * hq * d:(rank + 1) * hq * d], k[k0 * d:k1 * d], v[k0 * d:k1 * d]])
        elif ".gate_up_proj." in name:  # [gate | up] rows
            gate, up = t.split(c.intermediate_size)
            t = torch.cat([gate[rank * inner:(rank + 1) * inner], up[rank * inner:(rank + 1) * inner]])
        elif ".fc1." in name:
            t = t[rank * inner:(rank + 1) * inner]
        elif any(f".{p}." in name for p in ("o_proj", "down_proj", "fc2")):  # row-parallel: columns; bias on rank 0
            if kind == "weight":
                width = hq * d if ".o_proj." in name else inner
                t = t[:, rank * width:(rank + 1) * width]
            elif rank:
                t = torch.zeros_like(t)
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            t = F.pad(t, (0, 0, 0, vocab * size - t.shape[0]))[rank * vocab:(rank + 1) * vocab]
        out[name] = t.contiguous()
    return out


class TensorParallel:
    """One rank's view of its group: the collectives a sharded decoder runs. `group` is the
    group's own process group (exec/tensor_group.py), set once every rank has joined."""

    def __init__(self, rank: int, size: int, vocab_size: int, group=None):
        self.rank, self.size, self.group = rank, size, group
        self.vocab_size = vocab_size  # the whole model's
        self.shard = -(-vocab_size // size)  # vocabulary rows per rank
        self.vocab_start = rank * self.shard

    def all_reduce(self, x: Tensor) -> Tensor:
        self.group.allreduce([x]).wait()
        return x

    def embed(self, weight: Tensor, tokens: Tensor) -> Tensor:
        """tokens [T] (ids of the whole vocabulary) -> [T, H], summed over the ranks."""
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.shard)
        x = F.embedding(local.clamp(0, self.shard - 1), weight).masked_fill(outside[:, None], 0.0)
        return self.all_reduce(x)

    def gather_logits(self, logits: Tensor) -> Tensor:
        """This rank's logits [N, shard] -> every rank's [N, vocab], the same on every rank."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self.group.allgather([parts], [logits.contiguous()]).wait()
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]


def install(lm, tp: TensorParallel, full_config: DecoderConfig):
    """Make a shard's model (built from `shard_config`, loaded with `shard_state`) one rank of the
    group: the row-parallel projections reduce, the embedding and the head go through `tp`."""
    lm.tp, lm.full_config = tp, full_config
    for layer in lm.layers:
        layer.attn.reduce = layer.mlp.reduce = tp.all_reduce
    return lm


def shard_decoder(lm, rank: int, size: int, group=None):
    """Rank `rank`'s shard of a whole model `lm` (on the same device and dtype)."""
    from batchmaker.cells.decoder import empty_decoder, materialize
    full = lm.config
    shard = empty_decoder(shard_config(full, size))
    state = shard_state({k: v for k, v in lm.state_dict().items()}, full, rank, size)
    device = next(lm.parameters()).device
    return install(materialize(shard, state, device), TensorParallel(rank, size, full.vocab_size, group), full)

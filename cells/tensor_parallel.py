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
from dataclasses import dataclass, replace

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


def rank_device(device, rank: int) -> torch.device:
    """Where rank `rank` of a group whose rank 0 is on `device` runs: the CPU, or the rank-th CUDA
    device after rank 0's (ranks on consecutive GPUs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def check_rank_devices(device, size: int, stages: int = 1) -> None:
    """A typed refusal, when the model is built, of ranks (tensor_parallel `size` x
    pipeline_parallel `stages`) that would run on GPUs this machine lacks (ranks a launcher
    started run where it put them: batchmaker/launch.py)."""
    from batchmaker.launch import launched
    launch, ranks = launched(), size * stages
    asked = f"tensor_parallel={size}" if stages == 1 else \
        f"tensor_parallel={size} x pipeline_parallel={stages} ({ranks} ranks)"
    if launch is not None and ranks > 1:
        if launch.size != ranks:
            raise ValueError(f"{asked}: under a launcher the world (WORLD_SIZE={launch.size}) is the group: "
                             f"set tensor_parallel x pipeline_parallel = {launch.size}")
        return
    last = rank_device(device, ranks - 1)
    if last.type == "cuda" and last.index >= torch.cuda.device_count():
        raise ValueError(f"{asked} from {device}: ranks need {torch.device(device)} to {last}, "
                         f"this machine has {torch.cuda.device_count()} CUDA devices")
    if last.type not in ("cpu", "cuda"):
        raise ValueError(f"{asked}: ranks run on CPUs or CUDA devices, not {last.type}")


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


@dataclass(frozen=True)
class Slicing:
    """How rank r's slice of one parameter is cut from the whole one. The whole parameter is
    `parts` stacked by rows (q | k | v, gate | up; one part otherwise, as a checkpoint stores them
    apart), each part is cut to its span along `dim` (None: whole, replicated), and the pieces are
    stacked again; `zero`: this rank holds zeros (a row-parallel bias off rank 0); `rows`: padded
    with zero rows to this many (the vocabulary, to a multiple of the ranks)."""
    parts: tuple[int, ...]  # rows of each stacked part of the whole parameter
    dim: int | None = None
    spans: tuple[tuple[int, int], ...] = ()
    zero: bool = False
    rows: int | None = None

    def cut(self, t: Tensor) -> Tensor:
        """This rank's slice of the whole parameter `t`."""
        pieces = t.split(list(self.parts)) if len(self.parts) > 1 else [t]
        return self.join([self.cut_part(i, p) for i, p in enumerate(pieces)])

    def cut_part(self, i: int, part) -> Tensor:
        """Part i's piece; `part` is a tensor or anything indexed like one (a safetensors slice)."""
        if self.dim is None:
            return part[:]
        a, b = self.spans[i]
        return part[a:b] if self.dim == 0 else part[:, a:b]

    def join(self, pieces: list[Tensor]) -> Tensor:
        t = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if self.zero:
            t = torch.zeros_like(t)
        if self.rows is not None:
            t = F.pad(t, (0, 0, 0, self.rows - t.shape[0]))
        t = t.contiguous()
        return t.clone() if t.untyped_storage().nbytes() > t.nbytes else t  # (a view keeps the whole alive)


def slicing(name: str, config: DecoderConfig, rank: int, size: int) -> Slicing:
    """Rank `rank`'s cut of parameter `name` (names as cells/llama.py and cells/opt.py have them)."""
    c, d = config, config.head_dim
    hq, inner = c.num_heads // size, c.intermediate_size // size
    k0, k1 = _kv_heads(c, rank, size)
    if ".qkv_proj." in name:  # [q | k | v] rows
        parts = (c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d)
        return Slicing(parts, 0, ((rank * hq * d, (rank + 1) * hq * d), (k0 * d, k1 * d), (k0 * d, k1 * d)))
    if ".gate_up_proj." in name:  # [gate | up] rows
        return Slicing((c.intermediate_size,) * 2, 0, ((rank * inner, (rank + 1) * inner),) * 2)
    if ".fc1." in name:
        return Slicing((c.intermediate_size,), 0, ((rank * inner, (rank + 1) * inner),))
    if any(f".{p}." in name for p in ("o_proj", "down_proj", "fc2")):  # row-parallel: columns; bias on rank 0
        if name.endswith(".weight"):
            width = hq * d if ".o_proj." in name else inner
            return Slicing((c.hidden_size,), 1, ((rank * width, (rank + 1) * width),))
        return Slicing((c.hidden_size,), zero=rank > 0)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        vocab = -(-c.vocab_size // size)
        start = min(rank * vocab, c.vocab_size)
        return Slicing((c.vocab_size,), 0, ((start, min(start + vocab, c.vocab_size)),), rows=vocab)
    return Slicing(())  # norms, learned positions: replicated


@dataclass(frozen=True)
class TensorCut:
    """What rank `rank` of `size` holds of a whole model: every parameter, sliced."""
    rank: int
    size: int

    def config(self, whole: DecoderConfig) -> DecoderConfig:
        return shard_config(whole, self.size)

    def take(self, name: str) -> str:
        return name

    def slicing(self, name: str, whole: DecoderConfig) -> Slicing:
        return slicing(name, whole, self.rank, self.size)

    def install(self, lm, whole: DecoderConfig):
        return install(lm, TensorParallel(self.rank, self.size, whole.vocab_size), whole)


def shard_state(state: dict[str, Tensor], config: DecoderConfig, rank: int, size: int) -> dict[str, Tensor]:
    """Rank `rank`'s slices of a whole model's state dict."""
    return {name: slicing(name, config, rank, size).cut(t) for name, t in state.items()}


class TensorParallel:
    """One rank's view of its group: the collectives a sharded decoder runs. `group` is the
    group's own process group (exec/tensor_group.py), set once every rank has joined."""

    def __init__(self, rank: int, size: int, vocab_size: int, group=None):
        self.rank, self.size, self.group = rank, size, group
        self.one_shot = None  # small messages on GPUs of one host (exec/one_shot.py), else the group's
        self.vocab_size = vocab_size  # the whole model's
        self.shard = -(-vocab_size // size)  # vocabulary rows per rank
        self.vocab_start = rank * self.shard

    def all_reduce(self, x: Tensor) -> Tensor:
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
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

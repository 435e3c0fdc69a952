"""A decoder-Transformer step as a cell whose batch unit is tokens (thesis §2.9; ORCA).

The cell wraps a decoder (cells/decoder.py: Llama- or OPT-style) with its serving settings: the
KV cache's block size and size, and how many sequences one worker runs at once. The engine runs
it by iterations (batchmaker/exec/iterations.py), never row by row: its signature (a token in,
the next token out) says what one item of its batch is, and `forward` is not called.
"""
from dataclasses import dataclass

import torch

from batchmaker.cell import Cell
from batchmaker.cells.rotary import tables_bytes
from batchmaker.exec.sampling import sampling_bytes
from batchmaker.signature import Signature, TensorSpec


SKINNY_MODES = ("measure", "static", "off")  # (kernels/skinny_routes.py)


@dataclass(frozen=True)
class KVSettings:
    block_size: int = 16  # positions per KV block
    max_seqs: int = 256  # sequences running at once on one worker
    num_blocks: int | None = None  # per worker; None: from the memory below
    gpu_fraction: float = 0.9  # CUDA: of the memory free once the weights are placed
    # CUDA: left free at least (the graphs' pool, an iteration's activations, cuBLAS's workspace and,
    # with ranks, the communicators' buffers; sampling's, `sampling_bytes`, comes on top): a fraction
    # alone left 1 GB beside a 70B model's TP=2 shards on 80 GB cards, and capturing a graph ran out
    # of memory (2026-11-26)
    gpu_headroom: int = 2 << 30
    gpu_headroom_ranks: int = 2 << 30  # more where the decoder is split over processes (their communicators)
    cpu_bytes: int = 256 << 20  # CPU workers
    reserve: float = 0.1  # of the blocks, kept free for running decodes when new requests join
    # conversations (core/conversations.py): their caches across turns
    chunk_tokens: int = 32  # the unit of eviction (a multiple of block_size)
    host_bytes: int | None = None  # the host tier; None: 8 GiB beside a GPU, 32 MiB beside a CPU
    swap_threshold: float = 0.25  # copy chunks out ahead of time below this fraction of free blocks
    swap_out_rows: int = 4  # conversations one batch of copies out takes chunks from (their blocks wait for it)
    eviction: str = "value"  # "value" (Pensieve's Cost(l) / T) or "lru"
    # a stateless request's context is kept like a conversation's, and a request whose prompt
    # continues it exactly takes it (core/prefix_index.py; issue 32's automatic prefix caching, first slice).
    # Off: its bookkeeping costs the manager (3.6 against 2.0 ms an iteration at 30 chats/s, H100) and clients that
    # name their conversations gain nothing; `serve --http` turns it on (serving/cli_models.py)
    prefix_caching: bool = False
    # CUDA: iterations with prompt chunks of up to this many tokens replay CUDA graphs (0: eagerly). Eagerly their
    # launches take the host ~2x the GPU's time (H200, Llama-2-7B: a layer over 64 tokens 354 us of host, 158 us
    # of GPU, bench/launch_costs.py); each new shape is captured the second time it comes (exec/graphs.py)
    prefill_graph_tokens: int = 512
    # CUDA kernels: how few-token projections pick theirs (kernels/skinny_routes.py): "static" (the table
    # measured on an H200), "measure" (on the device at hand at start-up, cached) or "off" (cuBLAS)
    skinny_routes: str = "static"
    one_shot: bool = True  # split decoders: the one-shot all-reduce where it wins (exec/one_shot.py); False: NCCL

    def __post_init__(self):
        if self.gpu_headroom < 0 or self.gpu_headroom_ranks < 0:
            raise ValueError(f"gpu_headroom, gpu_headroom_ranks: bytes >= 0 expected, got {self.gpu_headroom!r}, "
                             f"{self.gpu_headroom_ranks!r}")
        for name in ("reserve", "swap_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name}: expected a fraction of the blocks in [0, 1), got {value!r}")
        if self.skinny_routes not in SKINNY_MODES:
            raise ValueError(f"skinny_routes: one of {', '.join(SKINNY_MODES)} expected, got {self.skinny_routes!r}")
        if isinstance(self.prefill_graph_tokens, bool) or not isinstance(self.prefill_graph_tokens, int) or \
                self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens: expected a count of tokens >= 0, got {self.prefill_graph_tokens!r}")


def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: K and V of `block_size` positions in every layer."""
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


class DecoderCell(Cell):
    batch_unit = "tokens"  # what the engine batches: tokens of many sequences, by iterations

    def __init__(self, lm: torch.nn.Module, kv: KVSettings = KVSettings(), tensor_parallel: int = 1, source=None,
                 pipeline_parallel: int = 1):
        super().__init__()
        if max(tensor_parallel, pipeline_parallel) > 1 and source is None:
            raise ValueError("a parallel DecoderCell needs its DecoderSource (each rank builds its part from it)")
        self.lm = lm  # the model, or rank 0's part of it (cells/tensor_parallel.py, cells/pipeline.py, both)
        self.kv = kv
        self.tensor_parallel = tensor_parallel  # ranks the model is split over (exec/tensor_group.py)
        self.pipeline_parallel = pipeline_parallel  # stages its layers are split into
        self.source = source  # cells/decoder_source.DecoderSource: where the weights come from
        self.config = lm.config if source is None else source.config  # the whole model's
        self.block_size = kv.block_size
        self.max_seqs = kv.max_seqs
        # token ids of prompts whose scores calibrate split decode's unified maximum at a GPU worker's
        # start (kernels/unified_max.py); none: the exact path. One process only (no tp/pp ranks)
        self.calibration_prompts: list[list[int]] = []
        vocab = self.config.vocab_size
        self.signature = Signature({"token": TensorSpec((), torch.int64, high=vocab)},
                                   {"token": TensorSpec((), torch.int64, high=vocab)})

    @property
    def ranks(self) -> int:
        """Processes the model runs on: its tensor-parallel shards times its pipeline stages."""
        return self.tensor_parallel * self.pipeline_parallel

    def cut(self, rank: int):
        """What rank `rank` holds of the whole model (None: all of it)."""
        from batchmaker.cells.pipeline import StageCut
        from batchmaker.cells.stage_shards import StageShardCut
        from batchmaker.cells.tensor_parallel import TensorCut
        if self.pipeline_parallel > 1 and self.tensor_parallel > 1:  # (rank = stage * tensor_parallel + shard)
            return StageShardCut.of(self.config, rank, self.pipeline_parallel, self.tensor_parallel)
        if self.pipeline_parallel > 1:
            return StageCut.of(self.config, rank, self.pipeline_parallel)
        return TensorCut(rank, self.tensor_parallel) if self.tensor_parallel > 1 else None

    def forward(self, **inputs):
        raise TypeError("a DecoderCell runs by iterations (batchmaker/exec/iterations.py), not row by row")

    def num_blocks_on(self, device: torch.device) -> int:
        """KV blocks for one worker on `device` (the settings' count, or what the memory holds)."""
        if self.kv.num_blocks is not None:
            return self.kv.num_blocks
        dtype = next(self.lm.parameters()).dtype
        per_block = kv_bytes_per_block(self.lm.config, self.block_size, dtype)  # (a rank's kv heads)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            headroom = self.kv.gpu_headroom + (self.kv.gpu_headroom_ranks if self.ranks > 1 else 0)
            headroom += sampling_bytes(self.max_seqs, self.lm.config.vocab_size) + tables_bytes(self.lm, dtype)
            budget = min(int(free * self.kv.gpu_fraction), free - headroom)
            if budget < 2 * per_block:
                raise MemoryError(f"{free / 2**30:.2f} GiB free on {device} once the weights are placed: no room "
                                  f"for a KV cache beside {headroom / 2**30:.2f} GiB of headroom (KVSettings "
                                  f"gpu_headroom, gpu_headroom_ranks; or give num_blocks)")
        else:
            budget = self.kv.cpu_bytes
        return max(2, budget // per_block)

"""Where a decoder's weights come from: a HF-style checkpoint directory, or a preset's seeded
random weights. A source is small and sendable, so that each rank of a tensor-parallel group
(exec/tensor_group.py) builds its own shard on its own device from it: no rank holds, reads or
receives the whole model.
"""
from dataclasses import dataclass

import torch

from batchmaker.cells.decoder_config import DecoderConfig


@dataclass(frozen=True)
class DecoderSource:
    config: DecoderConfig  # the whole model's
    checkpoint: str | None = None  # a directory (cells/checkpoint.py); None: seeded random weights
    seed: int = 0
    dtype: torch.dtype | None = None  # None: the checkpoint's

    def build(self, device, rank: int = 0, size: int = 1):
        """The whole model (size 1), or rank `rank`'s shard of it with its TensorParallel installed
        (its process group is set once the group has formed)."""
        from batchmaker.cells.checkpoint import load_checkpoint
        from batchmaker.cells.decoder import build_decoder
        from batchmaker.cells.tensor_parallel import TensorParallel, install
        if self.checkpoint is not None:
            lm = load_checkpoint(self.checkpoint, self.dtype, device, rank, size)
        else:
            lm = build_decoder(self.config, self.seed, self.dtype or torch.float32, device, rank, size)
        if size == 1:
            return lm
        return install(lm, TensorParallel(rank, size, self.config.vocab_size), self.config)

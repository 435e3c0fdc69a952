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

    def build(self, device, cut=None):
        """The whole model, or one rank's part of it (`cut`: cells/tensor_parallel.TensorCut, a
        shard with its TensorParallel; cells/pipeline.StageCut, a stage with its PipelineStage),
        whose process group is set once the group has formed."""
        from batchmaker.cells.checkpoint import load_checkpoint
        from batchmaker.cells.decoder import build_decoder
        if self.checkpoint is not None:
            lm = load_checkpoint(self.checkpoint, self.dtype, device, cut)
        else:
            lm = build_decoder(self.config, self.seed, self.dtype or torch.float32, device, cut)
        return lm if cut is None else cut.install(lm, self.config)

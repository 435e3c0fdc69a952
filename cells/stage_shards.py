"""Tensor and pipeline parallelism together (Megatron's, and ORCA's intra-layer parallelism inside
a host, inter-layer across hosts): `pipeline_parallel` = M stages of the layers
(cells/pipeline.py), each split over `tensor_parallel` = N shards (cells/tensor_parallel.py), on
N x M ranks. Rank r is shard r % N of stage r // N, so a stage's shards are consecutive ranks (on
consecutive GPUs: the GPUs of one host, where the all-reduces run) and rank 0, the manager's, is
stage 0's shard 0.

A rank holds its stage's layers (renumbered from 0), each cut as a shard of tensor parallelism
cuts it (column- and row-parallel projections, its kv heads, or one replicated where there are
fewer kv heads than shards); stage 0's shards the embedding by vocabulary rows, the last stage's
the final norm and the head by vocabulary rows (and the embedding too, if the head is tied to it).
Its model is an ordinary `DecoderLM` of its stage's shard config, with both a `TensorParallel`
(its stage's own process group: the all-reduces, the gathered logits) and a `PipelineStage` (the
residual stream to and from its peers in the neighbouring stages, the tokens back) installed.
"""
from dataclasses import dataclass

from batchmaker.cells.decoder_config import DecoderConfig
from batchmaker.cells.pipeline import PipelineStage, StageCut
from batchmaker.cells.tensor_parallel import Slicing, TensorCut


@dataclass(frozen=True)
class StageShardCut:
    """What rank `stage * shards + shard` holds of a whole model."""
    stage: StageCut
    shard: TensorCut

    @classmethod
    def of(cls, config: DecoderConfig, rank: int, stages: int, shards: int) -> "StageShardCut":
        return cls(StageCut.of(config, rank // shards, stages), TensorCut(rank % shards, shards))

    def config(self, whole: DecoderConfig) -> DecoderConfig:
        return self.shard.config(self.stage.config(whole))

    def take(self, name: str) -> str | None:
        return self.stage.take(name)

    def slicing(self, name: str, whole: DecoderConfig) -> Slicing:
        return self.shard.slicing(name, whole)  # (`name` is the whole model's: a layer is cut alike in any stage)

    def install(self, lm, whole: DecoderConfig):
        lm = self.shard.install(lm, whole)
        lm.pp = PipelineStage(self.stage.stage, self.stage.stages, shard=self.shard.rank, shards=self.shard.size)
        return lm

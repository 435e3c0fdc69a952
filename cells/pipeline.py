"""Pipeline parallelism of a decoder (ORCA's inter-layer parallelism): the layers split into
stages of about equal cost, one rank each. Stage 0 embeds the tokens and runs its layers, and
each stage hands its residual stream (hidden and residual, unsummed: [2, T, H]) to the next; the
last stage runs its layers, the final norm and the head, samples, and sends the sampled tokens
back to stage 0, whose manager needs them (the plans of its next iterations carry them).

A stage is an ordinary `DecoderLM` of its layers (`StageCut.config`: the layers renumbered from
0, so that its KV cache holds its layers only) with a `PipelineStage` installed, which does the
sends and receives. Parameters a stage does not use (the embedding off stage 0, the head off the
last) are empty tensors, never read from a checkpoint. Several iterations are in flight at once,
one per stage, on disjoint sets of sequences (core/sequence_queue.py `stages`): ORCA's
pipeline, in which no stage waits for a token another iteration has not sampled yet. The same
code runs on CPUs (gloo) and GPUs (NCCL); exec/stage_exchange.py calls it around each iteration.
"""
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from batchmaker.cells.decoder_config import DecoderConfig
from batchmaker.cells.tensor_parallel import Slicing

ACTIVATIONS, TOKENS = 1, 2  # message tags


def check_stages(config: DecoderConfig, stages: int) -> None:
    """A typed refusal, when the model is built, of stages the layers cannot fill."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"pipeline_parallel: expected a number of stages >= 1, got {stages!r}")
    if stages > config.num_layers:
        raise ValueError(f"pipeline_parallel={stages}: more stages than the model's {config.num_layers} layers")


def stage_bounds(config: DecoderConfig, stages: int) -> list[tuple[int, int]]:
    """Each stage's layers [first, end), of about equal cost: a layer's weights against the
    head's (the last stage's extra work; the embedding is a lookup), every stage at least one layer."""
    check_stages(config, stages)
    c = config
    layer = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
             + (3 if c.family == "llama" else 2) * c.hidden_size * c.intermediate_size)
    head = c.vocab_size * c.hidden_size / layer  # in layers
    per_stage = (c.num_layers + head) / stages
    cuts = [0] + [min(max(round(k * per_stage), k), c.num_layers - (stages - k)) for k in range(1, stages)]
    for k in range(1, stages):  # (strictly increasing)
        cuts[k] = max(cuts[k], cuts[k - 1] + 1)
    return list(zip(cuts, cuts[1:] + [c.num_layers]))


@dataclass(frozen=True)
class StageCut:
    """What stage `stage` of `stages` holds of a whole model: its layers, renumbered from 0; the
    token embedding (stage 0, and the last stage when the head is tied to it); the final norm
    and the head (the last stage)."""
    stage: int
    stages: int
    first: int  # its layers [first, end) in the whole model
    end: int
    tied: bool

    @classmethod
    def of(cls, config: DecoderConfig, stage: int, stages: int) -> "StageCut":
        first, end = stage_bounds(config, stages)[stage]
        return cls(stage, stages, first, end, config.tie_word_embeddings)

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def config(self, whole: DecoderConfig) -> DecoderConfig:
        return replace(whole, num_layers=self.end - self.first,
                       layer_windows=whole.layer_windows[self.first:self.end])  # (() stays ())

    def take(self, name: str) -> str | None:
        """This stage's name for the whole model's parameter `name`, or None when it does not hold it."""
        module = name.split(".", 1)[0]
        if module == "layers":
            _, index, rest = name.split(".", 2)
            i = int(index)
            return f"layers.{i - self.first}.{rest}" if self.first <= i < self.end else None
        if module == "embed_tokens":
            return name if self.stage == 0 or (self.last and self.tied) else None
        if module == "embed_positions":
            return name if self.stage == 0 else None
        return name if self.last else None  # the final norm, lm_head

    def slicing(self, name: str, whole: DecoderConfig) -> Slicing:
        return Slicing(())  # (a stage holds its parameters whole)

    def install(self, lm, whole: DecoderConfig):
        lm.pp, lm.full_config = PipelineStage(self.stage, self.stages), whole
        return lm


class PipelineStage:
    """One stage's view of its group: what it receives and sends. `group` is the group's own
    process group (exec/tensor_group.py), set once every stage has joined; `back` (stage 0 and the
    last only) a process group of those two, members 0 and 1, that carries the sampled tokens: on
    GPUs a communicator of its own, so that stage 0 can wait for tokens on a side stream while its
    next iteration sends on `group` (one NCCL communicator must not run two kernels at once).

    A stage may itself be `shards` tensor-parallel ranks (cells/stage_shards.py): rank
    stage * shards + shard. Shard k of a stage receives from shard k of the previous one and sends
    to shard k of the next (the residual stream is the same on every shard of a stage, after its
    all-reduces); shard 0 of the last stage sends the tokens to rank 0 (stage 0's shard 0). Pairs
    of peers rather than shard 0 sending and the next stage broadcasting: no collective is added
    to the receiving stage's group (each iteration would wait for it), and the N pairs run over
    their own links at once, each carrying what the one pair would (not measured on GPUs yet)."""

    def __init__(self, stage: int, stages: int, group=None, back=None, shard: int = 0, shards: int = 1):
        self.stage, self.stages, self.group, self.back = stage, stages, group, back
        self.shard, self.shards = shard, shards
        self.first, self.last = stage == 0, stage == stages - 1
        self.rank = stage * shards + shard  # in `group`
        self.receives_tokens = self.first and shard == 0  # (rank 0: the manager's)
        self.sends_tokens = self.last and shard == 0

    def run(self, lm, tokens: Tensor, positions: Tensor, attend, received: Tensor | None) -> Tensor:
        """This stage's part of a forward over the iteration's tokens, from `received` (the previous
        stage's residual stream [2, T, H]; stage 0 embeds `tokens`): on the last stage the hidden
        states before the final norm [T, H]; elsewhere the residual stream for the next [2, T, H]."""
        if self.first:
            hidden, residual = lm.embed(tokens, positions), None
        else:
            hidden, residual = received[0], received[1]
        hidden, residual = lm.run_layers(hidden, residual, positions, attend)
        return hidden + residual if self.last else torch.stack([hidden, residual])

    def receive(self, into: Tensor) -> Tensor:
        """The previous stage's residual stream, into `into` [2, T, H] (on a GPU the current stream
        waits for it, the host does not)."""
        self.group.recv([into], self.rank - self.shards, ACTIVATIONS).wait()
        return into

    def send(self, stream: Tensor) -> None:
        """The residual stream [2, T, H] to the next stage (to this shard's peer there)."""
        self.group.send([stream], self.rank + self.shards, ACTIVATIONS).wait()

    def send_tokens(self, chosen: Tensor) -> None:
        """The last stage's shard 0: the sampled tokens to stage 0's shard 0."""
        if chosen.numel():  # (an iteration of prompt chunks only samples nothing)
            self.back.send([chosen.contiguous()], 0, TOKENS).wait()

    def receive_tokens(self, count: int, device, side=None, region=None) -> "PendingTokens":
        """Stage 0's shard 0: the `count` tokens the last stage samples for this iteration (wait for them
        later). With `side` (a CUDA stream), the receive and the copy into `region` (pinned host
        memory, exec/staging.py) run on that stream, so stage 0's next launches never wait for the
        tokens, and an event says when they have landed."""
        if not count:
            return PendingTokens(None, torch.empty(0, dtype=torch.int64))
        if side is None:
            buffer = torch.empty(count, dtype=torch.int64, device=device)
            return PendingTokens(self.back.recv([buffer], 1, TOKENS), buffer)
        with torch.cuda.stream(side):
            buffer = torch.empty(count, dtype=torch.int64, device=device)
            self.back.recv([buffer], 1, TOKENS).wait()  # (the side stream waits, not the host)
            host = region.to_host(buffer)
            landed = torch.cuda.Event()
            landed.record(side)
        return PendingTokens(None, host, landed)


@dataclass
class PendingTokens:
    """An iteration's sampled tokens on their way from the last stage: a receive to wait for
    (CPU), or a copy to host memory that `landed` (a CUDA event) marks done."""
    work: object
    buffer: Tensor
    landed: object = None

    def ready(self) -> bool:
        if self.landed is not None:
            return self.landed.query()
        return self.work is None or self.work.is_completed()

    def wait(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
        if self.landed is not None:
            self.landed.synchronize()
        return self.buffer

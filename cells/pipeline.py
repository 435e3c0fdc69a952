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

ACTIVATIONS, TOKENS, SCORES = 1, 2, 3  # message tags


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
    last only) a process group of those two, members 0 and 1, that carries the sampled tokens (and
    their log-probabilities, when asked): on GPUs a communicator of its own, so that stage 0 can
    wait for tokens on a side stream while its next iteration sends on `group` (one NCCL
    communicator must not run two kernels at once).

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

    def send_tokens(self, chosen: Tensor, scores: tuple | None = None) -> None:
        """The last stage's shard 0: the sampled tokens to stage 0's shard 0, then, when the plan
        asks for log-probabilities, `scores` (exec/sampling.log_probabilities') packed in one
        message (`pack_scores`); an iteration that asks none sends the tokens alone."""
        if chosen.numel():  # (an iteration of prompt chunks only samples nothing)
            self.back.send([chosen.contiguous()], 0, TOKENS).wait()
            if scores is not None:
                self.back.send([pack_scores(*scores)], 0, SCORES).wait()

    def receive_tokens(self, count: int, device, side=None, region=None, logprobs: int = -1) -> "PendingTokens":
        """Stage 0's shard 0: the `count` tokens the last stage samples for this iteration (wait for them
        later), and with `logprobs` = k >= 0 (the plan's) their packed scores [count, 1 + 2k]. With
        `side` (a CUDA stream), the receives and the copies into `region` (pinned host memory,
        exec/staging.py) run on that stream, so stage 0's next launches never wait for them, and
        an event says when they have landed."""
        if not count:
            return PendingTokens((), torch.empty(0, dtype=torch.int64))
        if side is None:
            buffers, works = self._post_receives(count, logprobs, device)
            return PendingTokens(tuple(works), *buffers)
        with torch.cuda.stream(side):
            buffers, works = self._post_receives(count, logprobs, device)
            for work in works:
                work.wait()  # (the side stream waits, not the host)
            landed_in = [region.to_host(b) for b in buffers]
            landed = torch.cuda.Event()
            landed.record(side)
        return PendingTokens((), *landed_in, landed=landed)

    def _post_receives(self, count: int, logprobs: int, device) -> tuple[list[Tensor], list]:
        """The receives of an iteration's tokens [count] and, with logprobs = k >= 0, their scores
        [count, 1 + 2k], in the order the last stage sends them."""
        buffers = [torch.empty(count, dtype=torch.int64, device=device)]
        if logprobs >= 0:
            buffers.append(torch.empty(count, 1 + 2 * logprobs, dtype=torch.int32, device=device))
        return buffers, [self.back.recv([b], 1, tag) for b, tag in zip(buffers, (TOKENS, SCORES))]


def pack_scores(chosen: Tensor, top_ids: Tensor, top_values: Tensor) -> Tensor:
    """exec/sampling.log_probabilities' [N], [N, k] and [N, k] as one message [N, 1 + 2k] of int32:
    the float32 log-probabilities' bits (the chosen token's, then the top k's), then the ids."""
    values = torch.cat([chosen.float().unsqueeze(1), top_values.float()], 1).view(torch.int32)
    return torch.cat([values, top_ids.to(torch.int32)], 1)


def unpack_scores(packed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`pack_scores`' inverse, bit for bit: (chosen [N] float32, top ids [N, k] int64, top values [N, k])."""
    k = (packed.shape[1] - 1) // 2
    values = packed[:, :k + 1].view(torch.float32)
    return values[:, 0], packed[:, k + 1:].long(), values[:, 1:]


@dataclass
class PendingTokens:
    """An iteration's sampled tokens (and, if asked, their packed scores) on their way from the
    last stage: receives to wait for (CPU), or copies to host memory that `landed` (a CUDA event)
    marks done."""
    works: tuple
    buffer: Tensor
    scores: Tensor | None = None  # [N, 1 + 2k] int32 (pack_scores), when the plan asked for log-probabilities
    landed: object = None

    def ready(self) -> bool:
        if self.landed is not None:
            return self.landed.query()
        return all(work.is_completed() for work in self.works)

    def wait(self) -> Tensor:
        for work in self.works:
            work.wait()
        if self.landed is not None:
            self.landed.synchronize()
        return self.buffer

    def logprobs(self) -> tuple:
        """Once ready: the scores unpacked (exec/sampling.log_probabilities' three), or () if none came."""
        return () if self.scores is None else unpack_scores(self.scores)

"""A pipeline stage's exchanges around each iteration its runner runs (cells/pipeline.py does the
sends and receives; exec/iterations.py runs the iteration between them).

The receive and the send run eagerly around the iteration's own work, which may be a CUDA graph's
replay: no graph captures a point-to-point op, so a stage's graphs are the same as a lone GPU's,
and whether a capture succeeds or not, every stage sends and receives the same messages in the
same order. A graph reads what the stage received from one buffer per padded size (`inbox`),
filled by the receive before each replay.

Stage 0 gets its tokens back from the last stage, and, when the plan asks for log-probabilities
(`logprobs` >= 0: never a graph's), their scores in a second message on the same group; both ends
read k from the plan, so they agree on its shape, and an iteration that asks none sends what it
did before. On a CPU its worker thread posts the receives, and the manager waits for them when it
completes the iteration; on a GPU the receives and the copies to pinned host memory run on a side
stream (`side`), so stage 0's next launch never waits for them, and the worker reports the
iteration done once an event says they have landed (IterationRunner.landed).
"""
import torch

from batchmaker.cells.pipeline import PendingTokens, PipelineStage


class StageExchange:
    def __init__(self, stage: PipelineStage, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.stage, self.hidden_size, self.dtype, self.device = stage, hidden_size, dtype, device
        self._inboxes: dict[int, torch.Tensor] = {}  # the graphs' receive buffers, by padded tokens
        self._side: torch.cuda.Stream | None = None

    def around(self, forward, num_tokens: int, num_samples: int, tokens_back=None, graphed: bool = False,
               logprobs: int = -1):
        """`forward(inbox)`, the iteration's own work, between this stage's receive (a stage after
        the first: the residual stream [2, num_tokens, H] into `inbox`, one buffer per size if
        `graphed`) and its send (a stage before the last: `forward`'s output; the last: its sampled
        tokens, with `logprobs` >= 0 and their scores, to stage 0). Returns the last stage's tokens
        (and scores: `forward`'s output), stage 0's `tokens_back(num_samples, logprobs)`
        (their PendingTokens; None: wait for them here, as start-up's measurements do), or None
        (under tensor parallelism too: only stage 0's shard 0 gets the tokens back)."""
        stage = self.stage
        inbox = None
        if not stage.first:
            inbox = self._inboxes.get(num_tokens) if graphed else None
            if inbox is None:
                inbox = torch.empty(2, num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
                if graphed:
                    self._inboxes[num_tokens] = inbox
            stage.receive(inbox)
        out = forward(inbox)
        if stage.last:
            if stage.sends_tokens:  # (one shard of the last stage: every shard sampled the same)
                chosen, scores = out if isinstance(out, tuple) else (out, None)  # (scores: logprobs >= 0)
                stage.send_tokens(chosen, scores)
            return out
        stage.send(out)
        if not stage.receives_tokens:  # (a stage after the first, or stage 0's other shards: the plans feed them)
            return None
        if tokens_back is None:
            return stage.receive_tokens(num_samples, self.device, logprobs=logprobs).wait()
        return tokens_back(num_samples, logprobs)

    def receive_tokens(self, count: int, logprobs: int = -1) -> PendingTokens:
        """Stage 0 on a CPU: the receives of an iteration's tokens and scores (waited for at its completion)."""
        return self.stage.receive_tokens(count, self.device, logprobs=logprobs)

    def tokens_on_side(self, region):
        """Stage 0 on a GPU: `tokens_back` for `around`, receiving into `region` (exec/staging.py)
        on the side stream."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return lambda count, logprobs: self.stage.receive_tokens(count, self.device, self._side, region, logprobs)

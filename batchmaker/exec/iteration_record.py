"""`IterationRecord`: one iteration in a benchmark's trace (`IterationRunner.trace`; setting it
times them all): its size, what its attention read, the tokens it samples, when the host launched
it, and its span on the device."""
import time
from dataclasses import dataclass

import numpy as np

from batchmaker.core.task import IterationTask


@dataclass(slots=True)
class IterationRecord:
    tokens: int
    context: int  # context positions read: every sequence's, its new tokens included
    seqs: int
    graphed: bool
    seconds: float | None = None  # once finished: its span on the device (CUDA: events around it)
    pairs: int | None = None  # (query token, context position) pairs attended, causal: a prompt's FLOPs
    samples: int | None = None  # tokens it samples: its decodes and the prompts it finishes
    at: float | None = None  # time.perf_counter() when the host launched it

    @classmethod
    def of(cls, task: IterationTask) -> "IterationRecord":
        plan = task.plan
        queries = np.diff(plan.query_start)  # token i of a sequence's q new ones sees context - (q - 1 - i)
        lens = plan.context_lens.astype(np.int64)
        pairs = int((queries * lens - queries * (queries - 1) // 2).sum())
        return cls(task.batch, int(lens.sum()), plan.num_seqs, plan.graph is not None, pairs=pairs,
                   samples=plan.num_samples, at=time.perf_counter())

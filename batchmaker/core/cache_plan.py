"""A CachePlan: the copies between one worker's GPU blocks and its host chunks that the manager's
cache bookkeeping (core/conversation_cache.py) plans for an iteration, as the manager tracks them: the
iteration's plan carries them as plain arrays (`copies`: core/iteration_plan.Copies), the worker
(exec/kv_swap.py) carries them out and sets `done`."""
from dataclasses import dataclass, field

import numpy as np

from batchmaker.core.iteration_plan import Copies

_NONE = np.zeros(0, dtype=np.int64)


@dataclass(slots=True, eq=False)
class CachePlan:
    """Copies between the GPU blocks and the host chunks of one worker, run with an iteration.
    swap_in: host chunks [n] -> GPU blocks [n, blocks per chunk], before each layer's attention
    of the iteration (or, `deferred`, on the side: the turns wait, the iteration does not);
    swap_out: GPU blocks [m, blocks per chunk] -> host chunks [m], on the side; `done` is set by
    the worker once the copies out are complete (a flag, or an object with `query()`)."""

    swap_in_host: np.ndarray = field(default_factory=lambda: _NONE)
    swap_in_blocks: np.ndarray = field(default_factory=lambda: _NONE.reshape(0, 1))
    swap_out_blocks: np.ndarray = field(default_factory=lambda: _NONE.reshape(0, 1))
    swap_out_host: np.ndarray = field(default_factory=lambda: _NONE)
    done: object = None
    deferred: bool | None = None  # swap-in on the side, its turns prefilled once done (else: per layer)

    @property
    def finished(self) -> bool:
        done = self.done
        return done is True or (done is not None and done is not False and done.query())

    def copies(self, graphed: bool) -> Copies:
        """The copies as the iteration's plan carries them: swap-ins on the side where deferred,
        else whole before an iteration that replays a CUDA graph (its layers cannot wait for
        per-layer copies), else layer by layer."""
        mode = "side" if self.deferred else "before" if graphed else "layers"
        return Copies(self.swap_in_host, self.swap_in_blocks, self.swap_out_blocks, self.swap_out_host, mode)

    def add_swap_in(self, hosts: np.ndarray, blocks: np.ndarray) -> None:
        self.swap_in_host = np.concatenate([self.swap_in_host, hosts])
        self.swap_in_blocks = np.concatenate([self.swap_in_blocks.reshape(-1, blocks.shape[1]), blocks])

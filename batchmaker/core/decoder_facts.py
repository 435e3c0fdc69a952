"""What the manager plans one worker's decoder iterations by: facts measured once, when the worker
starts (exec/iterations.IterationRunner.measure), and handed to the planner as values."""
from dataclasses import dataclass

import numpy as np

from batchmaker.core.iteration_shapes import GraphShapes


@dataclass(frozen=True, eq=False)
class DecoderFacts:
    num_blocks: int  # KV blocks of the worker's cache (block 0 is scratch)
    host_chunks: int  # chunks of the host tier (0: none)
    chunk_tokens: int  # positions a chunk holds: the unit of eviction and of copies
    chunk_costs: np.ndarray  # float64 [chunks of the longest context]: seconds to recompute chunk k
    max_swap_in: int  # host chunks one iteration can copy in (the worker's staging)
    max_swap_out: int  # host chunks one copy-out plan can take
    chunk_bytes: int  # bytes of a chunk's K and V, every layer (and every rank of a tensor-parallel decoder)
    swap_in_seconds: float  # copying one chunk in, every layer (inf: unknown)
    shapes: GraphShapes  # the CUDA graphs it replays

"""What recomputing a chunk of a context costs at each position (Pensieve Eq. 3.6), measured on a
worker's free blocks at start-up: the conversation cache's eviction values and the planner's
recompute-or-copy choice read it (core/decoder_facts.py `chunk_costs`)."""
import time

import numpy as np
import torch

from batchmaker.core.iteration_plan import IterationPlan


def measure_chunk_costs(runner) -> np.ndarray:
    """Seconds to recompute chunk k of a context (its positions end at (k + 1) * chunk_tokens),
    measured at powers of two and interpolated (Pensieve Eq. 3.6). Each measurement recomputes
    up to 16 such chunks in one iteration (the time per chunk of a batch: one alone would time
    the host's launches, the same at every position). Runs on free blocks, before serving."""
    ct, bs = runner.chunk_tokens, runner.module.block_size
    ends = (np.arange(-(-runner.config.max_positions // ct)) + 1) * ct
    points = [ct]
    while points[-1] * 2 <= min(ends[-1], (runner.cache.num_blocks - 1) * bs):
        points.append(points[-1] * 2)
    seconds = []
    with torch.inference_mode():
        for end in [points[0]] + points:  # (the first run warms up)
            n_blocks = -(-end // bs)
            rows = max(1, min(16, runner.module.max_seqs, (runner.cache.num_blocks - 1) // n_blocks))
            table = np.zeros((rows, runner.max_blocks), dtype=np.int64)
            table[:, :n_blocks] = 1 + np.arange(rows * n_blocks).reshape(rows, n_blocks)
            positions = np.tile(np.arange(end - ct, end), rows)
            row = np.repeat(np.arange(rows), ct)
            zeros, scratch = np.zeros(rows, dtype=np.int64), np.full(rows, runner.scratch_slot)
            plan = IterationPlan.of(
                tokens=np.zeros(rows * ct), positions=positions, kv_slots=table[row, positions // bs] * bs + positions % bs,
                token_slots=np.full(rows * ct, runner.scratch_slot), query_start=np.arange(rows + 1) * ct,
                context_lens=np.full(rows, end), block_tables=table, sample_token=np.arange(1, rows + 1) * ct - 1,
                sample_slots=scratch, seeds=zeros, counters=zeros, top_k=zeros, temperature=zeros,
                top_p=np.ones(rows), max_query_len=ct)
            t = {k: torch.from_numpy(v).to(runner.device) for k, v in plan.arrays().items()}
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            start = time.perf_counter()
            runner._staged(lambda inbox: runner._forward(t, ct, True, None, inbox=inbox), rows * ct, rows)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            seconds.append((time.perf_counter() - start) / rows)
    return np.maximum.accumulate(np.interp(ends, points, seconds[1:]))

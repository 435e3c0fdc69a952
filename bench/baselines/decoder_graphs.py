"""Greedy decoding of a batch with the engine's decoder cell, eagerly or as CUDA graphs.

A decoder step is about six launches (embedding, the LSTM cell's GEMMs and gates, the vocab
projection, argmax); run eagerly for a batch's longest decode, the host's launches are the
baseline's bottleneck on a GPU. With graphs, `chunk` consecutive steps are one CUDA graph per
padded batch size (powers of two up to max_batch, all captured at start-up into one memory pool):
a batch runs ceil(steps / chunk) replays and its last replay may compute up to chunk - 1 steps
it does not need (their tokens are dropped). Padding rows hold whatever the last batch left
there; rows never mix, so they cost compute and change nothing.
"""
import logging
import math

import torch

from .cell_rows import CellRows

log = logging.getLogger("batchmaker.bench")


class _ChunkGraph:
    def __init__(self, cell, size: int, chunk: int, hidden: int, dtype, device, pool):
        self.token = torch.zeros(size, dtype=torch.int64, device=device)
        self.h = torch.zeros(size, hidden, dtype=dtype, device=device)
        self.c = torch.zeros_like(self.h)
        self.tokens = torch.zeros(chunk, size, dtype=torch.int64, device=device)  # each step's token
        self.cell, self.chunk = cell, chunk
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the capture (cuBLAS handles, workspaces)
                self._body()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self._body()

    def _body(self) -> None:
        token, h, c = self.token, self.h, self.c
        for s in range(self.chunk):
            out = self.cell(token=token, h=h, c=c)
            token, h, c = out["token"], out["h"], out["c"]
            self.tokens[s].copy_(token)
        self.token.copy_(token)
        self.h.copy_(h)
        self.c.copy_(c)


class GreedyDecoder:
    def __init__(self, cell, device: torch.device, max_batch: int, graphs: bool, chunk: int = 4,
                 rows: CellRows | None = None, graphed: bool | None = None):
        """rows: where its "decoder" cell-rows go; graphed: whether the same configuration runs
        graphs on a GPU (default: `graphs`), for the rows it would compute there."""
        self.cell, self.device, self.chunk = cell, device, chunk
        self.rows = rows if rows is not None else CellRows()
        self.graphed = graphs if graphed is None else graphed
        self.graphs: dict[int, _ChunkGraph] = {}
        self.sizes = [1 << i for i in range(max(1, math.ceil(math.log2(max_batch))) + 1) if 1 << i <= max_batch]
        if self.sizes[-1] < max_batch:
            self.sizes.append(max_batch)
        self.error = None
        if graphs:
            self._capture()

    def config(self) -> dict:
        return {"cuda_graphs": bool(self.graphs), "chunk_steps": self.chunk if self.graphs else None,
                "graph_batch_sizes": sorted(self.graphs), "capture_error": self.error}

    def _capture(self) -> None:
        hidden = self.cell.lstm.hidden_size
        dtype = self.cell.lstm.weight_ih.dtype
        pool = torch.cuda.graph_pool_handle()
        try:
            with torch.inference_mode():
                for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
                    self.graphs[size] = _ChunkGraph(self.cell, size, self.chunk, hidden, dtype, self.device, pool)
        except Exception as e:  # a cell that cannot be captured runs eagerly (said in the config)
            log.warning("decoder graphs not captured, running eagerly: %s", e)
            self.graphs, self.error = {}, f"{type(e).__name__}: {e}"

    def __call__(self, h: torch.Tensor, c: torch.Tensor, bos: int, steps: int) -> torch.Tensor:
        """Tokens [steps, B] (on the device) of greedy decoding from (h, c) [B, hidden]."""
        batch = h.shape[0]
        self._count(batch, steps)
        if not self.graphs:
            token = torch.full((batch,), bos, dtype=torch.int64, device=self.device)
            out = []
            for _ in range(steps):
                o = self.cell(token=token, h=h, c=c)
                token, h, c = o["token"], o["h"], o["c"]
                out.append(token)
            return torch.stack(out)
        g = self.graphs[next(s for s in self.sizes if s >= batch)]
        g.h[:batch].copy_(h)
        g.c[:batch].copy_(c)
        g.token.fill_(bos)
        replays = -(-steps // self.chunk)
        out = torch.empty(replays * self.chunk, g.token.shape[0], dtype=torch.int64, device=self.device)
        for j in range(replays):
            g.graph.replay()
            out[j * self.chunk:(j + 1) * self.chunk].copy_(g.tokens)
        return out[:steps, :batch]

    def _count(self, batch: int, steps: int) -> None:
        """A batch's decoder cell-rows: eager, every row for the batch's longest decode; graphed,
        rows padded to the graph's batch size for whole chunks of steps."""
        chunks = -(-steps // self.chunk) * self.chunk
        graphed = next(s for s in self.sizes if s >= batch) * chunks if self.graphed else batch * steps
        if self.graphs:
            self.rows.add("decoder", chunks, graphed, graphed, batch * steps)
        else:
            self.rows.add("decoder", steps, batch * steps, graphed, batch * steps)

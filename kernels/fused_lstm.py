"""One LSTM cell step (embedding + `torch.nn.LSTMCell`, gates i, f, g, o) that reads its inputs
from, and writes its outputs to, rows of the worker's state pools: one kernel launch per step
instead of gather -> embedding -> 2 GEMMs -> gates -> scatter (issue 5).

    weights = LSTMWeights.from_cell(cell)              # once per cell type and device
    fused_lstm_step(weights, tokens, h_rows, c_rows, h_out_rows, c_out_rows, pool)

Contract: pools are [num_rows, hidden] tensors of the weights' dtype (h and c may share one, as the
engine's per-(shape, dtype) pools do; row 0 holds zeros, so a None state is row 0). Input rows may
repeat. Output rows must be distinct and must not be input rows of the same step: programs of one
launch read input rows while others write output rows. `reference_lstm_step` is the pure-PyTorch
twin with the same arguments (index_select, the cell's math in fp32, index_copy_).
"""
from dataclasses import dataclass

import torch

from batchmaker.kernels.cell_launch import (BlockConfig, check_device, check_index, check_pool, combined_bias,
                                            dot_precision, load_kernels, pick_config)


@dataclass(frozen=True, slots=True)
class LSTMWeights:
    embedding: torch.Tensor  # [vocab, embed]
    w_ih: torch.Tensor  # [4 * hidden, embed], rows i, f, g, o
    w_hh: torch.Tensor  # [4 * hidden, hidden]
    bias: torch.Tensor  # fp32 [4 * hidden] = b_ih + b_hh

    @classmethod
    def from_cell(cls, cell: torch.nn.Module) -> "LSTMWeights":
        """From a module with `.embedding` (nn.Embedding) and `.lstm` (nn.LSTMCell), e.g.
        batchmaker.cells.lstm.LSTMCell; shares its tensors (no copy when they are contiguous)."""
        lstm = cell.lstm
        return cls(cell.embedding.weight.detach().contiguous(), lstm.weight_ih.detach().contiguous(),
                   lstm.weight_hh.detach().contiguous(),
                   combined_bias(lstm.bias_ih, lstm.bias_hh, size=4 * lstm.hidden_size, device=lstm.weight_ih.device))

    @property
    def hidden(self) -> int:
        return self.w_hh.shape[1]

    @property
    def embed(self) -> int:
        return self.w_ih.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.w_ih.dtype


def fused_lstm_step(weights: LSTMWeights, tokens: torch.Tensor, h_rows: torch.Tensor, c_rows: torch.Tensor,
                    h_out_rows: torch.Tensor, c_out_rows: torch.Tensor, h_pool: torch.Tensor,
                    c_pool: torch.Tensor | None = None, h_out_pool: torch.Tensor | None = None,
                    c_out_pool: torch.Tensor | None = None, *, token_rows: torch.Tensor | None = None,
                    config: BlockConfig | None = None) -> None:
    """h_out_pool[h_out_rows], c_out_pool[c_out_rows] = LSTMCell(embedding[tok], (h_pool[h_rows], c_pool[c_rows]))
    with tok = tokens, or tokens[token_rows] when token rows are given (tokens then is a token pool).

    Every index is a contiguous int64 [B] device tensor. c_pool defaults to h_pool, and each
    output pool to its input pool. Launches one kernel on the current stream; no sync.
    """
    c_pool = h_pool if c_pool is None else c_pool
    h_out_pool = h_pool if h_out_pool is None else h_out_pool
    c_out_pool = c_pool if c_out_pool is None else c_out_pool
    batch, hidden, embed = h_rows.shape[0], weights.hidden, weights.embed
    if batch == 0:
        return
    for name, index in (("h_rows", h_rows), ("c_rows", c_rows), ("h_out_rows", h_out_rows),
                        ("c_out_rows", c_out_rows), ("token_rows" if token_rows is not None else "tokens",
                                                     tokens if token_rows is None else token_rows)):
        check_index(name, index, batch)
    for name, pool in (("h_pool", h_pool), ("c_pool", c_pool), ("h_out_pool", h_out_pool), ("c_out_pool", c_out_pool)):
        check_pool(name, pool, hidden, weights.dtype)
    check_device(tokens, h_pool, weights.w_ih)
    cfg = pick_config("lstm", batch, hidden, (embed, hidden), 4, h_pool.element_size(), config)
    grid = (hidden // cfg.bn, -(-batch // cfg.bm))
    load_kernels().lstm_cell_kernel[grid](
        tokens, tokens if token_rows is None else token_rows, weights.embedding, weights.embedding.stride(0),
        h_pool, c_pool, h_rows, c_rows, h_pool.stride(0), c_pool.stride(0),
        h_out_pool, c_out_pool, h_out_rows, c_out_rows, h_out_pool.stride(0), c_out_pool.stride(0),
        weights.w_ih, weights.w_hh, weights.bias,
        batch, E=embed, H=hidden, TOKENS_BY_ROW=token_rows is not None,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, PRECISION=dot_precision(weights.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def reference_lstm_step(weights: LSTMWeights, tokens: torch.Tensor, h_rows: torch.Tensor, c_rows: torch.Tensor,
                        h_out_rows: torch.Tensor, c_out_rows: torch.Tensor, h_pool: torch.Tensor,
                        c_pool: torch.Tensor | None = None, h_out_pool: torch.Tensor | None = None,
                        c_out_pool: torch.Tensor | None = None, *, token_rows: torch.Tensor | None = None,
                        config: BlockConfig | None = None) -> None:
    """The twin of `fused_lstm_step`: index_select, nn.LSTMCell's math in fp32, index_copy_."""
    c_pool = h_pool if c_pool is None else c_pool
    h_out_pool = h_pool if h_out_pool is None else h_out_pool
    c_out_pool = c_pool if c_out_pool is None else c_out_pool
    tok = tokens if token_rows is None else tokens.index_select(0, token_rows)
    x = weights.embedding.index_select(0, tok).float()  # [B, embed]
    h = h_pool.index_select(0, h_rows).float()  # [B, hidden]
    c = c_pool.index_select(0, c_rows).float()
    gates = x @ weights.w_ih.float().T + h @ weights.w_hh.float().T + weights.bias  # [B, 4 * hidden]
    i, f, g, o = gates.chunk(4, dim=1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    c_out_pool.index_copy_(0, c_out_rows, c.to(c_out_pool.dtype))
    h_out_pool.index_copy_(0, h_out_rows, h.to(h_out_pool.dtype))


__all__ = ["LSTMWeights", "fused_lstm_step", "reference_lstm_step"]

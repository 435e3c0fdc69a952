"""One GPU batch of a FlexGen block (exec/offload.py): its prompts left-padded to one length, the
positions of each step's tokens, and attention over the batch's contiguous KV cache.

Layout (tokens ordered column-major, token t = l * B + b, so that a step's columns are one
contiguous prefix and a cache's valid part is `cache[:end]`, one contiguous copy):
    prompts  [B, P]            left-padded with token 0; row b's first real column is pads[b]
    cache    [S, B, Hkv, D]    K or V of one layer, S = P + num_tokens - 1 columns
    hidden   [L, 2, B, H]      the residual stream between layers, unsummed (x, residual)
A pad column is a key no real query sees; a pad query sees itself only (so that it stays finite).
A dense cache's K and V of one (layer, batch) are views of one [S, 2, B, Hkv, D] tensor (`KVPair`),
so that a move of a range of columns is one contiguous copy, not two.
"""
from dataclasses import dataclass
from typing import Self

import torch
from torch import Tensor

from batchmaker.kernels.paged_attention import capped


class KVPair(tuple):
    """(K, V) [S, B, Hkv, D] each, views of `both` [S, 2, B, Hkv, D]: columns [a, b) of both are
    `both[a:b]`, one contiguous range."""
    both: Tensor

    def __new__(cls, both: Tensor) -> Self:
        pair = super().__new__(cls, both.unbind(1))
        pair.both = both
        return pair


@dataclass(frozen=True)
class BatchPrompts:
    tokens: Tensor  # [B, P] long, left-padded
    pads: Tensor  # [B] long: pad columns before each row's prompt
    last: int  # the model's last position: a row run past its own count stays there (its tokens dropped)

    @classmethod
    def of(cls, prompts: list[list[int]], width: int, last: int, device) -> "BatchPrompts":
        """`prompts` left-padded to `width` (the block's longest: every batch of a block has one shape)."""
        tokens = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        pads = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
        return cls(tokens.to(device), pads.to(device), last)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def start(self, step: int) -> int:
        """The first cache column step `step` writes: 0 for the prompt, then one column a step."""
        return 0 if step == 0 else self.width + step - 1

    def columns(self, step: int) -> int:
        """How many columns (tokens per row) step `step` computes."""
        return self.width if step == 0 else 1

    def pad_keys(self, columns: int) -> Tensor:
        """[B, 1, columns]: key column c is a pad of row b. A decode step's query (the last column,
        real) sees every other key: this is its whole mask, sliced to the step's columns."""
        return (torch.arange(columns, device=self.pads.device) < self.pads[:, None])[:, None]

    def positions(self, step: int) -> Tensor:
        """[L * B] the position of each token of the step (pads at 0), in the column-major order."""
        start = self.start(step)
        columns = torch.arange(start, start + self.columns(step), device=self.pads.device)
        return (columns[:, None] - self.pads[None, :]).clamp(0, self.last).flatten()


def fp32_heads(cache: Tensor, workspace: Tensor | None = None) -> Tensor:
    """[S, B, Hkv, D] -> [B, Hkv, S, D] in fp32, converted and transposed in one pass, into the first
    S columns of `workspace` [B, Hkv, >= S, D] where given (each (b, h) a contiguous [S, D])."""
    heads = cache.permute(1, 2, 0, 3)
    if workspace is None:
        return torch.empty(heads.shape, dtype=torch.float32, device=cache.device).copy_(heads)
    return workspace[:, :, :heads.shape[2]].copy_(heads)


class BatchAttend:
    """An `Attend` (cells/decoder.py) for one step of one batch: writes the step's k, v into the
    batch's cache at its columns, then attends over columns [0, end) in fp32. The same on the
    device and, over the host cache, on the CPU (`Placement.cpu_attention`: exec/offload_attention.py),
    which passes fp32 `workspace`s for K and V [B, Hkv, S, D] kept across calls (the host's allocator
    maps fresh pages for a large tensor each time: faulting them in took longer than the attention).
A decode step's caller may pass `pad_keys` (`BatchPrompts.pad_keys` of the block's columns, made
once per block: the step's mask is a slice of it, no launches), else the mask is built per call."""

    def __init__(self, k_cache: Tensor, v_cache: Tensor, batch: BatchPrompts, step: int, scale: float,
                 softcap: float | None, workspace: tuple[Tensor, Tensor] | None = None,
                 pad_keys: Tensor | None = None):
        self.k_cache, self.v_cache, self.batch, self.scale, self.softcap = k_cache, v_cache, batch, scale, softcap
        self.workspace = workspace or (None, None)
        self.start, self.columns = batch.start(step), batch.columns(step)
        self.pad_keys = pad_keys if step > 0 else None  # (the prompt step's mask is causal too: built)

    def __call__(self, layer_index: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q [L*B, Hq, D], k, v [L*B, Hkv, D] (column-major tokens)
        num_rows, (num_kv_heads, head_dim) = self.batch.pads.shape[0], k.shape[1:]
        start, end, columns = self.start, self.start + self.columns, self.columns
        self.k_cache[start:end] = k.view(columns, num_rows, num_kv_heads, head_dim)
        self.v_cache[start:end] = v.view(columns, num_rows, num_kv_heads, head_dim)
        keys, values = (fp32_heads(c[:end], w) for c, w in zip((self.k_cache, self.v_cache), self.workspace))  # [B,
        # Hkv, end, D]
        group = q.shape[1] // num_kv_heads
        qh = q.float().view(columns, num_rows, num_kv_heads, group, head_dim).permute(1, 2, 3, 0, 4)  # [B, Hkv, G, L, D]
        qh = qh.reshape(num_rows, num_kv_heads, group * columns, head_dim)  # (a KV head's queries as rows: K is
        # read once per KV head, not expanded G times)
        scores = capped(qh @ keys.transpose(-1, -2) * self.scale, self.softcap)  # [B, Hkv, G*L, end]
        scores = scores.view(num_rows, num_kv_heads, group, columns, end)
        unseen = ~self.visible(end) if self.pad_keys is None else self.pad_keys[..., :end]  # [B, L, end]
        scores.masked_fill_(unseen[:, None, None], float("-inf"))
        out = scores.softmax(-1).view(num_rows, num_kv_heads, group * columns, end) @ values  # [B, Hkv, G*L, D]
        out = out.view(num_rows, num_kv_heads, group, columns, head_dim)
        return out.permute(3, 0, 1, 2, 4).reshape(q.shape).to(q.dtype)

    def visible(self, end: int) -> Tensor:
        """[B, L, end]: query column start + l of row b sees key column c."""
        device = self.batch.pads.device
        query = torch.arange(self.start, end, device=device)[:, None]  # [L, 1]
        key = torch.arange(end, device=device)  # [end]
        is_real = key[None, None, :] >= self.batch.pads[:, None, None]  # [B, 1, end]
        return (key <= query)[None] & (is_real | (key == query)[None])

"""Partial rotary embeddings (Phi-3's `partial_rotary_factor`) as a layout of q's and k's rows.

transformers rotates a head's first R dims in the rotate-half pairing (i, i + R/2), i < R/2, and
passes the other D - R through. Our kernels rotate every head in the pairing (i, i + D/2) by
cos/sin [T, D/2] (kernels/fused_decoder.py, the one-token GEMV's RoPE). Attention's scores are
sums over a head's dims, unchanged when q and k permute them alike, so the checkpoint's q and k rows
(and a per-head norm's weights) are permuted once, at load, so that pair i < R/2 of the kernels'
pairing is transformers' pair i, and the pass-through dims fill pairs R/2 .. D/2 - 1, which rotate
by a frequency of 0 (cos 1, sin 0: cells/rope.rope_inv_freq pads with zeros). V, o and the cache's
values are untouched; the cache holds K in this layout, which only attention reads.
"""
import torch
from torch import Tensor

from batchmaker.cells.decoder_config import DecoderConfig


def rotary_permutation(head_dim: int, rotary_dim: int) -> Tensor:
    """int64 [D]: the checkpoint's dim at each of our dims (ours j holds theirs perm[j])."""
    half, rotated = head_dim // 2, rotary_dim // 2
    passed = torch.arange(rotary_dim, head_dim)  # (D - R dims, split over the two halves' tails)
    first = torch.cat([torch.arange(rotated), passed[:half - rotated]])
    second = torch.cat([torch.arange(rotated, rotary_dim), passed[half - rotated:]])
    return torch.cat([first, second])


def to_rotary_layout(config: DecoderConfig, name: str, tensor: Tensor, inverse: bool = False) -> Tensor:
    """Parameter `name` of a (rank's) model of `config` in our rows' layout (from the checkpoint's;
    `inverse`: back to it): q | k | v's q and k rows per head, and q/k norms' weights; else as it is."""
    if config.rotary_dim is None or config.rotary_dim == config.head_dim:
        return tensor
    perm = rotary_permutation(config.head_dim, config.rotary_dim)
    if inverse:
        perm = torch.argsort(perm)
    perm = perm.to(tensor.device)
    if name.endswith(("attn.q_norm.weight", "attn.k_norm.weight")):
        return tensor[perm]
    if not name.endswith(("attn.qkv_proj.weight", "attn.qkv_proj.bias")):
        return tensor
    d = config.head_dim
    rotated = (config.num_heads + config.num_kv_heads) * d  # (q's rows, then k's; v's after them, kept)
    heads = tensor[:rotated].unflatten(0, (-1, d))[:, perm].flatten(0, 1)
    return torch.cat([heads, tensor[rotated:]])

"""RoPE's frequencies for the Llama family, as transformers computes them (modeling_rope_utils):
theta^(-2i/R) over a head's R rotated dims, scaled by the config's `rope_scaling` type: linear,
llama3 (Llama 3.1), longrope (Phi-3.5, Phi-4-mini: short factors, and long ones from
`original_max_position_embeddings` on) and yarn (Qwen2.5's and others' long contexts); longrope's and
yarn's attention factor scales cos and sin. cells/llama.py's `rotary` applies them (cells/gemma.py
takes the unscaled and linear ones).
"""
import math

import torch
from torch import Tensor

from batchmaker.cells.decoder_config import DecoderConfig, rope_type


def rope_inv_freq(config: DecoderConfig, long: bool = False) -> Tensor:
    """float32 [D/2] on the CPU: theta^(-2i/R) over the R rotated dims (all D, or Phi-3's partial
    rotary: then 0 for the pairs past R/2, which hold the dims passed through: cells/rotary_layout.py),
    scaled as `config.rope_scaling` says (longrope: its short factors, or `long` ones)."""
    dim = config.rotary_dim or config.head_dim
    # explicit device: stays real (and CPU) when the model is built on the meta device
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    scaling = config.rope_scaling_dict
    kind = rope_type(scaling)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling, config.max_positions)
    elif kind == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
    elif kind == "yarn":
        inv_freq = _yarn_scaled(inv_freq, scaling, dim, config.rope_theta, config.max_positions)
    return torch.cat([inv_freq, torch.zeros(config.head_dim // 2 - dim // 2, device="cpu")])


def long_factors_from(config: DecoderConfig) -> int | None:
    """A longrope model's first position rotated by the long factors (original_max_position_embeddings),
    else None. transformers picks the factors per forward, by its longest sequence: one request at a
    time, its decode steps as here, but a prompt longer than the original rotates every token by the
    long factors, where here its tokens before the original position keep the short ones. Per
    position, a token's K is a function of the tokens before it alone (not of its request's prompt
    length, its batch or its chunking), so prefix and conversation caches stay exact."""
    scaling = config.rope_scaling_dict
    return scaling["original_max_position_embeddings"] if rope_type(scaling) == "longrope" else None


def attention_factor(config: DecoderConfig) -> float:
    """What cos and sin are scaled by: longrope's sqrt(1 + ln(s) / ln(original)) and yarn's
    0.1 * ln(s) + 1 (or their configs' `attention_factor`, yarn's `mscale` ratio), s the context's
    scale; 1 for the other types."""
    scaling = config.rope_scaling_dict
    kind = rope_type(scaling)
    if kind not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor"):
        return scaling["attention_factor"]
    original, factor = _context_scale(scaling, config.max_positions)
    if kind == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dims:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dims)
    return _yarn_mscale(factor)


def rope_scale(config: DecoderConfig) -> Tensor | None:
    """float32 [D/2]: the attention factor for the rotated pairs, 1 for those passed through (their
    cos stays 1); None where the factor is 1."""
    factor = attention_factor(config)
    if factor == 1.0:
        return None
    scale = torch.ones(config.head_dim // 2, device="cpu")
    scale[:(config.rotary_dim or config.head_dim) // 2] = factor
    return scale


def _llama3_scaled(inv_freq: Tensor, scaling: dict, max_positions: int) -> Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling.get("original_max_position_embeddings", max_positions)
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(is_medium, blended, scaled)


def _yarn_scaled(inv_freq: Tensor, scaling: dict, dim: int, base: float, max_positions: int) -> Tensor:
    # YaRN: dims that rotate fewer than beta_slow times over the original context are divided by
    # `factor` (interpolated), those rotating more than beta_fast times kept, a linear ramp between
    original, factor = _context_scale(scaling, max_positions)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low or 0.001)).clamp(0, 1)
    kept = 1 - ramp  # (the share of each pair's unscaled frequency)
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def _context_scale(scaling: dict, max_positions: int) -> tuple[int, float]:
    # (the original context, the factor it is scaled by): the config's, else max_positions / original
    original = scaling.get("original_max_position_embeddings") or max_positions
    return original, scaling.get("factor") or max_positions / original


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

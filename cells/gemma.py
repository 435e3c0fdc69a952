"""Gemma, Gemma 2 and Gemma 3 (text): Llama's attention and RoPE, with Gemma's deltas.

- RMSNorm multiplies by (1 + w), in float32 before the cast back (HF casts after the weight,
  Llama before); Gemma 3 norms each head of q and k the same way before RoPE.
- Token embeddings are scaled by sqrt(hidden), the scale rounded to the weights' dtype first.
- The MLP is GeGLU: down(gelu_tanh(gate(x)) * up(x)).
- Gemma 2 and 3 norm the attention's and the MLP's outputs too before adding them to the residual
  stream: four norms a layer.
- Scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma 2, 3) and soft-capped (Gemma 2); the
  logits are soft-capped (Gemma 2, 3): cap * tanh(x / cap). Layers with a sliding window
  (`DecoderConfig.layer_windows`) attend to its positions only; in Gemma 3 they rotate with their
  own RoPE base (`local_rope_theta`, unscaled), the others with rope_theta and rope_scaling. The
  windows and the score cap are the caller's `attend`'s (kernels/paged_attention.py `PagedAttend`,
  or the dense path's). On CUDA the norms (with the residual adds before them) and GeGLU are one
  Triton launch each (kernels/fused_decoder.py: 54 kernels a layer before, H100 2026-11-26).
"""
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchmaker.cells.decoder import Attention, DecoderLayer, DecoderLM, rms_normalized
from batchmaker.cells.decoder_config import DecoderConfig
from batchmaker.cells.llama import GatedMLP
from batchmaker.cells.rope import rope_inv_freq
from batchmaker.cells.rotary import RopeTables, Rotary
from batchmaker.kernels.fused_decoder import add_rms_norm, can_fuse, rms_norm, silu_mul
from batchmaker.kernels.skinny import project


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in float32, cast back at the end (over the last dimension: a head's too)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if can_fuse(x):  # (one kernel instead of ~10 elementwise launches)
            return rms_norm(x, self.weight, self.eps, one_plus=True)
        return (rms_normalized(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(x + residual, self(x + residual)), in one kernel on CUDA."""
        if can_fuse(x):
            return add_rms_norm(x, residual, self.weight, self.eps, one_plus=True)
        total = x + residual
        return total, self(total)


class GeGLU(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)), with gate and up fused into one projection."""

    def forward(self, x: Tensor) -> Tensor:
        gate_up = project(self.gate_up_proj, x)  # [T, 2I]
        if can_fuse(gate_up):
            act = silu_mul(gate_up, gelu=True)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
        out = project(self.down_proj, act)
        return out if self.reduce is None else self.reduce(out)


class GemmaLayer(DecoderLayer):
    """x + post_attn_norm(attn(attn_norm(x))), then + post_mlp_norm(mlp(mlp_norm(.))); Gemma 1 has
    no post norms (Llama's block with Gemma's norms and MLP)."""

    def __init__(self, config: DecoderConfig, layer_index: int):
        c = config
        super().__init__(GemmaRMSNorm(c.hidden_size, c.norm_eps), Attention(c, layer_index, head_norm=GemmaRMSNorm),
                         GemmaRMSNorm(c.hidden_size, c.norm_eps), GeGLU(c))
        if c.post_norms:
            self.post_attn_norm = GemmaRMSNorm(c.hidden_size, c.norm_eps)
            self.post_mlp_norm = GemmaRMSNorm(c.hidden_size, c.norm_eps)

    def forward(self, x: Tensor, residual: Tensor | None, rotate, attend) -> tuple[Tensor, Tensor]:
        residual, normed = (x, self.attn_norm(x)) if residual is None else self.attn_norm.add_forward(x, residual)
        mixed = self.attn(normed, rotate, attend)
        if hasattr(self, "post_attn_norm"):
            mixed = self.post_attn_norm(mixed)
        residual, normed = self.mlp_norm.add_forward(mixed, residual)
        out = self.mlp(normed)
        if hasattr(self, "post_mlp_norm"):
            out = self.post_mlp_norm(out)
        return out, residual


class GemmaLM(DecoderLM):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        assert config.is_gemma
        self.config = c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(GemmaLayer(c, i) for i in range(c.num_layers))
        self.norm = GemmaRMSNorm(c.hidden_size, c.norm_eps)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(c), persistent=False)  # float32 [D/2]
        # Gemma 3: the layers with a window rotate with their own base, unscaled
        self.is_local = [bool(c.local_rope_theta and c.layer_windows and c.layer_windows[i])
                         for i in range(c.num_layers)]
        if any(self.is_local):
            local = replace(c, rope_theta=c.local_rope_theta, rope_scaling=None)
            self.register_buffer("local_inv_freq", rope_inv_freq(local), persistent=False)
        self.rope_tables = {False: RopeTables(c.max_positions), True: RopeTables(c.max_positions)}  # by is_local

    def embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        # sqrt(hidden) rounded to the weights' dtype first, as HF does (bf16: sqrt(3072) = 55.5)
        scale = float(torch.tensor(self.config.hidden_size ** 0.5, dtype=self.embed_tokens.weight.dtype))
        return self.tokens(tokens) * scale

    def run_layers(self, hidden: Tensor, residual: Tensor | None, positions: Tensor,
                   attend) -> tuple[Tensor, Tensor | None]:
        rotations = {False: self._rotary(False, positions)}  # computed once, shared by the layers
        if any(self.is_local):
            rotations[True] = self._rotary(True, positions)
        for layer, is_local in zip(self.layers, self.is_local):
            hidden, residual = layer(hidden, residual, rotations[is_local], attend)
        return hidden, residual

    def rotary(self, positions: Tensor) -> Rotary:
        """The global layers' rotation (the local layers' is `run_layers`')."""
        return self._rotary(False, positions)

    def _rotary(self, local: bool, positions: Tensor) -> Rotary:
        inv_freq = self.local_inv_freq if local else self.inv_freq

        def angles(at: Tensor) -> tuple[Tensor, Tensor]:
            freqs = at[:, None].float() * inv_freq[None, :]  # [T, D/2], float32
            return freqs.cos(), freqs.sin()
        return self.rope_tables[local].at(positions, self.embed_tokens.weight.dtype, angles)

    def head(self, hidden: Tensor) -> Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(self.norm(hidden), weight)
        cap = self.config.final_softcap
        if cap is not None:  # (in the weights' dtype, as HF)
            logits = torch.tanh(logits / cap) * cap
        return self.gathered(logits.float())

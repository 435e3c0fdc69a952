"""Llama: RMSNorm, rotary position embeddings (their frequencies and scaling in cells/rope.py, over
all of a head or part of it: cells/rotary_layout.py), SwiGLU, GQA.

Numerics follow HF's modeling_llama: RMSNorm in float32 and cast back before the weight; RoPE in
the rotate-half layout (the two halves of each head are the pairs rotated together), cos/sin
computed in float32 and cast to the activations' dtype. On CUDA the norms (with the residual add
before them), RoPE (with the K/V cache write, when the caller's attend offers it) and SiLU(gate) x up
run as one Triton kernel each (kernels/fused_decoder.py); elsewhere as their PyTorch twins, the code
HF runs. A forward of one token on CUDA (a batch-1 decode step) runs each layer as four
matrix-vector products with the norms and SiLU x up inside them (kernels/gemv.py), RoPE and the
K/V cache write inside the first (when the attend is a paged cache's), plus attention.
"""
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from batchmaker.cells.decoder import Attention, DecoderLayer, DecoderLM, reduced
from batchmaker.cells.decoder_config import DecoderConfig
from batchmaker.cells.rope import long_factors_from, rope_inv_freq, rope_scale
from batchmaker.cells.rotary import RopeTables, Rotary
from batchmaker.kernels import gemv
from batchmaker.kernels.skinny import project
from batchmaker.kernels.fused_decoder import (add_rms_norm, can_fuse, reference_add_rms_norm, reference_rms_norm,
                                              reference_silu_mul, rms_norm, silu_mul)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if can_fuse(x):
            return rms_norm(x, self.weight, self.eps)
        return reference_rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(x + residual, self(x + residual)), in one kernel on CUDA."""
        if can_fuse(x):
            return add_rms_norm(x, residual, self.weight, self.eps)
        return reference_add_rms_norm(x, residual, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one projection."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.has_mlp_bias
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.reduce = None  # tensor parallel: down's partial sums (cells/tensor_parallel.py)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = project(self.gate_up_proj, x)  # [T, 2I]: gate | up
        act = silu_mul(gate_up) if can_fuse(gate_up) else reference_silu_mul(gate_up)
        return reduced(self, project(self.down_proj, act))


@dataclass(frozen=True, slots=True)
class OneTokenConfig:
    """How a Llama layer runs a forward of one token on CUDA: as matrix-vector products with the small
    steps fused in (kernels/gemv.py). `LlamaLM.set_one_token` installs one (None: cuBLAS and the small
    kernels, the path of every other batch; benchmarks compare them)."""
    pdl: bool = True  # programmatic dependent launch between the projections
    rope_in_qkv: bool = True  # RoPE and the K/V cache write in the q | k | v projection (with a paged attend):
    # one launch fewer per layer, batch-1 step 3.87 against 3.90 ms (H200, bench/decode_profile.py)
    norm_squares: bool = True  # o and down add the residual and write the partial sums of squares the next norms
    # take instead of a pass over their input (kernels/gemv.linear_residual; LlamaLM.run_layers threads them; not
    # with tensor parallelism): batch-1 step 3.500 ms against 3.532 (H200), 4.706 against 4.777 (H100), with
    # q | k | v and gate | up under a register cap (bench/one_token_ab.py --squares, twenty-eighth session)


class LlamaLayer(DecoderLayer):
    """DecoderLayer, with a one-token path on CUDA: qkv = W rms_norm(x + residual) in one launch,
    RoPE and attention, o_proj, then silu(gate) * up of W rms_norm(...) in one launch, down_proj."""

    def __init__(self, config: DecoderConfig, layer_index: int):
        super().__init__(RMSNorm(config.hidden_size, config.norm_eps), Attention(config, layer_index),
                         RMSNorm(config.hidden_size, config.norm_eps), GatedMLP(config))
        # (the one-token kernels take a bias on q | k | v only (Qwen2), and no norms of q and k)
        self.has_bias = config.has_attention_bias or config.has_mlp_bias or config.qk_norm
        self.one_token: OneTokenConfig | None = None if self.has_bias else OneTokenConfig()

    def forward(self, x: Tensor, residual: Tensor | None, rotate, attend) -> tuple[Tensor, Tensor]:
        if self.one_token is None or not gemv.can_gemv(x, self.attn.qkv_proj.weight):
            return super().forward(x, residual, rotate, attend)
        return self.one_token_forward(x, residual, None, rotate, attend)[:2]

    def takes_squares(self) -> bool:
        """Whether one_token_forward passes partial sums of squares on (OneTokenConfig.norm_squares; the
        residual is added before a tensor-parallel all-reduce could be, so not with one)."""
        how = self.one_token
        return how is not None and how.norm_squares and self.attn.reduce is None and self.mlp.reduce is None

    def one_token_forward(self, x: Tensor, residual: Tensor | None, squares: Tensor | None, rotate, attend
                          ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """forward's one-token path (how.one_token's kernels): (the MLP's output, the residual before it, None),
        or with `takes_squares` (the block's output, None, its partial sums of squares for the next norm);
        `squares`: x's (then residual is None)."""
        how, qkv_weight = self.one_token, self.attn.qkv_proj.weight
        eps, pdl, attn = self.attn_norm.eps, how.pdl, self.attn
        if how.rope_in_qkv and isinstance(rotate, Rotary) and hasattr(attend, "attend_cached") and \
                gemv.qkv_takes_rope(qkv_weight, attn.head_dim):  # RoPE and the K/V write inside the projection
            cos, sin, rows = rotate.table_rows() or (rotate.cos, rotate.sin, None)  # (a table: no gather launch)
            target = gemv.RopeTarget(cos, sin, *attend.kv_cache(attn.layer_index), attn.num_heads, attn.num_kv_heads,
                                     rows)
            residual, q = gemv.norm_qkv_rope(x, residual, self.attn_norm.weight, eps, qkv_weight, target,
                                             attn.qkv_proj.bias, pdl=pdl, squares=squares)
            mixed = attend.attend_cached(attn.layer_index, q.view(1, attn.num_heads, attn.head_dim)).view(1, -1)
        else:
            residual, qkv = gemv.norm_linear(x, residual, self.attn_norm.weight, eps, qkv_weight, attn.qkv_proj.bias,
                                             pdl=pdl, squares=squares)
            mixed = attn.mix(qkv, rotate, attend)
        if self.takes_squares():  # (the residual added in o's and down's epilogues)
            total, squares = gemv.linear_residual(mixed, attn.o_proj.weight, residual, pdl=pdl)
            act = gemv.norm_gate_up(total, None, self.mlp_norm.weight, eps, self.mlp.gate_up_proj.weight, pdl=pdl,
                                    squares=squares)[1]
            hidden, squares = gemv.linear_residual(act, self.mlp.down_proj.weight, total, pdl=pdl)
            return hidden, None, squares
        out = reduced(attn, gemv.linear(mixed, attn.o_proj.weight, pdl=pdl))
        residual, act = gemv.norm_gate_up(out, residual, self.mlp_norm.weight, eps, self.mlp.gate_up_proj.weight,
                                          pdl=pdl)
        return reduced(self.mlp, gemv.linear(act, self.mlp.down_proj.weight, pdl=pdl)), residual, None


class LlamaLM(DecoderLM):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        assert config.family == "llama"
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(c), persistent=False)  # float32 [D/2]
        self.long_from = long_factors_from(c)  # (longrope: the first position rotated by the long factors)
        if self.long_from is not None:
            self.register_buffer("long_inv_freq", rope_inv_freq(c, long=True), persistent=False)
        self.register_buffer("rope_scale", rope_scale(c), persistent=False)  # (None, or cos and sin's scale)
        self.rope_tables = RopeTables(c.max_positions)

    def embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        return self.tokens(tokens)

    def set_one_token(self, how: OneTokenConfig | None) -> None:
        """How forwards of one token run on CUDA from now on (None: the general path); layers with
        biases keep the general path."""
        for layer in self.layers:
            layer.one_token = None if layer.has_bias else how

    def run_layers(self, hidden: Tensor, residual: Tensor | None, positions: Tensor,
                   attend) -> tuple[Tensor, Tensor | None]:
        """DecoderLM.run_layers; with OneTokenConfig.norm_squares, one token's layers pass each other the
        partial sums of squares of the residual stream (LlamaLayer.one_token_forward)."""
        first = self.layers[0] if len(self.layers) else None
        if first is None or not first.takes_squares() or not gemv.can_gemv(hidden, first.attn.qkv_proj.weight):
            return super().run_layers(hidden, residual, positions, attend)
        rotate, squares = self.rotary(positions), None
        for layer in self.layers:
            if layer.takes_squares():
                hidden, residual, squares = layer.one_token_forward(hidden, residual, squares, rotate, attend)
            else:  # (a total with its squares is a stream whose residual is None)
                hidden, residual, squares = *layer(hidden, residual, rotate, attend), None
        return hidden, residual

    def head(self, hidden: Tensor) -> Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        how = self.layers[0].one_token
        if how is not None and gemv.can_gemv(hidden, weight):
            logits = gemv.norm_linear(hidden, None, self.norm.weight, self.norm.eps, weight, pdl=how.pdl,
                                      out_dtype=torch.float32)[1]  # (float32 out: no cast launch)
            return self.gathered(logits)
        return super().head(hidden)

    def rotary(self, positions: Tensor) -> Rotary:
        return self.rope_tables.at(positions, self.embed_tokens.weight.dtype, self.rope_angles)

    def rope_angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """float32 cos, sin [T, D/2] at `positions` [T] (what `rotary` rounds to the activations' dtype)."""
        inv_freq = self.inv_freq[None, :]
        if self.long_from is not None:  # (per token, on the device: graphs replay it)
            inv_freq = torch.where((positions >= self.long_from)[:, None], self.long_inv_freq, inv_freq)
        freqs = positions[:, None].float() * inv_freq  # [T, D/2], float32
        cos, sin = freqs.cos(), freqs.sin()
        if self.rope_scale is not None:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        return cos, sin

"""A decoder-only language model computed token-wise, with its attention delegated to the caller.

The engine runs one iteration over a flat batch of `T` tokens from many requests (prompt chunks
and single decode tokens mixed) and owns the KV cache, so a model here never sees sequences:
every layer projects q/k/v for the `T` tokens and hands them to `attend(layer_index, q, k, v)`,
which stores k/v wherever it likes and returns the attention output. `dense_logits` is the plain
one-sequence path (causal attention over the sequence itself), the reference for everything else.

An `attend` over a KV cache may also let the model write the new K/V itself: with
`kv_cache(layer_index) -> (k_cache, v_cache, slots)` and `attend_cached(layer_index, q)`
(kernels/paged_attention.py `PagedAttend`), a model with rotary embeddings writes the rotated k and
v into the cache inside its RoPE kernel and asks for attention over the cache.

Everything on the token path is free of host syncs and data-dependent shapes, so one iteration
can be captured in a CUDA graph for a fixed `T`. Llama, Gemma and OPT share this base, the attention
block and the pre-norm layer; their files add norms, MLPs and position handling. Layers hand the
residual stream on unsummed (the MLP's output and the sum before it), so that the next layer's
norm adds them (one kernel for Llama's add + RMSNorm).
"""
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchmaker.cells.decoder_config import DecoderConfig
from batchmaker.kernels.paged_attention import causal_attention
from batchmaker.kernels.skinny import project

# attend(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]; q/k/v may be
# non-contiguous views of the fused projection (OPT, and v always): call .contiguous() if a kernel needs it
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]

INIT_STD = 0.02  # HF's initializer_range: keeps activations O(1) through the layers


def repeat_kv(x: Tensor, num_heads: int) -> Tensor:
    """[T, Hkv, D] -> [T, num_heads, D]: query head h reads kv head h // (num_heads // Hkv)."""
    return x.repeat_interleave(num_heads // x.shape[1], dim=1)


def causal_attend(layer_index: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention of one sequence over itself (tokens in order from position 0); an `Attend`."""
    num_heads = q.shape[1]
    q, k, v = (x.transpose(0, 1) for x in (q, repeat_kv(k, num_heads), repeat_kv(v, num_heads)))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)  # [L, Hq, D]


def dense_attend(config: DecoderConfig) -> Attend:
    """`causal_attend` as `config` attends: its scale, each layer's sliding window, soft-capped scores."""
    windows, softcap, scale = config.attention_windows, config.attn_softcap, config.attention_scale
    if not windows and softcap is None and config.query_pre_attn_scalar is None:
        return causal_attend

    def attend(layer_index: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        window = windows[layer_index] if windows else 0
        return causal_attention(q, k, v, scale, window or None, softcap).to(q.dtype)
    return attend


class Attention(nn.Module):
    """Fused q/k/v projection, optional rotary embedding, the caller's attention, output projection."""

    def __init__(self, config: DecoderConfig, layer_index: int, head_norm: type[nn.Module] | None = None):
        super().__init__()
        self.layer_index = layer_index
        c = config
        self.sizes = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, sum(self.sizes), bias=c.has_qkv_bias)
        self.o_proj = nn.Linear(self.sizes[0], c.hidden_size, bias=c.has_attention_bias)
        if c.qk_norm:  # (Qwen3, Gemma 3: each head of q and k normed before RoPE; `head_norm`: how, if not HeadNorm)
            norm = head_norm or HeadNorm
            self.q_norm, self.k_norm = norm(c.head_dim, c.norm_eps), norm(c.head_dim, c.norm_eps)
        self.reduce: Callable[[Tensor], Tensor] | None = None  # tensor parallel: o_proj's partial sums (cells/tensor_parallel.py)

    def forward(self, x: Tensor, rotate: Callable | None, attend: Attend) -> Tensor:
        # x: [T, H]
        return reduced(self, project(self.o_proj, self.mix(project(self.qkv_proj, x), rotate, attend)))

    def mix(self, qkv: Tensor, rotate: Callable | None, attend: Attend) -> Tensor:
        """The projected q | k | v [T, (Hq + 2 Hkv) D] -> attention's output [T, Hq D], before o_proj."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if rotate is not None and hasattr(attend, "attend_cached"):  # k, v written with the rotation
            q = rotate.write_kv(q, k, v, *attend.kv_cache(self.layer_index))
            out = attend.attend_cached(self.layer_index, q)
        else:
            if rotate is not None:
                q, k = rotate(q, k)
            out = attend(self.layer_index, q, k, v)  # [T, Hq, D]
        return out.reshape(num_tokens, self.sizes[0])


class HeadNorm(nn.Module):
    """RMSNorm over each head's [.., D] (Qwen3's q and k norms), as HF computes it: in float32,
    cast back, then the weight."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * rms_normalized(x, self.eps).to(x.dtype)


def rms_normalized(x: Tensor, eps: float) -> Tensor:
    """x / rms(x) over the last dimension, in float32 (the norms then weight it and cast back)."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); the norm and MLP kinds are given."""

    def __init__(self, attn_norm: nn.Module, attn: Attention, mlp_norm: nn.Module, mlp: nn.Module):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp

    def forward(self, x: Tensor, residual: Tensor | None, rotate, attend: Attend) -> tuple[Tensor, Tensor]:
        """The block's input is x + residual (x alone when residual is None); returns (the MLP's
        output, the residual before it): their sum, the block's output, is left to the next norm."""
        if residual is None:
            residual, normed = x, self.attn_norm(x)
        else:
            residual, normed = add_and_norm(self.attn_norm, x, residual)
        residual, normed = add_and_norm(self.mlp_norm, self.attn(normed, rotate, attend), residual)
        return self.mlp(normed), residual


def reduced(module: nn.Module, x: Tensor) -> Tensor:
    """A row-parallel projection's output summed over the ranks (as is without tensor parallelism)."""
    return x if module.reduce is None else module.reduce(x)


def add_and_norm(norm: nn.Module, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
    """(x + residual, norm(x + residual)); a norm with an `add_forward` (Llama's RMSNorm) fuses the two."""
    if hasattr(norm, "add_forward"):
        return norm.add_forward(x, residual)
    total = x + residual
    return total, norm(total)


class DecoderLM(nn.Module):
    """Token embedding, `num_layers` DecoderLayers, final norm and LM head.

    Subclasses build `embed_tokens`, `layers`, `norm` and `lm_head` (None when tied to the
    embedding) and define `embed`; Llama also overrides `rotary`.
    """

    config: DecoderConfig  # what this module computes (a rank's shard under tensor parallelism)
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear | None
    tp = None  # cells/tensor_parallel.TensorParallel: this module is one rank's shard
    pp = None  # cells/pipeline.PipelineStage: this module is one stage of a pipeline

    def embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens, positions: LongTensor [T] -> [T, H]."""
        raise NotImplementedError

    def rotary(self, positions: Tensor):
        """None without rotary embeddings; else an object rotating to `positions`: called as
        rotate(q [T, Hq, D], k [T, Hkv, D]) -> (q, k), and rotate.write_kv(q, k, v, k_cache,
        v_cache, slots) -> q, which writes the rotated k and v into the caches at slots."""
        return None

    def forward(self, tokens: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """tokens, positions: LongTensor [T] -> hidden states [T, H] before the final norm."""
        hidden, residual = self.run_layers(self.embed(tokens, positions), None, positions, attend)
        return hidden if residual is None else hidden + residual

    def run_layers(self, hidden: Tensor, residual: Tensor | None, positions: Tensor,
                   attend: Attend) -> tuple[Tensor, Tensor | None]:
        """This module's layers over the residual stream (hidden + residual, unsummed): a pipeline
        stage runs them between what it receives and what it sends (cells/pipeline.py)."""
        rotate = self.rotary(positions)  # computed once, shared by every layer
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rotate, attend)
        return hidden, residual

    def head(self, hidden: Tensor) -> Tensor:
        """hidden [N, H] -> float32 logits [N, vocab] (final norm, then the LM head)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.gathered(F.linear(self.norm(hidden), weight).float())

    def tokens(self, tokens: Tensor) -> Tensor:
        """The token embedding [T, H] (over the ranks' vocabulary rows under tensor parallelism)."""
        return self.embed_tokens(tokens) if self.tp is None else self.tp.embed(self.embed_tokens.weight, tokens)

    def gathered(self, logits: Tensor) -> Tensor:
        """Logits of the whole vocabulary from this module's rows."""
        return logits if self.tp is None else self.tp.gather_logits(logits)

    @torch.no_grad()
    def dense_logits(self, tokens: Tensor) -> Tensor:
        """Logits [L, vocab] of one sequence `tokens` [L] at positions 0..L-1 (the reference path)."""
        positions = torch.arange(tokens.shape[0], device=tokens.device)
        return self.head(self(tokens, positions, dense_attend(self.config)))


def decoder_class(config: DecoderConfig) -> type[DecoderLM]:
    from batchmaker.cells.gemma import GemmaLM  # imported here: these modules import this one
    from batchmaker.cells.llama import LlamaLM
    from batchmaker.cells.opt import OPTLM
    return GemmaLM if config.is_gemma else {"llama": LlamaLM, "opt": OPTLM}[config.family]


def empty_decoder(config: DecoderConfig) -> DecoderLM:
    """The model with its parameters on the meta device (no memory), to be filled by `materialize`."""
    with torch.device("meta"):
        return decoder_class(config)(config)


def materialize(model: DecoderLM, state: dict[str, Tensor], device) -> DecoderLM:
    """Install `state` (tensors already of the wanted dtype and device) into a meta `model`, for
    inference. A parameter `state` lacks is one this part of a model does not hold (a pipeline
    stage's embedding or head: cells/pipeline.py): it becomes an empty tensor."""
    missing = model.load_state_dict(state, assign=True, strict=False).missing_keys
    if missing:
        like = next(iter(state.values()))
        for name in missing:
            module_name, _, kind = name.rpartition(".")
            setattr(model.get_submodule(module_name), kind,
                    nn.Parameter(torch.empty(0, dtype=like.dtype, device=like.device), requires_grad=False))
    return model.to(device).requires_grad_(False).eval()  # .to moves the non-persistent rope buffer


def build_decoder(config: DecoderConfig, seed: int = 0, dtype=torch.float32, device="cpu", cut=None) -> DecoderLM:
    """A model with seeded random weights: normal(0, 0.02), norms at weight 1 and bias 0 (Gemma's,
    which scale by 1 + w: at 0).

    The same seed gives the same weights on the same kind of device (one generator on `device`,
    parameters drawn in registration order). With a `cut` (cells/tensor_parallel.TensorCut,
    cells/pipeline.StageCut), one rank's part of that model: every parameter is drawn whole, one
    at a time, and cut, so that each rank builds its own part of the same model without the
    whole model ever existing.
    """
    whole = empty_decoder(config)
    model = whole if cut is None else empty_decoder(cut.config(config))
    generator = torch.Generator(device=torch.device(device)).manual_seed(seed)
    state = {}
    for name, p in whole.named_parameters():
        t = torch.empty(p.shape, dtype=dtype, device=device)
        module_name, kind = name.rsplit(".", 1)
        if module_name.endswith("norm"):
            t.fill_(1.0 if kind == "weight" and not config.is_gemma else 0.0)
        else:
            t.normal_(0.0, INIT_STD, generator=generator)  # (drawn even where not kept: the stream stays the same)
        local = name if cut is None else cut.take(name)
        if local is not None:
            state[local] = t if cut is None else cut.slicing(name, config).cut(t)
    return materialize(model, state, device)

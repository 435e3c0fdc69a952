"""The shape of a decoder-only language model (Llama or OPT style), its presets, and HF config.json.

One frozen, hashable dataclass describes both families; the fields that only one family reads
say so. The Llama family takes the models built like it (`model_type` llama, mistral, qwen2,
qwen3, phi3: their deltas are biases on q, k, v only, per-head norms of q and k, an explicit head
size, q | k | v and gate | up stored fused). `from_hf` / `to_hf` translate to and from a HF `config.json` dict, so that a checkpoint
directory can be loaded and the tests can build the matching `transformers` model.
"""
from dataclasses import dataclass, replace

FAMILIES = ("llama", "opt")
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3")  # model_types the Llama family runs
ACTIVATIONS = {"llama": ("silu",), "opt": ("relu", "gelu")}
ROPE_TYPES = ("linear", "llama3")  # besides none
OPT_POSITION_OFFSET = 2  # OPT's learned position table starts at row 2 (a fairseq padding legacy)


@dataclass(frozen=True)
class DecoderConfig:
    family: str  # "llama" | "opt"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the MLP's inner width (HF: intermediate_size for Llama, ffn_dim for OPT)
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads: grouped-query attention (Llama only)
    head_dim: int
    max_positions: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # Llama only
    rope_scaling: tuple | None = None  # Llama only: sorted (key, value) pairs, so the config hashes
    activation: str = "silu"  # "silu" (Llama, gated); "relu" or "gelu" (OPT)
    tie_word_embeddings: bool = False  # the LM head reuses the token embedding
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    attention_bias: bool = False  # Llama: biases on q/k/v/o
    mlp_bias: bool = False  # Llama: biases on gate/up/down
    enable_bias: bool = True  # OPT: biases on every linear layer
    qkv_bias: bool = False  # Llama family: biases on q/k/v only (Qwen2)
    qk_norm: bool = False  # Llama family: RMSNorm of each head of q and k before RoPE (Qwen3)
    model_type: str = ""  # the checkpoint's (HF config.json); "" for presets: the family's own
    do_layer_norm_before: bool = True  # OPT: pre-norm (every OPT but 350m)
    word_embed_proj_dim: int | None = None  # OPT: None means hidden_size (no projection)
    shards: int = 1  # a rank's share of a model split over this many (cells/tensor_parallel.py): heads, kv
    # heads, intermediate_size and vocab_size are the rank's

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown decoder family {self.family!r}; known: {', '.join(FAMILIES)}")
        if self.activation not in ACTIVATIONS[self.family]:
            raise ValueError(f"{self.family} supports activation {ACTIVATIONS[self.family]}, "
                             f"got {self.activation!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.family == "opt":
            self._check_opt()
        rope_type(self.rope_scaling_dict)  # raises on unsupported scaling

    def _check_opt(self):
        if not self.do_layer_norm_before:
            raise ValueError("OPT with do_layer_norm_before=False (post-norm, as opt-350m) is not supported")
        if self.word_embed_proj_dim not in (None, self.hidden_size):
            raise ValueError(f"OPT with word_embed_proj_dim ({self.word_embed_proj_dim}) != hidden_size "
                             f"({self.hidden_size}) (projected embeddings, as opt-350m) is not supported")
        if self.num_kv_heads != self.num_heads or self.num_heads * self.head_dim * self.shards != self.hidden_size:
            raise ValueError("OPT needs num_kv_heads == num_heads and num_heads * head_dim == hidden_size")
        if self.rope_scaling is not None:
            raise ValueError("OPT has learned positions: rope_scaling must be None")
        if self.qkv_bias or self.qk_norm:
            raise ValueError("qkv_bias and qk_norm are Llama-family fields")

    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def has_attention_bias(self) -> bool:
        """Biases on q, k, v and o."""
        return self.enable_bias if self.family == "opt" else self.attention_bias

    @property
    def has_qkv_bias(self) -> bool:
        return self.has_attention_bias or self.qkv_bias

    @property
    def has_mlp_bias(self) -> bool:
        return self.enable_bias if self.family == "opt" else self.mlp_bias


def rope_type(scaling: dict | None) -> str:
    """"default", "linear" or "llama3" for a rope scaling dict (HF's `rope_type`, or legacy `type`)."""
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default" and kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: none, {', '.join(ROPE_TYPES)}")
    return kind


def scaling_tuple(scaling: dict | None) -> tuple | None:
    """A HF rope scaling dict as DecoderConfig stores it: sorted pairs, `rope_type` key, no theta."""
    kind = rope_type(scaling)
    if kind == "default":
        return None
    pairs = {k: v for k, v in scaling.items() if k not in ("type", "rope_type", "rope_theta", "partial_rotary_factor")}
    pairs["rope_type"] = kind
    return tuple(sorted(pairs.items()))


def num_parameters(config: DecoderConfig) -> int:
    """The model's parameter count, computed from the config (nothing is allocated)."""
    c = config
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attention = h * (q + 2 * kv) + q * h + (q + 2 * kv) * c.has_qkv_bias + h * c.has_attention_bias
    attention += 2 * c.head_dim * c.qk_norm
    if c.family == "llama":
        mlp = 3 * h * c.intermediate_size + (2 * c.intermediate_size + h) * c.has_mlp_bias
        norms, positions = 2 * h, 0  # two RMSNorm weights per layer
    else:
        mlp = 2 * h * c.intermediate_size + (c.intermediate_size + h) * c.has_mlp_bias
        norms, positions = 4 * h, (c.max_positions + OPT_POSITION_OFFSET) * h  # LayerNorms have biases
    final_norm = norms // 2
    head = 0 if c.tie_word_embeddings else c.vocab_size * h
    return c.vocab_size * h + positions + c.num_layers * (attention + mlp + norms) + final_norm + head


_LLAMA2_7B = DecoderConfig(
    family="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
    num_heads=32, num_kv_heads=32, head_dim=128, max_positions=4096, norm_eps=1e-5)
_OPT_13B = DecoderConfig(
    family="opt", vocab_size=50272, hidden_size=5120, intermediate_size=20480, num_layers=40,
    num_heads=40, num_kv_heads=40, head_dim=128, max_positions=2048, norm_eps=1e-5, activation="relu",
    tie_word_embeddings=True, bos_token_id=2, eos_token_ids=(2,))

PRESETS: dict[str, DecoderConfig] = {
    "llama-2-7b": _LLAMA2_7B,
    "llama-2-13b": replace(_LLAMA2_7B, hidden_size=5120, intermediate_size=13824, num_layers=40,
                           num_heads=40, num_kv_heads=40),
    "llama-2-70b": replace(_LLAMA2_7B, hidden_size=8192, intermediate_size=28672, num_layers=80,
                           num_heads=64, num_kv_heads=8),
    "opt-13b": _OPT_13B,
    # A CPU benchmark's: big enough that the layers, not the host, take the time
    "small-llama": replace(_LLAMA2_7B, vocab_size=4096, hidden_size=512, intermediate_size=1408, num_layers=8,
                           num_heads=8, num_kv_heads=8, head_dim=64, max_positions=1024),
    # Small enough for CPU tests; GQA (4 query heads share 2 kv heads) so that path is exercised.
    "tiny-llama": replace(_LLAMA2_7B, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, max_positions=256),
    "tiny-opt": replace(_OPT_13B, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=4, head_dim=16, max_positions=256),
}


def from_hf(config: dict) -> DecoderConfig:
    """The DecoderConfig of a HF `config.json` dict (model_type llama, mistral, qwen2, qwen3 or opt)."""
    model_type = config.get("model_type")
    if model_type in LLAMA_LIKE:
        return _llama_from_hf(config)
    if model_type == "opt":
        return _opt_from_hf(config)
    raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(LLAMA_LIKE + ('opt',))}")


def _eos_tuple(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)


def _llama_from_hf(c: dict) -> DecoderConfig:
    # transformers 4.x writes rope_theta + rope_scaling; 5.x writes rope_parameters (theta inside).
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    num_heads = c["num_attention_heads"]
    model_type = c["model_type"]
    _check_window(c)
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial}: rotary embeddings over part of each head are not "
                         f"supported yet")
    return DecoderConfig(
        model_type="" if model_type == "llama" else model_type, qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        family="llama", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=num_heads,
        num_kv_heads=c.get("num_key_value_heads") or num_heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // num_heads,
        max_positions=c["max_position_embeddings"], norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        rope_scaling=scaling_tuple(rope), activation=c.get("hidden_act", "silu"),
        tie_word_embeddings=c.get("tie_word_embeddings", False), bos_token_id=c.get("bos_token_id"),
        eos_token_ids=_eos_tuple(c.get("eos_token_id")), attention_bias=c.get("attention_bias", False),
        mlp_bias=c.get("mlp_bias", False))


def _check_window(c: dict) -> None:
    """Sliding-window attention is refused where it would bind (a window shorter than the
    positions): the attention kernels and their twin attend to every earlier position so far."""
    window = c.get("sliding_window")
    used = c.get("use_sliding_window", c["model_type"] in ("mistral", "phi3"))  # (Qwen's need the flag)
    if used and window is not None and window < c["max_position_embeddings"]:
        raise ValueError(f"sliding_window {window} < max_position_embeddings {c['max_position_embeddings']}: "
                         f"sliding-window attention is not supported yet")


def _opt_from_hf(c: dict) -> DecoderConfig:
    if not c.get("layer_norm_elementwise_affine", True) or c.get("_remove_final_layer_norm", False):
        raise ValueError("OPT without affine layer norms or without the final layer norm is not supported")
    hidden, num_heads = c["hidden_size"], c["num_attention_heads"]
    projected = c.get("word_embed_proj_dim", hidden)
    return DecoderConfig(
        family="opt", vocab_size=c["vocab_size"], hidden_size=hidden, intermediate_size=c["ffn_dim"],
        num_layers=c["num_hidden_layers"], num_heads=num_heads, num_kv_heads=num_heads,
        head_dim=hidden // num_heads, max_positions=c["max_position_embeddings"], norm_eps=1e-5,
        activation=c.get("activation_function", "relu"),
        tie_word_embeddings=c.get("tie_word_embeddings", True), bos_token_id=c.get("bos_token_id"),
        eos_token_ids=_eos_tuple(c.get("eos_token_id")), enable_bias=c.get("enable_bias", True),
        do_layer_norm_before=c.get("do_layer_norm_before", True),
        word_embed_proj_dim=None if projected in (None, hidden) else projected)


def to_hf(config: DecoderConfig) -> dict:
    """The HF `config.json` dict of `config` (keyword arguments for LlamaConfig / OPTConfig)."""
    c = config
    eos = c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids)
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                  num_attention_heads=c.num_heads, max_position_embeddings=c.max_positions,
                  tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
                  eos_token_id=eos)
    if c.family == "llama" and c.model_type not in ("", "llama"):
        return _llama_like_to_hf(c, common)
    if c.family == "llama":
        return dict(model_type="llama", architectures=["LlamaForCausalLM"], **common,
                    intermediate_size=c.intermediate_size, num_key_value_heads=c.num_kv_heads,
                    head_dim=c.head_dim, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
                    rope_scaling=c.rope_scaling_dict, hidden_act=c.activation,
                    attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
    return dict(model_type="opt", architectures=["OPTForCausalLM"], **common, ffn_dim=c.intermediate_size,
                activation_function=c.activation, enable_bias=c.enable_bias,
                do_layer_norm_before=c.do_layer_norm_before,
                word_embed_proj_dim=c.word_embed_proj_dim or c.hidden_size)


def _llama_like_to_hf(c: DecoderConfig, common: dict) -> dict:
    """Mistral, Qwen2, Qwen3: their config.json (no sliding window: the engine attends to every position)."""
    name = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3"}[c.model_type]
    out = dict(model_type=c.model_type, architectures=[f"{name}ForCausalLM"], **common,
               intermediate_size=c.intermediate_size, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
               rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling_dict,
               hidden_act=c.activation, sliding_window=None, use_sliding_window=False)
    if c.model_type == "qwen3":
        out["attention_bias"] = c.attention_bias
    return out

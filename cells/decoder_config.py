"""The shape of a decoder-only language model (Llama or OPT style), its presets, and HF config.json.

One frozen, hashable dataclass describes both families; the fields that only one family reads
say so. The Llama family takes the models built like it (`model_type` llama, mistral, qwen2,
qwen3, phi3: their deltas are biases on q, k, v only, per-head norms of q and k, an explicit head
size, q | k | v and gate | up stored fused, sliding windows; and gemma, gemma2, gemma3_text, run
by cells/gemma.py: norms of (1 + w), scaled embeddings, GeGLU, norms after attention and MLP too,
`query_pre_attn_scalar`, soft-capped scores and logits, sliding windows on some layers with their
own RoPE base). `from_hf` / `to_hf` translate to and from a HF `config.json` dict, so that a checkpoint
directory can be loaded and the tests can build the matching `transformers` model.
"""
from dataclasses import dataclass, replace

FAMILIES = ("llama", "opt")
GEMMA = ("gemma", "gemma2", "gemma3_text")  # (cells/gemma.py)
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3", *GEMMA)  # model_types the Llama family runs
ACTIVATIONS = {"llama": ("silu", "gelu_pytorch_tanh"), "opt": ("relu", "gelu")}  # (Llama: gelu for Gemma's GeGLU)
ROPE_TYPES = ("linear", "llama3", "longrope", "yarn")  # besides none (cells/rope.py)
ROPE_ALIASES = {"su": "longrope"}  # (Phi-3's first configs)
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
    activation: str = "silu"  # "silu" (Llama, gated), "gelu_pytorch_tanh" (Gemma, gated); "relu" or "gelu" (OPT)
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
    # Llama family: Gemma's deltas (cells/gemma.py), and sliding windows (Mistral, Qwen2, Phi-3, Gemma)
    post_norms: bool = False  # Gemma 2, 3: the attention's and the MLP's outputs normed too (four norms a layer)
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its ** -0.5; None: head_dim's
    attn_softcap: float | None = None  # attention scores soft-capped, cap * tanh(s / cap) (Gemma 2)
    final_softcap: float | None = None  # the logits soft-capped the same way (Gemma 2, 3)
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window (0: none); (): no layer has one
    local_rope_theta: float | None = None  # Gemma 3: the RoPE base of the layers with a window (unscaled)
    rotary_dim: int | None = None  # Llama family: the head's leading dims RoPE rotates (Phi-3's partial_rotary_factor;
    # the weights' rows are laid out for it: cells/rotary_layout.py); None: all of them
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
        self._check_rope()
        if (self.model_type in GEMMA) != (self.activation == "gelu_pytorch_tanh") and self.family == "llama":
            raise ValueError(f"{self.model_type or 'llama'} with activation {self.activation!r}: Gemma's MLP is "
                             f"gelu_pytorch_tanh-gated, the others' silu-gated")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise ValueError(f"layer_windows {self.layer_windows}: one window >= 0 per layer ({self.num_layers}) expected")
        for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} {value!r}: a positive number or None expected")

    def _check_rope(self):
        kind = rope_type(self.rope_scaling_dict)  # raises on unsupported scaling
        rotated = self.rotary_dim or self.head_dim
        if self.rotary_dim is not None and (self.family != "llama" or rotated % 2 or not 2 <= rotated <= self.head_dim):
            raise ValueError(f"rotary_dim {self.rotary_dim}: an even number of a head's dims (<= head_dim "
                             f"{self.head_dim}) of a Llama-family model expected")
        if kind in ("longrope", "yarn") and self.model_type in GEMMA:
            raise ValueError(f"{kind} RoPE scaling with {self.model_type}: not supported (Gemma's RoPE takes "
                             f"linear scaling)")
        if kind == "yarn" and not (self.rope_scaling_dict.get("factor") or
                                   self.rope_scaling_dict.get("original_max_position_embeddings")):
            raise ValueError("yarn RoPE scaling: `factor` or `original_max_position_embeddings` expected")
        if kind == "longrope":
            scaling = self.rope_scaling_dict
            for key in ("short_factor", "long_factor"):
                if len(scaling.get(key) or ()) != rotated // 2:
                    raise ValueError(f"longrope {key}: {rotated // 2} factors (one per rotated pair) expected, got "
                                     f"{len(scaling.get(key) or ())}")
            if not scaling.get("original_max_position_embeddings"):
                raise ValueError("longrope: original_max_position_embeddings (where the long factors start) missing")

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
        if self.qkv_bias or self.qk_norm or self.post_norms or self.layer_windows or self.local_rope_theta \
                or self.query_pre_attn_scalar or self.attn_softcap or self.final_softcap:
            raise ValueError("qkv_bias, qk_norm, Gemma's fields and sliding windows are Llama-family fields")

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

    @property
    def is_gemma(self) -> bool:
        return self.model_type in GEMMA

    @property
    def attention_scale(self) -> float:
        """What q k^T is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def attention_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window where it binds (shorter than max_positions), else 0; () when none binds."""
        windows = tuple(w if w < self.max_positions else 0 for w in self.layer_windows)
        return windows if any(windows) else ()


def rope_type(scaling: dict | None) -> str:
    """"default" or one of ROPE_TYPES for a rope scaling dict (HF's `rope_type`, or legacy `type`; ROPE_ALIASES)."""
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    kind = ROPE_ALIASES.get(kind, kind)
    if kind != "default" and kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: none, {', '.join(ROPE_TYPES)}")
    return kind


def scaling_tuple(scaling: dict | None) -> tuple | None:
    """A HF rope scaling dict as DecoderConfig stores it: sorted pairs, `rope_type` key, no theta."""
    kind = rope_type(scaling)
    if kind == "default":
        return None
    pairs = {k: tuple(v) if isinstance(v, list) else v for k, v in scaling.items()
             if k not in ("type", "rope_type", "rope_theta", "partial_rotary_factor")}  # (lists: longrope's factors)
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
        final_norm, positions = h, 0
        norms = (4 if c.post_norms else 2) * h  # two RMSNorm weights per layer (Gemma 2, 3: four)
    else:
        mlp = 2 * h * c.intermediate_size + (c.intermediate_size + h) * c.has_mlp_bias
        final_norm, positions = 2 * h, (c.max_positions + OPT_POSITION_OFFSET) * h  # LayerNorms have biases
        norms = 2 * final_norm
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
    # The families' sizes (issue 33's chat runs), from each model's published config.json: their shapes, norms'
    # eps, RoPE bases, token ids and tying. max_positions 4,096 for all (the workload's contexts, as Llama-2-7B's;
    # the real ones take 8K-128K): Gemma 2's windows of 4,096 then never bind, so that the chat roofline's K/V
    # term, which counts every context position, is exact; Phi-3-mini-4k's window of 2,047 is left out for the
    # same reason (its layers attend to every position: more reads than the real model's, never fewer).
    "qwen2.5-7b": replace(_LLAMA2_7B, model_type="qwen2", qkv_bias=True, vocab_size=152064, hidden_size=3584,
                          intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4, norm_eps=1e-6,
                          rope_theta=1e6, bos_token_id=151643, eos_token_ids=(151643,)),  # Qwen/Qwen2.5-7B
    "mistral-7b": replace(_LLAMA2_7B, model_type="mistral", vocab_size=32768, intermediate_size=14336,
                          num_kv_heads=8, rope_theta=1e6),  # mistralai/Mistral-7B-v0.3 (no sliding window)
    "phi-3-mini": replace(_LLAMA2_7B, model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                          head_dim=96, eos_token_ids=(32000,)),  # microsoft/Phi-3-mini-4k-instruct (MHA)
    "gemma-2-9b": replace(_LLAMA2_7B, model_type="gemma2", activation="gelu_pytorch_tanh", vocab_size=256000,
                          hidden_size=3584, intermediate_size=14336, num_layers=42, num_heads=16, num_kv_heads=8,
                          head_dim=256, norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=2, eos_token_ids=(1,),
                          post_norms=True, query_pre_attn_scalar=256, attn_softcap=50.0, final_softcap=30.0,
                          layer_windows=(4096, 0) * 21),  # google/gemma-2-9b (windows on layers 0, 2, ...)
    "llama-3-8b": replace(_LLAMA2_7B, vocab_size=128256, intermediate_size=14336, num_kv_heads=8,
                          rope_theta=500000.0, bos_token_id=128000, eos_token_ids=(128001,)),  # meta-llama/Meta-Llama-3-8B
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
    """The DecoderConfig of a HF `config.json` dict (model_type one of LLAMA_LIKE, or opt)."""
    model_type = config.get("model_type")
    if model_type in LLAMA_LIKE:
        return _llama_from_hf(config)
    if model_type == "opt":
        return _opt_from_hf(config)
    if model_type == "gemma3":
        raise ValueError("model_type 'gemma3' (Gemma 3 with its vision tower, Gemma3ForConditionalGeneration): only "
                         "the text model is supported (gemma3_text, Gemma3ForCausalLM)")
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
    if model_type in GEMMA:
        return _gemma_from_hf(c)
    head_dim = c.get("head_dim") or c["hidden_size"] // num_heads
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and model_type != "phi3":
        raise ValueError(f"partial_rotary_factor {partial}: rotary embeddings over part of each head are supported "
                         f"for model_type phi3 (as transformers runs them), not {model_type}")
    if rope_type(rope) == "longrope" and "original_max_position_embeddings" not in rope:
        rope = dict(rope, original_max_position_embeddings=c.get("original_max_position_embeddings"))
    return DecoderConfig(
        model_type="" if model_type == "llama" else model_type, qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        family="llama", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=num_heads,
        num_kv_heads=c.get("num_key_value_heads") or num_heads,
        head_dim=head_dim, rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
        max_positions=c["max_position_embeddings"], norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        rope_scaling=scaling_tuple(rope), activation=c.get("hidden_act", "silu"),
        tie_word_embeddings=c.get("tie_word_embeddings", False), bos_token_id=c.get("bos_token_id"),
        eos_token_ids=_eos_tuple(c.get("eos_token_id")), attention_bias=c.get("attention_bias", False),
        mlp_bias=c.get("mlp_bias", False), layer_windows=layer_windows(c))


def layer_windows(c: dict) -> tuple[int, ...]:
    """Each layer's sliding window (0: none) as transformers runs the HF config `c`: every layer's
    for Mistral and Phi-3; for Qwen2/3 (with `use_sliding_window`) and Gemma 2/3, those that
    `layer_types` calls "sliding_attention", or by default the layers from `max_window_layers` on
    (Qwen), alternate layers from the first (Gemma 2), all but every `sliding_window_pattern`-th
    (Gemma 3, 6). () when none has one."""
    model_type, n = c["model_type"], c["num_hidden_layers"]
    window = c.get("sliding_window", 4096 if model_type in ("gemma2", "gemma3_text") else None)  # (their default)
    if model_type in ("qwen2", "qwen3") and not c.get("use_sliding_window", False):
        window = None
    if not window or model_type in ("llama", "gemma"):
        return ()
    if model_type in ("mistral", "phi3"):
        return (window,) * n
    types = c.get("layer_types") or [_default_layer_type(c, i) for i in range(n)]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != n:
        raise ValueError(f"layer_types {types}: {n} of 'sliding_attention' or 'full_attention' expected")
    return tuple(window if kind == "sliding_attention" else 0 for kind in types)


def _default_layer_type(c: dict, i: int) -> str:
    if c["model_type"] == "gemma2":
        sliding = i % 2 == 0
    elif c["model_type"] == "gemma3_text":
        sliding = (i + 1) % c.get("sliding_window_pattern", 6) != 0
    else:  # (Qwen)
        sliding = i >= c.get("max_window_layers", 28)  # (transformers' default)
    return "sliding_attention" if sliding else "full_attention"


def _gemma_from_hf(c: dict) -> DecoderConfig:
    """Gemma, Gemma 2, Gemma 3 (text): RoPE bases by layer type (Gemma 3's sliding layers: their own,
    unscaled), GeGLU, soft caps, the attention's scalar (a key left out: transformers' default);
    refused: what transformers would run otherwise."""
    model_type, num_heads = c["model_type"], c["num_attention_heads"]
    if c.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: only causal attention is served")
    if model_type == "gemma3_text" and c.get("attn_logit_softcapping") is not None:
        raise ValueError(f"attn_logit_softcapping {c['attn_logit_softcapping']} on gemma3_text: transformers' "
                         f"Gemma 3 ignores it, so its meaning is unclear; None expected")
    activation = c.get("hidden_activation") or c.get("hidden_act", "gelu_pytorch_tanh")
    if model_type == "gemma" and activation == "gelu":  # (the first releases' legacy name, as transformers reads it)
        activation = "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {activation!r}: Gemma's gelu_pytorch_tanh expected")
    global_rope, local_rope = _gemma_ropes(c)
    if rope_type(local_rope) != "default":
        raise ValueError(f"rope_parameters of sliding_attention {local_rope}: scaled local RoPE is not supported")
    return DecoderConfig(
        family="llama", model_type=model_type, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=num_heads,
        num_kv_heads=c.get("num_key_value_heads") or num_heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // num_heads, max_positions=c["max_position_embeddings"],
        norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(global_rope["rope_theta"]),
        rope_scaling=scaling_tuple(global_rope), activation=activation,
        tie_word_embeddings=c.get("tie_word_embeddings", True), bos_token_id=c.get("bos_token_id"),
        eos_token_ids=_eos_tuple(c.get("eos_token_id")), attention_bias=c.get("attention_bias", False),
        qk_norm=model_type == "gemma3_text", post_norms=model_type != "gemma",
        query_pre_attn_scalar=c.get("query_pre_attn_scalar", 256) if model_type != "gemma" else None,
        attn_softcap=c.get("attn_logit_softcapping", 50.0) if model_type == "gemma2" else None,
        final_softcap=c.get("final_logit_softcapping", 30.0 if model_type == "gemma2" else None),
        layer_windows=layer_windows(c),
        local_rope_theta=float(local_rope["rope_theta"]) if model_type == "gemma3_text" else None)


def _gemma_ropes(c: dict) -> tuple[dict, dict]:
    """(the global layers' RoPE dict, the sliding layers'), each with its rope_theta: transformers 5
    writes rope_parameters (per layer type for Gemma 3); 4.x rope_theta, rope_scaling and Gemma 3's
    rope_local_base_freq (defaults: 10^6 global, 10^4 local for Gemma 3; 10^4 before)."""
    params = c.get("rope_parameters") or {}
    if c["model_type"] != "gemma3_text":
        rope = dict(params or c.get("rope_scaling") or {})
        rope.setdefault("rope_theta", c.get("rope_theta", 10000.0))
        return rope, rope
    if "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    else:
        full, local = dict(c.get("rope_scaling") or {}), {}
        full.setdefault("rope_theta", c.get("rope_theta", 1e6))
        local["rope_theta"] = c.get("rope_local_base_freq", 1e4)
    full.setdefault("rope_theta", 1e6)
    local.setdefault("rope_theta", 1e4)
    return full, local


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
    """Mistral, Qwen2, Qwen3, Phi-3 (without sliding windows) and Gemma 2: their config.json."""
    names = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3", "gemma2": "Gemma2"}
    if c.model_type not in names or (c.layer_windows and c.model_type != "gemma2"):
        raise ValueError(f"to_hf writes no {c.model_type} config, nor sliding windows but Gemma 2's (tests save "
                         f"those from transformers' own config classes)")
    name = names[c.model_type]
    out = dict(model_type=c.model_type, architectures=[f"{name}ForCausalLM"], **common,
               intermediate_size=c.intermediate_size, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
               rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling_dict)
    if c.model_type == "gemma2":
        return dict(out, hidden_activation=c.activation, query_pre_attn_scalar=c.query_pre_attn_scalar,
                    attn_logit_softcapping=c.attn_softcap, final_logit_softcapping=c.final_softcap,
                    sliding_window=max(c.layer_windows, default=None) or None,
                    layer_types=[("sliding" if w else "full") + "_attention" for w in c.layer_windows] or None)
    out.update(hidden_act=c.activation, sliding_window=None, use_sliding_window=False)
    if c.rotary_dim is not None:
        out["partial_rotary_factor"] = c.rotary_dim / c.head_dim
    if c.model_type == "qwen3":
        out["attention_bias"] = c.attention_bias
    return out

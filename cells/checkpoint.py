"""Loading a HF-style checkpoint directory: config.json, *.safetensors (one file or sharded), tokenizer.json.

HF names map onto ours per layer (`HF_LAYER_NAMES`) and for the rest (`HF_MODEL_NAMES`); q/k/v
and gate/up are concatenated, in that order, into our fused projections. Tensors the model does
not use (rotary inv_freq, a tied lm_head.weight) are ignored. The model is built on the meta
device and each tensor is read, converted and placed once, so a 13B model needs no spare copy.
"""
import json
from pathlib import Path

import torch

from batchmaker.cells.decoder import DecoderLM, empty_decoder, materialize
from batchmaker.cells.decoder_config import DecoderConfig, from_hf
from batchmaker.cells.rotary_layout import to_rotary_layout

_QKV = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]

# our name inside layer N -> HF module names inside HF layer N (concatenated along dim 0)
HF_LAYER_NAMES = {
    "llama": {
        "attn_norm": ["input_layernorm"],
        "attn.qkv_proj": _QKV,
        "attn.o_proj": ["self_attn.o_proj"],
        "attn.q_norm": ["self_attn.q_norm"],  # (Qwen3)
        "attn.k_norm": ["self_attn.k_norm"],
        "mlp_norm": ["post_attention_layernorm"],
        "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
        "mlp.down_proj": ["mlp.down_proj"],
    },
    "opt": {
        "attn_norm": ["self_attn_layer_norm"],
        "attn.qkv_proj": _QKV,
        "attn.o_proj": ["self_attn.out_proj"],
        "mlp_norm": ["final_layer_norm"],
        "mlp.fc1": ["fc1"],
        "mlp.fc2": ["fc2"],
    },
}
HF_LAYER_NAMES["phi3"] = dict(HF_LAYER_NAMES["llama"], **{"attn.qkv_proj": ["self_attn.qkv_proj"],  # (stored fused)
                                                            "mlp.gate_up_proj": ["mlp.gate_up_proj"]})
HF_LAYER_NAMES["gemma2"] = HF_LAYER_NAMES["gemma3_text"] = dict(  # (four norms: the MLP's is "pre_feedforward")
    HF_LAYER_NAMES["llama"], mlp_norm=["pre_feedforward_layernorm"], post_attn_norm=["post_attention_layernorm"],
    post_mlp_norm=["post_feedforward_layernorm"])
HF_LAYER_PREFIX = {"llama": "model.layers.{}.", "opt": "model.decoder.layers.{}."}
HF_MODEL_NAMES = {
    "llama": {"embed_tokens": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"},
    "opt": {"embed_tokens": "model.decoder.embed_tokens", "embed_positions": "model.decoder.embed_positions",
            "norm": "model.decoder.final_layer_norm", "lm_head": "lm_head"},
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def hf_names(config: DecoderConfig, name: str) -> list[str]:
    """The HF tensor names that make up our parameter `name` (e.g. layers.0.attn.qkv_proj.weight)."""
    family = config.family
    module, kind = name.rsplit(".", 1)
    if module.startswith("layers."):
        _, index, inner = module.split(".", 2)
        prefix = HF_LAYER_PREFIX[family].format(index)
        return [f"{prefix}{hf}.{kind}" for hf in HF_LAYER_NAMES.get(config.model_type, HF_LAYER_NAMES[family])[inner]]
    return [f"{HF_MODEL_NAMES[family][module]}.{kind}"]


def read_config(path: str | Path) -> tuple[DecoderConfig, dict]:
    """The DecoderConfig of directory `path` and its raw config.json dict."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: no config.json (expected a HF-style checkpoint directory)")
    raw = json.loads(file.read_text())
    try:
        return from_hf(raw), raw
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


class SafetensorsDirectory:
    """Tensors by name across a directory's safetensors files, opened lazily, read one at a time."""

    def __init__(self, path: Path):
        try:
            from safetensors import safe_open
        except ImportError:
            raise ImportError("loading checkpoints needs safetensors: pip install safetensors") from None
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.where = {name: path / file for name, file in weight_map.items()}
            self.source = index  # named in errors
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ValueError(f"{path}: no *.safetensors files")
            self.where = {name: file for file in files for name in safe_open(file, "pt").keys()}
            self.source = files[0] if len(files) == 1 else path
        self.handles = {file: safe_open(file, "pt") for file in set(self.where.values())}

    def find(self, name: str) -> str | None:
        """`name`, or the same name without "model." (OPT checkpoints saved from OPTModel)."""
        for candidate in (name, name.removeprefix("model.")):
            if candidate in self.where:
                return candidate
        return None

    def slice(self, name: str):
        return self.handles[self.where[name]].get_slice(name)


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None, device="cpu", cut=None) -> DecoderLM:
    """The model stored in HF-style directory `path`, with its weights in `dtype` on `device`;
    with a `cut` (cells/tensor_parallel.TensorCut, cells/pipeline.StageCut), one rank's part of
    it, read as slices of the stored tensors: a rank reads only what it holds, and the host
    holds one tensor at a time.

    dtype None keeps the checkpoint's: config.json's torch_dtype (or dtype), else the stored
    embedding's. Raises ValueError naming the file and tensor for a missing config.json, an
    unsupported model_type, and missing or misshapen tensors.
    """
    path = Path(path)
    config, raw = read_config(path)
    files = SafetensorsDirectory(path)
    whole = empty_decoder(config)
    model = whole if cut is None else empty_decoder(cut.config(config))
    dtype = dtype or DTYPES.get(raw.get("torch_dtype") or raw.get("dtype"))
    state = {}
    for name, param in whole.named_parameters():
        sources = hf_names(config, name)
        stored = [_open(files, hf, name) for hf in sources]
        _check_shapes(files, name, param.shape, sources, [tuple(s.get_shape()) for s in stored])
        dtype = dtype or _stored_dtype(stored[0])  # (the embedding's: it comes first)
        local = name if cut is None else cut.take(name)
        if local is None:  # (not this rank's: never read)
            continue
        piece = cut.slicing(name, config) if cut is not None else None
        if piece is not None and len(stored) < len(piece.parts):  # (q | k | v stored fused: read it, cut it)
            state[local] = piece.cut(stored[0][:].to(device=device, dtype=dtype))
            continue
        parts = [(s[:] if piece is None else piece.cut_part(i, s)).to(device=device, dtype=dtype)
                 for i, s in enumerate(stored)]
        state[local] = (parts[0] if len(parts) == 1 else torch.cat(parts)) if piece is None else piece.join(parts)
    for local, tensor in state.items():  # (q's and k's rows for partial rotary: cells/rotary_layout.py)
        state[local] = to_rotary_layout(model.config, local, tensor)
    return materialize(model, state, device)


def _stored_dtype(stored) -> torch.dtype:
    """A stored tensor's dtype, as torch names it."""
    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[stored.get_dtype()]


def _check_shapes(files: SafetensorsDirectory, name: str, shape: tuple, sources: list[str], stored: list[tuple]):
    joined = (sum(s[0] for s in stored), *stored[0][1:])
    if joined != tuple(shape) or any(s[1:] != tuple(shape[1:]) for s in stored):
        shapes = ", ".join(f"{hf} {s}" for hf, s in zip(sources, stored))
        raise ValueError(f"{files.source}: unexpected shape: {shapes}; config.json makes {name} {tuple(shape)}")


def _open(files: SafetensorsDirectory, hf_name: str, ours: str):
    """A stored tensor, not read yet (a safetensors slice: indexing it reads just those rows or columns)."""
    found = files.find(hf_name)
    if found is None:
        raise ValueError(f"{files.source}: missing tensor {hf_name!r} (needed for {ours})")
    return files.slice(found)


def load_tokenizer(path: str | Path):
    """The directory's tokenizer.json as a `tokenizers.Tokenizer`, or None when there is none."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError("loading tokenizer.json needs tokenizers: pip install tokenizers") from None
    return Tokenizer.from_file(str(file))

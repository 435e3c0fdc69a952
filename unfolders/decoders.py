"""The decoder-Transformer models: "llama" (Llama-style: RMSNorm, RoPE, SwiGLU, grouped-query
attention; and the checkpoints built like it: Mistral, Qwen2/3, Phi-3, Gemma 1-3) and "opt"
(OPT-style: LayerNorm, learned positions). Each is one DecoderCell served by a Generate form
(batchmaker/generation.py says what a request holds and what comes back). What a GPU cannot run
yet (head sizes past 256) is refused when the model is built.

Weights: seeded random ones of a named preset (cells/decoder_config.py: the papers' Llama-2-7B,
Llama-2-13B, OPT-13B, the families' sizes (Qwen2.5-7B, Mistral-7B, Phi-3-mini, Gemma-2-9B,
Llama-3-8B), and tiny ones for tests and the demo), or a HF-style checkpoint directory
(`config.json` + `*.safetensors`; with a `tokenizer.json`, requests may send text).
"""
import torch

from batchmaker.cells.decoder_cell import DecoderCell, KVSettings
from batchmaker.cells.pipeline import check_stages
from batchmaker.cells.tensor_parallel import check_rank_devices, check_shardable
from batchmaker.core.sequences import MAX_STOPS
from batchmaker.forms import Generate
from batchmaker.kernels.paged_attention import MAX_HEAD_DIM
from batchmaker.model import Model
from batchmaker.registry import register_model
from batchmaker.unfolders.common import as_dtype, power_of_two_sizes

GPU_MAX_TOKENS, CPU_MAX_TOKENS = 2048, 256


def decoder_model(name: str, family: str, preset: str, checkpoint: str | None, seed: int, dtype, device: str,
                  max_tokens: int | None, max_seqs: int, block_size: int, num_blocks: int | None,
                  max_new_tokens: int, conversations: dict, tensor_parallel: int = 1,
                  pipeline_parallel: int = 1) -> Model:
    from batchmaker.cells.decoder_source import DecoderSource
    config, tokenizer = _config(name, family, preset, checkpoint, device, tensor_parallel, pipeline_parallel)
    dtype = None if dtype is None else as_dtype(dtype)
    source = DecoderSource(config, checkpoint, seed, dtype if checkpoint is not None else dtype or torch.float32)
    ttl = conversations.pop("conversation_ttl")
    kv = KVSettings(block_size=block_size, max_seqs=max_seqs, num_blocks=num_blocks, **conversations)
    cell = DecoderCell(None, kv, tensor_parallel, source, pipeline_parallel)
    cell.lm = source.build(device, cell.cut(0))  # (rank 0's part: the other ranks build theirs)
    if max_tokens is None:  # a GPU iteration reads every weight once: more tokens each (bench/results/README.md)
        max_tokens = GPU_MAX_TOKENS if torch.device(device).type == "cuda" else CPU_MAX_TOKENS
    cell.tokenizer = tokenizer
    vocab, limit = config.vocab_size, config.max_positions - 1
    prompt = {"prompt": f"str: the prompt as text (instead of tokens), at most {limit} tokens"} if tokenizer else {}
    return Model(
        name=name,
        cells={"decoder": cell},
        unfold=Generate("decoder", max_new_tokens=max_new_tokens, conversation_ttl=ttl),
        batch_sizes={"decoder": power_of_two_sizes(max_tokens)},
        input_schema={
            "tokens": f"list[int]: prompt token ids in [0, {vocab}), 1 to {limit} of them",
            **prompt,
            "max_new_tokens": f"int >= 0, default {max_new_tokens}",
            "temperature": "float >= 0, default 0 (greedy)", "top_k": "int >= 0 (0: off)",
            "top_p": "float in (0, 1], default 1", "seed": "int: reproducible sampling",
            "stop_token_ids": f"list[int], at most {MAX_STOPS - len(config.eos_token_ids)}, besides EOS {list(config.eos_token_ids)}",
            "ignore_eos": "bool, default false",
            "conversation": "true: start a conversation with this turn (the reply names it); its id: the next "
                            "turn, after everything said so far (kept in the KV cache across turns)",
            "end": "true, with a conversation id and nothing else: end that conversation",
        },
        streamed_outputs=("tokens",),
    )


def _config(name: str, family: str, preset: str, checkpoint: str | None, device: str, tensor_parallel: int,
            pipeline_parallel: int):
    """The whole model's DecoderConfig and tokenizer, refused here (a typed error when the model is
    built) if this engine cannot run it on `device` over the ranks asked."""
    from batchmaker.cells.checkpoint import load_tokenizer, read_config
    from batchmaker.cells.decoder_config import PRESETS
    if checkpoint is not None:
        config, tokenizer = read_config(checkpoint)[0], load_tokenizer(checkpoint)
    elif preset in PRESETS:
        config, tokenizer = PRESETS[preset], None
    else:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    if config.family != family:
        raise ValueError(f"model {name!r} serves {family} decoders; {checkpoint or preset} is {config.family}")
    if torch.device(device).type == "cuda":
        check_gpu_attention(config, checkpoint or preset)
    check_shardable(config, tensor_parallel)
    check_stages(config, pipeline_parallel)
    check_rank_devices(device, tensor_parallel, pipeline_parallel)
    return config, tokenizer


def check_gpu_attention(config, source: str) -> None:
    """A typed refusal, when the model is built for a GPU, of what the attention kernels lack: a head
    past MAX_HEAD_DIM (the CPU's twin takes any). Sliding windows and soft-capped scores they run."""
    if config.head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {config.head_dim} ({source}): the GPU attention kernels take head sizes up "
                         f"to {MAX_HEAD_DIM} (on a CPU any head size runs)")


@register_model("llama")
def llama_model(preset: str = "tiny-llama", checkpoint: str | None = None, seed: int = 0,
                dtype: torch.dtype | str | None = None, device: str = "cpu", max_tokens: int | None = None,
                max_seqs: int = 64, block_size: int = 16, num_blocks: int | None = None,
                max_new_tokens: int = 64, host_bytes: int | None = None, eviction: str = "value",
                chunk_tokens: int = 32, conversation_ttl: float = 3600.0, reserve: float = 0.1,
                swap_threshold: float = 0.25, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                prefix_caching: bool = False, skinny_routes: str = "static", one_shot: bool = True) -> Model:
    """max_tokens: the token budget of one iteration (prompt chunks and decodes together); by
    default 2,048 on a GPU (Llama-2-7B chat on an H200: 2,034 tok/s against 1,505 at 512, in one
    lease) and 256 on a CPU. Conversations (core/conversations.py): host_bytes, the host tier of
    the KV cache (default 8 GiB beside a GPU, 32 MiB beside a CPU, over all ranks of a parallel model;
    0: the GPU tier only);
    eviction "value" (Pensieve) or "lru"; chunk_tokens, the unit of eviction; conversation_ttl,
    seconds a conversation is kept idle; swap_threshold, the fraction of free blocks below which
    chunks are copied to the host ahead of time. reserve: the fraction of blocks new requests leave
    free for running decodes. tensor_parallel: ranks the model is split over (processes the engine
    starts: rank r on the r-th CUDA device after `device`'s, or on the CPU). pipeline_parallel:
    stages the layers are split into, a process each (ORCA's pipeline: stage r on the r-th CUDA
    device after `device`'s, or on the CPU; with tensor_parallel N, each stage is N ranks: stage s on
    the N devices from the (s N)-th after `device`'s). prefix_caching: a
    request without a conversation keeps its context like one, and a later request whose prompt
    continues it exactly (a client resending its history)
    takes it; a prompt's leading whole blocks that any request computed before are read, not
    computed (a shared system prompt's). skinny_routes: how few-token projections pick their kernel on a
    GPU: "static" (a table measured on an H200), "measure" (on the device at start-up, cached) or "off"
    (cuBLAS); one_shot: a split decoder's one-shot all-reduce where it wins (False: NCCL only)."""
    return decoder_model("llama", "llama", preset, checkpoint, seed, dtype, device, max_tokens, max_seqs,
                         block_size, num_blocks, max_new_tokens,
                         dict(host_bytes=host_bytes, eviction=eviction, chunk_tokens=chunk_tokens,
                              conversation_ttl=conversation_ttl, reserve=reserve, swap_threshold=swap_threshold,
                              prefix_caching=prefix_caching, skinny_routes=skinny_routes, one_shot=one_shot),
                         tensor_parallel, pipeline_parallel)


@register_model("opt")
def opt_model(preset: str = "tiny-opt", checkpoint: str | None = None, seed: int = 0,
              dtype: torch.dtype | str | None = None, device: str = "cpu", max_tokens: int | None = None,
              max_seqs: int = 64, block_size: int = 16, num_blocks: int | None = None,
              max_new_tokens: int = 64, host_bytes: int | None = None, eviction: str = "value",
              chunk_tokens: int = 32, conversation_ttl: float = 3600.0, reserve: float = 0.1,
              swap_threshold: float = 0.25, tensor_parallel: int = 1, pipeline_parallel: int = 1,
              prefix_caching: bool = False, skinny_routes: str = "static", one_shot: bool = True) -> Model:
    return decoder_model("opt", "opt", preset, checkpoint, seed, dtype, device, max_tokens, max_seqs,
                         block_size, num_blocks, max_new_tokens,
                         dict(host_bytes=host_bytes, eviction=eviction, chunk_tokens=chunk_tokens,
                              conversation_ttl=conversation_ttl, reserve=reserve, swap_threshold=swap_threshold,
                              prefix_caching=prefix_caching, skinny_routes=skinny_routes, one_shot=one_shot),
                         tensor_parallel, pipeline_parallel)

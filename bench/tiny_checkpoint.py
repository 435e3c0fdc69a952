"""A tiny HF Llama checkpoint with a real tokenizer and a chat template, built offline in seconds:
what the HTTP tests (tests/test_http_api.py) and bench/http_overhead.py serve, and a way to try
`batchmaker serve --http` without downloading a model.

    python bench/tiny_checkpoint.py /tmp/tiny-chat
    batchmaker serve --models llama --set checkpoint=/tmp/tiny-chat --http 127.0.0.1:8000

The tokenizer is a byte-level BPE (`tokenizers`) trained on the repository's README.md, so text
is real text and a non-ASCII character may take several tokens; the weights are transformers'
seeded random initialization of a 2-layer Llama (`save_pretrained`), so the text it writes is
noise. The chat template is ChatML-like and refuses a role it does not know (raise_exception).
"""
import json
import math
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(vocab_size: int = 480, whole_characters: bool = False):
    """A byte-level BPE over README.md's lines; BOS is added to encoded text (not to chat prompts,
    whose template writes it). With `whole_characters`, over the lines' ASCII only, from an ASCII
    alphabet: every token but the special ones is whole characters, so a stream of random-weight
    samples adds text at every token, as a trained model's mostly does (with all 256 bytes, 27% of
    the ids are a byte inside a multi-byte character and add no text alone: a text stream then
    skips an iteration that often, which doubles its gap p90 whatever the server)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet, lines = pre_tokenizers.ByteLevel.alphabet(), README.read_text().splitlines()
    if whole_characters:
        alphabet = [_byte_char(b) for b in (9, 10, *range(32, 127))]
        lines = [line.encode("ascii", "ignore").decode() for line in lines]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=alphabet)
    tokenizer.train_from_iterator(lines, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    return tokenizer


def _byte_char(byte: int) -> str:
    """The character byte-level BPE writes for `byte` (GPT-2's map: printable Latin-1 as itself, the
    rest from U+0100 on in byte order)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if byte in printable:
        return chr(byte)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(byte))


def save_tiny_chat_model(path, seed: int = 0, chat_template: str | None = CHAT_TEMPLATE,
                         max_positions: int = 256, whole_characters: bool = False) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json (with
    `chat_template` unless None) into `path`; returns it (`whole_characters`: train_tokenizer's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(whole_characters=whole_characters)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL}
    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, bos_token_id=ids["<s>"],
                         eos_token_id=[ids["</s>"], ids["<|im_end|>"]], tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                        "unk_token": "<unk>", "model_max_length": max_positions}
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def save_sized_chat_model(path, preset: str, device: str = "cuda:0", seed: int = 0,
                          shard_bytes: int = 4 << 30) -> Path:
    """A checkpoint of `preset`'s layers (cells/decoder_config.py: llama-2-7b, ...) with seeded random
    bf16 weights drawn on `device`, and the tiny model's tokenizer and chat template: what a GPU
    measurement of the HTTP path serves (the vocabulary is the tokenizer's 480 tokens, not the
    preset's: its embedding and head are ~0.1% of a 7B's weight bytes instead of ~4%; its tokens
    whole characters, so that text streams and token streams tick alike). Written as
    safetensors shards with an index, as HF writes large models; no transformers model is built."""
    import torch
    from safetensors.torch import save_file

    from batchmaker.cells.decoder_config import PRESETS

    path = save_tiny_chat_model(path, seed=seed, whole_characters=True)  # (the tokenizer files and a config to overwrite)
    for old in path.glob("*.safetensors"):
        old.unlink()
    shape = PRESETS[preset]
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                  num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                  num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                  max_position_embeddings=shape.max_positions,
                  torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    h, inter, kv = shape.hidden_size, shape.intermediate_size, shape.num_kv_heads * shape.head_dim
    vocab = config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(shape.num_layers):
        layer = f"model.layers.{i}."
        shapes.update({layer + "self_attn.q_proj.weight": (shape.num_heads * shape.head_dim, h),
                       layer + "self_attn.k_proj.weight": (kv, h), layer + "self_attn.v_proj.weight": (kv, h),
                       layer + "self_attn.o_proj.weight": (h, shape.num_heads * shape.head_dim),
                       layer + "mlp.gate_proj.weight": (inter, h), layer + "mlp.up_proj.weight": (inter, h),
                       layer + "mlp.down_proj.weight": (h, inter), layer + "input_layernorm.weight": (h,),
                       layer + "post_attention_layernorm.weight": (h,)})
    generator = torch.Generator(device).manual_seed(seed)
    shard, size, weight_map, files = {}, 0, {}, []

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        files.append(name)

    for name, dims in shapes.items():
        if len(dims) == 1:
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(dims, generator=generator, device=device) * dims[1] ** -0.5).to(torch.bfloat16).cpu()
        shard[name] = tensor
        size += tensor.nbytes
        if size >= shard_bytes:
            flush()
            shard, size = {}, 0
    if shard:
        flush()
    index = {"metadata": {"total_size": sum(math.prod(d) * 2 for d in shapes.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python bench/tiny_checkpoint.py DIR [PRESET]  (a PRESET's layers: random bf16 on cuda:0)")
    print(save_tiny_chat_model(sys.argv[1]) if len(sys.argv) == 2 else save_sized_chat_model(sys.argv[1], sys.argv[2]))

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


def train_tokenizer(vocab_size: int = 480):
    """A byte-level BPE over README.md's lines; BOS is added to encoded text (not to chat prompts,
    whose template writes it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(README.read_text().splitlines(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    return tokenizer


def save_tiny_chat_model(path, seed: int = 0, chat_template: str | None = CHAT_TEMPLATE,
                         max_positions: int = 256) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json (with
    `chat_template` unless None) into `path`; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/tiny_checkpoint.py DIR")
    print(save_tiny_chat_model(sys.argv[1]))

"""bench/tiny_checkpoint.py's sized checkpoint (what a GPU measurement of the HTTP path serves): a
preset's layers as sharded safetensors with an index, read alike by the engine and by HF
transformers (greedy tokens equal, fp32, on the CPU), with the tiny model's tokenizer."""
import json

import pytest
import torch

tiny_checkpoint = pytest.importorskip("bench.tiny_checkpoint")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")


def test_a_sized_checkpoint_is_sharded_and_read_alike_by_the_engine_and_hf(tmp_path):
    from batchmaker import Engine, build_model
    path = tiny_checkpoint.save_sized_chat_model(tmp_path / "small", "small-llama", device="cpu", shard_bytes=8 << 20)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and (path / "tokenizer.json").is_file()
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (512, 8, 64)
    prompt = [1, 5, 9, 20, 33]
    with Engine([build_model("llama", checkpoint=str(path), dtype="float32")]) as engine:
        ours = engine.infer("llama", {"tokens": prompt, "max_new_tokens": 6, "ignore_eos": True}, timeout=120)["tokens"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert ours == out[0, len(prompt):].tolist()


def test_the_sized_checkpoints_tokens_are_whole_characters_and_the_tests_are_not():
    """The GPU measurement's tokenizer adds text at every token but the special ones (a text stream
    ticks with the tokens); the tests' keeps byte tokens, so that streaming whole UTF-8 is tested."""
    def ids_without_whole_text(tokenizer):
        texts = [tokenizer.decode([i], skip_special_tokens=True) for i in range(tokenizer.get_vocab_size())]
        return sum(t == "" for t in texts), sum("\ufffd" in t for t in texts)
    assert ids_without_whole_text(tiny_checkpoint.train_tokenizer(whole_characters=True)) == \
        (len(tiny_checkpoint.SPECIAL), 0)
    assert ids_without_whole_text(tiny_checkpoint.train_tokenizer())[1] >= 100

"""`batchmaker generate` (serving/generate.py): prompts from a JSON-lines file, one line per
finished prompt; a run stopped early (--max-prompts, or killed mid-line) and resumed writes every
id exactly once, with the tokens of one uninterrupted run; the offloading executor and the engine
give the same tokens (with a share of the weights kept on the device too, and with the CPU attending
over the host cache); a bad input line is one error naming it."""
import json
import random
from pathlib import Path

import pytest

from batchmaker.serving.cli import main

OFFLOAD = ["--set", "offload=weights+cache+hidden", "--set", "gpu_batch=2", "--set", "num_batches=2"]


def write_prompts(path, count: int = 9) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(count):
            line = {"id": f"p{i}" if i % 2 else i, "tokens": [rng.randrange(3, 512) for _ in range(rng.randint(1, 9))]}
            if i % 3:
                line["max_new_tokens"] = rng.randint(1, 7)
            f.write(json.dumps(line) + "\n")


def results(path) -> dict:
    lines = [json.loads(line) for line in open(path)]
    ids = [line["id"] for line in lines]
    assert len(ids) == len(set(ids)), "an id written twice"
    return {line["id"]: (line["tokens"], line["finish_reason"]) for line in lines}


def generate(tmp_path, output: str, *extra: str) -> int:
    return main(["generate", "--models", "llama", "--input", str(tmp_path / "in.jsonl"), "--output",
                 str(tmp_path / output), "--max-new-tokens", "5", *extra])


@pytest.fixture
def whole(tmp_path):
    """One uninterrupted offloaded run's results."""
    write_prompts(tmp_path / "in.jsonl")
    assert generate(tmp_path, "whole.jsonl", *OFFLOAD) == 0
    return results(tmp_path / "whole.jsonl")


def test_the_offloaded_run_equals_the_engine(tmp_path, whole):
    assert generate(tmp_path, "engine.jsonl") == 0
    assert results(tmp_path / "engine.jsonl") == whole
    assert len(whole) == 9 and all(1 <= len(tokens) <= 7 for tokens, _ in whole.values())


@pytest.mark.parametrize("offload", [True, False], ids=["offloaded", "engine"])
def test_a_run_stopped_and_resumed_writes_every_id_once_with_the_same_tokens(tmp_path, whole, offload, capsys):
    extra = OFFLOAD if offload else []
    assert generate(tmp_path, "out.jsonl", *extra, "--max-prompts", "3") == 0
    assert len(results(tmp_path / "out.jsonl")) == 3
    with open(tmp_path / "out.jsonl", "a") as f:
        f.write('{"id": "p5", "tok')  # (killed while writing a line)
    assert generate(tmp_path, "out.jsonl", *extra, "--max-prompts", "4") == 0
    assert generate(tmp_path, "out.jsonl", *extra) == 0
    assert results(tmp_path / "out.jsonl") == whole
    assert "tokens/s" in capsys.readouterr().err and generate(tmp_path, "out.jsonl", *extra) == 0  # (nothing left)
    assert results(tmp_path / "out.jsonl") == whole


def test_the_cpus_attention_gives_the_same_results(tmp_path, whole):
    cpu_attention = ["--set", "offload=weights+cache+hidden+cpu_attention"] + OFFLOAD[2:]
    assert generate(tmp_path, "cpu.jsonl", *cpu_attention) == 0
    assert results(tmp_path / "cpu.jsonl") == whole


def test_auto_prints_its_policy(tmp_path, whole, capsys):
    assert generate(tmp_path, "auto.jsonl", "--set", "llama.offload=auto", "--set", "gpu_memory=64MiB") == 0
    assert "offload policy: gpu_batch=" in capsys.readouterr().err
    assert results(tmp_path / "auto.jsonl") == whole


def test_a_share_of_resident_weights_gives_the_same_tokens(tmp_path, whole):
    assert generate(tmp_path, "share.jsonl", *OFFLOAD, "--set", "weights_gpu=0.5") == 0
    assert results(tmp_path / "share.jsonl") == whole


def test_compressed_weights_run_and_cut_at_each_length(tmp_path, whole):
    assert generate(tmp_path, "4bit.jsonl", *OFFLOAD, "--set", "compress=weights") == 0
    compressed = results(tmp_path / "4bit.jsonl")
    assert compressed.keys() == whole.keys()
    assert all(len(compressed[i][0]) == len(whole[i][0]) or compressed[i][1] == "stop" for i in whole)
    assert generate(tmp_path, "fused.jsonl", *OFFLOAD, "--set", "compress=weights", "--set", "dequant=fused") == 0
    assert results(tmp_path / "fused.jsonl") == compressed  # (on the CPU the fused path's twin: the same products)
    assert generate(tmp_path, "kv.jsonl", *OFFLOAD, "--set", "compress=kv") == 0
    assert results(tmp_path / "kv.jsonl").keys() == whole.keys()


def test_compressed_weights_without_offloading_give_the_offloaded_tokens(tmp_path, capsys):
    """compress=weights alone: every layer resident as 4-bit codes (exec/offload_resident.py); on the
    CPU the same products as the offloaded 4-bit run. A 4-bit cache needs the cache on the host."""
    write_prompts(tmp_path / "in.jsonl")
    assert generate(tmp_path, "offloaded.jsonl", *OFFLOAD, "--set", "compress=weights") == 0
    assert generate(tmp_path, "resident.jsonl", "--set", "compress=weights") == 0
    assert generate(tmp_path, "none.jsonl", "--set", "offload=none", "--set", "compress=weights") == 0
    assert results(tmp_path / "resident.jsonl") == results(tmp_path / "offloaded.jsonl") == \
        results(tmp_path / "none.jsonl")
    assert generate(tmp_path, "kv.jsonl", "--set", "compress=kv") == 2
    assert "a 4-bit cache on the device is not built" in capsys.readouterr().err


@pytest.mark.parametrize("line, message", [
    ('{"tokens": [1]}', "in.jsonl:2: id must be"),
    ('{"id": 7, "tokens": []}', "in.jsonl:2: tokens must be"),
    ('{"id": 7, "tokens": [1], "max_new_tokens": 0}', "max_new_tokens must be"),
    ('{"id": 0, "tokens": [1]}', "id 0 appears twice"),
    ('not json', "in.jsonl:2: expected a JSON object"),
])
def test_a_bad_line_is_one_error_naming_it(tmp_path, capsys, line, message):
    (tmp_path / "in.jsonl").write_text('{"id": 0, "tokens": [5]}\n' + line + "\n")
    assert generate(tmp_path, "out.jsonl") == 2
    assert message in capsys.readouterr().err


def test_bad_settings_are_usage_errors(tmp_path, capsys):
    write_prompts(tmp_path / "in.jsonl", 2)
    for setting, message in (("offload=disk", "expected auto, none"), ("gpu_memory=lots", "expected a size"),
                             ("gpu_batch=0", "integer >= 1"), ("compress=cache", "expected weights, kv or both"),
                             ("dequant=fast", "expected reference, expand or fused"),
                             ("dequant=expand", "with compress='weights'"), ("weights_gpu=1.5", "share in [0, 1]"),
                             ("weights_gpu=0.5", "every layer's weights there already"),
                             ("offload=weights+cpu_attention", "add cache")):
        assert generate(tmp_path, "out.jsonl", "--set", setting) == 2
        assert message in capsys.readouterr().err


def test_eos_cuts_the_offloaded_output_as_the_engine_stops(tmp_path):
    """A checkpoint whose EOS is a token the model generates mid-way: both paths stop there, EOS included."""
    pytest.importorskip("transformers")
    from test_decoder_models import save_hf
    from batchmaker.cells.decoder_config import PRESETS
    save_hf(PRESETS["tiny-llama"], tmp_path / "model")
    write_prompts(tmp_path / "in.jsonl")
    checkpoint = ["--set", f"checkpoint={tmp_path / 'model'}"]
    assert generate(tmp_path, "first.jsonl", *checkpoint, "--set", "ignore=1") == 2  # (an unknown key: refused)
    assert generate(tmp_path, "first.jsonl", *checkpoint) == 0
    longest = max(results(tmp_path / "first.jsonl").values(), key=lambda r: len(r[0]))[0]
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["eos_token_id"] = longest[2]
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    assert generate(tmp_path, "engine.jsonl", *checkpoint) == 0
    assert generate(tmp_path, "offloaded.jsonl", *checkpoint, *OFFLOAD) == 0
    engine = results(tmp_path / "engine.jsonl")
    assert results(tmp_path / "offloaded.jsonl") == engine
    assert any(reason == "stop" and tokens[-1] == longest[2] for tokens, reason in engine.values())


def test_a_killed_process_resumes_where_it_stopped(tmp_path):
    """SIGKILL once the first lines are written (the prompts one at a time, 64 tokens each), then a re-run."""
    import os
    import signal
    import subprocess
    import sys
    import time
    write_prompts(tmp_path / "in.jsonl", 30)
    one_at_a_time = ["--set", "offload=weights+cache+hidden", "--set", "gpu_batch=1", "--set", "num_batches=1",
                     "--max-new-tokens", "64"]
    assert generate(tmp_path, "whole.jsonl", *OFFLOAD, "--max-new-tokens", "64") == 0
    command = [sys.executable, "-c", "import sys; from batchmaker.serving.cli import main; sys.exit(main())",
               "generate", "--models", "llama", "--input", str(tmp_path / "in.jsonl"), "--output",
               str(tmp_path / "out.jsonl"), *one_at_a_time]
    root = str(Path(__file__).resolve().parent.parent)  # (this checkout's package, in the child too)
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if (tmp_path / "out.jsonl").exists() and (tmp_path / "out.jsonl").read_text().count("\n") >= 2:
            break
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    written = len(results(tmp_path / "out.jsonl"))
    assert 2 <= written < 30, f"{written} lines before the kill: not an interruption"
    assert generate(tmp_path, "out.jsonl", *one_at_a_time) == 0
    assert results(tmp_path / "out.jsonl") == results(tmp_path / "whole.jsonl")

"""bench/offload.py end to end on the CPU (a small model, weights offloaded under a tiny budget,
a stand-in for the Accelerate probe): every policy's row carries its measurement, its share of
resident layers and, without compression, the cost model's prediction; the chosen policy rerun
with every layer streamed moves more weight bytes and is predicted slower; the 4-bit rows their agreement with bf16; the anchor's
lines are parsed, and a missing probe is skipped with a reason. The attention A/B: with the CPU's
attention forced on, the chosen policy's host cache is attended on the CPU, and `--flip-attention`
reruns it with the cache moved to the device instead, the same tokens (both exact on the CPU). The
host model's matrices are views of one arena, whose bytes `host_budget` takes out."""
import json

import pytest

offload = pytest.importorskip("bench.offload")

FAKE_PROBE = '''import sys
args = sys.argv[1:]
batches = args[args.index("--batches") + 1].split(",")
print("host->device GB/s: {'pinned': 50.0, 'pageable': 14.0}")
for b in batches:
    print(f"accelerate offload 13b gpu 0 GiB B={b} prompt 4 new 3: 2.0 s, {int(b) * 3 / 2.0:.2f} generated tok/s")
'''


ARGS = ["--device", "cpu", "--preset", "small-llama", "--gpu-memory", "0.03", "--batches", "2", "--prompt", "4",
        "--new", "3"]


def run(tmp_path, monkeypatch, probe: str) -> dict:
    from bench import common
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    offload.main(ARGS + ["--other", "1x2:weights+cache+hidden", "--dequant-rows", "2", "--shares", "0"])
    offload.main(ARGS + ["--anchor", probe])
    (path,) = tmp_path.glob("offload-*.json")
    return json.loads(path.read_text())


def test_a_cpu_smoke_run_records_each_policy_and_the_anchor(tmp_path, monkeypatch):
    probe = tmp_path / "probe.py"
    probe.write_text(FAKE_PROBE)
    record = run(tmp_path, monkeypatch, str(probe))
    systems = record["systems"]
    share = systems["auto-B2"]["weights_gpu"]
    assert 0 < share < 1  # (30 MiB holds two of small-llama's 8 bf16 layers beside the buffers)
    assert set(systems) == {"auto-B2", "auto-B2-weights_gpu0", "other-1x2-weights+cache+hidden", "auto-B2-4bit"}
    for name, row in systems.items():
        assert row["block"] <= 2 and row["tokens_per_s"] > 0 and min(row["seconds"], row["prefill_seconds"]) > 0
        assert row["predicted"]["step_seconds"] > 0 and row["bound"]["tokens_per_s"] > 0
        assert 0 < row["weight_floor_seconds"] and row["step_over_weight_floor"] > 0
        if name == "auto-B2-4bit":  # (the search's policy for 4-bit weights: their codes fit the 30 MiB whole)
            assert row["resident_layers"] == 8 and row["moved_gb"]["weights"] == 0 and row["compress"] == "weights"
            assert record["choices"]["auto-B2-4bit"]["compress"] == "weights"
            continue
        assert row["moved_gb"]["weights"] > 0 and row["offloaded"].startswith("weights")
        assert row["resident_layers"] == (0 if name.startswith("other") or "weights_gpu0" in name else round(share * 8))
    streamed = systems["auto-B2-weights_gpu0"]  # (the same policy with every layer streamed: --shares 0)
    assert streamed["moved_gb"]["weights"] > systems["auto-B2"]["moved_gb"]["weights"]
    assert streamed["agreement_with_chosen"]["tokens"] == 1.0  # (another executor over the same host model)
    assert streamed["predicted"]["step_seconds"] > systems["auto-B2"]["predicted"]["step_seconds"]
    assert 0 <= systems["auto-B2-4bit"]["agreement_with_bf16"]["tokens"] <= 1
    assert systems["auto-B2-4bit"]["dequant"] == "reference"  # (the CPU's)
    assert record["choices"]["auto-B2"]["policy"]["gpu_batch"] == systems["auto-B2"]["gpu_batch"]
    assert record["dequant"]["2"]["faster"] in ("expand_matmul", "fused")
    assert "--anchor" in record["anchor_command"]
    anchor = record["accelerate"]
    assert anchor["status"] == 0 and anchor["batches"]["2"]["tokens_per_s"] == 3.0
    assert anchor["batches"]["2"]["ours_over_accelerate"] == pytest.approx(systems["auto-B2"]["tokens_per_s"] / 3.0)


def test_the_attention_ab_runs_the_chosen_policy_both_ways(tmp_path, monkeypatch):
    from bench import common
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    args = ARGS[:ARGS.index("--gpu-memory")] + ["--gpu-memory", "0.02"] + ARGS[ARGS.index("--gpu-memory") + 2:]
    offload.main(args + ["--cpu-attention", "on", "--flip-attention", "--no-compress", "--dequant-rows", "--other", ""])
    (path,) = tmp_path.glob("offload-*.json")
    systems = json.loads(path.read_text())["systems"]
    assert set(systems) == {"auto-B2", "auto-B2-cpu_attention-off"}  # (20 MiB: the cache goes to the host)
    on, off = systems["auto-B2"], systems["auto-B2-cpu_attention-off"]
    assert on["cpu_attention"] and not off["cpu_attention"] and "cache" in on["offloaded"]
    assert on["moved_gb"]["attention"] > 0 and off["moved_gb"]["attention"] == 0
    assert on["moved_gb"]["cache"] < off["moved_gb"]["cache"]  # (the prompt's columns stored, nothing loaded)
    assert off["agreement_with_chosen"]["tokens"] == 1.0
    assert on["bound"]["cpu_seconds"][1] > 0 == off["bound"]["cpu_seconds"][1]


def test_a_model_larger_than_the_host_keeps_only_its_streamed_layers_there(tmp_path, monkeypatch):
    """`--streamed-only` (automatic where the model does not fit the host: 70B beside 128 GiB): each
    policy's resident layers are drawn on the device and taken by the executor as they are, the
    search counts the streamed layers' host copy itself; the tokens are those of the whole host
    model (the same draws)."""
    from bench import common
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    args = ARGS + ["--no-compress", "--dequant-rows", "--other", "", "--shares", "0"]
    offload.main(args)
    (path,) = tmp_path.glob("offload-*.json")
    whole = json.loads(path.read_text())
    path.unlink()
    offload.main(args + ["--streamed-only"])
    (path,) = tmp_path.glob("offload-*.json")
    streamed = json.loads(path.read_text())
    assert whole["host_holds"] == "the whole model" and streamed["host_holds"] == "the streamed layers"
    assert streamed["host_budget_gib"] > whole["host_budget_gib"]  # (the weights' arena not taken out first)
    assert set(streamed["systems"]) == {"auto-B2", "auto-B2-weights_gpu0"}
    for name in ("auto-B2", "auto-B2-weights_gpu0"):
        assert streamed["systems"][name]["resident_layers"] == whole["systems"][name]["resident_layers"]
    assert streamed["systems"]["auto-B2"]["resident_layers"] > 0
    built, draw = [], offload.random_model
    monkeypatch.setattr(offload, "random_model", lambda *a, **k: built.append(k["resident"]) or draw(*a, **k))
    offload.main(args + ["--streamed-only"])
    assert sorted(built) == [0, streamed["systems"]["auto-B2"]["resident_layers"]]  # (a model per share)


def test_resident_layers_built_on_the_device_are_taken_as_they_are():
    import random
    from dataclasses import replace

    from bench.offload_model import random_model
    from batchmaker.cells.decoder_config import PRESETS
    from batchmaker.core.zigzag import Placement
    from batchmaker.exec.offload import OffloadConfig, OffloadExecutor
    config = replace(PRESETS["tiny-llama"], num_layers=4)
    config_ = OffloadConfig(2, 2, Placement(True, True, True, weights_gpu=0.5))
    adopted, whole = random_model(config, "cpu", resident=2).float(), random_model(config, "cpu").float()
    executor = OffloadExecutor(adopted, "cpu", config_, adopt=True)
    assert executor.resident[0] is adopted.layers[0] and executor.resident[1] is adopted.layers[1]
    assert all(p.numel() for p in adopted.layers[0].parameters())
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(9)] for _ in range(4)]
    assert executor.generate_block(prompts, 5)[0] == OffloadExecutor(whole, "cpu", config_).generate_block(prompts, 5)[0]
    with pytest.raises(ValueError, match="adopt"):  # (resident layers somewhere else: refused)
        OffloadExecutor(random_model(config, "cpu").float(), "meta", config_, adopt=True)


def test_policy_names_carry_the_attention():
    from bench.offload_names import compresses, parse_policy, placement_name, variant_of
    gbs, nb, placement = parse_policy("4x2:weights+cache+hidden+cpu_attention@0.5")
    assert (gbs, nb) == (4, 2) and placement.cpu_attention and placement.weights_gpu == 0.5
    assert placement_name(placement) == "weights+cache+hidden+cpu_attention@0.50"
    assert compresses(placement, "weights") and not compresses(placement, "kv")
    assert variant_of("auto-B64-cpu_attention-off") == "auto-B64" and variant_of("auto-B64") is None


def test_a_missing_probe_is_skipped_with_its_reason(tmp_path, monkeypatch):
    from bench import common
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    offload.main(ARGS + ["--anchor", str(tmp_path / "absent.py")])
    (path,) = tmp_path.glob("offload-*.json")
    assert "missing" in json.loads(path.read_text())["accelerate"]["skipped"]


def test_the_host_models_matrices_are_views_of_the_arena_its_budget_subtracts(monkeypatch):
    """random_model's layer matrices share the chunks of one arena (one, unpinned, for a small model),
    and host_budget takes out what that arena holds, the rest of the model and the reserve."""
    from batchmaker.cells.decoder_config import PRESETS
    from bench import offload_model
    config = PRESETS["small-llama"]
    lm = offload_model.random_model(config, "cpu")
    is_matrix = {name: name.startswith("layers.") and p.dim() == 2 for name, p in lm.named_parameters()}
    chunks = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
              for name, p in lm.named_parameters() if is_matrix[name]}
    rest = sum(p.nbytes for name, p in lm.named_parameters() if not is_matrix[name])
    assert len(chunks) == 1 and 0.99 < sum(p.nbytes for name, p in lm.named_parameters() if is_matrix[name]) / sum(
        chunks.values()) <= 1
    monkeypatch.setattr(offload_model, "host_bytes", lambda: 64.0 * 2**30)
    assert offload_model.host_budget(config, "cpu") == 64.0 * 2**30 * (1 - offload_model.HOST_RESERVE) - sum(
        chunks.values()) - rest

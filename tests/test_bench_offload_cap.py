"""The capped headline of bench/offload.py (issue 34) on the CPU: the wrapper applies the cap's
fraction before the probe and passes the probe its arguments as they are, and records out of
memory as the probe's failure (exit status, one line); the anchor under a cap tries its batches
smallest first in processes of their own, with a weight budget that shrinks as the batch grows,
stops at the first out of memory and keeps the best; our side records the block-size curve, each
row's prediction, bound and peaks, an out-of-memory policy as that policy's failure, our best and
our best over Accelerate's (a fake probe stands for Accelerate's)."""
import json
import sys

import pytest
import torch

offload = pytest.importorskip("bench.offload")
from bench import capped_probe, offload_anchor  # noqa: E402
from batchmaker.cells.decoder_config import PRESETS  # noqa: E402

FAKE_PROBE = '''import json, sys
args = sys.argv[1:]
print("argv", json.dumps(sys.argv))
batch = int(args[args.index("--batches") + 1])
if batch >= 4:  # (out of memory from the fourth prompt on: what a cap does to a growing KV cache)
    import torch
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
gib = args[args.index("--gpu-gib") + 1]
print("host->device GB/s: {'pinned': 50.0, 'pageable': 14.0}")
print(f"accelerate offload 13b gpu {gib} GiB B={batch} prompt 4 new 3: 2.0 s, {batch * 3 / 2.0:.2f} generated tok/s")
'''


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(FAKE_PROBE)
    return str(path)


def test_the_wrapper_passes_the_probe_its_arguments_as_they_are(probe, capsys):
    argv = ["--preset", "13b", "--gpu-gib", "6", "--batches", "2", "--prompt", "4", "--new", "3"]
    assert capped_probe.main(["--cap-gib", "16", probe, *argv]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.split("argv ", 1)[1].splitlines()[0]) == [probe, *argv]
    assert "B=2 prompt 4 new 3" in out and out.rstrip().endswith("the cap was not applied")  # (no GPU here)
    assert sys.argv[0] != probe  # (the wrapper's own argv back)


def test_out_of_memory_under_the_cap_is_the_probes_failure(probe, capsys):
    status = capped_probe.main(["--cap-gib", "16", probe, "--gpu-gib", "1", "--batches", "8"])
    assert status == capped_probe.OOM_STATUS
    assert "out of memory under the cap of 16 GiB: CUDA out of memory" in capsys.readouterr().out


def test_the_cap_is_the_fraction_of_the_devices_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 80 << 30}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    assert capped_probe.apply_cap(16, 0) and calls == [(0.2, 0)]
    assert capped_probe.apply_cap(160, 1) and calls[-1] == (1.0, 1)  # (a cap above the device: all of it)


def test_the_weight_budget_leaves_the_batchs_cache_and_activations_room():
    config = PRESETS["llama-2-13b"]
    budgets = [offload_anchor.weight_budget_gib(config, b, 512, 32, 16) for b in (1, 8, 16, 24, 32, 64)]
    assert budgets == sorted(budgets, reverse=True) and budgets[-1] == 1
    kv16 = 16 * 544 * 2 * 40 * 40 * 128 * 2 / (1 << 30)  # (6.6 GiB: HF's cache at batch 16)
    assert budgets[2] + kv16 + offload_anchor.MARGIN_GIB <= 16


def run(tmp_path, monkeypatch, argv: list[str]) -> dict:
    from bench import common
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    offload.main(argv)
    (path,) = tmp_path.glob("offload-cap-*.json")
    return json.loads(path.read_text())


CAPPED = ["--device", "cpu", "--preset", "small-llama", "--gpu-cap", "0.03", "--prompt", "4", "--new", "3"]


def test_the_capped_record_holds_the_curve_bounds_best_and_the_anchors_best(tmp_path, monkeypatch, probe):
    record = run(tmp_path, monkeypatch, CAPPED + ["--batches", "2", "--curve", "1", "2", "4", "--other", "",
                                                  "--no-compress", "--dequant-rows"])
    assert record["gpu_cap_gib"] == 0.03 and record["title"].startswith("small-llama bf16, offload=auto gpu cap 0.03GiB")
    chosen = record["systems"][record["chosen"]]
    curve = record["curve"]
    assert [row["num_batches"] for row in curve] == sorted({1, 2, 4, chosen["num_batches"]})
    assert {row["gpu_batch"] for row in curve} == {chosen["gpu_batch"]} and chosen in curve
    for row in curve:
        assert row["block"] == row["gpu_batch"] * row["num_batches"] and row["tokens_per_s"] > 0
        assert row["predicted"]["device_gib"] <= 0.03 or row is not chosen
        assert row["bound"]["binding"] in ("link", "host_memory", "gpu", "host")  # (host: a tiny model's launches)
        assert row["over_bound"] == pytest.approx(row["tokens_per_s"] / row["bound"]["tokens_per_s"])
        assert row["bound"]["tokens_per_s"] >= row["predicted"]["tokens_per_s"] * (1 - 1e-9)
    assert chosen["predicted"]["device_gib"] <= 0.03  # (the search's budget is the cap)
    best = max(record["systems"].values(), key=lambda r: r["tokens_per_s"])
    assert record["best"]["tokens_per_s"] == best["tokens_per_s"]

    record = run(tmp_path, monkeypatch, CAPPED + ["--anchor", probe, "--anchor-batches", "8", "1", "2", "4"])
    anchor = record["accelerate"]
    rows = {int(b): row for b, row in anchor["batches"].items()}
    assert rows[1]["tokens_per_s"] == 1.5 and rows[2]["tokens_per_s"] == 3.0 and not rows[2]["out_of_memory"]
    assert rows[4]["out_of_memory"] and "tokens_per_s" not in rows[4] and "skipped" in rows[8]
    assert rows[1]["weight_budget_gib"] >= rows[2]["weight_budget_gib"] >= 1
    assert f"--gpu-gib {rows[2]['weight_budget_gib']} --batches 2" in rows[2]["command"]
    assert "--cap-gib 0.03" in rows[2]["command"]
    assert anchor["best"] == {"batch": 2, "tokens_per_s": 3.0}
    ratio = record["ours_over_accelerate_best"]
    assert ratio["ratio"] == pytest.approx(record["best"]["tokens_per_s"] / 3.0) and ratio["accelerate_batch"] == 2
    assert (tmp_path / next(tmp_path.glob("offload-cap-*.json")).name).with_suffix(".png").exists() or \
        pytest.importorskip("matplotlib") is None


def test_a_policy_out_of_memory_is_its_failure_not_the_runs(tmp_path, monkeypatch):
    generate = offload.OffloadExecutor.generate_block

    def capped(self, prompts, num_tokens):
        if len(prompts) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return generate(self, prompts, num_tokens)

    def measure(*args, **kwargs):  # (the start-up rates run the executor on a tiny decoder: not capped)
        offload.OffloadExecutor.generate_block = generate
        try:
            return real_measure(*args, **kwargs)
        finally:
            offload.OffloadExecutor.generate_block = capped

    real_measure = offload.measure
    monkeypatch.setattr(offload, "measure", measure)
    monkeypatch.setattr(offload.OffloadExecutor, "generate_block", capped)
    record = run(tmp_path, monkeypatch, CAPPED + ["--batches", "2", "--curve", "1", "4", "--other", "",
                                                  "--no-compress", "--dequant-rows"])
    rows = {row["num_batches"]: row for row in record["curve"]}
    big = rows[max(rows)]
    assert big["failed"] == "out of memory" and "Tried to allocate" in big["message"] and "tokens_per_s" not in big
    assert rows[1]["tokens_per_s"] > 0  # (the run went on)
    assert record["best"]["name"] != f"curve-nb{max(rows)}"

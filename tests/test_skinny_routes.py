"""The few-token projections' routes (kernels/skinny_routes.py): chosen by timing on the device at
hand (a fake timer here), cached by device name and versions, switched by KVSettings.skinny_routes, never
measured on the CPU, installed before any CUDA graph is captured, and what `project` runs.

    python -m pytest -q tests/test_skinny_routes.py
    python -m pytest -q -m gpu tests/test_skinny_routes.py   # measured on a Hopper GPU
"""
import json
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS
from batchmaker.exec import iterations, tensor_rank
from batchmaker.exec.iterations import IterationRunner
from batchmaker.kernels import skinny, skinny_routes
from batchmaker.kernels.flat_gemm import FlatConfig
from batchmaker.kernels.skinny import SkinnyConfig

FLAT, DEEP = FlatConfig(64, 256, 4, 4), SkinnyConfig(32, 256, 4, 6)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_routes(monkeypatch, tmp_path):
    monkeypatch.setattr(skinny, "ROUTES", {})
    monkeypatch.setenv("BATCHMAKER_CACHE_DIR", str(tmp_path))


class FakeTimer:
    """ms by route (missing: 10), never running the pass; counts its calls."""

    def __init__(self, times: dict):
        self.times, self.calls = times, []

    def __call__(self, route, one_pass) -> float:
        self.calls.append(route)
        return self.times.get(route, 10.0)


def never(route, one_pass):
    raise AssertionError("measured")


def tiny_lm(dtype=torch.bfloat16):
    return build_decoder(PRESETS["tiny-llama"], seed=0, dtype=dtype)


def routable(monkeypatch):
    """As on a Hopper GPU: the kernels take the products (the fake timer never launches them)."""
    monkeypatch.setattr(skinny, "can_skinny", lambda x, weight: True)


def test_the_router_picks_the_fastest_and_cublas_when_it_wins():
    weights = [torch.zeros(256, 64, dtype=torch.bfloat16)] * 3
    timer = FakeTimer({None: 5.0, FLAT: 2.0, DEEP: 3.0})
    route, times = skinny_routes.measure(weights, 16, timer)
    assert route == FLAT and set(timer.calls) == set(skinny_routes.candidates(256, 64, 16)) == set(times)
    assert None in times and len(times) >= 4  # cuBLAS and the bucket's candidates (the static pick among them)
    assert skinny_routes.measure(weights, 16, FakeTimer({None: 1.0, FLAT: 2.0}))[0] is None
    assert skinny_routes.measure(weights, 16, FakeTimer({}))[0] is None  # ties: cuBLAS


def test_a_failing_candidate_is_left_out():
    def timer(route, one_pass):
        if route == FLAT:
            raise RuntimeError("out of shared memory")
        return 1.0 if route == DEEP else 2.0
    route, times = skinny_routes.measure([torch.zeros(256, 64)], 16, timer)
    assert route == DEEP and FLAT not in times


def test_candidates_fit_every_familys_shapes():
    """Each preset's projections (and their halves under TP 2) get cuBLAS and at least 3 kernels a
    bucket; a candidate's columns divide N."""
    for name in ("llama-2-7b", "llama-3-8b", "qwen2.5-7b", "mistral-7b", "phi-3-mini", "gemma-2-9b"):
        c = PRESETS[name]
        h, i, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for ranks in (1, 2):
            for n, k in (((q + 2 * kv) // ranks, h), (h, q // ranks), (2 * i // ranks, h), (h, i // ranks)):
                for bucket in skinny_routes.ROW_BUCKETS:
                    found = skinny_routes.candidates(n, k, bucket)
                    assert found[0] is None and len(found) >= 4, (name, n, k, bucket)
                    assert all(n % r.block_n == 0 for r in found[1:])


def test_the_model_s_projections_by_shape():
    lm = tiny_lm()
    c = lm.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = skinny_routes.projection_weights(lm)
    assert set(shapes) == {(q + 2 * kv, c.hidden_size), (c.hidden_size, q), (2 * c.intermediate_size, c.hidden_size),
                           (c.hidden_size, c.intermediate_size)}
    assert all(len(ws) == c.num_layers for ws in shapes.values())
    biased = nn.Module()
    biased.qkv_proj = nn.Linear(64, 96)  # (Qwen2's q | k | v has a bias: `project` never routes it)
    assert skinny_routes.projection_weights(biased) == {}


def test_nothing_is_measured_on_the_cpu():
    assert skinny_routes.settle_routes(tiny_lm(), CPU, "measure", timer=never) == {} and skinny.ROUTES == {}


def test_measured_routes_are_installed_cached_and_reused(monkeypatch, tmp_path):
    routable(monkeypatch)
    lm = tiny_lm()
    timer = FakeTimer({FLAT: 1.0})
    routes = skinny_routes.settle_routes(lm, CPU, "measure", timer=timer)
    shapes = skinny_routes.projection_weights(lm)
    assert len(routes) == len(shapes) * len(skinny_routes.ROW_BUCKETS) == len(skinny.ROUTES)
    for (n, k, bucket, dtype), route in routes.items():
        assert dtype == "bfloat16" and skinny.ROUTES[n, k, bucket, torch.bfloat16, -1] == route
        assert route == (FLAT if FLAT in skinny_routes.candidates(n, k, bucket) else None), (n, k, bucket)
    assert len(timer.calls) > len(routes)
    skinny.ROUTES.clear()
    assert skinny_routes.settle_routes(lm, CPU, "measure", timer=never) == routes  # the cache: nothing measured again
    assert len(skinny.ROUTES) == len(routes)
    path = skinny_routes.cache_path()
    assert path.parent == tmp_path and list(json.loads(path.read_text())) == [skinny_routes.cache_entry("cpu")]


def test_the_cache_is_keyed_by_device_and_versions(monkeypatch, tmp_path):
    path = tmp_path / "routes.json"
    routes = {(4096, 4096, 16, "bfloat16"): DEEP, (4096, 4096, 8, "bfloat16"): FLAT, (4096, 11008, 64, "float16"): None}
    h100 = skinny_routes.cache_entry("NVIDIA H100 80GB HBM3")
    skinny_routes.save_routes(path, h100, routes)
    assert skinny_routes.load_routes(path, h100) == routes  # round trip: kernels, configs and cuBLAS
    h200 = skinny_routes.cache_entry("NVIDIA H200")
    assert h200 != h100 and skinny_routes.load_routes(path, h200) == {}
    skinny_routes.save_routes(path, h200, {(4096, 4096, 16, "bfloat16"): None})
    assert skinny_routes.load_routes(path, h100) == routes  # (another device's entry beside it)
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert skinny_routes.cache_entry("NVIDIA H100 80GB HBM3") != h100  # a new torch measures again
    monkeypatch.setattr(skinny_routes, "CACHE_VERSION", skinny_routes.CACHE_VERSION + 1)
    path.write_text("{not json")
    assert skinny_routes.load_routes(path, h100) == {}  # unreadable: measured again, then rewritten
    skinny_routes.save_routes(path, h100, routes)
    assert skinny_routes.load_routes(path, h100) == routes


def test_the_switch(monkeypatch):
    """The mode: KVSettings.skinny_routes (static by default, until a GPU run checks the router), an
    unknown one refused when the settings are made."""
    from batchmaker.cells.decoder_cell import KVSettings
    routable(monkeypatch)
    lm = tiny_lm()
    off = skinny_routes.settle_routes(lm, CPU, "off", timer=never)
    assert off and all(route is None for route in off.values())  # cuBLAS everywhere
    static = skinny_routes.settle_routes(lm, CPU, "static", timer=never)
    assert static == {key: skinny.pick_config(n, k, max(16, bucket)) for key in off for n, k, bucket, _ in [key]}
    with pytest.raises(ValueError, match="measure, static, off"):
        skinny_routes.settle_routes(lm, CPU, "fast", timer=never)
    assert skinny_routes.settle_routes(lm, CPU, timer=never) == static  # the default
    timer = FakeTimer({})
    skinny_routes.settle_routes(lm, CPU, "measure", timer=timer)
    assert timer.calls
    assert KVSettings().skinny_routes == "static" and KVSettings(skinny_routes="measure").skinny_routes == "measure"
    with pytest.raises(ValueError, match="skinny_routes"):
        KVSettings(skinny_routes="fast")


def test_measuring_stops_at_its_budget(monkeypatch):
    routable(monkeypatch)
    monkeypatch.setattr(skinny_routes, "BUDGET_S", 0.0)
    timer = FakeTimer({})
    routes = skinny_routes.settle_routes(tiny_lm(), CPU, "measure", timer=timer)
    first = next(iter(routes))  # one (shape, bucket) measured (each start makes progress), the rest static
    assert len(timer.calls) == len(skinny_routes.candidates(*first[:3]))
    assert all(route == skinny_routes.static_route(*key[:3]) for key, route in routes.items() if key != first)
    assert list(skinny_routes.load_routes(skinny_routes.cache_path(), skinny_routes.cache_entry("cpu"))) == [first]


def test_project_runs_the_installed_route(monkeypatch):
    routable(monkeypatch)
    launched = []
    for kernel in ("flat", "skinny"):  # (recorded, F.linear's product returned)
        monkeypatch.setattr(skinny, f"{kernel}_linear",
                            lambda x, w, config, pdl, kernel=kernel: launched.append((kernel, config)) or x @ w.T)
    layer = nn.Linear(64, 128, bias=False)
    x = torch.randn(5, 64)
    skinny.ROUTES[128, 64, 8, torch.float32, -1] = FLAT
    skinny.ROUTES[128, 64, 32, torch.float32, -1] = None
    assert torch.allclose(skinny.project(layer, x), F.linear(x, layer.weight))
    assert torch.equal(skinny.project(layer, torch.ones(20, 64)), F.linear(torch.ones(20, 64), layer.weight))
    skinny.project(layer, torch.ones(12, 64))  # (no route at 16 rows: the static table's)
    assert launched == [("flat", FLAT), ("skinny", skinny.default_config(128, 64, 16))]


def test_routes_settle_before_graphs_are_captured(monkeypatch):
    """A GPU rank starts (exec/tensor_rank.py; exec/worker.py CUDAWorker alike): compile_kernels,
    which settles the routes first, then the graphs' capture; warm_up refuses to capture before."""
    from batchmaker.cells.decoder_cell import KVSettings
    order = []
    monkeypatch.setattr(iterations, "settle_routes", lambda lm, device, mode: order.append("routes") or {})
    monkeypatch.setattr(iterations, "compile_variants", lambda *args: order.append("attention"))
    k = torch.zeros(1, 2, 16, 2, 16)
    runner = types.SimpleNamespace(lm=tiny_lm(), device=CPU, module=types.SimpleNamespace(
        ranks=1, calibration_prompts=[], block_size=16, kv=KVSettings()), config=types.SimpleNamespace(
        num_heads=2, max_positions=64, attention_windows=(), attn_softcap=None), max_blocks=4,
        cache=types.SimpleNamespace(k=k, v=k), unified_max=None, routes=None)
    runner.warm_up = lambda: order.append("graphs")
    runner.compile_kernels = lambda: IterationRunner.compile_kernels(runner)
    runner.measure = lambda: order.append("measure")
    stream = types.SimpleNamespace(synchronize=lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    pipe = types.SimpleNamespace(recv_bytes=lambda: (_ for _ in ()).throw(EOFError()))
    tensor_rank._follow_on_gpu(runner, None, pipe, [])
    assert order == ["routes", "attention", "graphs", "measure"] and runner.routes == {}
    unsettled = types.SimpleNamespace(shapes=types.SimpleNamespace(enabled=True), routes=None)
    with pytest.raises(AssertionError, match="settle before graphs"):
        IterationRunner.warm_up(unsettled)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and skinny.HAS_TRITON and skinny.has_sm90(torch.device("cuda"))),
                    reason="needs a Hopper GPU (compute capability 9.0+) and triton")
def test_routes_measured_on_the_gpu():
    """tiny-llama in bf16 on the GPU: every (shape, bucket) measured with CUDA graphs, the winners
    installed; a forward of 2-64 tokens through them equals cuBLAS's; the next start reads the cache."""
    lm = build_decoder(PRESETS["tiny-llama"], seed=0, dtype=torch.bfloat16, device="cuda")
    routes = skinny_routes.settle_routes(lm, torch.device("cuda"), "measure")
    assert len(routes) == 4 * len(skinny_routes.ROW_BUCKETS)
    assert skinny_routes.settle_routes(lm, torch.device("cuda"), "measure", timer=never) == routes
    for length in (2, 9, 16, 40, 64):
        tokens = torch.randint(0, lm.config.vocab_size, (length,), device="cuda")
        with torch.no_grad():
            ours = lm.dense_logits(tokens)
            skinny.ROUTES, saved = {}, skinny.ROUTES
            skinny_routes.settle_routes(lm, torch.device("cuda"), mode="off")
            want = lm.dense_logits(tokens)
            skinny.ROUTES = saved
        torch.testing.assert_close(ours, want, rtol=1e-1, atol=1e-1)  # (bf16 logits of O(1) after 2 layers)

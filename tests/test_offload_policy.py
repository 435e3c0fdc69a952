"""FlexGen's cost model and policy search (core/offload_policy.py): the search (GPU batch sizes,
doubling the number of GPU batches, placements on a grid) finds what trying every policy of the
same grid finds; what it picks fits every tier; a GPU that holds everything keeps everything;
a faster host link never makes the best policy slower; with the executor's whole layers
(`kv_to_gpu`) and the weights' share on a finer grid, the search still finds what trying every
policy finds, a budget between no layer and every layer picks a share in between, and the
predicted link bytes fall as the share grows. With the CPU's attention over a host cache
(`cpu_attention`): a decode step moves q, k, v and the output instead of the cache, the CPU's time
is its flops or the cache's bytes at host memory's rate, whichever is longer, the slots hold the
prompt's columns; the search tries both ways, equals trying every policy both ways, and picks the
CPU's where the link is slow beside host memory and the CPU, not where the CPU is slow."""
import numpy as np
import pytest

from batchmaker.core.offload_policy import (Hardware, ModelShape, best_placement, gpu_batch_sizes, layer_seconds,
                                            layer_terms, peak_bytes, placements, search)

GB = 1e9
T4 = Hardware(ctog=12.89 * GB, gtoc=4.82 * GB, dtoc=0.473 * GB, ctod=0.746 * GB, mm_flops=4.3e12, bmm_flops=0.079e12,
              cpu_flops=0.0123e12, gpu_bytes=16 * GB, cpu_bytes=200 * GB, disk_bytes=1500 * GB)
OPT_30B = ModelShape(layers=48, hidden=7168, intermediate=28672, prompt=512, generate=32)
OPT_6B = ModelShape(layers=32, hidden=4096, intermediate=16384, prompt=256, generate=64)


def brute_force(m, hw, step, max_gpu_batch, max_batches):
    grid = placements(step)
    return max(best_placement(m, hw, gbs, nb, grid)[0] for gbs in gpu_batch_sizes(max_gpu_batch)
               for nb in range(1, max_batches + 1))


@pytest.mark.parametrize("model", [OPT_30B, OPT_6B], ids=["opt-30b", "opt-6.7b"])
@pytest.mark.parametrize("gpu_gb, cpu_gb", [(16, 200), (24, 64), (80, 400), (8, 30)])
def test_the_search_finds_what_trying_every_policy_finds(model, gpu_gb, cpu_gb):
    hw = Hardware(**{**T4.__dict__, "gpu_bytes": gpu_gb * GB, "cpu_bytes": cpu_gb * GB})
    rate, policy = search(model, hw, step=0.5, max_gpu_batch=16, max_batches=24)
    assert rate == pytest.approx(brute_force(model, hw, 0.5, 16, 24), rel=1e-9)
    if policy is not None:
        p = np.array([[policy.wg, policy.wc, policy.cg, policy.cc, policy.hg, policy.hc]])
        assert (peak_bytes(model, policy.gpu_batch, policy.num_batches, p)[0] <=
                np.array([hw.gpu_bytes, hw.cpu_bytes, hw.disk_bytes]) + 1e-6).all()


@pytest.mark.parametrize("max_block", [1, 6, 16])
def test_a_bounded_block_is_what_trying_every_policy_within_the_bound_finds(max_block):
    grid = placements(0.5)
    want = max(best_placement(OPT_30B, T4, gbs, nb, grid)[0] for gbs in gpu_batch_sizes(16)
               for nb in range(1, 25) if gbs * nb <= max_block)
    rate, policy = search(OPT_30B, T4, step=0.5, max_gpu_batch=16, max_batches=24, max_block=max_block)
    assert rate == pytest.approx(want, rel=1e-9) and policy.block <= max_block


def test_a_gpu_that_holds_everything_keeps_everything():
    hw = Hardware(**{**T4.__dict__, "gpu_bytes": 10_000 * GB})
    _, policy = search(OPT_6B, hw, step=0.25, max_gpu_batch=8, max_batches=4)
    assert (policy.wg, policy.cg, policy.hg) == (1.0, 1.0, 1.0)
    prefill, decode = layer_seconds(OPT_6B, hw, policy.gpu_batch, policy.num_batches,
                                    np.array([[1.0, 0, 1.0, 0, 1.0, 0]]))
    assert decode[0] == pytest.approx(policy.block * OPT_6B.layer_bytes / hw.mm_flops
                                      + 4 * policy.block * (256 + 32) * 4096 / hw.bmm_flops)


def test_a_faster_host_link_never_makes_the_best_policy_slower():
    slow, _ = search(OPT_30B, T4, step=0.25, max_gpu_batch=16, max_batches=16)
    fast, _ = search(OPT_30B, Hardware(**{**T4.__dict__, "ctog": 4 * T4.ctog, "gtoc": 4 * T4.gtoc}), step=0.25,
                     max_gpu_batch=16, max_batches=16)
    assert fast >= slow > 0


def test_placements_cover_the_grid_and_sum_to_one():
    grid = placements(0.25)
    assert len(grid) == 15 ** 3 and (grid >= 0).all()
    for pair in ((0, 1), (2, 3), (4, 5)):
        assert (grid[:, pair].sum(1) <= 1 + 1e-9).all()


def test_a_cache_moved_to_the_gpu_is_counted_on_the_link_and_in_its_slots():
    """kv_to_gpu (the executor's way): the decode step reads the host cache over the link and
    attends on the GPU; FlexGen's way charges the CPU's attention instead."""
    p = np.array([[0.0, 1.0, 0.0, 1.0, 1.0, 0.0]])  # weights and cache on the CPU, activations on the GPU
    m, gbs, nb = OPT_6B, 4, 2
    kv_mean = 4 * gbs * nb * (m.prompt + m.generate / 2) * m.hidden
    moved = layer_seconds(m, T4, gbs, nb, p, kv_to_gpu=True)[1][0]
    compute = gbs * nb * m.layer_bytes / T4.mm_flops + kv_mean / T4.bmm_flops
    assert moved == pytest.approx((m.layer_bytes + kv_mean) / T4.ctog + compute)
    delegated = layer_seconds(m, T4, gbs, nb, p)[1][0]
    assert delegated == pytest.approx(m.layer_bytes / T4.ctog + gbs * nb * m.layer_bytes / T4.mm_flops
                                      + kv_mean / T4.cpu_flops)
    slots = peak_bytes(m, gbs, nb, p, kv_to_gpu=True)[0, 0] - peak_bytes(m, gbs, nb, p)[0, 0]
    assert slots == pytest.approx(3 * 4 * (m.prompt + m.generate) * m.hidden * gbs)


def test_with_a_weight_share_the_executors_search_finds_what_trying_every_policy_finds():
    """The executor's grid: weights on the GPU by tenths (whole layers of a 40-layer model), the
    cache and activations wholly on one side; GPUs that hold none, some or all of the weights."""
    model = ModelShape(layers=40, hidden=5120, intermediate=20480, prompt=512, generate=32)  # (13B-sized)
    weights = model.layer_bytes * model.layers
    grid = placements(1.0, weight_step=0.1)
    for gpu_bytes in (0.3 * weights, 0.55 * weights, 3 * weights):
        hw = Hardware(**{**T4.__dict__, "gpu_bytes": gpu_bytes, "dtoc": 0.0, "ctod": 0.0, "disk_bytes": 0.0})
        rate, policy = search(model, hw, step=1.0, max_gpu_batch=16, max_batches=8, kv_to_gpu=True, weight_step=0.1)
        want = max(best_placement(model, hw, gbs, nb, grid, kv_to_gpu=True)[0] for gbs in gpu_batch_sizes(16)
                   for nb in range(1, 9))
        assert rate == pytest.approx(want, rel=1e-9) and policy is not None
        p = np.array([[policy.wg, policy.wc, policy.cg, policy.cc, policy.hg, policy.hc]])
        assert peak_bytes(model, policy.gpu_batch, policy.num_batches, p, kv_to_gpu=True)[0, 0] <= gpu_bytes
        if gpu_bytes == 0.55 * weights:
            assert 0 < policy.wg < 1  # (as much as fits beside the buffers, not all or nothing)


def test_the_predicted_link_bytes_fall_as_the_weight_share_grows():
    """With compute free, a decode step is its bytes over the link: (1 - wg) of a layer's weights
    plus the cache moved to the GPU; and the GPU's peak holds wg of the weights plus two whole
    layers' buffers while any layer streams."""
    m, gbs, nb = OPT_6B, 4, 2
    free = Hardware(**{**T4.__dict__, "mm_flops": 1e30, "bmm_flops": 1e30, "cpu_flops": 1e30})
    shares = np.round(np.arange(0, 1.05, 0.1), 6)
    p = np.array([[wg, 1 - wg, 0.0, 1.0, 1.0, 0.0] for wg in shares])  # (the cache on the CPU, activations on the GPU)
    decode = layer_seconds(m, free, gbs, nb, p, kv_to_gpu=True)[1]
    kv_mean = 4 * gbs * nb * (m.prompt + m.generate / 2) * m.hidden
    assert decode * free.ctog == pytest.approx((1 - shares) * m.layer_bytes + kv_mean)
    assert (np.diff(decode) < 0).all()
    gpu = peak_bytes(m, gbs, nb, p, kv_to_gpu=True)[:, 0]
    buffers = np.where(shares < 1, 2 * m.layer_bytes, 0.0)
    assert np.diff(gpu - shares * m.layer_bytes * m.layers - buffers) == pytest.approx(0.0)


def test_the_cpus_attention_moves_q_k_v_and_the_output_and_takes_the_cpus_time():
    p = np.array([[0.0, 1.0, 0.0, 1.0, 1.0, 0.0]])  # weights and cache on the CPU, activations on the GPU
    m, gbs, nb = OPT_6B, 4, 2
    bls, h1 = gbs * nb, m.hidden
    kv_mean = 4 * bls * (m.prompt + m.generate / 2) * h1
    for cpu_memory, cpu_seconds in ((0.0, kv_mean / T4.cpu_flops), (1e9, kv_mean / 1e9)):  # (flops; host memory binds)
        hw = Hardware(**{**T4.__dict__, "cpu_memory": cpu_memory})
        _, dec = layer_terms(m, hw, gbs, nb, p, kv_to_gpu=True, cpu_attention=True)
        assert dec[0][0] == pytest.approx((m.layer_bytes + 2 * h1 * bls) / hw.ctog)  # (weights in, the output up)
        assert dec[1][0] == pytest.approx(6 * h1 * bls / hw.gtoc)  # (q, k, v down)
        assert dec[4][0] == pytest.approx(bls * m.layer_bytes / hw.mm_flops) and dec[5][0] == pytest.approx(cpu_seconds)
        decode = layer_seconds(m, hw, gbs, nb, p, kv_to_gpu=True, cpu_attention=True)[1][0]
        assert decode == pytest.approx(dec[0][0] + max(dec[1][0], dec[4][0] + cpu_seconds))  # (GPU, then CPU)
    moved = peak_bytes(m, gbs, nb, p, kv_to_gpu=True)[0, 0] - peak_bytes(m, gbs, nb, p, kv_to_gpu=True,
                                                                        cpu_attention=True)[0, 0]
    assert moved == pytest.approx(3 * 4 * m.generate * h1 * gbs)  # (the slots hold the prompt's columns only)
    on_gpu = np.array([[0.0, 1.0, 1.0, 0.0, 1.0, 0.0]])  # (a cache on the GPU: the same either way)
    assert layer_seconds(m, T4, gbs, nb, on_gpu, True, True)[1] == pytest.approx(layer_seconds(m, T4, gbs, nb, on_gpu,
                                                                                               True)[1])


MODEL_13B = ModelShape(layers=40, hidden=5120, intermediate=20480, prompt=512, generate=32)


def executor_hardware(**rates) -> Hardware:
    """A GPU that holds half the 13B model's weights: the cache must live on the CPU."""
    weights = MODEL_13B.layer_bytes * MODEL_13B.layers
    return Hardware(**{**T4.__dict__, "gpu_bytes": 0.5 * weights, "cpu_bytes": 1e13, "dtoc": 0.0, "ctod": 0.0,
                       "disk_bytes": 0.0, "mm_flops": 300e12, "bmm_flops": 300e12, **rates})


@pytest.mark.parametrize("link, cpu_flops, cpu_memory, on_cpu", [
    (4e9, 200e9, 100e9, True),  # (a slow link beside a fast CPU and host memory: attend where the cache is)
    (4e9, 200e9, 2e9, False),  # (host memory slower than the link)
    (4e9, 1e9, 100e9, False),  # (a slow CPU)
    (50e9, 20e9, 100e9, False),  # (a fast link)
])
def test_the_search_attends_on_the_cpu_where_that_is_faster(link, cpu_flops, cpu_memory, on_cpu):
    hw = executor_hardware(ctog=link, gtoc=link, cpu_flops=cpu_flops, cpu_memory=cpu_memory)
    kwargs = {"step": 1.0, "max_gpu_batch": 16, "max_batches": 8, "kv_to_gpu": True, "weight_step": 0.1}
    rate, policy = search(MODEL_13B, hw, **kwargs, cpu_attention=(False, True))
    assert policy.cc == 1.0 and policy.cpu_attention is on_cpu
    grid = placements(1.0, weight_step=0.1)
    want = max(best_placement(MODEL_13B, hw, gbs, nb, grid, True, None, option)[0] for option in (False, True)
               for gbs in gpu_batch_sizes(16) for nb in range(1, 9))
    assert rate == pytest.approx(want, rel=1e-9)  # (the search equals trying every policy both ways)
    alone = [search(MODEL_13B, hw, **kwargs, cpu_attention=(option,))[0] for option in (False, True)]
    assert rate == pytest.approx(max(alone)) and (alone[1] > alone[0]) is on_cpu


def test_compressed_weights_and_cache_cross_the_link_at_their_ratio_and_are_expanded_on_the_gpu():
    """FlexGen §5 in the cost model: a streamed layer and the host cache move `weight_ratio` and
    `kv_ratio` of their dense bytes, and the GPU expands what crossed (codes read, values written)
    at device memory's rate; a resident 4-bit layer multiplies its codes for up to CODE_ROWS rows and
    is expanded per GPU batch beyond. Without the rate no expansion term; at ratio 1 nothing changes."""
    from dataclasses import replace
    from batchmaker.core.offload_policy import CODE_ROWS
    hw = replace(T4, gpu_memory=300 * GB)
    m, gbs, nb = OPT_6B, 4, 2
    streamed = np.array([[0.0, 1.0, 0.0, 1.0, 1.0, 0.0]])  # weights and cache on the CPU
    dense = layer_terms(m, hw, gbs, nb, streamed, kv_to_gpu=True)[1]
    small = replace(m, weight_ratio=0.25, kv_ratio=0.5)
    packed = layer_terms(small, hw, gbs, nb, streamed, kv_to_gpu=True)[1]
    kv_mean = 4 * gbs * nb * (m.prompt + m.generate / 2) * m.hidden
    w = m.layer_bytes
    assert one(packed[0]) == pytest.approx((0.25 * w + 0.5 * kv_mean) / hw.ctog)
    assert one(dense[0]) == pytest.approx((w + kv_mean) / hw.ctog)
    assert one(packed[4]) - one(dense[4]) == pytest.approx((w * 1.25 + kv_mean * 1.5) / hw.gpu_memory)
    assert one(layer_terms(small, T4, gbs, nb, streamed, kv_to_gpu=True)[1][4]) == \
        pytest.approx(one(layer_terms(m, T4, gbs, nb, streamed, kv_to_gpu=True)[1][4]))  # (no rate: no term)
    resident = np.array([[1.0, 0.0, 1.0, 0.0, 1.0, 0.0]])
    few, many = (one(layer_terms(replace(m, weight_ratio=0.25), hw, rows, 3, resident, kv_to_gpu=True)[1][4])
                 - one(layer_terms(m, hw, rows, 3, resident, kv_to_gpu=True)[1][4]) for rows in (CODE_ROWS, CODE_ROWS + 1))
    assert few == pytest.approx(0.0) and many == pytest.approx(3 * w * 1.25 / hw.gpu_memory)


def one(term) -> float:
    """A term of one placement (a cost term is a scalar where it does not depend on the placement)."""
    return float(np.ravel(term)[0])

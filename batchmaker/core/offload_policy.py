"""FlexGen's cost model and policy search (Sheng et al., ICML 2023, §4.3 and Appendix A.3; issue
34): how long a block of `num_batches` GPU batches of `gpu_batch` sequences takes per layer, for
a placement of weights (w), KV cache (c) and activations (h) over GPU (g), CPU (c) and disk (d),
from the machine's link bandwidths and compute rates; and the policy that maximizes tokens/s
within the tiers' capacities. No torch here: the rates come from measurements made elsewhere.

Per layer, with w the layer's weight bytes, h1 the hidden size, s the prompt, n the generated
tokens and bls = gpu_batch x num_batches (2-byte values):
  prefill  max(ctog + dtoc, gtoc + ctod, comp)
  decode   ctog + max(gtoc, dtoc, ctod, comp)          (FlexGen's code: serialised chains)
where ctog moves CPU- and disk-resident weights and activations to the GPU, gtoc the new cache
and activations back, dtoc/ctod the disk's share, and comp the GPU's matmuls and attention over
its cache plus the CPU's attention over the CPU's and disk's cache (A.3's table). The whole
block takes l x (prefill + (n - 1) x decode). Placements are searched on a grid of fractions,
GPU batch sizes over FlexGen's candidates, and the number of GPU batches by doubling while it
fits and pays (FlexGen's procedure), each checked against an exhaustive search in the tests.
FlexGen attends on the CPU over a cache that lives there; our executor moves that cache to the GPU
instead (`kv_to_gpu`: its bytes join the decode step's ctog, its attention the GPU's compute, and
its three batch slots the GPU's working memory). FlexGen splits every layer's tensors by wg; the
executor keeps the first wg x l layers whole on the GPU and streams the others whole (also meant by
`kv_to_gpu`): the decode chain is linear in wg, so the same per-layer mean, while prefill's max is
taken of the mean layer (an underestimate where a streamed layer's load outlasts its compute), and
the two weight buffers hold whole layers (2w, not 2(1 - wg)w, while any layer streams). With
`cpu_attention` too, the executor attends on the CPU over the host cache in decode steps as FlexGen
does (`Placement.cpu_attention`): no cache on the link, q, k, v down (3 h1 per token) and the output
up (h1) instead, the CPU's attention beside the GPU's compute, and slots that hold the prompt's
columns only; `search` tries both (`cpu_attention=(False, True)`) and the policy says which won.
The CPU's attention takes the longer of its flops at the CPU's measured attention rate (FlexGen's
term) and the cache's bytes at host memory's rate (`cpu_memory`, where measured); it runs after the
GPU's part and before the rest (a sum, A.3's and the executor's). A caller that knows its
executor's memory better than `peak_bytes` passes the search its own count (`peaks`;
exec/offload_memory.py); `layer_terms` gives each resource's time, from which a bound is taken.

Two terms FlexGen's model lacks, both per GPU batch of a layer (a "unit": a block's step issues
layers x num_batches of them), measured where the executor runs (exec/offload_auto.py), each
absent where its rate is 0 (unmeasured): each GPU batch's matmuls read the layer's weights from
device memory (`gpu_memory`: w bytes a unit, the roofline's other side of its flops, which at a
small GPU batch it is: 13B's layer is 634 MB, 0.2 ms at 3 TB/s, against 3 µs of flops for 3
rows); and the host issues each unit (`unit_seconds`: the executor's Python, the layer's
launches, the slot's copies and sync; exec/offload_host.py), which the device's compute overlaps
(launches run ahead of it) but cannot outrun: comp becomes max(the GPU's, the host's). Without
them a block of many small GPU batches looked as fast as one of few large ones; on one H100 the
measured decode step of 64 batches of 3 ran 2.7x the prediction.

Compression (FlexGen §5; `ModelShape.weight_ratio`, `kv_ratio`: the bytes a 4-bit tensor moves per
dense byte, ~0.28 for groups of 64 in 16 bits): the link carries the streamed weights and the host
cache at their compressed size, and the GPU expands what crossed (reading the codes, writing the
values) at device memory's rate, beside its matmuls, once a step for a streamed layer; a resident
layer kept 4-bit (exec/offload_resident.py) multiplies its codes directly for a GPU batch of up to
CODE_ROWS rows and is expanded for each larger one (every prompt step). The memory the compressed
tensors hold is the caller's count (`peaks`).
"""
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ModelShape:
    layers: int  # l
    hidden: int  # h1
    intermediate: int  # h2
    prompt: int  # s
    generate: int  # n
    weight_ratio: float = 1.0  # bytes a streamed layer moves per dense byte (4-bit codes: ~0.28; FlexGen §5)
    kv_ratio: float = 1.0  # the same for the host's KV cache

    @property
    def layer_bytes(self) -> float:
        return 2.0 * (4 * self.hidden ** 2 + 2 * self.hidden * self.intermediate)  # FlexGen's 8h1² + 4h1h2


@dataclass(frozen=True)
class Hardware:
    ctog: float  # bytes/s, CPU -> GPU
    gtoc: float  # GPU -> CPU
    dtoc: float  # disk -> CPU
    ctod: float  # CPU -> disk
    mm_flops: float  # the GPU's matmuls
    bmm_flops: float  # the GPU's attention
    cpu_flops: float  # the CPU's attention
    gpu_bytes: float
    cpu_bytes: float
    disk_bytes: float = 0.0
    cpu_memory: float = 0.0  # bytes/s host memory serves the CPU's attention (0: unmeasured, no term)
    gpu_memory: float = 0.0  # bytes/s device memory serves a GPU batch's weight reads (0: unmeasured, no term)
    unit_seconds: float = 0.0  # host seconds to issue one GPU batch of one layer (0: unmeasured, no term)
    unit_seconds_resident: float = 0.0  # the same where nothing is offloaded (no slot waits on the GPU: the launches
    # only, issued while the GPU runs); 0: unmeasured, unit_seconds counts


@dataclass(frozen=True)
class Policy:
    gpu_batch: int
    num_batches: int
    wg: float
    wc: float
    cg: float
    cc: float
    hg: float
    hc: float
    cpu_attention: bool = False  # a cache off the GPU is attended on the CPU in decode steps (with kv_to_gpu)

    @property
    def block(self) -> int:
        return self.gpu_batch * self.num_batches


def mean_kv_bytes(m: ModelShape, bls: int) -> float:
    """One layer's K and V of a block, at the mean decode step (FlexGen's 4 bls (s + n/2) h1)."""
    return 4 * bls * (m.prompt + m.generate / 2) * m.hidden


def cpu_attention_seconds(kv_bytes, hw: Hardware):
    """The CPU's attention over `kv_bytes` of cache: its flops (numerically the bytes: 2 per value
    of K and of V) at the CPU's rate, or the bytes read at host memory's, whichever is longer."""
    return np.maximum(kv_bytes / hw.cpu_flops, kv_bytes / hw.cpu_memory if hw.cpu_memory else 0.0)


def layer_terms(m: ModelShape, hw: Hardware, gbs: int, nb: int, p: np.ndarray, kv_to_gpu: bool = False,
                cpu_attention: bool = False) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Each resource's seconds per layer, (ctog, gtoc, dtoc, ctod, comp, cpu, host) for prefill and
    for a decode step, for placements `p` [P, 6] (wg, wc, cg, cc, hg, hc): comp the GPU's (its
    matmuls' flops or, per GPU batch, the weights' reads, whichever is longer, and attention), cpu
    the CPU's attention, host the issuing of the layer's GPU batches; what `layer_seconds` combines,
    and what a bound takes the slowest of. `kv_to_gpu`: the executor's model, whose decode step
    moves the KV cache that lives off the GPU to it and attends there (exec/offload.py), instead of attending on the CPU where it lives (FlexGen's delegation);
    with `cpu_attention` too, the executor delegates as FlexGen does, moving q, k, v and the output."""
    wg, wc, cg, cc, hg, hc = p.T
    wd, cd, hd = 1 - wg - wc, 1 - cg - cc, 1 - hg - hc
    w, h1, s, bls = m.layer_bytes, m.hidden, m.prompt, gbs * nb
    wr, kr = m.weight_ratio, m.kv_ratio
    kv_mean = mean_kv_bytes(m, bls)
    pre = (((wc + wd) * w * wr + 2 * (hc + hd) * s * h1 * bls) / hw.ctog,
           (4 * (cc + cd) * (s + 1) * h1 * bls * kr + 2 * (hc + hd) * s * h1 * bls) / hw.gtoc,
           (wd * w + 2 * hd * s * h1 * bls) / hw.dtoc if hw.dtoc else np.where(wd + hd > 0, np.inf, 0.0),
           (4 * cd * bls * (s + 1) * h1 + 2 * hd * s * h1 * bls) / hw.ctod if hw.ctod else np.where(cd + hd > 0, np.inf, 0.0),
           _matmuls(hw, w, gbs, nb, gbs * (8 * s * h1 ** 2 + 4 * s * h1 * m.intermediate))
           + 4 * bls * s ** 2 * h1 / hw.bmm_flops + _expansion(hw, (wc + wd + nb * wg) * w, wr),
           np.zeros_like(wg),  # (the prompt step attends on the GPU)
           nb * _unit_seconds(hw, wg, cg, hg))
    on_gpu = kv_to_gpu and not cpu_attention  # (a host cache's decode attention: moved to the GPU, or on the CPU)
    kv_moved = (cc + cd) * kv_mean if on_gpu else 0.0  # (the cache read in, every decode step)
    qkv, out = ((cc + cd) * 6 * h1 * bls, (cc + cd) * 2 * h1 * bls) if kv_to_gpu and cpu_attention else (0.0, 0.0)
    dec = (((wc + wd) * w * wr + 2 * (hc + hd) * h1 * bls + kv_moved * kr + out) / hw.ctog,
           (2 * (hc + hd) * h1 * bls + qkv) / hw.gtoc,
           (4 * cd * kv_mean + wd * w + 2 * hd * h1 * bls) / hw.dtoc if hw.dtoc else np.where(cd + wd + hd > 0, np.inf, 0.0),
           (4 * cd * bls * h1 + 2 * hd * h1 * bls) / hw.ctod if hw.ctod else np.where(cd + hd > 0, np.inf, 0.0),
           _matmuls(hw, w, gbs, nb, gbs * w) + (kv_mean if on_gpu else cg * kv_mean) / hw.bmm_flops
           + _expansion(hw, (wc + wd + (nb * wg if gbs > CODE_ROWS else 0.0)) * w, wr) + _expansion(hw, kv_moved, kr),
           np.zeros_like(wg) if on_gpu else (cc + cd) * cpu_attention_seconds(kv_mean, hw),
           nb * _unit_seconds(hw, wg, cg, hg))
    return pre, dec


def _unit_seconds(hw: Hardware, wg, cg, hg):
    """The host's seconds per unit for each placement: fewer where it keeps everything on the GPU
    (exec/offload.py: a block that moves nothing never waits on the GPU between units)."""
    resident = hw.unit_seconds_resident or hw.unit_seconds
    return np.where((wg >= 1) & (cg >= 1) & (hg >= 1), resident, hw.unit_seconds)


CODE_ROWS = 16  # rows a resident 4-bit layer's projections multiply straight from the codes (kernels/compress4.py
# GEMV4_MAX_ROWS); a GPU batch of more rows expands the layer first, as every prompt step does


def _expansion(hw: Hardware, dense_bytes, ratio: float):
    """The GPU's expansion of compressed bytes into `dense_bytes` (reading the codes, writing the
    values) at device memory's rate; nothing where nothing is compressed or the rate is unmeasured."""
    if ratio >= 1.0 or not hw.gpu_memory:
        return 0.0
    return dense_bytes * (1.0 + ratio) / hw.gpu_memory


def _matmuls(hw: Hardware, w: float, gbs: int, nb: int, flops: float) -> float:
    """A layer's matmuls over `nb` GPU batches of `flops` each: per batch its flops or its read of
    the layer's `w` weight bytes from device memory, whichever is longer (flops alone unmeasured)."""
    return nb * max(flops / hw.mm_flops, w / hw.gpu_memory if hw.gpu_memory else 0.0)


def layer_seconds(m: ModelShape, hw: Hardware, gbs: int, nb: int, p: np.ndarray, kv_to_gpu: bool = False,
                  cpu_attention: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(prefill, decode) seconds per layer for placements `p` [P, 6] (wg, wc, cg, cc, hg, hc), FlexGen's
    combination of `layer_terms`: prefill overlaps its chains, decode serialises the load in; the
    GPU's compute overlaps the host's issuing of it (the longer counts), and the CPU's attention
    adds to both."""
    wg = p.T[0]
    pre, dec = layer_terms(m, hw, gbs, nb, p, kv_to_gpu, cpu_attention)
    prefill = np.maximum(np.maximum(pre[0] + pre[2], pre[1] + pre[3]), np.maximum(pre[4], pre[6]) + pre[5])
    decode = dec[0] + np.maximum(np.maximum(dec[1], dec[2]), np.maximum(dec[3], np.maximum(dec[4], dec[6]) + dec[5]))
    return np.broadcast_to(prefill, wg.shape), np.broadcast_to(decode, wg.shape)


def peak_bytes(m: ModelShape, gbs: int, nb: int, p: np.ndarray, kv_to_gpu: bool = False,
               cpu_attention: bool = False) -> np.ndarray:
    """[P, 3]: each tier's peak (GPU, CPU, disk): what lives there, plus the GPU's working set
    (two layers' weight buffers for what is not resident, one GPU batch's activations; with
    `kv_to_gpu`, two whole layers' buffers while any layer streams, and three GPU batches' cache
    slots of one layer for a cache that is not resident: of the prompt's columns with `cpu_attention`)."""
    wg, wc, cg, cc, hg, hc = p.T
    wd, cd, hd = 1 - wg - wc, 1 - cg - cc, 1 - hg - hc
    weights = m.layer_bytes * m.layers
    kv = 4 * (m.prompt + m.generate) * m.hidden * gbs * nb * m.layers
    act = 2 * m.hidden * gbs * nb * m.prompt
    buffers = np.where(wg < 1, 2.0, 0.0) if kv_to_gpu else 2 * (1 - wg)  # (layers' worth: whole ones, or shares)
    gpu = wg * weights + cg * kv + hg * act + buffers * m.layer_bytes + 2 * m.hidden * gbs * m.prompt
    if kv_to_gpu:
        columns = m.prompt if cpu_attention else m.prompt + m.generate
        gpu = gpu + np.where(cg < 1, 3 * 4 * columns * m.hidden * gbs, 0.0)
    return np.stack([gpu, wc * weights + cc * kv + hc * act, wd * weights + cd * kv + hd * act], axis=1)


def placements(step: float, weight_step: float | None = None) -> np.ndarray:
    """Every (wg, wc, cg, cc, hg, hc) on a grid of `step` (the weights' of `weight_step`, default
    `step`: e.g. 1 / layers for whole layers) whose tiers' fractions sum to 1."""
    weights, other = _pairs(weight_step or step), _pairs(step)
    i, j, k = np.meshgrid(np.arange(len(weights)), np.arange(len(other)), np.arange(len(other)), indexing="ij")
    return np.concatenate([weights[i.ravel()], other[j.ravel()], other[k.ravel()]], axis=1)


def _pairs(step: float) -> np.ndarray:
    """(GPU, CPU) fractions k / n, n = 1 / step, that sum to at most 1 (the rest on disk)."""
    n = round(1 / step)
    f = np.arange(n + 1) / n
    return np.array([(a, b) for a in f for b in f if a + b <= 1 + 1e-9])


Peaks = Callable[[int, int, np.ndarray, bool], np.ndarray]  # (gbs, nb, placements [P, 6], cpu_attention) ->
# [P, 3] bytes per tier


def best_placement(m: ModelShape, hw: Hardware, gbs: int, nb: int, grid: np.ndarray, kv_to_gpu: bool = False,
                   peaks: Peaks | None = None, cpu_attention: bool = False) -> tuple[float, np.ndarray | None]:
    """(tokens/s, placement) of the fastest placement of `grid` that fits; (0, None) if none does.
    `peaks`: each tier's peak as the caller's executor counts it (default: `peak_bytes`)."""
    capacity = np.array([hw.gpu_bytes, hw.cpu_bytes, hw.disk_bytes])
    peak = peaks(gbs, nb, grid, cpu_attention) if peaks is not None else \
        peak_bytes(m, gbs, nb, grid, kv_to_gpu, cpu_attention)
    fits = (peak <= capacity + 1e-6).all(1)
    if not fits.any():
        return 0.0, None
    prefill, decode = layer_seconds(m, hw, gbs, nb, grid[fits], kv_to_gpu, cpu_attention)
    rate = gbs * nb * m.generate / (m.layers * (prefill + (m.generate - 1) * decode))
    best = int(np.argmax(rate))
    return float(rate[best]), grid[fits][best]


def gpu_batch_sizes(limit: int) -> list[int]:
    """FlexGen's candidates: 1, 2, 3, 4, then doubling."""
    sizes, size = [1, 2, 3, 4], 8
    while size <= limit:
        sizes.append(size)
        size *= 2
    return [s for s in sizes if s <= limit]


def search(m: ModelShape, hw: Hardware, step: float = 0.25, max_gpu_batch: int = 64,
           max_batches: int = 64, max_block: int | None = None, kv_to_gpu: bool = False,
           weight_step: float | None = None, peaks: Peaks | None = None,
           cpu_attention: tuple[bool, ...] = (False,)) -> tuple[float, Policy | None]:
    """FlexGen's search: for each GPU batch size, double the number of GPU batches while a
    placement fits and tokens/s grows, then look between the last two; the best policy found
    (of policies as fast, the largest block, then the largest GPU batch: each GPU batch of a block
    is a slot of its own launches and sync, which only `Hardware.unit_seconds` counts). With
    `max_block`, blocks of at most that many sequences (a run of that many prompts); `kv_to_gpu`:
    as `layer_seconds`; `weight_step`: as `placements`; `peaks`: as `best_placement`;
    `cpu_attention`: the options tried for each block (with `kv_to_gpu`), the first of those as fast kept."""
    grid = placements(step, weight_step)
    best_rate, best = 0.0, None
    for gbs in gpu_batch_sizes(min(max_gpu_batch, max_block or max_gpu_batch)):
        max_batches_here = max_batches if max_block is None else min(max_batches, max_block // gbs)
        rates = {}
        nb = 1
        while nb <= max_batches_here:
            rates[nb] = _best_option(m, hw, gbs, nb, grid, kv_to_gpu, peaks, cpu_attention)
            if rates[nb][1] is None or (nb > 1 and rates[nb][0] <= rates[nb // 2][0]):
                break
            nb *= 2
        for between in range(max(1, nb // 4) + 1, min(nb, max_batches_here + 1)):  # (between the last doublings)
            rates.setdefault(between, _best_option(m, hw, gbs, between, grid, kv_to_gpu, peaks, cpu_attention))
        for nb, (rate, placement, on_cpu) in rates.items():
            tie = best is not None and rate >= best_rate * (1 - 1e-12) and (gbs * nb, gbs) > (best.block, best.gpu_batch)
            if placement is not None and (rate > best_rate * (1 + 1e-12) or tie):  # (ties: the larger block, GPU batch)
                best_rate, best = rate, Policy(gbs, nb, *map(float, placement), cpu_attention=on_cpu)
    return best_rate, best


def _best_option(m: ModelShape, hw: Hardware, gbs: int, nb: int, grid: np.ndarray, kv_to_gpu: bool,
                 peaks: Peaks | None, options: tuple[bool, ...]) -> tuple[float, np.ndarray | None, bool]:
    """`best_placement` under each cpu_attention option: (tokens/s, placement, option) of the fastest,
    the first option of those as fast (a cache on the GPU is as fast under either: no delegation)."""
    best = (0.0, None, options[0])
    for on_cpu in options:
        rate, placement = best_placement(m, hw, gbs, nb, grid, kv_to_gpu, peaks, on_cpu)
        if placement is not None and (best[1] is None or rate > best[0] * (1 + 1e-12)):
            best = (rate, placement, on_cpu)
    return best

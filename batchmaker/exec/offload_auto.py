"""`offload=auto`: the machine's rates measured at start-up (about a second), FlexGen's
cost model and policy search (core/offload_policy.py) over what the executor runs, and the chosen
policy with its predicted step time, as one line to print.

What is measured (`measure`): the copy rate host -> device and back (pinned host memory beside a
GPU; on a CPU, between two CPU tensors, the executor's two pools), the device's matmul rate at
the model's dtype, host memory's rate (a large copy), and the executor's own CPU attention
(exec/offload_block.BatchAttend over a host cache in the model's dtype, one decode step, on torch's
intra-op threads: FlexGen's CPU attention term, an effective rate that includes the fp32 copies),
device memory's rate (a large copy on the device: each GPU batch's read of a layer's weights) and
the executor's host seconds per (GPU batch, layer) of a decode step (exec/offload_host.py, over a
tiny decoder of the model's family: a second or so on a GPU).
A cache on the host is attended in decode steps either on the device after a move (`kv_to_gpu`)
or on the CPU where it lives (`Placement.cpu_attention`): the search tries both for each block and
keeps the faster by prediction. The search runs over what the executor places: the weights' share on the
device by whole layers (fractions k / layers: `Placement.weights_gpu`, resident weights counted
against the device budget), the KV cache and hidden states wholly on the host or the device
(fractions 0 or 1; no disk), so a policy maps onto a `Placement` exactly. What a policy takes of
each memory is the executor's own count (exec/offload_memory.py: its buffers, slots, working set
and reserve, the host arena's chunks), not FlexGen's formula, so that a budget can be a cap.
`bound` states the policy's bound: the slowest of the host link, host memory, the GPU and (with
cpu_attention) the CPU, each busy for its own share of a step (the cost model's terms, overlapped
perfectly; the executor runs the CPU's attention and the GPU's compute one after the other, which
the prediction counts).

Adaptations of FlexGen's model (it counts 2-byte values, OPT's two-matrix MLP and one KV head per
query head): the model is described to it with an MLP width scaled to Llama's three matrices, and
the rates are converted to its 2-byte units for the model's dtype; grouped-query KV is counted as
FlexGen's full KV (an overestimate of the KV traffic).
"""
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from batchmaker.cells.decoder_config import PRESETS, DecoderConfig
from batchmaker.core.offload_policy import (Hardware, ModelShape, Policy, layer_seconds, layer_terms, mean_kv_bytes,
                                            peak_bytes, search)
from batchmaker.core.zigzag import Placement
from batchmaker.exec.offload_block import BatchAttend, BatchPrompts
from batchmaker.exec.offload_host import unit_seconds
from batchmaker.exec.offload_memory import Footprint, ModelBytes, footprint, peaks

CPU_DEVICE_BYTES = 1 << 30  # the "device" pool's budget on a CPU when none is given


@dataclass(frozen=True)
class Rates:
    ctog: float  # bytes/s host -> device
    gtoc: float  # bytes/s device -> host
    mm_flops: float  # the device's matmuls
    cpu_flops: float  # the CPU's decode attention (the executor's, in the model's dtype: an effective rate)
    host_memory: float = 0.0  # bytes/s host memory serves (a large copy's reads and writes); 0: unmeasured
    cpu_threads: int = 0  # torch's intra-op threads the CPU's rates were measured on (0: not said)
    device_memory: float = 0.0  # bytes/s device memory serves (a large copy on the device); 0: unmeasured
    unit_seconds: float = 0.0  # the executor's host seconds per (GPU batch, layer) of a decode step; 0: unmeasured
    unit_seconds_resident: float = 0.0  # the same with nothing offloaded (no waits between units); 0: unmeasured


@dataclass(frozen=True)
class Choice:
    policy: Policy
    placement: Placement
    tokens_per_s: float  # predicted
    step_seconds: float  # predicted: one decode step of the whole block (every layer)
    footprint: Footprint  # predicted: device and host bytes at the block's peak
    compress: str | None = None  # what the policy was chosen for (OffloadConfig's compress)

    def describe(self) -> str:
        p = self.placement
        where = lambda offloaded: "host" if offloaded else "device"
        weights = "weights on device" if not p.weights else "weights on host" if not p.weights_gpu else \
            f"weights_gpu={p.weights_gpu:.2f} (the first layers' weights on device, the others' on host)"
        cache = "KV cache on device" if not p.cache else \
            f"KV cache on host ({'decode attention on the CPU' if p.cpu_attention else 'moved to the device to attend'})"
        return (f"offload policy: gpu_batch={self.policy.gpu_batch} num_batches={self.policy.num_batches} "
                f"(block {self.policy.block}); {weights}, {cache}, "
                f"hidden states on {where(p.hidden)}; predicted decode step {self.step_seconds * 1e3:.2f} ms, "
                f"{self.tokens_per_s:.1f} tokens/s, device {self.footprint.device / 2**30:.2f} GiB, "
                f"host {self.footprint.host / 2**30:.1f} GiB" + (f", 4-bit {self.compress}" if self.compress else ""))


def _seconds(fn, repeats: int = 3) -> float:
    fn()  # (warm-up)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def measure(device, dtype: torch.dtype, copy_bytes: int = 32 << 20, size: int | None = None,
            config: DecoderConfig | None = None) -> Rates:
    """The rates of this machine: copies of `copy_bytes` (8 times that within a memory), matmuls of
    `size` cubed (4,096 on a GPU: at 512 an H100's matmul took less time than its launch and measured
    7.6 TFLOP/s; 512 on a CPU), the executor's host cost per unit over a tiny decoder of `config`'s
    family (None: Llama's)."""
    device = torch.device(device)
    is_cuda = device.type == "cuda"
    size = size or (4096 if is_cuda else 512)
    host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=is_cuda)
    dev = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    ctog = copy_bytes / _seconds(lambda: dev.copy_(host, non_blocking=True))
    gtoc = copy_bytes / _seconds(lambda: host.copy_(dev, non_blocking=True))
    a = torch.randn(size, size, dtype=dtype, device=device)
    mm = 2 * size ** 3 / _seconds(lambda: a @ a)
    memory = _copy_rate("cpu", 8 * copy_bytes)  # (beyond the caches)
    device_memory = _copy_rate(device, 8 * copy_bytes) if is_cuda else memory  # (a CPU's device pool: host memory)
    unit = unit_seconds(config or PRESETS["tiny-llama"], device, dtype)
    resident = unit_seconds(config or PRESETS["tiny-llama"], device, dtype, placement=Placement(False, False, False))
    return Rates(ctog, gtoc, mm, cpu_attention_flops(dtype, 2 * copy_bytes), memory, torch.get_num_threads(),
                 device_memory, unit, resident)


def _copy_rate(device, nbytes: int) -> float:
    """bytes/s a copy of `nbytes` within `device`'s memory reads and writes."""
    src, dst = (torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2))
    return 2 * nbytes / _seconds(lambda: dst.copy_(src))


def cpu_attention_flops(dtype: torch.dtype, kv_bytes: int, rows: int = 8, heads: int = 8, head_dim: int = 128) -> float:
    """flop/s of the executor's CPU attention: one decode step of `rows` sequences over a host cache
    of `kv_bytes` (K and V, one query head a KV head: FlexGen's count)."""
    itemsize = torch.finfo(dtype).bits // 8
    end = max(16, kv_bytes // (2 * rows * heads * head_dim * itemsize))  # the columns attended
    k_cache, v_cache = (torch.empty(end, rows, heads, head_dim, dtype=dtype).normal_() for _ in range(2))
    batch = BatchPrompts(torch.zeros(rows, end - 1, dtype=torch.long), torch.zeros(rows, dtype=torch.long), end)
    q, k, v = (torch.randn(rows, heads, head_dim).to(dtype) for _ in range(3))
    workspace = tuple(torch.empty(rows, heads, end, head_dim) for _ in range(2))  # (fp32, as the executor's)
    attend = BatchAttend(k_cache, v_cache, batch, 1, head_dim ** -0.5, None, workspace)  # (step 1 writes column end - 1)
    return 4 * rows * heads * end * head_dim / _seconds(lambda: attend(0, q, k, v))


def host_bytes() -> float:
    """The machine's physical memory (the host pool's bound)."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def model_shape(config: DecoderConfig, prompt: int, generate: int, compress: str | None = None,
                dtype: torch.dtype = torch.bfloat16) -> ModelShape:
    """FlexGen's view of `config`: a gated MLP's three matrices as an OPT MLP 1.5x wider; with
    `compress` ("weights", "kv", "both") the bytes a streamed layer and the host cache move per
    dense byte, as exec/offload_memory.py counts their codes."""
    width = config.intermediate_size * (3 if config.family == "llama" else 2) // 2
    model = ModelBytes.of(config, dtype) if compress else None
    weight_ratio = model.layer4 / model.layer if compress in ("weights", "both") else 1.0
    kv_ratio = sum(model.kv_tensor4(1, 1, 1)) / model.kv_tensor(1, 1, 1) if compress in ("kv", "both") else 1.0
    return ModelShape(config.num_layers, config.hidden_size, width, prompt, generate, weight_ratio, kv_ratio)


def _compresses(compress: str | None) -> tuple[bool, bool]:
    """(weights, cache) of a `compress` setting (OffloadConfig's)."""
    if compress not in (None, "weights", "kv", "both"):
        raise ValueError(f"compress={compress!r}: None, 'weights', 'kv' or 'both'")
    return compress in ("weights", "both"), compress in ("kv", "both")


def hardware(rates: Rates, dtype: torch.dtype, device_bytes: float, host: float) -> Hardware:
    """The cost model's machine, in its 2-byte units: our bytes count 2 / itemsize of its values."""
    units = 16 / torch.finfo(dtype).bits
    return Hardware(ctog=rates.ctog * units, gtoc=rates.gtoc * units, dtoc=0.0, ctod=0.0, mm_flops=rates.mm_flops,
                    bmm_flops=rates.mm_flops, cpu_flops=rates.cpu_flops, gpu_bytes=device_bytes * units,
                    cpu_bytes=host * units, disk_bytes=0.0, cpu_memory=rates.host_memory * units,
                    gpu_memory=rates.device_memory * units, unit_seconds=rates.unit_seconds,
                    unit_seconds_resident=rates.unit_seconds_resident)


def choose(config: DecoderConfig, dtype: torch.dtype, rates: Rates, device_bytes: float, host: float,
           prompt: int, generate: int, max_gpu_batch: int = 64, max_batches: int = 64,
           max_block: int | None = None, reserve: float = 0.0, pinned: bool = False,
           host_weights: float | None = None, cpu_attention: bool | None = None,
           compress: str | None = None) -> Choice:
    """The fastest policy the executor runs within `device_bytes` and `host` bytes (and blocks of
    at most `max_block` sequences), each counted as exec/offload_memory.py counts the executor's
    tensors: `reserve` device bytes held back (CUDA_RESERVE on a GPU), host storage `pinned` (a
    GPU's), `host_weights` the weights' host copy the caller holds (None: the streamed layers).
    `cpu_attention`: how a host cache is attended in decode steps (None: the search picks, per block).
    `compress` (OffloadConfig's): the policy for 4-bit weights, cache or both, their bytes on the link
    and in memory counted as compressed; a compressed cache lives on the host and is attended on the
    device (the executor's only way for it), so the search keeps it there."""
    weights4, cache4 = _compresses(compress)
    hw = hardware(rates, dtype, device_bytes, host)
    shape = model_shape(config, prompt, generate, compress, dtype)
    model = ModelBytes.of(config, dtype)
    units = 16 / torch.finfo(dtype).bits  # (the cost model's 2-byte units)

    def executor_peaks(gbs: int, nb: int, grid: np.ndarray, on_cpu: bool) -> np.ndarray:
        cache_on = grid[:, 2] >= 1
        device, on_host = peaks(model, gbs, nb, prompt, generate, grid[:, 0], cache_on, grid[:, 4] >= 1,
                                reserve, pinned, host_weights, cpu_attention=on_cpu, compress_weights=weights4,
                                compress_cache=cache4)
        if cache4:  # (a 4-bit cache is the host's: a device cache does not fit)
            device = np.where(cache_on, np.inf, device)
        disk = peak_bytes(shape, gbs, nb, grid, kv_to_gpu=True)[:, 2]  # (no disk tier: 0 holds nothing)
        return np.stack([device * units, on_host * units, disk], axis=1)

    options = (False,) if cache4 else (False, True) if cpu_attention is None else (cpu_attention,)
    rate, policy = search(shape, hw, step=1.0, max_gpu_batch=max_gpu_batch, max_batches=max_batches,
                          max_block=max_block, kv_to_gpu=True, weight_step=1 / config.num_layers, peaks=executor_peaks,
                          cpu_attention=options)
    if policy is None:
        raise ValueError(f"no placement of the model fits {device_bytes / 2**30:.2f} GiB of device and "
                         f"{host / 2**30:.1f} GiB of host memory")
    p = np.array([[policy.wg, policy.wc, policy.cg, policy.cc, policy.hg, policy.hc]])
    decode = layer_seconds(shape, hw, policy.gpu_batch, policy.num_batches, p, kv_to_gpu=True,
                           cpu_attention=policy.cpu_attention)[1][0]
    is_offloaded = policy.wg < 1
    placement = Placement(is_offloaded, policy.cg < 1, policy.hg < 1, policy.wg if is_offloaded else 0.0,
                          cpu_attention=policy.cpu_attention and policy.cg < 1)
    used = footprint(model, policy.gpu_batch, policy.num_batches, prompt, generate, policy.wg, policy.cg >= 1,
                     policy.hg >= 1, reserve=reserve, pinned=pinned, host_weights=host_weights,
                     cpu_attention=placement.cpu_attention, compress_weights=weights4, compress_cache=cache4)
    return Choice(policy, placement, rate, float(decode) * config.num_layers, used, compress)


@dataclass(frozen=True)
class Prediction:
    block_seconds: float  # the whole block: prefill and every decode step, every layer
    prefill_seconds: float  # step 0 (the prompts), every layer
    step_seconds: float  # one decode step of the block, every layer
    footprint: Footprint  # device and host bytes at the block's peak (exec/offload_memory.py)


def _placement_array(config: DecoderConfig, placement: Placement) -> np.ndarray:
    """The cost model's (wg, wc, cg, cc, hg, hc) of a placement the executor runs."""
    wg = placement.num_resident(config.num_layers) / config.num_layers
    return np.array([[wg, 1 - wg] + [v for is_off in (placement.cache, placement.hidden)
                                     for v in ((0.0, 1.0) if is_off else (1.0, 0.0))]])


def predict(config: DecoderConfig, dtype: torch.dtype, rates: Rates, placement: Placement, gpu_batch: int,
            num_batches: int, prompt: int, generate: int, reserve: float = 0.0, pinned: bool = False,
            host_weights: float | None = None, compress: str | None = None) -> Prediction:
    """The cost model's times for a policy the executor runs (the weights' share on the device by
    whole layers, the cache and hidden states wholly on the host or the device), and its memory
    (`reserve`, `pinned`, `host_weights`, `compress`: as `choose`)."""
    weights4, cache4 = _compresses(compress)
    hw = hardware(rates, dtype, 0.0, 0.0)
    p = _placement_array(config, placement)
    prefill, decode = (float(t[0]) * config.num_layers for t in
                       layer_seconds(model_shape(config, prompt, generate, compress, dtype), hw, gpu_batch, num_batches,
                                     p, kv_to_gpu=True, cpu_attention=placement.cpu_attention))
    used = footprint(ModelBytes.of(config, dtype), gpu_batch, num_batches, prompt, generate, p[0, 0],
                     not placement.cache, not placement.hidden, reserve=reserve, pinned=pinned, host_weights=host_weights,
                     cpu_attention=placement.cpu_attention, compress_weights=weights4, compress_cache=cache4 and placement.cache)
    return Prediction(prefill + (generate - 1) * decode, prefill, decode, used)


@dataclass(frozen=True)
class Bound:
    """A policy's bound (seconds of the whole model): each resource busy for its own work alone."""
    link: tuple[float, float]  # (prefill, decode step): the host link's busier direction
    host_memory: tuple[float, float]  # every byte crossing the link, and the cache the CPU attends over, at
    # host memory's rate
    gpu: tuple[float, float]  # the matmuls (or each GPU batch's weight reads) and attention at the device's rates
    tokens_per_s: float  # the block's tokens over (prefill + (generate - 1) x step), each the slowest resource's
    cpu: tuple[float, float] = (0.0, 0.0)  # the CPU's attention (cpu_attention)
    host: tuple[float, float] = (0.0, 0.0)  # the executor's issuing of every (GPU batch, layer) (`Rates.unit_seconds`)

    @property
    def binding(self) -> str:
        """Which resource bounds a decode step."""
        return max(("link", "host_memory", "gpu", "cpu", "host"), key=lambda name: getattr(self, name)[1])


def bound(config: DecoderConfig, dtype: torch.dtype, rates: Rates, placement: Placement, gpu_batch: int,
          num_batches: int, prompt: int, generate: int, compress: str | None = None) -> Bound:
    """The slowest of the host link, host memory, the GPU, the CPU (its attention) and the host's
    issuing of the units for a policy, from the cost model's terms (`layer_terms`); host memory and
    the units count only where measured (`Rates.host_memory`, `Rates.unit_seconds`)."""
    hw = hardware(rates, dtype, 0.0, 0.0)
    units = 16 / torch.finfo(dtype).bits
    shape = model_shape(config, prompt, generate, compress, dtype)
    pre, dec = layer_terms(shape, hw, gpu_batch, num_batches, _placement_array(config, placement), kv_to_gpu=True,
                           cpu_attention=placement.cpu_attention)
    layers = config.num_layers
    pre, dec = ([float(np.ravel(term)[0]) * layers for term in terms] for terms in (pre, dec))  # (one policy)
    link = tuple(max(t[0], t[1]) for t in (pre, dec))
    read = layers * mean_kv_bytes(shape, gpu_batch * num_batches) if placement.cpu_attention else 0.0  # (by the CPU)
    moved = (pre[0] * hw.ctog + pre[1] * hw.gtoc, dec[0] * hw.ctog + dec[1] * hw.gtoc + read)  # (2-byte units)
    memory = tuple(m / (rates.host_memory * units) if rates.host_memory else 0.0 for m in moved)
    gpu, cpu, host = (tuple(t[i] for t in (pre, dec)) for i in (4, 5, 6))
    prefill, step = (max(link[i], memory[i], gpu[i], cpu[i], host[i]) for i in (0, 1))
    return Bound(link, memory, gpu, gpu_batch * num_batches * generate / (prefill + (generate - 1) * step), cpu, host)

"""What the offloading executor (exec/offload.py) holds on the device and on the host for a policy,
counted from the tensors it allocates: the search's memory check (exec/offload_auto.py passes it
to core/offload_policy.search as `peaks`) and the prediction a bench compares with the measured
peak (issue 34: under a process-wide cap, weights, KV cache, activations and workspace together).

FlexGen's `peak_bytes` counts the weights, the cache, one GPU batch's hidden states and the weight
buffers; the executor also holds, on the device:
    rest       the embedding, final norm and head (never offloaded)
    slots      3 batch buffers of the cache and of the hidden states (x and residual: 2 tensors)
               for what is offloaded (with `cpu_attention`, a cache slot holds the prompt's columns
               only: no decode step brings the cache there); what is not lives there whole (every batch)
    working    one GPU batch's compute at its peak: the prompt step's attention in fp32 (scores
               and their softmax, B x heads x prompt^2 each, beside fp32 copies of q, K, V and the
               output) or its MLP, over the layer's inputs and the residual stream; or a decode
               step's fp32 copies of a batch's K and V, where larger (short prompts), unless the CPU
               attends (`cpu_attention` over a host cache: the decode step's attention is the host's)
    reserve    what no policy shapes: cuBLAS workspaces, the caching allocator's 2 MiB rounding and
               the gap between what is allocated and what it reserves (`CUDA_RESERVE` on a GPU; the
               cap bounds what it reserves)
and on the host: the block's arena (exec/pinned_arena.py, `arena_bytes`: its chunks, each rounded
up to a power of two by torch's pinned allocator beside a GPU, with what each chunk's tail wastes)
holding, in the executor's order, the cache's (layer, batch) tensors and the hidden states where
offloaded and with `cpu_attention` the q | k | v and output staging (exec/offload_attention.py);
the weights' host copy (the streamed share, FlexGen's count, unless the caller says what it
holds); and with `cpu_attention` the CPU's decode working set (a batch's fp32 K, V and scores, not
pinned). With `compress_weights` (compress="weights"; the search passes it for a compressed
executor) the weights are counted as the executor keeps them: resident layers as 4-bit
codes plus one dense scratch of the largest matrix (exec/offload_resident.py), each weight buffer
dense beside its codes' staging (dequant expand or reference; fused frees the dense matrices, so
this over-counts it), the host copy as codes pinned a tensor each. With `compress_cache` (compress="kv")
the host cache's K and V are codes, scales and mins in the arena, and the device holds each batch slot's
codes staging (exec/offload_cache.py) and one store's codes beside the dense slots.
"""
import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from batchmaker.cells.decoder import empty_decoder
from batchmaker.cells.decoder_config import DecoderConfig
from batchmaker.core.zigzag import BATCH_BUFFERS, WEIGHT_BUFFERS
from batchmaker.exec import pinned_arena
from batchmaker.exec.offload_cache import kv_group
from batchmaker.exec.pinned_arena import arena_bytes

CUDA_RESERVE = 1 << 30  # bytes: the measured 13B peaks (allocated) sat within 1% of the count; reserved
# runs above allocated by the allocator's segments and fragmentation (an estimate, checked by bench/offload.py)


@dataclass(frozen=True)
class ModelBytes:
    """A decoder's sizes as the executor sees them (bytes at its dtype)."""
    num_layers: int
    layer: int  # one decoder layer's parameters
    rest: int  # the embedding, final norm and head
    hidden: int  # H
    intermediate: int  # I
    num_heads: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    tensors: tuple = ()  # bytes of each of a layer's tensors, in exec/offload_weights.layer_tensors' order
    tensors4: tuple = ()  # the same with each matrix as its 4-bit codes, scales and mins (3 tensors, groups of 64)
    staging4: int = 0  # the codes, scales and mins of a layer's matrices (a weight buffer's staging)
    largest_matrix: int = 0  # bytes of a layer's largest matrix (a resident 4-bit layer's scratch)

    @property
    def layer4(self) -> int:
        """One layer's bytes with its matrices 4-bit (the vectors stay dense)."""
        return sum(self.tensors4)

    @classmethod
    def of(cls, config: DecoderConfig, dtype: torch.dtype) -> "ModelBytes":
        lm = empty_decoder(config)  # (meta tensors: shapes, no memory)
        itemsize = torch.finfo(dtype).bits // 8
        layer = sum(t.numel() for t in lm.layers[0].parameters())
        total = sum(t.numel() for t in lm.parameters())
        shapes = [t.shape for t in [*lm.layers[0].parameters(), *lm.layers[0].buffers()]]
        tensors = tuple(math.prod(shape) * itemsize for shape in shapes)
        tensors4 = tuple(b for shape in shapes for b in _compressed(shape, itemsize))
        staging4 = sum(sum(_compressed(shape, itemsize)) for shape in shapes if len(shape) == 2)
        largest = max((math.prod(shape) * itemsize for shape in shapes if len(shape) == 2), default=0)
        return cls(config.num_layers, layer * itemsize, (total - layer * config.num_layers) * itemsize,
                   config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
                   config.head_dim, itemsize, tensors, tensors4, staging4, largest)

    def streamed_weights(self, streamed: np.ndarray, pinned: bool) -> np.ndarray:
        """The host bytes of `streamed` layers' weights as exec/offload_weights.HostWeights keeps
        them: beside a GPU in one arena (exec/pinned_arena.pin_in_place), else as they are."""
        streamed = np.asarray(streamed, dtype=np.int64)
        if not pinned or not self.tensors:
            return streamed * self.layer
        held = {int(n): _layers_arena(self.tensors, int(n), pinned_arena.CHUNK_BYTES) for n in np.unique(streamed)}
        return np.vectorize(held.__getitem__, otypes=[np.int64])(streamed)


    def kv_tensor(self, gpu_batch: int, prompt: int, generate: int) -> int:
        """One (layer, batch)'s K or V: [prompt + generate - 1, B, Hkv, D]."""
        return (prompt + generate - 1) * gpu_batch * self.num_kv_heads * self.head_dim * self.itemsize

    def kv_tensor4(self, gpu_batch: int, prompt: int, generate: int) -> tuple[int, int, int]:
        """One (layer, batch)'s K or V as 4-bit codes (exec/offload_cache.py): codes, scales, mins."""
        rows = (prompt + generate - 1) * gpu_batch * self.num_kv_heads
        return _compressed((self.head_dim, rows), self.itemsize, kv_group(self.head_dim))  # (grouped along the head)

    def hidden_tensor(self, gpu_batch: int, prompt: int) -> int:
        """One batch's hidden states between layers: [prompt, 2, B, H] (x and residual)."""
        return prompt * 2 * gpu_batch * self.hidden * self.itemsize

    def working(self, gpu_batch: int, prompt: int, generate: int, decode_attends: bool = True) -> int:
        """One GPU batch's compute at its peak (the larger of the prompt step and a decode step's
        attention, where the device attends in decode steps: `decode_attends`)."""
        e, n, hq, hkv, d = self.itemsize, gpu_batch * prompt, self.num_heads, self.num_kv_heads, self.head_dim
        inputs = 5 * n * self.hidden * e  # the inputs' copy (x, residual), the residual stream, two norms' outputs
        attention = (n * (hq + 2 * hkv) * d * e + n * (hq + hkv) * d * e  # q | k | v, rotated q, k
                     + 2 * gpu_batch * hkv * prompt * d * 4 + 2 * n * hq * d * 4  # fp32 K, V, q, output
                     + 2 * gpu_batch * hq * prompt * prompt * 4 + gpu_batch * prompt * prompt)  # scores, softmax, mask
        mlp = 3 * n * self.intermediate * e + 2 * n * self.hidden * e  # gate | up, act; output, the stacked pair
        return max(inputs + max(attention, mlp), self.decode_attention(gpu_batch, prompt, generate) if decode_attends
                   else 0)

    def decode_attention(self, gpu_batch: int, prompt: int, generate: int) -> int:
        """A decode step's attention over a batch's whole cache: fp32 K, V and scores."""
        end, hq, hkv, d = prompt + generate - 1, self.num_heads, self.num_kv_heads, self.head_dim
        return 2 * gpu_batch * hkv * end * d * 4 + 3 * gpu_batch * hq * end * 4

    def attention_staging(self, gpu_batch: int) -> tuple[int, int]:
        """The pinned q | k | v and output of one batch's decode step (cpu_attention)."""
        per_head = gpu_batch * self.head_dim * self.itemsize
        return (self.num_heads + 2 * self.num_kv_heads) * per_head, self.num_heads * per_head

def _compressed(shape: tuple, itemsize: int, group: int = 64) -> tuple[int, ...]:
    """Bytes of a tensor as exec/offload_weights keeps it: a matrix [N, K] as codes [K, N / group,
    group / 2] and a scale and a min a group; anything else as it is."""
    if len(shape) != 2:
        return (math.prod(shape) * itemsize,)
    groups = shape[1] * -(-shape[0] // group)
    return groups * group // 2, groups * itemsize, groups * itemsize


@functools.lru_cache(maxsize=4096)
def _layers_arena(tensors: tuple, layers: int, chunk_bytes: int) -> int:
    """A pinned arena's bytes for `layers` layers of `tensors` (the search asks for the same few often)."""
    return int(arena_bytes([(1, b) for b in tensors] * layers, True, chunk_bytes))


def peaks(model: ModelBytes, gpu_batch: int, num_batches: int, prompt: int, generate: int, wg: np.ndarray,
          cache_on_device: np.ndarray, hidden_on_device: np.ndarray, reserve: float = 0.0, pinned: bool = False,
          host_weights: float | None = None, cpu_attention: bool = False,
          compress_weights: bool = False, compress_cache: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(device, host) bytes [P] for placements given as the weights' share on the device `wg`
    (whole layers: the first floor(wg x layers)) and whether the cache and hidden states stay
    there. `host_weights`: the weights' host copy as the caller holds it (None: the streamed layers);
    `cpu_attention`: a host cache is attended on the CPU in decode steps (`Placement.cpu_attention`);
    `compress_weights`: the layers' matrices as 4-bit codes (compress="weights"), on the device and the host;
    `compress_cache`: a host cache as 4-bit codes (compress="kv"): its K and V codes in the arena, and on
    the device each batch slot's codes staging beside its dense K and V, and one store's codes."""
    wg, cache_on, hidden_on = (np.asarray(a, dtype=float) for a in (wg, cache_on_device, hidden_on_device))
    resident = np.floor(wg * model.num_layers + 1e-6)
    kv = 2 * model.kv_tensor(gpu_batch, prompt, generate)  # K and V of one (layer, batch)
    slot = 2 * model.kv_tensor(gpu_batch, prompt, 1) if cpu_attention else kv  # (the prompt's columns)
    hidden = model.hidden_tensor(gpu_batch, prompt)
    on_cpu = (cache_on == 0) & cpu_attention  # (the CPU attends in decode steps)
    working = np.where(on_cpu, model.working(gpu_batch, prompt, generate, decode_attends=False),
                       model.working(gpu_batch, prompt, generate))
    if compress_weights:  # (resident codes and one scratch; weight buffers dense beside their staging)
        weights_on_device = resident * model.layer4 + np.where(resident > 0, model.largest_matrix, 0) + \
            np.where(resident < model.num_layers, WEIGHT_BUFFERS * (model.layer + model.staging4), 0)
    else:
        weights_on_device = resident * model.layer + np.where(resident < model.num_layers, WEIGHT_BUFFERS * model.layer, 0)
    kv4 = model.kv_tensor4(gpu_batch, prompt, generate)
    codes_staging = np.where(cache_on > 0, 0, (2 * BATCH_BUFFERS + 1) * sum(kv4)) if compress_cache else 0
    device = (weights_on_device + model.rest + working + reserve + codes_staging
              + np.where(cache_on > 0, model.num_layers * num_batches * kv, BATCH_BUFFERS * slot)
              + np.where(hidden_on > 0, num_batches * hidden, BATCH_BUFFERS * hidden)
              + num_batches * gpu_batch * (prompt + generate) * 8)  # (prompts and tokens, int64)
    kv_host = np.where(cache_on > 0, 0, model.num_layers * num_batches)  # (K and V one tensor: offload_block.KVPair)
    staging = [(on_cpu.astype(int), n) for n in model.attention_staging(gpu_batch)]
    cache_groups = [(2 * kv_host, b) for b in kv4] if compress_cache else [(kv_host, kv)]  # (codes: K and V apart)
    arena = arena_bytes([*cache_groups, (np.where(hidden_on > 0, 0, num_batches), hidden), *staging], pinned)
    if host_weights is not None:
        weights = np.full_like(wg, host_weights)
    elif compress_weights:  # (the codes pinned a tensor each: exec/offload_weights.HostWeights)
        weights = (model.num_layers - resident) * sum(pinned_arena.pinned_size(b, pinned) for b in model.tensors4)
    else:
        weights = model.streamed_weights(model.num_layers - resident, pinned)
    host = weights + arena + np.where(on_cpu, model.decode_attention(gpu_batch, prompt, generate), 0)
    return device, host


@dataclass(frozen=True)
class Footprint:
    device: float  # bytes on the device at the block's peak
    host: float  # bytes of host memory the block and the weights' host copy take


def footprint(model: ModelBytes, gpu_batch: int, num_batches: int, prompt: int, generate: int, weights_gpu: float,
              cache_on_device: bool, hidden_on_device: bool, **kwargs) -> Footprint:  # (kwargs: as `peaks`)
    """`peaks` of one policy."""
    device, host = peaks(model, gpu_batch, num_batches, prompt, generate, np.array([weights_gpu]),
                         np.array([float(cache_on_device)]), np.array([float(hidden_on_device)]), **kwargs)
    return Footprint(float(device[0]), float(host[0]))

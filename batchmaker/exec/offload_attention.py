"""FlexGen's delegation of decode attention to the CPU (Sheng et al., ICML 2023, §4.2 "Computation
delegation"; its code's `cpu_cache_compute`), for one block of the offloading executor
(exec/offload.py, `Placement.cpu_attention`; issue 34).

A decode step's attention over a cache that lives on the host runs on the CPU, where the cache is:
the device computes the layer up to q, k, v; they cross to pinned host buffers (`store_qkv`); the
CPU writes k, v into the host cache at the step's column and attends over it (`cpu_attend`:
`BatchAttend`, the device path's own fp32 math, over host tensors, on torch's intra-op threads);
the output crosses back (`load_attention`) and the layer's forward resumes. So a step moves
B x (Hq + 2 Hkv + Hq) x D values a layer over the link instead of the cache's B x context x 2 Hkv x D,
and the cache never goes to the device in a decode step (the prompt step attends on the device and
stores the prompt's columns, as without the option).

The three operations run inside the compute of their (step, layer, batch): `CpuAttention.attend`
is the `Attend` the layer calls (cells/decoder.py), the one place where a layer's forward hands its
attention over; it carries out the schedule's next three operations (core/zigzag.py), which must
be these. On CUDA the copies run on a stream of their own (not behind the slot's weight and hidden
moves on the other two): q, k, v after the compute stream's work, then the host waits for them;
the output's copy is waited on by the compute stream, not the host. What overlaps: the slot's
moves (the next layer's weights, the next batch's hidden states in, the previous batch's out) with
the whole compute, the CPU's attention included. What does not: the device idles while the CPU
attends (its compute resumes with the output), and the CPU's attention of one batch does not
overlap the device's compute of another (that would take the layer's forward cut in two at its
attention: two operations of the schedule instead of one compute).

Staging: one pinned q | k | v [B, Hq + 2 Hkv, D] and one output [B, Hq, D] per block (`staging`, views of
the block's host arena: exec/pinned_arena.py), reused by
every (layer, batch): the next `store_qkv` waits for the stream, so the previous output's copy has
left the buffer before the CPU writes it again; and the fp32 K and V the CPU attends over, one
workspace each [B, Hkv, S, D] (FlexGen keeps fp32 workspaces too: the CPU's half-precision
matmuls are slow), reused by every (layer, batch).
"""
import torch
from torch import Tensor

from batchmaker.cells.decoder_config import DecoderConfig
from batchmaker.core.zigzag import ATTENTION_OPS, Op
from batchmaker.exec.offload_block import BatchAttend, BatchPrompts
from batchmaker.exec.pinned_arena import Empty


class CpuAttention:
    def __init__(self, run, batches: list[BatchPrompts]):
        """`run`: the block's BlockRun (exec/offload.py): its host cache, schedule and byte counts."""
        x, c = run.x, run.x.lm.config
        self.run, self.config, self.device = run, c, x.device
        self.sizes = (c.num_heads, c.num_kv_heads, c.num_kv_heads)
        rows = batches[0].tokens.shape[0]
        self.qkv, self.out = run.attention_staging  # (host tensors of the block's arena)
        self.batches = [BatchPrompts(b.tokens.cpu(), b.pads.cpu(), b.last) for b in batches]  # (masks on the CPU)
        columns = run.cache[0][0][0].shape[0]  # S
        self.pad_keys = [b.pad_keys(columns) for b in self.batches]  # (each decode step's mask: a slice)
        self.workspace = tuple(torch.empty(rows, c.num_kv_heads, columns, c.head_dim) for _ in range(2))  # fp32
        self.stream = torch.cuda.Stream(x.device) if x.is_cuda else None
        self.pending: tuple[Tensor, Tensor, Tensor] | None = None  # the layer's q, k, v (device)
        self.result: Tensor | None = None  # the output, on the device

    @staticmethod
    def staging(empty: Empty, config: DecoderConfig, rows: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The host's q | k | v [B, Hq + 2 Hkv, D] and output [B, Hq, D] of a block's decode steps."""
        c = config
        return (empty((rows, c.num_heads + 2 * c.num_kv_heads, c.head_dim), dtype),
                empty((rows, c.num_heads, c.head_dim), dtype))

    def attend(self, compute: Op):
        """The `Attend` of `compute`'s layer: the schedule's three attention operations, then the output."""
        def attend(layer_index: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            self.pending = (q, k, v)
            for kind in ATTENTION_OPS:
                self.run.do(self.run.next_op(kind, compute))
            out, self.result, self.pending = self.result, None, None
            return out
        return attend

    def store_qkv(self, op: Op) -> None:
        qkv = torch.cat(self.pending, dim=1)  # [B, Hq + 2 Hkv, D]
        if self.stream is None:
            self.qkv.copy_(qkv)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # (after the compute that made them)
            with torch.cuda.stream(self.stream):
                self.qkv.copy_(qkv, non_blocking=True)
            self.stream.synchronize()  # (the CPU reads them next)
        self.run.moved.bytes["attention"] += qkv.numel() * qkv.element_size()

    def cpu_attend(self, op: Op) -> None:
        k_cache, v_cache = self.run.cache[op.layer][op.batch]  # (host tensors)
        attend = BatchAttend(k_cache, v_cache, self.batches[op.batch], op.step, self.config.attention_scale,
                             self.config.attn_softcap, self.workspace, self.pad_keys[op.batch])
        self.out.copy_(attend(op.layer, *self.qkv.split(self.sizes, dim=1)))

    def load_attention(self, op: Op) -> None:
        out = torch.empty(self.out.shape, dtype=self.out.dtype, device=self.device)
        if self.stream is None:
            out.copy_(self.out)
        else:
            with torch.cuda.stream(self.stream):
                out.copy_(self.out, non_blocking=True)
            torch.cuda.current_stream(self.device).wait_stream(self.stream)  # (the compute resumes with it)
        self.run.moved.bytes["attention"] += out.numel() * out.element_size()
        self.result = out
        self.run.poison_after_sync(self.qkv, self.out)

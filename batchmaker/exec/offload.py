"""FlexGen's offloading executor (Sheng et al., ICML 2023, Algorithm 1; issue 34): a decoder
generates greedily for a block of `num_batches` GPU batches of `gpu_batch` prompts by carrying
out core/zigzag.py's operations in order.

What the placement offloads lives in host storage between uses and moves through device buffers:
each streamed layer's weights (exec/offload_weights.py: pinned beside a GPU, optionally 4-bit) into 2
weight buffers (the first `Placement.num_resident` layers keep theirs on the device, loaded once;
with compress="weights" as 4-bit codes there too: exec/offload_resident.py),
each (layer, batch)'s KV cache (exec/offload_cache.py: optionally 4-bit) and each batch's hidden
states into 3 batch buffers; a compute reads and writes device buffers only. A block's host tensors
are views of one arena (exec/pinned_arena.py: a few large pinned allocations beside a GPU, not one
rounded up to a power of two each), released with the block's run. What is not
offloaded stays on the device (the embedding, the final norm and the head always do). On CUDA
the loads and stores run on two side streams beside the compute on the current one, each slot
closed by the host waiting on the streams it used (the schedule's `sync`); on a CPU device the moves run in
order between separate tensors, so the schedule's loads and stores really move the data its
computes read.
With `Placement.cpu_attention` a decode step's attention over the host cache runs on the CPU
instead (exec/offload_attention.py): the schedule moves no cache in decode steps, q, k, v go to
the host and the output comes back, inside the compute.

Prompts of a batch are left-padded (exec/offload_block.py). A block runs as many steps as its
largest count for all its prompts (FlexGen's fixed length) and returns each prompt's own count;
the caller cuts at EOS.
What a decode step computes once per batch, not once per (layer, batch) (issue 34's host cost per
unit: a decode step issues layers x batches units, each of them a layer's launches and the slot's
moves): the tokens' positions, their rotary table and the attention mask (a slice of each batch's
pad keys, made once per block); and a dense cache's move of K and V is one copy (`KVPair`).
`check_buffers` fills a buffer with NaN as soon as the schedule is done with it (after its store,
or after a layer's last batch for weights), so that a compute reading stale data shows (tests).
"""
import contextlib
import copy
import math
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from batchmaker.cells.decoder import DecoderLM
from batchmaker.core.zigzag import ATTENTION_OPS, BATCH_BUFFERS, WEIGHT_BUFFERS, Op, Placement, zigzag
from batchmaker.exec import offload_cache, pinned_arena
from batchmaker.exec.offload_attention import CpuAttention
from batchmaker.exec.offload_block import BatchAttend, BatchPrompts, KVPair
from batchmaker.exec.offload_resident import resident_layers
from batchmaker.exec.offload_weights import DEQUANTS, HostWeights, default_dequant, layer_tensors
from batchmaker.exec.pinned_arena import Empty
from batchmaker.kernels.compress4 import Compressed


@dataclass(frozen=True)
class OffloadConfig:
    gpu_batch: int = 4  # prompts per GPU batch
    num_batches: int = 2  # GPU batches per block (FlexGen's block size = gpu_batch x num_batches)
    placement: Placement = Placement()
    check_buffers: bool = False  # NaN into a buffer the schedule is done with (tests)
    compress: str | None = None  # 4-bit codes: "weights" (every layer's matrices, streamed or resident:
    # exec/offload_weights.py, exec/offload_resident.py), "kv" (the host's KV cache: BlockRun), or "both"
    dequant: str | None = None  # how compressed tensors meet the compute (offload_weights.DEQUANTS, for
    # streamed weights; a cache and resident weights use Triton unless "reference"); None: Triton on a GPU,
    # the PyTorch twins elsewhere (fused is not the default for streamed weights: no GPU timing yet)

    def __post_init__(self):
        if self.gpu_batch < 1 or self.num_batches < 1:
            raise ValueError(f"gpu_batch and num_batches must be >= 1, got {self.gpu_batch}, {self.num_batches}")
        if self.compress not in (None, "weights", "kv", "both"):
            raise ValueError(f"compress={self.compress!r}: None, 'weights', 'kv' or 'both'")
        if self.compresses_cache and not self.placement.cache:
            raise ValueError("compress='kv' compresses the host's KV cache: the placement keeps it on the device "
                             "(a 4-bit cache on the device is not built; offload the cache)")
        if self.compresses_cache and self.placement.cpu_attention:
            raise ValueError("cpu_attention attends over a dense host cache: not with compress='kv' or 'both'")
        if self.dequant is not None and (self.dequant not in DEQUANTS or not self.compress):
            raise ValueError(f"dequant={self.dequant!r}: one of {', '.join(DEQUANTS)}, with compress='weights', "
                             "'kv' or 'both'")

    @property
    def compresses_weights(self) -> bool:
        return self.compress in ("weights", "both")

    @property
    def compresses_cache(self) -> bool:
        return self.compress in ("kv", "both")

    @property
    def block(self) -> int:
        return self.gpu_batch * self.num_batches


@dataclass
class Moved:
    """Bytes each kind of move carried ("attention": q, k, v down and the output up, with
    cpu_attention), and the operations carried out, in the order they were issued."""
    bytes: dict = field(default_factory=lambda: {"weights": 0, "cache": 0, "hidden": 0, "attention": 0})
    ops: list = field(default_factory=list)


def check_offloadable(lm: DecoderLM) -> None:
    c = lm.config
    if c.is_gemma or c.attention_windows:
        raise ValueError("offloading runs Llama-family and OPT decoders without sliding windows or Gemma's "
                         "norms so far")


class OffloadExecutor:
    def __init__(self, lm: DecoderLM, device, config: OffloadConfig = OffloadConfig(), adopt: bool = False):
        """`lm`: the model built on the CPU; its layers become the host copy (pinned beside a GPU)
        and the rest of it moves to `device`. Resident layers are copies (the host model stays whole,
        for another executor) unless `adopt`: then `lm`'s first `num_resident` layers are already on
        `device` and are taken as they are (a model larger than the host, whose resident layers never
        touch it: bench/offload_model.random_model's `resident`)."""
        check_offloadable(lm)
        if adopt and any(not _is_on(t, torch.device(device)) for layer in
                         lm.layers[:config.placement.num_resident(len(lm.layers))] for t in layer_tensors(layer)):
            raise ValueError(f"adopt: the resident layers must already be on {device}")
        self.device, self.config, self.lm = torch.device(device), config, lm
        self.is_cuda = self.device.type == "cuda"
        layers, lm.layers = lm.layers, nn.ModuleList()
        lm.to(self.device)  # embedding, final norm, head, rotary table
        lm.layers = layers
        self.num_layers = len(layers)
        self.dtype = lm.embed_tokens.weight.dtype
        self.num_resident = config.placement.num_resident(self.num_layers)  # the first layers: weights stay
        self.is_reference = (config.dequant or default_dequant(self.device)) == "reference"  # (the twins)
        self.resident, self.scratch = resident_layers(  # (4-bit: codes on the device, a dense scratch for prompts)
            layers[:self.num_resident], (lambda layer: layer) if adopt else lambda layer: copy.deepcopy(layer).to(
                self.device), config.compresses_weights, self.is_reference)
        if self.num_resident < self.num_layers:
            self.weight_buffers = [copy.deepcopy(layers[0]).to(self.device) for _ in range(WEIGHT_BUFFERS)]
            self.host_weights = HostWeights(layers[self.num_resident:], self.weight_buffers,
                                            config.compresses_weights, config.dequant or default_dequant(self.device))
        if self.is_cuda:
            self.streams = {"in": torch.cuda.Stream(self.device), "out": torch.cuda.Stream(self.device)}

    def with_block(self, gpu_batch: int, num_batches: int, placement: Placement) -> "OffloadExecutor":
        """An executor of another block shape and placement of the cache and hidden states, sharing
        this one's host weights and device buffers (the same offloaded model: no rebuild); the
        weights' placement (and share on the device) must stay. Not to run beside this one (they
        share buffers and streams)."""
        was = self.config.placement
        if (placement.weights, placement.weights_gpu) != (was.weights, was.weights_gpu):
            raise ValueError("with_block keeps the weights where they are: build another executor to move them")
        other = copy.copy(self)
        other.config = replace(self.config, gpu_batch=gpu_batch, num_batches=num_batches, placement=placement)
        return other

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
        """`num_tokens` greedy tokens for each prompt, blocks of `config.block` prompts at a time."""
        out = []
        for first in range(0, len(prompts), self.config.block):
            out += self.generate_block(prompts[first:first + self.config.block], num_tokens)[0]
        return out

    @torch.no_grad()
    def generate_block(self, prompts: list[list[int]], num_tokens: int | list[int]) -> tuple[list[list[int]], Moved]:
        """One block (at most `config.block` prompts; a last batch short of `gpu_batch` is filled
        with copies of its first prompt): `num_tokens` tokens of each prompt (one count, or one
        each: the block runs the largest, a row's positions stop at the model's last), and what moved."""
        counts = [num_tokens] * len(prompts) if isinstance(num_tokens, int) else list(num_tokens)
        self.check(prompts, counts)
        gbs, steps = self.config.gpu_batch, max(counts)
        batches = [prompts[i:i + gbs] for i in range(0, len(prompts), gbs)]
        batches[-1] = batches[-1] + [batches[-1][0]] * (gbs - len(batches[-1]))
        width, last = max(map(len, prompts)), self.lm.config.max_positions - 1
        run = BlockRun(self, [BatchPrompts.of(b, width, last, self.device) for b in batches], steps)
        run.carry_out(zigzag(self.num_layers, len(batches), steps, self.config.placement))
        tokens = run.tokens.cpu()  # [num_batches, B, steps]: the block's one sync
        return [row[:n] for row, n in zip(tokens.flatten(0, 1).tolist(), counts)], run.moved

    def check(self, prompts: list[list[int]], counts: list[int]) -> None:
        """A ValueError unless `prompts` make a block this executor generates `counts` tokens of."""
        c = self.lm.config
        if not 1 <= len(prompts) <= self.config.block or len(counts) != len(prompts):
            raise ValueError(f"a block takes 1 to {self.config.block} prompts and a count each, got {len(prompts)} "
                             f"and {len(counts)}")
        if min(counts) < 1:
            raise ValueError(f"num_tokens must be >= 1, got {min(counts)}")
        if any(not p or min(p) < 0 or max(p) >= c.vocab_size for p in prompts):
            raise ValueError(f"a prompt needs 1 or more token ids in [0, {c.vocab_size})")
        for p, n in zip(prompts, counts):
            if len(p) + n - 1 > c.max_positions:  # (the last token sampled is not fed back)
                raise ValueError(f"a prompt of {len(p)} + {n} tokens exceeds the model's {c.max_positions} positions")


class BlockRun:
    """One block's storage and the effect of each operation on it."""

    def __init__(self, executor: OffloadExecutor, batches: list[BatchPrompts], num_tokens: int):
        self.x, self.batches, self.num_tokens = executor, batches, num_tokens
        self.placement, self.moved = executor.config.placement, Moved()
        c = executor.lm.config
        rows, width = batches[0].tokens.shape
        cache_shape = (width + num_tokens - 1, rows, c.num_kv_heads, c.head_dim)
        slot_shape = (width, *cache_shape[1:]) if self.placement.cpu_attention else cache_shape  # (the prompt's
        # columns: no decode step brings the cache to the device)
        hidden_shape = (width, 2, rows, c.hidden_size)
        place = self.placement
        # host storage of what is offloaded (views of one arena a run: exec/pinned_arena.py), device storage of
        # what is not (per batch)
        self.is_compressed = executor.config.compresses_cache  # (the host cache as 4-bit codes: offload_cache.py)
        self.arena, (cache, hidden, self.attention_staging) = pinned_arena.holding(
            executor.is_cuda, lambda empty: self._host_storage(empty, cache_shape, hidden_shape, rows))
        on_device = self._device_empty
        self.cache = cache if place.cache else [[self._kv(cache_shape, on_device) for _ in batches]
                                                for _ in range(executor.num_layers)]
        self.cache_staging = [self._codes(cache_shape, on_device) for _ in range(BATCH_BUFFERS)] \
            if self.is_compressed else None
        self.hidden = hidden if place.hidden else [on_device(hidden_shape, executor.dtype) for _ in batches]
        self.cache_slots = [self._kv(slot_shape, on_device) for _ in range(BATCH_BUFFERS)] if place.cache else None
        self.hidden_slots = [on_device(hidden_shape, executor.dtype) for _ in range(BATCH_BUFFERS)] \
            if place.hidden else None
        self.tokens = torch.zeros(len(batches), rows, num_tokens, dtype=torch.long, device=executor.device)
        self.used: set[str] = set()  # the side streams the next sync waits on (CUDA)
        self.pad_keys = [batch.pad_keys(cache_shape[0]) for batch in batches]  # [B, 1, S]: decode steps' masks
        self.step_inputs: list[tuple | None] = [None] * len(batches)  # (step, positions, rotate) of each batch
        self.poison: list[Tensor] = []  # what the next sync fills with NaN (check_buffers)
        self.cpu_attention = CpuAttention(self, batches) if place.cpu_attention else None
        self.moves = place.moves_anything(executor.num_layers)  # (else no slot's buffers are reused and a sync
        # waits for nothing)
        self.schedule = iter(())  # the operations not yet carried out (carry_out)
        for b, batch in enumerate(batches):  # the prompts' embeddings: "given" at (step 0, layer 0)
            embedded = executor.lm.embed(batch.tokens.t().flatten(), batch.positions(0))
            self.hidden[b][:, 0].copy_(embedded.view(width, rows, -1))

    def _host_storage(self, empty: Empty, cache_shape: tuple, hidden_shape: tuple, rows: int) -> tuple:
        """What the placement keeps on the host, every tensor from `empty`, in this order (the memory
        model's, exec/offload_memory.py): the KV cache (by layer, then batch), the hidden states, the
        CPU attention's staging; None for each kept on the device."""
        x, place, n = self.x, self.placement, len(self.batches)
        if place.cache and self.is_compressed:  # (K and V codes of each (layer, batch), field by field)
            codes = iter(offload_cache.empty_codes_many(cache_shape, x.dtype, empty, 2 * n * x.num_layers))
            cache = [[(next(codes), next(codes)) for _ in range(n)] for _ in range(x.num_layers)]
        else:
            cache = [[self._kv(cache_shape, empty) for _ in range(n)] for _ in range(x.num_layers)] \
                if place.cache else None
        hidden = [empty(hidden_shape, x.dtype) for _ in range(n)] if place.hidden else None
        staging = CpuAttention.staging(empty, x.lm.config, rows, x.dtype) if place.cpu_attention else None
        return cache, hidden, staging

    def _device_empty(self, shape: tuple, dtype: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dtype, device=self.x.device)

    def _kv(self, shape, empty: Empty) -> KVPair | tuple:
        if self.is_compressed:  # (a device slot a load expands codes into: K and V apart)
            return empty(shape, self.x.dtype), empty(shape, self.x.dtype)
        return KVPair(empty((shape[0], 2, *shape[1:]), self.x.dtype))

    def _codes(self, shape, empty: Empty) -> tuple[Compressed, Compressed]:
        return tuple(offload_cache.empty_codes(shape, self.x.dtype, empty) for _ in range(2))

    # the operations ---------------------------------------------------------------------------
    def carry_out(self, ops: list[Op]) -> None:
        self.schedule = iter(ops)
        for op in self.schedule:
            self.do(op)

    def do(self, op: Op) -> None:
        self.moved.ops.append(op)
        getattr(self.cpu_attention if op.kind in ATTENTION_OPS else self, op.kind)(op)

    def next_op(self, kind: str, compute: Op) -> Op:
        """The schedule's next operation, which a compute carries out inside itself: it must be
        `kind` of the compute's (step, layer, batch)."""
        op = next(self.schedule, None)
        want = (kind, compute.step, compute.layer, compute.batch)
        assert op is not None and op[:4] == want, f"{compute} carries out {kind} next; the schedule has {op}"
        return op

    def load_weights(self, op: Op) -> None:
        with self._stream("in"):  # (the host keeps the streamed layers only, from num_resident on)
            self.moved.bytes["weights"] += self.x.host_weights.load(op.layer - self.x.num_resident, op.slot)

    def load_cache(self, op: Op) -> None:
        end = self.batches[op.batch].start(op.step)  # every column written before this step
        if self.is_compressed:
            with self._stream("in"):
                for dst, src, stage in zip(self.cache_slots[op.slot], self.cache[op.layer][op.batch],
                                           self.cache_staging[op.slot]):
                    self.moved.bytes["cache"] += offload_cache.load(dst, src, stage, end, self.x.is_reference)
            return
        self._copy(self.cache_slots[op.slot].both[:end], self.cache[op.layer][op.batch].both[:end], "in", "cache")

    def store_cache(self, op: Op) -> None:
        batch = self.batches[op.batch]
        start, end = batch.start(op.step), batch.start(op.step) + batch.columns(op.step)
        if self.is_compressed:
            for dst, src in zip(self.cache[op.layer][op.batch], self.cache_slots[op.slot]):
                with self._stream("out"):
                    self.moved.bytes["cache"] += offload_cache.store(dst, src, start, end, self.x.is_reference)
        else:
            self._copy(self.cache[op.layer][op.batch].both[start:end], self.cache_slots[op.slot].both[start:end],
                       "out", "cache")
        self.poison_after_sync(*self.cache_slots[op.slot])

    def load_hidden(self, op: Op) -> None:
        n = self.batches[op.batch].columns(op.step)
        self._copy(self.hidden_slots[op.slot][:n], self.hidden[op.batch][:n], "in", "hidden")

    def store_hidden(self, op: Op) -> None:
        n = self._hidden_out(op.step, op.layer, op.batch)
        self._copy(self.hidden[op.batch][:n], self.hidden_slots[op.slot][:n], "out", "hidden")
        self.poison_after_sync(self.hidden_slots[op.slot])

    def compute(self, op: Op) -> None:
        step, layer, b = op.step, op.layer, op.batch
        x, lm, batch = self.x, self.x.lm, self.batches[b]
        streams = self.placement.streams(layer, x.num_layers)
        module = x.weight_buffers[(step * x.num_layers + layer) % WEIGHT_BUFFERS] if streams else x.resident[layer]
        hidden = (self.hidden_slots[op.slot] if self.placement.hidden else self.hidden[b])[:batch.columns(step)]
        if self.placement.attends_on_cpu(step):
            attend = self.cpu_attention.attend(op)
        else:
            k_cache, v_cache = self.cache_slots[op.slot] if self.placement.cache else self.cache[layer][b]
            attend = BatchAttend(k_cache, v_cache, batch, step, lm.config.attention_scale, lm.config.attn_softcap,
                                 pad_keys=self.pad_keys[b])
        rotate = self._step_inputs(step, b)[1]
        inputs = hidden.transpose(0, 1).flatten(1, 2)  # [2, L*B, H]
        out, residual = module(inputs[0], None if layer == 0 else inputs[1], rotate, attend)
        if layer + 1 < x.num_layers:
            hidden.copy_(torch.stack([out, residual]).unflatten(1, (hidden.shape[0], -1)).transpose(0, 1))
            return
        last = (out + residual).view(hidden.shape[0], -1, out.shape[-1])[-1]  # [B, H]: each row's last token
        token = lm.head(last).argmax(-1)
        self.tokens[b, :, step] = token
        if step + 1 < self.num_tokens:  # the next step's input: the token's embedding
            hidden[:1, 0].copy_(lm.embed(token, self._step_inputs(step + 1, b)[0]).unsqueeze(0))
        if self.x.config.check_buffers and streams and b == len(self.batches) - 1:
            self.poison_after_sync(*layer_tensors(module))

    def sync(self, op: Op) -> None:
        if self.x.is_cuda and (self.moves or self.poison):  # (the compute of this slot, on the current stream, and
            # the moves on the side streams it used: everything on them is this slot's, the previous sync having
            # waited for the rest; a block that moves nothing issues its computes without waiting: the GPU runs
            # them in order on one stream, and the tokens' copy at the end is the block's one sync)
            torch.cuda.current_stream(self.x.device).synchronize()
            for name in self.used:
                self.x.streams[name].synchronize()
            self.used.clear()
        for t in self.poison:
            t.fill_(math.nan)
        self.poison = []

    # helpers -------------------------------------------------------------------------------------
    def _step_inputs(self, step: int, b: int) -> tuple[Tensor, object]:
        """(positions, rotate) of batch `b`'s tokens in `step`: a decode step's made at its first
        layer and kept for the others (the prompt step's, P times larger, are made per layer)."""
        kept = self.step_inputs[b]
        if kept is not None and kept[0] == step:
            return kept[1:]
        positions = self.batches[b].positions(step)
        inputs = positions, self.x.lm.rotary(positions)
        if step > 0:
            self.step_inputs[b] = (step, *inputs)
        return inputs

    def _hidden_out(self, step: int, layer: int, b: int) -> int:
        """Columns of hidden states compute(step, layer, b) leaves: the next step's input is one."""
        return 1 if layer + 1 == self.x.num_layers else self.batches[b].columns(step)

    def _copy(self, dst: Tensor, src: Tensor, stream: str, kind: str) -> None:
        with self._stream(stream):
            dst.copy_(src, non_blocking=True)
        self.moved.bytes[kind] += src.numel() * src.element_size()

    def _stream(self, name: str):
        """A side stream's context on CUDA, closed by an event the next `sync` waits on."""
        return _SideStream(self, name) if self.x.is_cuda else contextlib.nullcontext()

    def poison_after_sync(self, *tensors: Tensor) -> None:
        """With check_buffers: `tensors` filled with NaN at the next sync (the schedule is done with them)."""
        if self.x.config.check_buffers:
            self.poison += tensors


def _is_on(t: Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


class _SideStream:
    """Work issued inside runs on the run's side stream `name`, which the next sync waits on."""

    def __init__(self, run: BlockRun, name: str):
        run.used.add(name)
        self.context = torch.cuda.stream(run.x.streams[name])

    def __enter__(self):
        self.context.__enter__()

    def __exit__(self, *exc):
        self.context.__exit__(*exc)

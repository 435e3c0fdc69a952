"""FlexGen's zig-zag block schedule (Sheng et al., ICML 2023, §4.2 and Algorithm 1; issue 34), as
a list of operations an offloading executor carries out. No torch here: the order is the thing,
and it is tested as a property with a fake device (tests/test_zigzag.py).

A block is `num_batches` GPU batches generated together for `num_tokens` steps (step 0 is the
prompt). The schedule walks one layer across every batch of the block before the next layer, so
that a layer's weights cross the host link once per block and step, not once per batch; and it
overlaps, in each slot between two syncs, the computation of (step, layer, batch) with six moves:
the next layer's weights in, the next batch's cache and hidden states in, the previous batch's
cache and hidden states out. Weights take two device buffers (the layer computing, the next one
coming: by the parity of the layer's place in the walk), a batch's cache and hidden states three
(the batch computing, the next coming in, the previous going out: by batch index mod 3), so what
moves in a slot never lands where that slot computes or reads.

    for step, for layer, for batch:
        load_weights(layer + 1)            (once per layer: at the layer's first batch)
        load_cache(layer, batch + 1)       store_cache(layer, batch - 1)
        load_hidden(layer, batch + 1)      store_hidden(layer, batch - 1)
        compute(step, layer, batch)
        sync()

Which moves exist depends on the placement: weights that stay on the device are never loaded
(`Placement.weights`, or the layers `Placement.weights_gpu` keeps resident), nor a cache or hidden
states that stay there. A streamed layer's load is issued one place of the walk ahead, whatever
comes before it: where that is a resident layer, no weight buffer is in use in that slot.

With `Placement.cpu_attention` (FlexGen's delegation, §4.2; its code's `cpu_cache_compute`) a
decode step's attention over a host cache runs on the CPU, where the cache lives: no decode step
loads or stores a cache (the prompt step computes on the device and stores the prompt's columns
as before), and a decode slot's compute hands its attention over in three operations, in order,
inside that compute (the layer's forward waits for the third):

        compute(step, layer, batch)        the layer on the device, up to q, k, v
        store_qkv(step, layer, batch)      q, k, v to the host
        cpu_attend(step, layer, batch)     the CPU writes k, v into the host cache and attends over it
        load_attention(step, layer, batch) the output to the device (the forward resumes: o_proj, MLP)
"""
import math
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Placement:
    """What lives off the device between uses (True) or stays on it (False); with the weights
    offloaded, `weights_gpu` is the share of the decoder layers whose weights stay on the device
    all the same (FlexGen's wg, by whole layers): the first floor(weights_gpu x layers) of them.

    Why a prefix: each load is issued one place of the walk ahead and closed by that slot's sync,
    so where the resident layers sit changes neither how many loads a step makes nor what each
    overlaps (one slot of compute), except that a resident layer 0 lets the block's first load
    overlap a compute instead of standing alone; and a prefix is one number to read."""
    weights: bool = True
    cache: bool = True
    hidden: bool = True
    weights_gpu: float = 0.0
    cpu_attention: bool = False  # decode steps attend on the CPU over the host cache (FlexGen's
    # cpu_cache_compute) instead of moving it to the device

    def __post_init__(self):
        if not 0.0 <= self.weights_gpu <= 1.0:
            raise ValueError(f"weights_gpu={self.weights_gpu}: a share in [0, 1]")
        if self.weights_gpu > 0 and not self.weights:
            raise ValueError("weights_gpu is the share of offloaded weights kept on the device: the placement keeps "
                             "every layer's weights there already")
        if self.cpu_attention and not self.cache:
            raise ValueError("cpu_attention attends over a cache on the host: the placement keeps it on the device")

    def num_resident(self, num_layers: int) -> int:
        """How many layers (the first ones) keep their weights on the device."""
        if not self.weights:
            return num_layers
        return math.floor(self.weights_gpu * num_layers + 1e-6)  # (at most the share: a budget counted it)

    def streams(self, layer: int, num_layers: int) -> bool:
        """Whether `layer`'s weights cross the link each step."""
        return layer >= self.num_resident(num_layers)

    def moves_anything(self, num_layers: int) -> bool:
        """Whether anything crosses the link: streamed weights, a host cache or host hidden states."""
        return self.cache or self.hidden or self.num_resident(num_layers) < num_layers

    def moves_cache(self, step: int) -> bool:
        """Whether step `step`'s cache crosses the link (a decode step's stays on the host with cpu_attention)."""
        return self.cache and not (self.cpu_attention and step > 0)

    def attends_on_cpu(self, step: int) -> bool:
        return self.cpu_attention and step > 0


WEIGHT_BUFFERS, BATCH_BUFFERS = 2, 3
ATTENTION_OPS = ("store_qkv", "cpu_attend", "load_attention")  # inside a decode compute, with cpu_attention


class Op(NamedTuple):
    kind: str  # load_weights, load_cache, store_cache, load_hidden, store_hidden, compute, sync; with
    # cpu_attention also store_qkv, cpu_attend, load_attention (ATTENTION_OPS)
    step: int = -1
    layer: int = -1
    batch: int = -1
    slot: int = -1  # the device buffer a move uses (weights' or the batch's); compute: its batch's


def _op(kind: str, step: int, layer: int, batch: int = -1, num_layers: int = 1) -> Op:
    if kind == "load_weights":
        return Op(kind, step, layer, batch, (step * num_layers + layer) % WEIGHT_BUFFERS)
    return Op(kind, step, layer, batch, batch % BATCH_BUFFERS)


def zigzag(num_layers: int, num_batches: int, num_tokens: int, placement: Placement = Placement()) -> list[Op]:
    """The block's operations in issue order (Algorithm 1), `sync` closing each slot. A layer's
    last batch is followed by its cache and hidden states out, a sync, the next layer's first
    batch's in, and a sync (with one batch they share a buffer)."""
    if min(num_layers, num_batches, num_tokens) < 1:
        raise ValueError(f"a block needs layers, batches and tokens >= 1, got {num_layers}, {num_batches}, {num_tokens}")
    first_in = [_op("load_weights", 0, 0)] if placement.streams(0, num_layers) else []
    ops = _window(first_in + _first_batch_in((0, 0), placement))
    for step in range(num_tokens):
        for layer in range(num_layers):
            nxt = _next_layer(step, layer, num_layers, num_tokens)
            for batch in range(num_batches):
                ops += _slot(step, layer, batch, num_batches, num_layers, nxt, placement)
            ops += _window([_op(kind, step, layer, num_batches - 1) for kind, on in
                            (("store_cache", placement.moves_cache(step)), ("store_hidden", placement.hidden)) if on])
            if nxt is not None:
                ops += _window(_first_batch_in(nxt, placement))
    return ops


def _slot(step: int, layer: int, batch: int, num_batches: int, num_layers: int, nxt: tuple | None,
          placement: Placement) -> list[Op]:
    """One slot: compute (step, layer, batch) beside the six moves."""
    loads_next = nxt is not None and batch == 0 and placement.streams(nxt[1], num_layers)
    moves = [("load_weights", loads_next, *(nxt or (0, 0)), -1),
             ("load_cache", placement.moves_cache(step) and batch + 1 < num_batches and step > 0, step, layer, batch + 1),
             ("store_cache", placement.moves_cache(step) and batch > 0, step, layer, batch - 1),
             ("load_hidden", placement.hidden and batch + 1 < num_batches, step, layer, batch + 1),
             ("store_hidden", placement.hidden and batch > 0, step, layer, batch - 1)]
    ops = [_op(kind, s, layer_, b, num_layers) for kind, on, s, layer_, b in moves if on]
    computes = ("compute",) + (ATTENTION_OPS if placement.attends_on_cpu(step) else ())
    return _window(ops + [_op(kind, step, layer, batch) for kind in computes])  # (the prompt step reads no cache)


def _first_batch_in(at: tuple[int, int], placement: Placement) -> list[Op]:
    """Before a layer's first slot: its batch 0's cache (past the prompt step) and hidden states."""
    step, layer = at
    return [_op(kind, step, layer, 0) for kind, on in (("load_cache", placement.moves_cache(step) and step > 0),
                                                       ("load_hidden", placement.hidden)) if on]


def _window(ops: list[Op]) -> list[Op]:
    return ops + [Op("sync")] if ops else []


def _next_layer(step: int, layer: int, num_layers: int, num_tokens: int) -> tuple[int, int] | None:
    """(step, layer) that comes after `layer` of `step` (the next step's layer 0 after the last), or None."""
    if layer + 1 < num_layers:
        return step, layer + 1
    return (step + 1, 0) if step + 1 < num_tokens else None

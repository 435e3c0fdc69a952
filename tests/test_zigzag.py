"""FlexGen's zig-zag block schedule (core/zigzag.py) run on a fake device that records what every
buffer holds: for random shapes and placements, every compute finds its layer's weights, its
batch's cache and hidden states on the device, loaded in an earlier slot; nothing is loaded over
data not yet stored or still in use in the same slot; every output reaches the host; and a
streamed layer's weights cross once per step of the block, not once per batch, while the layers
a share `weights_gpu` keeps on the device never cross. With `cpu_attention`, no decode step moves a
cache, and each decode compute's q, k, v reach the host, the CPU attends over host columns every
earlier step wrote (the prompt's stored, the decode steps' written there by the CPU) and the output
reaches the device before the layer resumes: nothing is read before it is written."""
import itertools
import random

import pytest

from batchmaker.core.zigzag import ATTENTION_OPS, BATCH_BUFFERS, WEIGHT_BUFFERS, Placement, zigzag


class FakeDevice:
    def __init__(self, num_layers: int, placement: Placement):
        self.num_layers, self.placement = num_layers, placement
        self.weights = [None] * WEIGHT_BUFFERS  # the (step, layer) each weight buffer was loaded for
        self.buffers = {kind: [None] * BATCH_BUFFERS for kind in ("cache", "hidden")}  # (tag, "in" | "out")
        self.host = {"cache": set(), "hidden": set()}  # tags stored off the device
        self.computed = []
        self.weight_loads = 0
        self.attention = dict.fromkeys(("device_qkv", "host_qkv", "host_out", "device_out"))  # the tag each holds

    def run(self, ops) -> None:
        window = []
        for op in ops:
            if op.kind == "sync":
                self.window(window)
                window = []
            else:
                window.append(op)
        assert not window, "operations after the last sync"

    def window(self, ops) -> None:
        """Check every op against the state at the window's start, then apply them all."""
        computes = [op for op in ops if op.kind == "compute"]
        busy = {(kind, op.slot) for op in computes for kind in ("cache", "hidden")}
        busy |= {(op.kind.split("_")[1], op.slot) for op in ops if op.kind.startswith("store")}
        weight_in_use = {self.weights.index((op.step, op.layer)) for op in computes
                         if self.streams(op.layer) and (op.step, op.layer) in self.weights}
        updates = []
        for op in ops:  # (the attention operations, ordered by events inside their compute, act at once)
            updates += getattr(self, op.kind)(op, busy, weight_in_use)
        for op in computes:
            if self.placement.attends_on_cpu(op.step):  # (the layer resumed with its own output)
                assert self.attention["device_out"] == (op.step, op.layer, op.batch), f"{op}: no output"
        for apply in updates:
            apply()

    def streams(self, layer: int) -> bool:
        return self.placement.streams(layer, self.num_layers)

    # each op: checks now, returns what it changes at the window's end
    def compute(self, op, busy, weight_in_use):
        tag = (op.step, op.layer, op.batch)
        assert not self.streams(op.layer) or (op.step, op.layer) in self.weights, f"{tag}: its weights are absent"
        on_cpu = self.placement.attends_on_cpu(op.step)
        if on_cpu:
            self.attention["device_qkv"] = tag
        for kind in ("cache", "hidden"):
            if not getattr(self.placement, kind) or kind == "cache" and on_cpu:  # (no cache slot used)
                continue
            held = self.buffers[kind][op.slot]
            if kind == "hidden" or op.step > 0:
                assert held == (tag, "in"), f"compute {tag}: {kind} buffer holds {held}"
            else:  # (the prompt step writes a fresh cache)
                assert held is None or held[1] != "out", f"compute {tag} overwrites unsaved {kind} {held}"
        self.computed.append(tag)
        return [lambda k=kind: self.buffers[k].__setitem__(op.slot, (tag, "out"))
                for kind in ("cache", "hidden") if getattr(self.placement, kind) and not (kind == "cache" and on_cpu)]

    def _attention(self, op, reads: str, writes: str):
        tag = (op.step, op.layer, op.batch)
        assert self.placement.attends_on_cpu(op.step), f"{op.kind} {tag} without cpu attention"
        assert self.attention[reads] == tag, f"{op.kind} {tag}: {reads} holds {self.attention[reads]}"
        self.attention[writes] = tag
        return []

    def store_qkv(self, op, busy, weight_in_use):
        return self._attention(op, "device_qkv", "host_qkv")

    def cpu_attend(self, op, busy, weight_in_use):
        earlier = {(s, op.layer, op.batch) for s in range(op.step)}
        assert earlier <= self.host["cache"], f"cpu_attend {op}: host columns missing {earlier - self.host['cache']}"
        self.host["cache"].add((op.step, op.layer, op.batch))  # (the CPU writes the step's k, v there)
        return self._attention(op, "host_qkv", "host_out")

    def load_attention(self, op, busy, weight_in_use):
        return self._attention(op, "host_out", "device_out")

    def load_weights(self, op, busy, weight_in_use):
        assert self.streams(op.layer), f"weights of resident layer {op.layer} loaded"
        assert op.slot not in weight_in_use, f"weights of layer {op.layer} over the buffer in use"
        self.weight_loads += 1
        return [lambda: self.weights.__setitem__(op.slot, (op.step, op.layer))]

    def _load(self, kind, op, busy, source):
        tag = (op.step, op.layer, op.batch)
        assert source is None or source in self.host[kind], f"load {kind} {tag}: {source} not on the host"
        held = self.buffers[kind][op.slot]
        assert (kind, op.slot) not in busy, f"load {kind} {tag} into a buffer in use in the same slot"
        assert held is None or held[1] != "out", f"load {kind} {tag} over unsaved {held}"
        return [lambda: self.buffers[kind].__setitem__(op.slot, (tag, "in"))]

    def load_cache(self, op, busy, weight_in_use):
        assert self.placement.moves_cache(op.step), f"load_cache {op}: the CPU attends over it"
        return self._load("cache", op, busy, (op.step - 1, op.layer, op.batch))

    def load_hidden(self, op, busy, weight_in_use):
        if op.layer > 0:
            source = (op.step, op.layer - 1, op.batch)
        else:
            source = (op.step - 1, self.num_layers - 1, op.batch) if op.step > 0 else None  # (the prompt: given)
        return self._load("hidden", op, busy, source)

    def _store(self, kind, op):
        tag = (op.step, op.layer, op.batch)
        assert self.buffers[kind][op.slot] == (tag, "out"), f"store {kind} {tag}: buffer holds {self.buffers[kind][op.slot]}"
        return [lambda: self.host[kind].add(tag), lambda: self.buffers[kind].__setitem__(op.slot, (tag, "stored"))]

    def store_cache(self, op, busy, weight_in_use):
        assert self.placement.moves_cache(op.step), f"store_cache {op}: the CPU wrote it"
        return self._store("cache", op)

    def store_hidden(self, op, busy, weight_in_use):
        return self._store("hidden", op)


CASES = [(1, 1, 1), (1, 3, 2), (2, 1, 3), (3, 2, 2), (2, 3, 4)] + \
        [(random.Random(i).randint(1, 6), random.Random(i + 50).randint(1, 7), random.Random(i + 99).randint(1, 5))
         for i in range(12)]


PLACEMENTS = [Placement(*p) for p in itertools.product((True, False), repeat=3)] + \
    [Placement(True, cache, hidden, share) for share in (0.3, 0.5, 1.0) for cache, hidden in ((True, True), (False, True))] + \
    [Placement(weights, True, hidden, share, cpu_attention=True) for weights, hidden, share in
     ((True, True, 0.0), (True, False, 0.0), (False, True, 0.0), (False, False, 0.0), (True, True, 0.5))]


@pytest.mark.parametrize("layers, batches, tokens", CASES)
@pytest.mark.parametrize("placement", PLACEMENTS,
                         ids=lambda p: f"w{int(p.weights)}c{int(p.cache)}h{int(p.hidden)}g{p.weights_gpu}"
                                       + ("-cpu" if p.cpu_attention else ""))
def test_the_schedule_keeps_every_dependency_on_a_fake_device(layers, batches, tokens, placement):
    device = FakeDevice(layers, placement)
    device.run(zigzag(layers, batches, tokens, placement))
    walk = [(s, lay, b) for s in range(tokens) for lay in range(layers) for b in range(batches)]
    assert device.computed == walk  # (each once, a layer across the block's batches before the next)
    streamed = layers - placement.num_resident(layers)
    assert device.weight_loads == streamed * tokens  # (once per streamed layer and step)
    for kind in ("cache", "hidden"):
        if getattr(placement, kind):
            assert device.host[kind] == set(walk)  # (every output reached the host)
    kinds = [op.kind for op in zigzag(layers, batches, tokens, placement)]
    decode_computes = len(walk) - layers * batches
    for kind in ATTENTION_OPS:  # (one of each per decode compute with cpu_attention; none without)
        assert kinds.count(kind) == (decode_computes if placement.cpu_attention else 0)
    if placement.cpu_attention:  # (a decode step moves no cache: only the prompt step's is stored)
        assert kinds.count("load_cache") == 0 and kinds.count("store_cache") == layers * batches


def test_a_share_keeps_the_first_layers_whole_and_at_most_that_share():
    assert [Placement(weights_gpu=g).num_resident(10) for g in (0.0, 0.1, 0.35, 0.99, 1.0)] == [0, 1, 3, 9, 10]
    assert Placement(weights_gpu=3 / 7).num_resident(7) == 3  # (k / layers, as the search picks it)
    assert Placement(False, True, True).num_resident(5) == 5
    assert [Placement(weights_gpu=0.5).streams(layer, 4) for layer in range(4)] == [False, False, True, True]
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        Placement(weights_gpu=1.5)
    with pytest.raises(ValueError, match="already"):
        Placement(False, True, True, weights_gpu=0.5)


def test_cpu_attention_needs_a_host_cache():
    with pytest.raises(ValueError, match="cpu_attention"):
        Placement(True, False, True, cpu_attention=True)
    assert Placement(cpu_attention=True).moves_cache(0) and not Placement(cpu_attention=True).moves_cache(1)


def test_the_fake_device_catches_an_attention_operation_out_of_order():
    ops = zigzag(2, 2, 3, Placement(cpu_attention=True))
    at = next(i for i, op in enumerate(ops) if op.kind == "cpu_attend")
    ops[at], ops[at + 1] = ops[at + 1], ops[at]  # (the output loaded before the CPU wrote it)
    with pytest.raises(AssertionError, match="load_attention"):
        FakeDevice(2, Placement(cpu_attention=True)).run(ops)


def test_a_block_needs_layers_batches_and_tokens():
    with pytest.raises(ValueError, match=">= 1"):
        zigzag(2, 0, 3)

"""4-bit weights that stay on the device (issue 34: FlexGen's compression with and without
offloading): with `OffloadConfig(compress="weights")`, the layers the placement keeps resident
(all of them with `Placement(weights=False)`, the first `weights_gpu` share otherwise) hold their
matrices as 4-bit codes on the device (kernels/compress4.py, groups of 64 along the output
channels, as the streamed layers' host copy), about 0.28x the bytes of fp16. Each nn.Linear
becomes an exec/offload_weights.Linear4: a decode step's few rows run `gemv4` over the codes; a
prompt step's many rows expand the matrix into one dense scratch buffer the executor shares (sized
for the largest matrix: layers run one at a time on one stream) and run F.linear. Norms and biases
stay dense (as FlexGen), and so do the embedding and the head (never in a layer). On the CPU each
projection is the twin F.linear(x, decompress(codes), b): the round-tripped model's, bit for bit.
"""
import torch
from torch import Tensor, nn

from batchmaker.exec.offload_weights import GROUP, Linear4, to_linear4
from batchmaker.kernels.compress4 import compress, decompress


def resident_layers(layers, to_device, compressed: bool, reference: bool = False) -> tuple[nn.ModuleList, Tensor | None]:
    """The resident layers on their device, `to_device(layer)` bringing each there; with `compressed`
    each matrix kept as its 4-bit codes, a layer compressed as soon as it arrives (so the device
    holds one dense layer at a time beside the codes so far, never every resident layer dense), and
    the shared dense scratch (None where nothing is compressed). `reference`: the PyTorch twins on a
    GPU too."""
    resident, scratch = nn.ModuleList(), None
    for layer in layers:
        layer = to_device(layer)
        if compressed:
            scratch = _compress_layer(layer, scratch, reference)
        resident.append(layer)
    return resident, scratch


def _compress_layer(layer: nn.Module, scratch: Tensor | None, reference: bool) -> Tensor | None:
    """`layer`'s nn.Linears as Linear4s over their codes (the dense matrices freed), sharing `scratch`
    (made for the first layer: the size of its largest matrix, every layer's shapes alike)."""
    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    if linears and scratch is None:
        largest = max(linears, key=lambda m: m.weight.numel()).weight
        scratch = torch.empty(largest.numel(), dtype=largest.dtype, device=largest.device)
    with torch.no_grad():
        codes = {id(m.weight): compress(m.weight, GROUP, dim=0) for m in linears}
        to_linear4(layer, codes, scratch, reference)
        for p in layer.parameters():  # (a matrix outside an nn.Linear, if any: its round trip, kept dense)
            if p.dim() == 2:
                p.copy_(decompress(compress(p, GROUP, dim=0)))
    return scratch


def resident_bytes(layers: nn.ModuleList) -> int:
    """Device bytes of `layers` as compress_resident leaves them: codes, (scale, min) and what stays dense."""
    codes = sum(m.codes.nbytes for m in layers.modules() if isinstance(m, Linear4))
    return codes + sum(t.numel() * t.element_size() for t in [*layers.parameters(), *layers.buffers()])


def round_tripped(lm: nn.Module) -> nn.Module:
    """`lm` (in place) with its decoder layers' matrices replaced by their 4-bit round trip: the
    dense model that 4-bit weights compute as (norms, biases, the embedding and the head untouched)."""
    with torch.no_grad():
        for p in lm.layers.parameters():
            if p.dim() == 2:
                p.copy_(decompress(compress(p, GROUP, dim=0)))
    return lm

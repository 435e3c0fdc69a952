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


def compress_resident(layers: nn.ModuleList, reference: bool = False) -> Tensor | None:
    """`layers` (on their device) with each matrix kept as its 4-bit codes there; returns the
    shared dense scratch (None where there is no layer). `reference`: the PyTorch twins on a GPU too."""
    linears = [m for m in layers.modules() if isinstance(m, nn.Linear)]
    if not linears:
        return None
    largest = max(linears, key=lambda m: m.weight.numel()).weight
    scratch = torch.empty(largest.numel(), dtype=largest.dtype, device=largest.device)
    with torch.no_grad():
        for layer in layers:
            codes = {id(m.weight): compress(m.weight, GROUP, dim=0) for m in layer.modules() if isinstance(m, nn.Linear)}
            to_linear4(layer, codes, scratch, reference)
        for p in layers.parameters():  # (a matrix outside an nn.Linear, if any: its round trip, kept dense)
            if p.dim() == 2:
                p.copy_(decompress(compress(p, GROUP, dim=0)))
    return scratch


def resident_bytes(layers: nn.ModuleList) -> int:
    """Device bytes of `layers` as compress_resident leaves them: codes, (scale, min) and what stays dense."""
    codes = sum(m.codes.nbytes for m in layers.modules() if isinstance(m, Linear4))
    return codes + sum(t.numel() * t.element_size() for t in [*layers.parameters(), *layers.buffers()])

"""How bench/offload.py names its policies: what a placement offloads as text and back (`--other`),
which 4-bit runs a placement takes, and which policy a rerun with one thing changed reruns."""
from batchmaker.core.zigzag import Placement


def placement_name(p: Placement) -> str:
    """What lives on the host, and the share of the layers' weights kept on the GPU where some is."""
    offloaded = "+".join(k for k, on in (("weights", p.weights), ("cache", p.cache), ("hidden", p.hidden),
                                         ("cpu_attention", p.cpu_attention)) if on)
    return (offloaded or "none") + (f"@{p.weights_gpu:.2f}" if p.weights_gpu else "")


def parse_policy(text: str) -> tuple[int, int, Placement]:
    """'4x2:weights+cache+hidden[+cpu_attention][@0.4]' -> (gpu_batch, num_batches, placement with that weights_gpu)."""
    shape, _, where = text.partition(":")
    where, _, share = where.partition("@")
    gbs, nb = (int(v) for v in shape.split("x"))
    parts = set(where.split("+"))
    return gbs, nb, Placement("weights" in parts, "cache" in parts, "hidden" in parts, float(share or 0),
                              "cpu_attention" in parts)


def compresses(placement: Placement, what: str) -> bool:
    """Whether the executor takes `compress=what` with `placement` (weights anywhere: resident ones keep
    their codes on the device; a cache only on the host, and not one the CPU attends over)."""
    return what == "weights" or placement.cache and not placement.cpu_attention


def variant_of(name: str) -> str | None:
    """The policy `name` reruns with one thing changed (a share, the attention), or None."""
    for mark in ("-weights_gpu", "-cpu_attention-"):
        if mark in name:
            return name.split(mark)[0]
    return None

"""kernels/attention_variants.py: the paged-attention variants compiled before serving are the
ones serving launches (a variant met mid-serving stalls every request for its compile)."""
import itertools
import types

import pytest
import torch

from batchmaker.cells.decoder_cell import KVSettings
from batchmaker.kernels import decode_row
from batchmaker.kernels.attention_variants import compile_variants, launch_variants
from batchmaker.kernels.attention_launch import window_bound
from batchmaker.kernels.paged_attention import COMBINE_MAX_SPLITS, _pow2, plan_launch, small_tokens
from helpers import interpreter, needs_gpu, run_interpreted


def mode(cfg, splits: int, combine: bool, work: bool) -> tuple:
    """What tells two compiled variants apart: tiles, how slices merge (the combine launch's
    width), the launch form."""
    return cfg, 1 if splits == 1 else "in kernel" if combine else _pow2(splits), work


@pytest.mark.parametrize("wide", (False, True))
@pytest.mark.parametrize("group,max_positions", [(1, 4096), (4, 4096), (8, 2048), (1, 16384)])
def test_the_variants_are_the_launches_the_planner_makes(group, max_positions, wide):
    """Every launch `plan_launch` makes over a sweep of batches, query lengths, contexts and work
    lists is one of `launch_variants`, and every variant is made by some launch (with the
    narrower prompt tiles and with the wide ones of GPUs with the shared memory)."""
    kv_heads = 32 // group
    compiled = {mode(cfg, n, 1 < n <= COMBINE_MAX_SPLITS, work)
                for cfg, n, work in launch_variants(group, kv_heads, max_positions, 132, wide)}
    reached = set()
    for seqs, query, bound, items in itertools.product(
            (1, 2, 3, 8, 16, 64, 256), (1, 2, 4, small_tokens(group), 8, 16, 64, 128, 512, 2048),
            (16, 100, 200, 256, 300, 360, 512, 700, 1024, 2048, 3000, 4096, 6000, 8192, 10240, 16384, 20000, 40000),
            (None, 1, 4, 16, 100, 1000)):
        if bound > max_positions or (items is not None and query not in (small_tokens(group),) and query <= small_tokens(group)):
            continue
        cfg, n, combine = plan_launch(seqs, kv_heads, group, query, bound, 132, True, num_items=items, wide=wide)
        reached.add(mode(cfg, n, combine, items is not None))
    assert reached <= compiled, sorted(map(str, reached - compiled))
    assert compiled <= reached, sorted(map(str, compiled - reached))  # (no compile for a launch never made)


class _Recorder:
    """Stands in for the Triton kernels: records each launch's constexprs (what makes a variant)."""

    def __init__(self):
        self.launched = set()

    def __getattr__(self, name):
        recorder = self

        class Kernel:
            def __getitem__(self, grid):
                return lambda *args, **kw: recorder.launched.add(
                    (name, tuple(sorted((k, v) for k, v in kw.items() if k in _VARIANT))))
        return Kernel()


_VARIANT = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "IS_SPLIT", "COMBINE", "WORK", "SPLITS_PAD", "WINDOWED",
            "CAPPED", "PRELOAD")


def _kernel_launches(cfg, n: int, combine: bool, work: bool, windowed: bool = False, capped: bool = False,
                     rows: bool = False, pairs: int = 0) -> set:
    """`rows`: the launch is the row loop's (kernels/decode_row.py), its tile ROW_DECODE's, over `pairs`
    (sequence, kv head) pairs."""
    if rows:  # (its own merge: up to the tile's merge_max slices in the kernel, a variant per padded count)
        tile, combine = decode_row.ROW_DECODE, decode_row.merges_in_kernel(n, True)
        attention = ("decode_row_kernel", tuple(sorted({"BLOCK_N": tile.block_n, "num_warps": tile.num_warps,
                                                        "IS_SPLIT": n > 1, "COMBINE": combine,
                                                        "SPLITS_PAD": _pow2(n) if combine else 1,
                                                        "PRELOAD": decode_row.preloads(pairs)}.items())))
    else:
        attention = ("paged_attention_kernel", tuple(sorted({
            "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "IS_SPLIT": n > 1, "COMBINE": combine, "WORK": work, "WINDOWED": windowed, "CAPPED": capped}.items())))
    combine_launch = ("combine_splits_kernel", (("SPLITS_PAD", _pow2(n)), ("num_warps", 1)))
    return {attention} | ({combine_launch} if n > 1 and not combine else set())


FEATURES = {"none": ((), None), "alternating windows and a cap": ((16, 0, 16), 50.0), "windows": ((8, 8), None),
            "a cap": ((), 30.0)}  # (each layer's sliding window, the soft cap), as DecoderConfig has them


@pytest.mark.parametrize("row", (None, decode_row.ROW_TILE), ids=("tiles", "row-loop"))
@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("wide", (False, True))
@pytest.mark.parametrize("group,max_positions,block", [(1, 4096, 16), (4, 4090, 16), (8, 2048, 16), (2, 700, 8)])
def test_compile_variants_launches_what_serving_launches(group, max_positions, block, wide, features, row,
                                                         monkeypatch):
    """The kernels compile_variants launches (constexprs recorded in place of Triton) are those
    the planner picks over a sweep of batches up to the block table's width, a block past
    max_positions where it is no multiple of the block size (an unbounded launch's bound); with
    the device's prompt tiles either way (wide_prompt); for each of the layers' windows (none,
    or one: a launch of its own, whose bound the window caps) with the model's cap or without; with
    the one-row decode loop on (kernels/decode_row.py) and off."""
    from batchmaker.kernels import attention_variants, paged_attention
    from batchmaker.exec.iterations import IterationRunner
    recorder = _Recorder()
    monkeypatch.setattr(decode_row, "ROW_DECODE", row)
    monkeypatch.setattr(paged_attention, "_load_kernels", lambda: recorder)
    monkeypatch.setattr(decode_row, "load_kernels", lambda *names: recorder)
    for module in (attention_variants, paged_attention):  # (the device's answers, on this CPU)
        monkeypatch.setattr(module, "wide_prompt", lambda device, row_bytes: wide)
    monkeypatch.setattr(attention_variants, "_num_sms", lambda device: 132)
    kv_heads, max_blocks = 32 // group, -(-max_positions // block)
    k = torch.zeros(2, block, kv_heads, 16, dtype=torch.bfloat16)  # (16-bit: the row loop's too)
    windows, softcap = FEATURES[features]
    config = types.SimpleNamespace(num_heads=32, max_positions=max_positions, attention_windows=windows,
                                   attn_softcap=softcap)
    runner = types.SimpleNamespace(cache=types.SimpleNamespace(k=k[None], v=k[None]), max_blocks=max_blocks,
                                   config=config, module=types.SimpleNamespace(
                                       block_size=block, calibration_prompts=[], kv=KVSettings()),
                                   unified_max=None, lm=torch.nn.Module(), device=torch.device("cpu"))  # (no routes)
    IterationRunner.compile_kernels(runner)
    width = max_blocks * block
    wanted, served = set(), set()
    for seqs, query, bound, items in itertools.product(
            (1, 2, 3, 8, 16, 64, 256), (1, 2, 4, 8, 16, 64, 128, 512, 2048), sorted({*range(16, width + 1, 37), width}),
            (None, 1, 4, 16, 100, 1000)):
        for window in {*windows} or {0}:
            eligible = decode_row.runs_rows(group, query, items, None, window or None, softcap, None, k)
            capped = window_bound(bound, window or None, query)
            for launched, cut in ((served, capped), (wanted, bound)):
                splits = decode_row.row_splits(seqs * kv_heads, cut, None) if eligible else None
                flags = (items is not None, window > 0, softcap is not None, splits is not None)
                launched |= _kernel_launches(*plan_launch(seqs, kv_heads, group, query, cut, 132, True,
                                                          num_splits=splits, num_items=items, wide=wide), *flags,
                                             seqs * kv_heads)
    # (a window compiles the launches of every bound: those a window as long as the context reaches)
    assert recorder.launched == wanted and served <= wanted
    unwindowed = not windows or 0 in windows
    assert any(name == "decode_row_kernel" for name, _ in recorder.launched) == (
        row is not None and group == 1 and unwindowed and softcap is None)
    assert any(("BLOCK_N", 128) in key and ("BLOCK_M", 128 // group) in key
               for name, key in recorder.launched if name == "paged_attention_kernel") == wide


@interpreter
def test_every_variant_launches_over_scratch_in_the_interpreter():
    k = torch.randn(3, 4, 2, 16)
    v = torch.randn_like(k)
    before = (k.clone(), v.clone())
    assert compile_variants(k, v, num_q_heads=4, max_blocks=64, max_positions=512) > 0
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])  # (reads only)


def test_the_interpreter_in_a_subprocess():
    assert "1 passed" in run_interpreted(__file__, "test_every_variant_launches_over_scratch", timeout=300)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kv_heads,row", [(8, None), (32, decode_row.ROW_TILE)], ids=("gqa", "row-loop"))
def test_no_launch_compiles_after_the_variants_did(kv_heads, row, monkeypatch):
    """After compile_variants, paged attention over random mixed batches (decodes, chunks, work
    lists, long contexts: split) compiles nothing new (the runtime's compile hook counts); with
    one query head per kv head and the row loop on, half the batches decode only (its launches)."""
    from triton import knobs

    from batchmaker.kernels.attention_work import work_lists
    from batchmaker.kernels.paged_attention import paged_attention
    monkeypatch.setattr(decode_row, "ROW_DECODE", row)
    heads, dim, block, max_blocks = 32, 128, 16, 256
    k = torch.randn(2048, block, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    compile_variants(k, v, heads, max_blocks, max_blocks * block)
    compiled = []
    knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiled.append(kw.get("repr", "?"))
    try:
        gen = torch.Generator().manual_seed(0)
        for trial in range(40):
            seqs = int(torch.randint(1, 80, (), generator=gen))
            lens = [1 if torch.rand((), generator=gen) < 0.8 or (row and trial % 2) else
                    int(torch.randint(2, 600, (), generator=gen)) for _ in range(seqs)]
            ctxs = [min(max_blocks * block, q + int(torch.randint(0, 4000, (), generator=gen))) for q in lens]
            tables = torch.randint(1, 2048, (seqs, max_blocks), dtype=torch.int32, device="cuda")
            starts = torch.tensor([0] + lens).cumsum(0)
            q = torch.randn(int(starts[-1]), heads, dim, dtype=torch.bfloat16, device="cuda")
            args = (q, k, v, tables, starts.int().cuda(), torch.tensor(ctxs, dtype=torch.int32, device="cuda"),
                    max(lens), dim ** -0.5)
            paged_attention(*args, max_context_len=max(ctxs))
            if seqs >= 2 and max(lens) > 1:
                work = tuple(torch.from_numpy(x).cuda() for x in work_lists(starts.numpy(), len(q), heads // kv_heads,
                                                                              max(lens)))
                paged_attention(*args, max_context_len=max(ctxs), work=work)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compiled == []

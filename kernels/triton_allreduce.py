"""One-shot all-reduce over NVLink peer memory (issue 31): for the small messages of a decode step
(a few rows of the hidden size), where NCCL's protocol costs more than the bytes.

Each rank owns one buffer of two halves and one flag per rank (int64: a call number that never
wraps around), mapped into every other rank's
address space (exec/peer_memory.py). A call is two launches on the rank's stream:
- `stage`: copy the input into this rank's half `e % 2`, where `e` is this call's number (one
  more than the last number this rank posted to itself); program 0 writes `e` to `epoch`;
- `reduce`: post `e` into every rank's flag slot of this rank (a release store at system scope),
  wait until every rank has posted `e` here (acquire), then sum the ranks' halves `e % 2` in rank
  order (fp32) into the output: every rank computes the same sum, bit for bit.
Why two halves and one flag suffice: a rank stages call e + 2 into half e % 2 only after call e + 1
completed, which waited for every rank to post e + 1, which each did after it finished reading
call e. The numbers live on the device, so the launches replay inside CUDA graphs: every rank runs
the same calls in the same order. The reference twin is the plain sum of the ranks' inputs.
"""
import triton
import triton.language as tl

BLOCK = 1024  # elements per program: a few programs for a decode step's rows
MAX_POLLS = 1 << 23  # a rank that never posts (dead, hung): give up after seconds with garbage, as an
# aborted NCCL collective does; the group is broken by then (exec/tensor_group.py) and fails the iteration
STOP_POLLS = 1 << 12  # every this many polls the wait reads the group's stop word (pinned host memory,
# ~1 µs over the host link): set once the group is broken (OneShot.stop), it ends every wait at once, so
# that a decode graph of 2 all-reduces a layer drains in milliseconds instead of seconds per all-reduce
# (2026-11-26: a TP=2 x PP=2 rank's graph kept its stream busy for minutes after a rank was killed, and
# the NCCL abort behind it timed out). A wait of fewer polls, as every healthy one is, never reads it


@triton.jit
def stage_kernel(x_ptr, buffers, flag_tables, epoch, n, half, RANK: tl.constexpr, BLOCK: tl.constexpr):
    own_flags = tl.load(flag_tables + RANK).to(tl.pointer_type(tl.int64))
    e = tl.load(own_flags + RANK, volatile=True) + 1  # only `reduce` writes it: stable here
    own = tl.load(buffers + RANK).to(tl.pointer_type(x_ptr.dtype.element_ty))
    own += (e % 2) * half
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(own + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)
    if tl.program_id(0) == 0:
        tl.store(epoch, e)


@triton.jit
def reduce_kernel(out_ptr, buffers, flag_tables, epoch, stop_at, n, half, RANK: tl.constexpr, RANKS: tl.constexpr,
                  BLOCK: tl.constexpr, MAX_POLLS: tl.constexpr, STOP_POLLS: tl.constexpr):
    e = tl.load(epoch)  # only `stage` writes it: stable here
    if tl.program_id(0) == 0:
        for r in tl.static_range(RANKS):  # post e in rank r's slot for this rank
            slots = tl.load(flag_tables + r).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(slots + RANK, e, sem="release", scope="sys")
    own_flags = tl.load(flag_tables + RANK).to(tl.pointer_type(tl.int64))
    stop = tl.load(stop_at).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(RANKS):  # every rank's stage of call e is visible
        seen = tl.atomic_add(own_flags + r, 0, sem="acquire", scope="sys")
        polls = 0
        while (seen < e) & (polls < MAX_POLLS):
            seen = tl.atomic_add(own_flags + r, 0, sem="acquire", scope="sys")
            polls += 1
            if polls % STOP_POLLS == 0:
                if tl.load(stop, volatile=True) != 0:
                    polls = MAX_POLLS
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(RANKS):
        peer = tl.load(buffers + r).to(tl.pointer_type(out_ptr.dtype.element_ty)) + (e % 2) * half
        total += tl.load(peer + offsets, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


def one_shot_all_reduce(x, buffers, flag_tables, epoch, stop_at, half: int, rank: int, ranks: int):
    """Sum `x` (contiguous, at most `half` elements) over the ranks, in place; `stop_at` [1] int64 holds
    the address of the group's stop word (int32, pinned host memory: nonzero ends every wait)."""
    n = x.numel()
    grid = (triton.cdiv(n, BLOCK),)
    stage_kernel[grid](x, buffers, flag_tables, epoch, n, half, RANK=rank, BLOCK=BLOCK)
    reduce_kernel[grid](x, buffers, flag_tables, epoch, stop_at, n, half, RANK=rank, RANKS=ranks, BLOCK=BLOCK,
                        MAX_POLLS=MAX_POLLS, STOP_POLLS=STOP_POLLS)
    return x

"""The Triton kernel of greedy decoding's argmax over each row of logits (kernels/greedy.py launches
it). A row's vocabulary is split into chunks of BLOCK, a program a chunk, so that a long row is read
by many SMs at once (one program a row of 256,000 took 25 µs against torch's 8, H200): a program
takes its chunk's largest key and the first index holding it, packs them into one int64 (the key
above, the index inverted below: the largest packed value is the largest key at its first index) and
atomically maxes the row's slot with it; the row's last program to count itself in reads the slot,
writes the index and resets the slot and the count for the next launch (graph replays included).

Keys are the float32 bits mapped to int32 so that integer order is float order, NaN of either sign
above everything (torch.argmax's order); ties go to the first index, as torch.argmax's do.
"""
import triton
import triton.language as tl

from batchmaker.kernels.triton_pdl import wait_for_input

LOWEST_KEY = tl.constexpr(-2147483648)  # below every float's key: the lanes past the vocabulary
EMPTY = tl.constexpr(-9223372036854775808)  # a row slot before any chunk's max (int64's least)


@triton.jit
def _keys(x):
    # int32 keys in float order (negative floats' bits flipped below the positive ones); NaN of either sign the
    # largest, as torch.argmax ranks it
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def greedy_kernel(logits_ptr, out_ptr, best_ptr, count_ptr, vocab, stride_row, num_chunks, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    # out[row] = the first index of row's largest logit (float32 [rows, vocab], unit column stride); best[row]
    # (int64, EMPTY) and count[row] (int32, 0) as the previous launch left them
    row, chunk = tl.program_id(0), tl.program_id(1)
    wait_for_input(PDL)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    key = tl.where(ok, _keys(tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=ok, other=0.0)),
                   LOWEST_KEY)
    top = tl.max(key, axis=0)
    first = tl.min(tl.where(key == top, cols, vocab), axis=0)
    packed = (top.to(tl.int64) << 32) | (0x7FFFFFFF - first.to(tl.int64))
    tl.atomic_max(best_ptr + row, packed)
    if tl.atomic_add(count_ptr + row, 1) == num_chunks - 1:  # (acq_rel: every chunk's max is in)
        final = tl.atomic_xchg(best_ptr + row, EMPTY)
        tl.store(out_ptr + row, 0x7FFFFFFF - (final & 0x7FFFFFFF))
        tl.atomic_xchg(count_ptr + row, 0)

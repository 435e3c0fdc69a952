"""Choosing the next token of each sampled sequence, on the device, for a whole iteration at once.

Greedy (temperature 0) takes the argmax (one launch on CUDA: kernels/greedy.py). Otherwise the
logits are divided by the temperature, cut to the top-k and to the smallest nucleus of probability
top-p, and a token is drawn by the Gumbel-max trick with noise that is a hash of (seed, token
index, vocabulary id): a request's
draw depends on its own seed and position only, never on what it was batched with, so sampled
outputs are reproducible, batched equals unbatched, and a suspended request recomputed later
continues exactly as it would have. No host sync and fixed shapes: it runs inside CUDA graphs.
"""
import torch

from batchmaker.kernels.greedy import greedy as greedy_tokens

_MASK = 0xFFFFFFFF
SAMPLING_BYTES_PER_LOGIT = 48  # `sample`'s temporaries a row and vocabulary entry at once: fp32 logits,
# their sorted copy and order (int64), the Gumbel noise's int64 hashes and float64 draws
CHUNK_BYTES = 512 << 20  # rows are sampled in chunks whose temporaries stay under this: a whole Gemma 2
# batch at once (256 rows of 256,000) held 3.1 GB, and each CUDA graph's batch size its own blocks of
# the graphs' pool: captures ran out of memory beside a KV cache that left 6 GB (H100, 2026-11-26)


def chunk_rows(vocab: int) -> int:
    """Rows one chunk samples at once (Llama's 32,000: 349; Qwen2's 152,064: 73; Gemma's 256,000: 43)."""
    return max(8, CHUNK_BYTES // (vocab * SAMPLING_BYTES_PER_LOGIT))


def sampling_bytes(rows: int, vocab: int) -> int:
    """What sampling `rows` rows over a `vocab` of logits holds at its peak (one chunk's temporaries)."""
    return min(rows, chunk_rows(vocab)) * vocab * SAMPLING_BYTES_PER_LOGIT


def sample_rows(head, hidden: torch.Tensor, rows: torch.Tensor, t: dict, step: int, greedy_only: bool,
                logprobs: int = -1):
    """The next tokens [N] of `hidden`'s rows `rows` [N] through the LM head `head`, `step` rows at a
    time (`chunk_rows` of the whole vocabulary; fixed shapes, so it runs inside CUDA graphs); `t`: the
    rows' temperature, top_k, top_p, seeds and counters; with `logprobs` >= 0, also their
    `log_probabilities` (concatenated over the chunks)."""
    n = rows.shape[0]
    parts = []
    for begin in range(0, max(n, 1), step):
        end = min(n, begin + step)
        logits = head(hidden.index_select(0, rows[begin:end]))
        chosen = sample(logits, t["temperature"][begin:end], t["top_k"][begin:end], t["top_p"][begin:end],
                        t["seeds"][begin:end], t["counters"][begin:end], greedy_only)
        parts.append((chosen, log_probabilities(logits, chosen, logprobs)) if logprobs >= 0 else (chosen,))
    if len(parts) == 1:
        return parts[0][0] if logprobs < 0 else parts[0]
    chosen = torch.cat([part[0] for part in parts])
    if logprobs < 0:
        return chosen
    return chosen, tuple(torch.cat([part[1][i] for part in parts]) for i in range(3))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, counters: torch.Tensor, greedy_only: bool = False) -> torch.Tensor:
    """Tokens [N] (int64) from float32 logits [N, V]; per row temperature (0: greedy), top_k (0:
    all), top_p (1: all), seed and counter (the token's index in its sequence)."""
    greedy = greedy_tokens(logits)  # (one launch on CUDA; torch.argmax elsewhere)
    if greedy_only:
        return greedy
    vocab = logits.shape[-1]
    scaled = logits / temperature.clamp_min(1e-5).unsqueeze(1)
    ordered, order = scaled.sort(-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    keep = ranks.unsqueeze(0) < k
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), -1)
    keep &= (probs.cumsum(-1) - probs) < top_p.unsqueeze(1)  # the first token always stays
    noise = gumbel(seeds, counters, vocab).gather(1, order)
    choice = (ordered.masked_fill(~keep, float("-inf")) + noise).argmax(-1, keepdim=True)
    drawn = order.gather(1, choice).squeeze(1)
    return torch.where(temperature > 0, drawn, greedy)


def gumbel(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [N, V] (float32), a pure function of (seed, counter, vocabulary id)."""
    row = _hash32((seeds & _MASK) ^ _hash32((counters & _MASK) ^ _hash32((seeds >> 32) & _MASK)))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _hash32(row.unsqueeze(1) ^ ((ids * 0x9E3779B1) & _MASK))
    u = (h.to(torch.float64) + 0.5) / 4294967296.0
    return (-torch.log(-torch.log(u))).to(torch.float32)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (lowbias32), in int64 arithmetic kept to 32 bits."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def log_probabilities(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """The chosen tokens' log-probabilities [N] and the k most likely tokens' ids and
    log-probabilities [N, k], under the model's own distribution (the logits' softmax, before
    temperature, top-k or top-p), in float32."""
    logp = torch.log_softmax(logits.float(), -1)
    top = logp.topk(k, -1) if k else None
    empty = logp.new_empty(logp.shape[0], 0)
    return (logp.gather(1, chosen.unsqueeze(1)).squeeze(1), top.indices if top else empty.long(),
            top.values if top else empty)

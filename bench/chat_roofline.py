"""bench/chat.py's accounting of a BatchMaker run from its iteration trace (IterationRecord,
batchmaker/exec/iteration_record.py): each iteration's floor at the device's measured limits (the
roofline), where the wall time went on the device, and the throughput at saturation."""
import numpy as np


def saturated_window(trace: list, start: float, arrivals, rate: float, work, latencies=None,
                     warm: float = 0.25) -> dict:
    """Output tokens/s while requests kept arriving, the first `warm` of that span left out: from
    the iterations' sampled tokens and launch times (`IterationRecord.samples`, `.at`). The span ends
    at the last arrival, or, all at once (rate inf), at the last iteration with a prompt chunk (no
    request waits after it). It is the throughput at saturation, without the drain at the end where
    the last few requests decode alone, where the engine fell behind: it sampled under 0.95 of the
    output tokens of the requests that arrived in the window, and the requests' latency per token
    grew (the median of the window's last quarter of arrivals over its first quarter's, `growth`,
    above 1.5: a queue built up) or all came at once."""
    arrivals = np.asarray(arrivals, dtype=float)
    if rate == float("inf"):
        prompt_at = [r.at for r in trace if r.tokens > r.samples]
        end = max(prompt_at) if prompt_at else start
    else:
        end = start + float(arrivals[-1])
    begin = start + warm * (end - start)
    tokens = sum(r.samples for r in trace if begin <= r.at < end)
    outputs = np.array([o for _, o in work], dtype=float)
    inside = (start + arrivals >= begin) & (start + arrivals < end)
    achieved = tokens / (end - begin) if end > begin else None
    offered = float(outputs[inside].sum()) / (end - begin) if end > begin and rate != float("inf") else float("inf")
    growth = None
    if latencies is not None and inside.sum() >= 8:
        norm = (np.asarray(latencies) / outputs)[inside]
        quarter = len(norm) // 4
        growth = float(np.median(norm[-quarter:]) / np.median(norm[:quarter]))
    queued = rate == float("inf") or (growth is not None and growth > 1.5)
    return {"begin_s": begin - start, "end_s": end - start, "tokens": tokens, "tokens_per_s": achieved,
            "offered_tokens_per_s": offered, "latency_growth": growth,
            "saturated": achieved is not None and achieved < 0.95 * offered and queued}


def iteration_floor(record, config, params: int, itemsize: int, bandwidth: float, peak: float,
                    serial: bool = False) -> float:
    """Seconds one iteration (an exec/iterations.IterationRecord) would take at its roofline:
    max(bytes / bandwidth, FLOPs / peak). With `serial`, the projections' roofline plus
    attention's instead: what an iteration whose kernels run one after another (each at its own
    roofline) cannot beat. A mixed iteration (prompt chunks: FLOPs in the GEMMs; decodes: bytes in
    attention) reaches at most roofline / serial of the first."""
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
    head, table = head_parameters(config)
    samples = record.tokens if record.samples is None else record.samples  # (the LM head's rows)
    weight_s = (params - table) * itemsize / bandwidth
    gemm_s = 2 * ((params - head - table) * record.tokens + head * samples) / peak
    kv_s = record.context * kv_per_token / bandwidth
    pairs = record.context if record.pairs is None else record.pairs  # a decode's: its context
    attention_s = 4 * config.num_layers * config.num_heads * config.head_dim * pairs / peak
    return max(weight_s, gemm_s) + max(kv_s, attention_s) if serial else max(weight_s + kv_s, gemm_s + attention_s)


def head_parameters(config) -> tuple[int, int]:
    """(the LM head's parameters, an untied token embedding's): the head is read once an iteration
    (tied: the embedding's table, counted once) and multiplies only the rows sampled; an untied
    embedding is neither read whole nor multiplied (a row gathered per token)."""
    head = config.vocab_size * config.hidden_size
    return head, 0 if config.tie_word_embeddings else head


def roofline(trace: list, config, params: int, itemsize: int, bandwidth: float, peak: float,
             serial: bool = False) -> float:
    """The iterations' floors (above), summed."""
    return sum(iteration_floor(r, config, params, itemsize, bandwidth, peak, serial) for r in trace)


def device_time(trace: list, wall_s: float, floor) -> dict:
    """Where a run's wall time went: the iterations' spans on the device (graphed and eager
    apart), the rest (the device waiting between iterations: for the host), and each part's
    roofline (`floor(record)` seconds) over its span: how close its kernels ran to their floor."""
    split = {}
    for graphed, name in ((True, "graphed"), (False, "eager")):
        part = [r for r in trace if r.graphed == graphed and r.seconds is not None]
        busy, ideal = sum(r.seconds for r in part), sum(floor(r) for r in part)
        split[name] = {"iterations": len(part), "busy_s": busy, "roofline_s": ideal,
                       "roofline_of_busy": ideal / busy if busy else None,
                       "mean_tokens": float(np.mean([r.tokens for r in part])) if part else None}
    busy = split["graphed"]["busy_s"] + split["eager"]["busy_s"]
    return {"busy_s": busy, "busy_fraction": busy / wall_s, **split}

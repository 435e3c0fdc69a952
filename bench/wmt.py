"""LSTM and Seq2Seq on WMT-like sentences: BatchMaker against padding + bucketing, the paper's
bucketing variant and the engine with cellular batching off (thesis Figs. 2.7-2.13), under the
protocol of bench/protocol.py (sustainable throughput at a p90 SLO, curves at the same offered
rates, repeats in shuffled order, the load generator in a process of its own).

Every system serves the same Poisson arrivals in the same run, on the same device, with the same
weights (the engine's cells; the baselines copy them), the same dtype and TF32 policy. Seq2Seq
decodes as many steps as the target sentence has tokens (synthetic data: the source length),
clipped to --max-decode, in every system.

    python bench/wmt.py --model lstm --dtype fp16 --rates 12800 25600 38400 51200 --tune
    python bench/wmt.py --model lstm --device cpu --hidden 256 --rates 200 400 800 1200
    python bench/wmt.py --model seq2seq --moses europarl-v7.de-en.de europarl-v7.de-en.en --rates ...
    python bench/wmt.py --model lstm --dtype fp16 --devices cuda:0,cuda:1 --replicas 1 2 --systems batchmaker null \
        --rates ...           # the engine as 1 and 2 replica processes (bench/replica_runs.py)
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replica_runs  # noqa: E402
import runner  # noqa: E402
from baselines import BucketingLSTM, BucketingSeq2Seq  # noqa: E402
from protocol import Slo  # noqa: E402

from batchmaker import build_model  # noqa: E402
from batchmaker.data import LENGTH_VARIANTS, MAX_LENGTH, read_parallel, variant_sentences  # noqa: E402

SYSTEMS = [runner.ENGINE, "bucketing", "bucketing-paper", runner.ABLATION, "null"]
# The targets against the strong baseline: sustainable throughput >= x (the whole range
# over repeats), p90 at half the baseline's sustainable throughput <= y x its p90 (the whole range).
TARGETS = {"lstm": {"sustainable": 1.25, "p90": 1 / 3}, "seq2seq": {"sustainable": 1.6, "p90": None}}
SLOS = {
    ("lstm", "cuda"): Slo(100.0, "an interactive request (one sentence): 7-20x either system's p90 at light load "
                                 "on a GPU (5-15 ms), so it rejects a growing queue, not a batching policy"),
    ("seq2seq", "cuda"): Slo(200.0, "a translation decodes as many steps as its source has tokens (mean 24, up "
                                    "to 330): twice the LSTM's budget for about twice the sequential steps"),
    ("lstm", "cpu"): Slo(250.0, "the 2-core CPU at h = 256: a request's own compute is ~1-5 ms alone and tens "
                                "of ms in a batch of hundreds; 250 ms keeps the same 'interactive' intent"),
    ("seq2seq", "cpu"): Slo(2000.0, "the 2-core CPU decodes a 30,000-word projection per step: a batch of "
                                    "translations takes hundreds of ms; 2 s is an interactive bound there"),
}


def dataset(args) -> list[tuple[list[int], int]]:
    """(source tokens, target length) pairs."""
    if args.moses:
        pairs = read_parallel(args.moses[0], args.moses[-1], args.vocab)
        return pairs[:args.pool] if args.pool else pairs
    sentences = variant_sentences(args.pool, args.vocab, args.lengths, seed=args.seed)
    return [(s, len(s)) for s in sentences]


def requests(args, pairs) -> list[tuple[str, dict]]:
    if args.model == "lstm":
        return [("lstm", {"tokens": s}) for s, _ in pairs]
    return [("seq2seq", {"tokens": s, "max_len": min(n, args.max_decode)}) for s, n in pairs]


def spec(args) -> tuple[str, dict]:
    """The model's registered name and options (same seed: same weights wherever it is built)."""
    sizes = dict(vocab=args.vocab, embed=args.embed or args.hidden, hidden=args.hidden, dtype=args.dtype, seed=args.seed)
    if args.model == "lstm":
        return "lstm", dict(sizes, max_batch=args.max_batch)
    return "seq2seq", dict(sizes, max_len=args.max_decode, max_batch_encoder=args.max_batch,
                           max_batch_decoder=args.max_batch_decoder)


def build(args):
    """A fresh model for each engine and baseline."""
    name, options = spec(args)
    return build_model(name, **options)


def bucketing(args, pick: str, max_in_flight: int, max_batch: int, graphs: bool = True):
    if args.model == "lstm":
        return runner.baseline_factory(lambda: BucketingLSTM(build(args), args.device, width=args.bucket_width,
                                                             max_batch=max_batch, pick=pick, max_in_flight=max_in_flight))
    return runner.baseline_factory(lambda: BucketingSeq2Seq(
        build(args), args.device, width=args.bucket_width, max_batch=max_batch, max_len=args.max_decode, pick=pick,
        max_in_flight=max_in_flight, graphs=graphs))


def factories(args) -> tuple[dict, dict]:
    """The systems, and the strong baseline's tuning candidates (its bucket pick)."""
    model_name = args.model
    make = {
        **replica_runs.engine_systems(args, lambda: [build(args)], lambda: [spec(args)], model_name),
        "bucketing": bucketing(args, args.pick, 2, args.max_batch),
        "bucketing-paper": bucketing(args, "round-robin", 1, args.paper_max_batch, graphs=False),
        runner.ABLATION: runner.engine_factory(lambda: [build(args)], args, model_name, cellular=False,
                                               width=args.bucket_width, max_batch=args.max_batch),
        "null": runner.null_factory(),
    }
    tuning = {"bucketing": {f"bucketing-{pick}": bucketing(args, pick, 2, args.max_batch) for pick in ("oldest", "fullest")}}
    return {name: make[name] for name in replica_runs.expand(args.systems, args)}, tuning


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="lstm", choices=["lstm", "seq2seq"])
    runner.add_common_args(parser)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--lengths", default="wmt", choices=LENGTH_VARIANTS, help="synthetic length variant")
    parser.add_argument("--moses", nargs="+", default=None, metavar="FILE",
                        help="Moses-format text: SOURCE [TARGET] (target lengths set Seq2Seq decode lengths)")
    parser.add_argument("--pool", type=int, default=20000, help="sentences requests are drawn from")
    parser.add_argument("--max-batch", type=int, default=512,
                        help="requests per batch: the engine's LSTM / encoder b_max, the strong bucketing's and the ablation's")
    parser.add_argument("--max-batch-decoder", type=int, default=256, help="the engine's decoder b_max")
    parser.add_argument("--paper-max-batch", type=int, default=None, help="the paper's bucketing (default: "
                        "--max-batch for the LSTM, 256 for Seq2Seq as in the paper)")
    parser.add_argument("--bucket-width", type=int, default=10)
    parser.add_argument("--pick", default="oldest", choices=["oldest", "fullest", "round-robin"],
                        help="the strong bucketing's bucket pick (--tune picks it)")
    parser.add_argument("--max-decode", type=int, default=MAX_LENGTH)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    args.paper_max_batch = args.paper_max_batch or (args.max_batch if args.model == "lstm" else 256)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    policy = runner.numerics(args)
    pairs = dataset(args)
    reqs = requests(args, pairs)
    lengths = np.array([len(s) for s, _ in pairs])
    print(f"{args.model}: {len(reqs)} sentences, mean length {lengths.mean():.1f}, max {lengths.max()}; {policy}",
          file=sys.stderr)
    slo = Slo(args.slo_ms, "given on the command line") if args.slo_ms else SLOS[(args.model, args.device.split(":")[0])]
    make, tuning = factories(args)
    comparisons = {"bucketing": {"ours": runner.ENGINE, "half_load": True, **TARGETS[args.model]},
                   "bucketing-paper": {"ours": runner.ENGINE},
                   runner.ABLATION: {"ours": runner.ENGINE}, **replica_runs.comparisons(args)}
    title = f"{args.model} h={args.hidden} {args.dtype} {args.lengths}, TF32 {args.tf32}, {args.mode}"
    name = f"wmt-{args.model}-{args.dtype}-{args.lengths if not args.moses else 'moses'}"
    name += f"-{args.mode}" if args.mode != "inproc" else ""
    name += f"-{args.tag}" if args.tag else ""
    about = {"source": "moses" if args.moses else f"synthetic WMT-like ({args.lengths})", "num_sentences": len(pairs),
            "mean_length": float(lengths.mean()), "max_length": int(lengths.max())}

    return runner.run_and_write(args, name, about, title, policy, reqs, make, comparisons, slo, tuning)


if __name__ == "__main__":
    sys.exit(main())

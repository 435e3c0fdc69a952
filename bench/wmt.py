"""LSTM and Seq2Seq on WMT-like sentences: BatchMaker vs padding + bucketing (thesis Figs. 2.7-2.13).

Both systems serve the same Poisson arrival stream (bench/loadgen.py) in the same run, on the same
device, with the same weights (the engine's cells; the baseline copies them into nn.LSTM), the same
dtype and the same TF32 policy. Seq2Seq decodes as many steps as the target sentence has tokens
(synthetic data: the source length), clipped to --max-decode, in both systems.

    python bench/wmt.py --model lstm                              # GPU, h=1024, fp32, sweep to saturation
    python bench/wmt.py --model seq2seq --dtype fp16 --devices cuda:0,cuda:1
    python bench/wmt.py --model lstm --device cpu --hidden 256 --rates 50 100 200 --duration 2
    python bench/wmt.py --model lstm --lengths max50               # Fig. 2.11 variants: wmt all24 max50 max100
    python bench/wmt.py --model seq2seq --moses europarl-v7.de-en.de europarl-v7.de-en.en
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runner  # noqa: E402
from baselines import BucketingLSTM, BucketingSeq2Seq  # noqa: E402
from common import write_results  # noqa: E402

from batchmaker import build_model  # noqa: E402
from batchmaker.data import LENGTH_VARIANTS, MAX_LENGTH, read_parallel, variant_sentences  # noqa: E402

# The targets: peak >= x bucketing; p90 at a fraction of bucketing's peak <= y x its p90.
TARGETS = {"lstm": dict(peak_target=1.25, load_fraction=0.5, p90_target=1 / 3),
           "seq2seq": dict(peak_target=1.6, load_fraction=0.5, p90_target=1 / 3)}


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


def build(args):
    sizes = dict(vocab=args.vocab, embed=args.embed or args.hidden, hidden=args.hidden, dtype=args.dtype,
                 seed=args.seed)
    if args.model == "lstm":
        return build_model("lstm", **sizes, max_batch=args.max_batch)
    return build_model("seq2seq", **sizes, max_len=args.max_decode, max_batch_encoder=args.max_batch,
                       max_batch_decoder=args.max_batch_decoder)


def baseline(args, model):
    if args.model == "lstm":
        return BucketingLSTM(model, args.device, width=args.bucket_width, max_batch=args.max_batch)
    return BucketingSeq2Seq(model, args.device, width=args.bucket_width, max_batch=args.baseline_max_batch,
                            max_len=args.max_decode)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="lstm", choices=["lstm", "seq2seq"])
    runner.add_common_args(parser)
    parser.add_argument("--systems", nargs="+", default=[runner.ENGINE, "bucketing", "null"],
                        choices=[runner.ENGINE, "bucketing", "null"])
    parser.add_argument("--lengths", default="wmt", choices=LENGTH_VARIANTS, help="synthetic length variant")
    parser.add_argument("--moses", nargs="+", default=None, metavar="FILE",
                        help="Moses-format text: SOURCE [TARGET] (target lengths set Seq2Seq decode lengths)")
    parser.add_argument("--pool", type=int, default=20000, help="sentences requests are drawn from")
    parser.add_argument("--max-batch", type=int, default=512, help="LSTM / Seq2Seq encoder b_max")
    parser.add_argument("--max-batch-decoder", type=int, default=256)
    parser.add_argument("--baseline-max-batch", type=int, default=256, help="Seq2Seq bucketing b_max (paper: 256)")
    parser.add_argument("--bucket-width", type=int, default=10)
    parser.add_argument("--max-decode", type=int, default=MAX_LENGTH)
    args = parser.parse_args(argv)

    policy = runner.numerics(args)
    model = build(args)
    pairs = dataset(args)
    reqs = requests(args, pairs)
    lengths = np.array([len(s) for s, _ in pairs])
    print(f"{args.model}: {len(reqs)} sentences, mean length {lengths.mean():.1f}, max {lengths.max()}; "
          f"{policy}", file=sys.stderr)
    results = {}
    for name in args.systems:
        system = (runner.engine_system([model], args) if name == runner.ENGINE
                  else runner.null_system(args) if name == "null"
                  else runner.baseline_system(baseline(args, model), args))
        results[name] = runner.run_system(name, system, reqs, args)
    comparison = (runner.compare({k: v for k, v in results.items() if k != "null"}, "bucketing", **TARGETS[args.model])
                  if {runner.ENGINE, "bucketing"} <= set(results) else None)
    headroom = runner.headroom(results)
    print("load generator headroom:", headroom)
    for line in runner.summary_lines(results):
        print(line)
    print("comparison:", comparison)
    title = f"{args.model} h={args.hidden} {args.dtype} {args.lengths}, TF32 {args.tf32}, {args.mode}"
    settings = {k: v for k, v in vars(args).items() if k != "profile_out"}
    payload = {"settings": settings, "numerics": policy,
               "data": {"source": "moses" if args.moses else f"synthetic WMT-like ({args.lengths})",
                        "num_sentences": len(pairs), "mean_length": float(lengths.mean()),
                        "max_length": int(lengths.max())},
               "title": title, "systems": results, "comparison": comparison, "generator_headroom": headroom}
    name = f"wmt-{args.model}-{args.dtype}-{args.lengths if not args.moses else 'moses'}"
    name += f"-{args.mode}" if args.mode != "inproc" else ""
    name += f"-{len((args.devices or args.device).split(','))}dev" if args.devices else ""
    name += f"-{args.tag}" if args.tag else ""
    path = write_results(name, args.device, payload, plot=runner.plot_or_none(results, title))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

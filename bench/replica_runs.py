"""The engine as data-parallel replicas in bench/wmt.py and bench/treebank.py (issue 31): with
`--replicas 1 2 4 --devices cuda:0,cuda:1,cuda:2,cuda:3`, one system per count N,
batchmaker-rN, the engine as N replica processes over the first N devices
(batchmaker/replicas.py), all measured in one run under one protocol, and each N > 1 compared
with r1 against the issue's targets.

    python bench/wmt.py --model lstm --device cpu --devices cpu,cpu --replicas 1 2 --systems batchmaker null ...
"""
from dataclasses import asdict

import runner

# The targets for N replicas against one: sustainable throughput (its whole range over
# the repeats), and at low load (half of r1's sustainable throughput) a p90 no worse than r1's.
TARGETS = {2: 1.8, 4: 3.4}


def engine_systems(args, build_models, specs, model_name: str) -> dict:
    """The engine under test: one engine over --devices (runner.ENGINE), or with --replicas a
    system per N. build_models() -> [Model] (one engine); specs() -> [(name, options)] (each
    replica builds its models itself)."""
    if not args.replicas:
        return {runner.ENGINE: runner.engine_factory(build_models, args, model_name)}
    return {name(n): factory(specs, args, n) for n in args.replicas}


def name(num: int) -> str:
    return f"{runner.ENGINE}-r{num}"


def factory(specs, args, num: int):
    from batchmaker.replicas import Replicas, ReplicasConfig

    devices = runner.devices_of(args)
    if num > len(devices):
        raise SystemExit(f"--replicas {num}: --devices names {len(devices)} ({','.join(devices)})")

    def make():
        config = ReplicasConfig(devices=devices[:num], engine=runner.engine_config(args))
        about = {"name": name(num), "replicas": num, "devices": list(devices[:num]),
                 "engine_config": runner.plain(asdict(config.engine)), "models": runner.plain(specs())}
        return Replicas(specs(), config), about
    return make


def comparisons(args) -> dict:
    """batchmaker-rN against batchmaker-r1, for every N > 1 measured beside r1."""
    if not args.replicas or 1 not in args.replicas:
        return {}
    return {f"{name(n)} vs r1": {"ours": name(n), "baseline": name(1), "half_load": True,
                                 "sustainable": TARGETS.get(n), "p90": 1.0}
            for n in sorted(set(args.replicas)) if n > 1}


def expand(systems: list[str], args) -> list[str]:
    """--systems with batchmaker standing for the replica systems when --replicas is given."""
    if not args.replicas:
        return systems
    return [s for system in systems for s in ([name(n) for n in args.replicas] if system == runner.ENGINE else [system])]

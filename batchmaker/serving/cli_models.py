"""What `batchmaker serve` and `demo` build from --models, --set and --devices: the models, each
on its device (a tensor-parallel decoder's ranks among the devices), or replicas that build them;
every mistake in what the command line names is a UsageError (one line, exit status 2)."""
import os
import re
import sys


class UsageError(Exception):
    """A mistake in the command line or in what it names: reported as one line, exit status 2."""


def load_models(specs: list[str], settings: list[str], devices: tuple[str, ...] = ("cpu",),
                http: bool = False) -> list:
    """Registered names (with their --set options) and module:attribute specs -> Models. A
    registered model with a `device` option (the decoders) is built on the first of `devices`
    unless told otherwise, so that large weights are placed once, where they run. Served over
    HTTP (`http`), a registered decoder gets prefix caching unless told otherwise: OpenAI clients
    resend their history every turn, and ZeroMQ clients that never do need not pay for it. A
    registered decoder given offload keys (`--set llama.offload=auto`: serving/offload_options.py)
    is an OffloadedModel, served by a block worker through FlexGen's executor (block_worker.py)."""
    from batchmaker.errors import UnknownModelError
    from batchmaker.registry import load_model, registered_models
    from batchmaker.serving.model_options import SettingError, factory_options, parse_settings
    from batchmaker.serving.offload_options import is_offloaded, offloaded_model, split_settings

    known = registered_models()
    unknown = [s for s in specs if ":" not in s and s not in known]
    if unknown:
        raise UsageError(str(UnknownModelError(unknown[0], known)) + "; or module:attribute for your own")
    if any(":" in s for s in specs) and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # module:attribute from the current directory, as `python -m` does
    offload, settings = split_settings(settings, [s for s in specs if ":" not in s and "device" in factory_options(s)])
    try:
        per_model = parse_settings(settings, [s for s in specs if ":" not in s])
    except SettingError as e:
        raise UsageError(str(e)) from None
    for name, options in per_model.items():
        if "device" in factory_options(name):
            check_model_device(name, options.setdefault("device", devices[0]), devices)
            check_rank_devices(name, options["device"], options.get("tensor_parallel", 1), devices,
                               options.get("pipeline_parallel", 1))
        if http and "prefix_caching" in factory_options(name) and not is_offloaded(offload.get(name, {})):
            options.setdefault("prefix_caching", True)
    models = []
    for spec in specs:
        if ":" in spec:
            try:
                models.append(load_model(spec))
            except ValueError as e:  # not importable, not a Model: the message names the spec
                raise UsageError(str(e)) from None
            continue
        try:  # the model checks its values: --set hidden=-1, a checkpoint that is not one, no safetensors
            if is_offloaded(offload.get(spec, {})):
                models.append(offloaded_model(spec, per_model[spec], offload[spec]))
                continue
            models.append(load_model(spec, **per_model[spec]))
        except (TypeError, ValueError, RuntimeError, ImportError) as e:
            shown = " ".join(f"{k}={v}" for k, v in per_model[spec].items())
            raise UsageError(f"cannot build model {spec}{' with ' + shown if shown else ''}: {e}") from e
    return models


def check_model_device(name: str, device: str, devices: tuple[str, ...]) -> None:
    """A model built on a device no worker runs on would fail every request: refuse it here."""
    def full(d: str) -> str:
        return "cuda:0" if d == "cuda" else d

    if full(device) not in map(full, devices):
        raise UsageError(f"--set device={device}: model {name} would be built on {device}, but it is served on "
                         f"{','.join(devices)} (--devices)")


def check_rank_devices(name: str, device: str, size, devices: tuple[str, ...], stages=1) -> None:
    """A parallel decoder's ranks (tensor_parallel `size` x pipeline_parallel `stages`) run on
    consecutive GPUs from its device: --devices lists them all."""
    from batchmaker.launch import launched
    if not isinstance(size, int) or not isinstance(stages, int) or size * stages < 2 or \
            not device.startswith("cuda") or launched() is not None:
        return
    ranks, index = size * stages, int(device.partition(":")[2] or 0)
    missing = [f"cuda:{index + r}" for r in range(ranks) if f"cuda:{index + r}" not in devices]
    if missing:
        asked = f"tensor_parallel={size}" + (f" pipeline_parallel={stages}" if stages > 1 else "")
        raise UsageError(f"--set {asked}: model {name}'s ranks run on cuda:{index} to "
                         f"cuda:{index + ranks - 1}; --devices lacks {', '.join(missing)}")


def check_devices(text: str, flag: str) -> tuple[str, ...]:
    """cpu and cuda:N only, and only CUDA devices this torch can see."""
    devices = tuple(d.strip() for d in text.split(",") if d.strip())
    if not devices:
        raise UsageError(f"{flag}: no device given")
    cuda = [d for d in devices if d != "cpu"]
    for device in cuda:
        if not re.fullmatch(r"cuda(:\d+)?", device):
            raise UsageError(f"{flag} {device}: expected cpu or cuda:N")
    if cuda:
        import torch

        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise UsageError(f"{flag} {cuda[0]}: {why} (torch {torch.__version__}); use cpu")
        count = torch.cuda.device_count()
        missing = [d for d in cuda if int(d.partition(":")[2] or 0) >= count]
        if missing:
            raise UsageError(f"{flag} {missing[0]}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return devices


def replicas_of(specs: list[str], settings: list[str], engine_config):
    """A replica per device builds the models; here the options are only checked. The server
    exits (status 1) once no replica is left."""
    from batchmaker.replicas import Replicas, ReplicasConfig
    from batchmaker.serving.model_options import SettingError, replica_specs

    try:
        models = replica_specs(specs, settings)
    except (SettingError, LookupError) as e:  # (an unknown registered name: UnknownModelError)
        raise UsageError(str(e)) from None
    return Replicas(models, ReplicasConfig(devices=engine_config.devices, engine=engine_config))

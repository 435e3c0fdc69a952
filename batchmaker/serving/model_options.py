"""`batchmaker serve --set KEY=VALUE`: settings of the registered models, checked against the
signatures of their factories (`register_model`), so that a typo or a bad value is reported with
its key before any model is built. A key applies to every served registered model that takes it;
`MODEL.KEY=VALUE` to that model only (`--set llama.checkpoint=DIR --set opt.preset=tiny-opt`).
"""
import inspect
import typing

import torch

from batchmaker import registry
from batchmaker.unfolders.common import as_dtype


class SettingError(ValueError):
    """A `--set` item that no served model takes, or whose value does not fit; names the key."""


def factory_options(name: str) -> dict[str, inspect.Parameter]:
    """The keyword options of a registered model's factory, by name."""
    factory = registry.model_factory(name)
    return {p.name: p for p in inspect.signature(factory).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def describe(names: list[str]) -> str:
    """One line per model: its options and their defaults (the epilog of `serve --help`)."""
    return "\n".join(f"  {name}: " + " ".join(f"{key}={_show(p.default)}" for key, p in factory_options(name).items())
                     for name in names)


def parse_settings(items: list[str], names: list[str]) -> dict[str, dict[str, object]]:
    """`KEY=VALUE` and `MODEL.KEY=VALUE` items -> per model in `names`, the keyword arguments for
    its factory. Every key must be an option of at least one of the models it applies to; values
    are converted to the option's type. A later item overrides an earlier one."""
    options = {name: factory_options(name) for name in names}
    settings: dict[str, dict[str, object]] = {name: {} for name in names}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SettingError(f"--set expects KEY=VALUE or MODEL.KEY=VALUE, got {item!r}")
        if not names:
            raise SettingError(f"--set {key}: --set applies to registered models "
                               f"({', '.join(registry.registered_models())}), and none is served")
        scope, dot, key = key.rpartition(".")
        if dot and scope not in names:
            raise SettingError(f"--set {scope}.{key}: {scope!r} is not a served registered model "
                               f"({', '.join(names)})")
        scoped = [scope] if dot else names
        takers = [name for name in scoped if key in options[name]]
        if not takers:
            valid = sorted({k for name in scoped for k in options[name]})
            raise SettingError(f"--set {item.partition('=')[0].strip()}: unknown key for {', '.join(scoped)}; "
                               f"valid keys: {', '.join(valid)}")
        for name in takers:
            settings[name][key] = convert(key, text, options[name][key])
    return settings


def replica_specs(specs: list[str], items: list[str]) -> list[tuple[str, dict]]:
    """(name, options) per served model, as replica processes build them (batchmaker/replicas.py):
    registered names with their `--set` options, module:attribute specs as given. A registered
    decoder (a model with a `device` option) is refused: replicas serve the RNN and tree models."""
    names = [s for s in specs if ":" not in s]
    settings = parse_settings(items, names)
    decoders = [name for name in names if "device" in factory_options(name)]
    if decoders:
        raise SettingError(f"--replicas: {', '.join(decoders)} is a decoder; replicas serve the RNN and tree "
                           "models (a decoder keeps its conversations and KV cache on one engine: serve it "
                           "without --replicas)")
    return [(s, settings.get(s, {})) for s in specs]


def convert(key: str, text: str, option: inspect.Parameter):
    """`text` as the option's annotated type (or its default's type when it has no annotation)."""
    kinds = _kinds(option)
    if text.lower() == "none" and type(None) in kinds:
        return None
    if bool in kinds:
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise SettingError(f"--set {key}: expected true or false, got {text!r}")
        return text.lower() in ("true", "1", "yes")
    for kind, what in ((int, "an integer"), (float, "a number")):
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                raise SettingError(f"--set {key}: expected {what}, got {text!r}") from None
    if torch.dtype in kinds:
        try:
            return as_dtype(text)
        except ValueError:
            raise SettingError(f"--set {key}: expected a floating dtype (float32, float16, bfloat16, float64), "
                               f"got {text!r}") from None
    return text


def _kinds(option: inspect.Parameter) -> set:
    annotation = option.annotation
    if annotation is inspect.Parameter.empty or isinstance(annotation, str):  # none, or postponed
        return {str} if option.default in (None, inspect.Parameter.empty) else {type(option.default)}
    return set(typing.get_args(annotation) or (annotation,))


def _show(default) -> str:
    if isinstance(default, torch.dtype):
        return str(default).removeprefix("torch.")
    return "(required)" if default is inspect.Parameter.empty else str(default)

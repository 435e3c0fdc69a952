"""Model registry: an extension point is a dict and a decorator."""
import importlib
from collections.abc import Callable

from batchmaker.errors import UnknownModelError
from batchmaker.model import Model

ModelFactory = Callable[..., Model]
_FACTORIES: dict[str, ModelFactory] = {}


def register_model(name: str, factory: ModelFactory | None = None):
    """Register `factory(**kwargs) -> Model` under `name`; usable as a call or a decorator."""

    def add(f: ModelFactory) -> ModelFactory:
        _FACTORIES[name] = f
        return f

    return add if factory is None else add(factory)


def build_model(name: str, **kwargs) -> Model:
    _load_builtins()
    if name not in _FACTORIES:
        raise UnknownModelError(name, _FACTORIES)
    return _FACTORIES[name](**kwargs)


def model_factory(name: str) -> ModelFactory:
    """The factory registered under `name` (its signature lists the model's options)."""
    _load_builtins()
    if name not in _FACTORIES:
        raise UnknownModelError(name, _FACTORIES)
    return _FACTORIES[name]


def load_model(spec: str, **kwargs) -> Model:
    """A registered name (built with `kwargs`), or `module:attribute` naming a user's Model or a
    factory that returns one (called without arguments; importing the module may also register
    models by name)."""
    if ":" not in spec:
        return build_model(spec, **kwargs)
    module_name, _, attribute = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load model {spec!r}: {e}") from None
    model = found() if callable(found) and not isinstance(found, Model) else found
    if not isinstance(model, Model):
        raise ValueError(f"{spec!r} is a {type(model).__name__}, not a batchmaker Model")
    return model


def registered_models() -> list[str]:
    _load_builtins()
    return sorted(_FACTORIES)


def _load_builtins() -> None:
    import batchmaker.unfolders  # noqa: F401  (registers lstm, seq2seq, treelstm)

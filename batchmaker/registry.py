"""Model registry: an extension point is a dict and a decorator."""
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


def registered_models() -> list[str]:
    _load_builtins()
    return sorted(_FACTORIES)


def _load_builtins() -> None:
    import batchmaker.unfolders  # noqa: F401  (registers lstm, seq2seq, treelstm)

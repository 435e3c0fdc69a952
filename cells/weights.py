"""Seeded initialization and saving/loading of cell weights.

A model's weights on disk are one `torch.save`d dict `{cell_name: state_dict}`, so the serving
side, the benchmarks and the baselines can share exactly the same numbers.
"""
from pathlib import Path

import torch
from torch import nn

INIT_SCALE = 0.1  # uniform(-0.1, 0.1): keeps the LSTM gates out of saturation at any hidden size


def init_uniform(module: nn.Module, seed: int, scale: float = INIT_SCALE) -> None:
    """Fill every parameter of `module`, in registration order, from one generator seeded `seed`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(-scale, scale, generator=g)


def save_weights(cells: dict[str, nn.Module], path: str | Path) -> None:
    torch.save({name: cell.state_dict() for name, cell in cells.items()}, path)


def load_weights(cells: dict[str, nn.Module], path: str | Path) -> None:
    """Load `{cell_name: state_dict}` from `path` into `cells`, all or nothing.

    Raises ValueError naming every missing/unexpected cell or tensor and every shape mismatch;
    dtypes are converted to each cell's own dtype.
    """
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: expected a dict {{cell_name: state_dict}}, got {type(saved).__name__}")
    problems = _diff_names("cells", set(cells), set(saved))
    for name in sorted(set(cells) & set(saved)):
        problems += _diff_state(name, cells[name].state_dict(), saved[name])
    if problems:
        raise ValueError(f"{path}: weights do not fit the model: " + "; ".join(problems))
    for name, cell in cells.items():
        cell.load_state_dict(saved[name])


def _diff_state(cell: str, want: dict, got) -> list[str]:
    if not isinstance(got, dict):
        return [f"cell {cell!r}: expected a state dict, got {type(got).__name__}"]
    problems = _diff_names(f"tensors of {cell!r}", set(want), set(got))
    for key in sorted(set(want) & set(got)):
        shape = tuple(getattr(got[key], "shape", ()))
        if shape != tuple(want[key].shape):
            problems.append(f"{cell}.{key}: shape {shape} != expected {tuple(want[key].shape)}")
    return problems


def _diff_names(what: str, want: set, got: set) -> list[str]:
    problems = []
    if want - got:
        problems.append(f"missing {what} {sorted(want - got)}")
    if got - want:
        problems.append(f"unexpected {what} {sorted(got - want)}")
    return problems

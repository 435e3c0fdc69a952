"""Structured unfolders: the shapes most models take, declared once per model.

An unfolder function runs once per request and adds nodes one Python call at a time; a *form*
tells the engine the shape of every request's cell graph up front, so that it admits requests in
one vectorized pass, keeps running requests as rows of arrays (positions, lengths, state rows),
and completes them in bulk. Give a form (or a tuple of forms, run one after the other) as a
model's `unfold`:

    Model("lstm", {"lstm": LSTMCell(...)},
          unfold=Chain("lstm", steps={"token": "tokens"}, carry={"h": "h", "c": "c"}, outputs={"h": "h"}))

    Model("seq2seq", {"encoder": ..., "decoder": ...}, unfold=(
        Chain("encoder", steps={"token": "tokens"}, carry={"h": "h", "c": "c"}),
        DecodeLoop("decoder", carry={"token": "token", "h": "h", "c": "c"}, start={"token": BOS},
                   stop=("token", EOS), max_len=50, init={"h": "h", "c": "c"}, collect={"tokens": "token"})))

    Model("treelstm", {"leaf": ..., "internal": ...},
          unfold=Tree("leaf", "internal", left={"h_l": "h", "c_l": "c"}, right={"h_r": "h", "c_r": "c"},
                      outputs={"h": "h"}))

Carried state starts from zeros, or, in the stages after the first, from the previous stage's
final outputs named in `init`. A request's stages run on one worker (its state never moves).
Unfolder functions (`unfold(inputs, g)`, generators included) remain the general path for any
other graph.
"""
from dataclasses import dataclass, field

from batchmaker.signature import Signature


@dataclass(frozen=True)
class Chain:
    """Steps of one cell over a sequence of the request: step t takes element t of each `steps`
    input (non-empty lists of integers of equal length) and the previous step's `carry` outputs."""

    cell: str
    steps: dict[str, str]  # cell input -> request input holding its value at every step
    carry: dict[str, str]  # cell input -> the output of the previous step it takes
    outputs: dict[str, str] = field(default_factory=dict)  # result key -> output after the last step
    init: dict[str, str] = field(default_factory=dict)  # carried input -> previous stage's output


@dataclass(frozen=True)
class DecodeLoop:
    """Steps of one cell that feed outputs back as the next step's inputs until a row emits the
    `stop` value (EOS) or has run `max_len` steps; `collect` outputs are gathered at every step
    (the decoded tokens) and, with `stream`, sent as partial outputs once per round of steps."""

    cell: str
    carry: dict[str, str]  # cell input -> the output of the previous step it takes (state, token)
    start: dict[str, int]  # carried integer input -> its value at step 0 (BOS)
    stop: tuple[str, int]  # (integer output, value): a row ends after the step that emits it
    max_len: int
    collect: dict[str, str]  # result key -> integer scalar output collected at every step
    max_len_input: str | None = "max_len"  # optional request input that lowers max_len
    init: dict[str, str] = field(default_factory=dict)  # carried input -> previous stage's output
    stream: bool = True


@dataclass(frozen=True)
class Tree:
    """A binary tree of the request (`input`: a bracketed string or nested pairs, see
    batchmaker.unfolders.trees): a `leaf` cell per word (its integer input `token`), an
    `internal` cell per pair of subtrees (inputs from the left and right child's outputs)."""

    leaf: str
    internal: str
    left: dict[str, str]  # internal input -> output of the left child
    right: dict[str, str]  # internal input -> output of the right child
    outputs: dict[str, str]  # result key -> the root's output
    input: str = "tree"
    token: str = "token"


@dataclass(frozen=True)
class Generate:
    """Autoregressive generation by a decoder cell whose batch unit is tokens (a DecoderCell,
    batchmaker/cells/decoder_cell.py): each iteration mixes prompt chunks of joining requests with
    one decode token of running ones (ORCA, Pensieve). The request gives `tokens` (ids) or `prompt`
    (text, where the model has a tokenizer) and generation settings (batchmaker/generation.py)."""

    cell: str
    max_new_tokens: int = 128  # when a request names none
    conversation_ttl: float = 3600.0  # seconds a conversation is kept idle (then forgotten)


Form = Chain | DecodeLoop | Tree | Generate


def form_cells(form: Form) -> tuple[str, ...]:
    return (form.leaf, form.internal) if isinstance(form, Tree) else (form.cell,)


def check_forms(forms: tuple[Form, ...], signatures: dict[str, Signature]) -> None:
    """Raise TypeError unless the forms fit the model's cells (names, shapes, dtypes)."""
    if not forms:
        raise TypeError("a structured unfolder needs at least one form")
    if any(isinstance(f, (Tree, Generate)) for f in forms) and len(forms) > 1:
        raise TypeError("a Tree or Generate form stands alone")
    used = [c for f in forms for c in form_cells(f)]
    if len(set(used)) != len(used):
        raise TypeError(f"each cell serves one stage of a form; cells {used}")
    previous: Signature | None = None
    for i, form in enumerate(forms):
        for cell in form_cells(form):
            if cell not in signatures:
                raise TypeError(f"form {type(form).__name__} names unknown cell {cell!r}")
        if isinstance(form, Tree):
            _check_tree(form, signatures[form.leaf], signatures[form.internal])
            continue
        if isinstance(form, Generate):
            if form.max_new_tokens < 0:
                raise TypeError(f"{form.cell}: max_new_tokens must be >= 0")
            continue
        sig = signatures[form.cell]
        _check_steps(form, sig)
        if set(form.init) - set(form.carry):
            raise TypeError(f"{form.cell}: init names inputs that are not carried: {sorted(set(form.init) - set(form.carry))}")
        if form.init and previous is None:
            raise TypeError(f"{form.cell}: the first stage has no previous stage to init from")
        for name, out in form.init.items():
            _check_fits(previous.outputs.get(out), sig.inputs[name], f"{form.cell}.{name} <- previous {out!r}")
        previous = sig
        if i < len(forms) - 1 and (getattr(form, "outputs", None) or getattr(form, "collect", None)):
            raise TypeError(f"{form.cell}: only the last stage has outputs")


def _check_steps(form: Chain | DecodeLoop, sig: Signature) -> None:
    steps = form.steps if isinstance(form, Chain) else {}
    if set(steps) | set(form.carry) != set(sig.inputs) or set(steps) & set(form.carry):
        raise TypeError(f"{form.cell}: step inputs {sorted(steps)} and carried inputs {sorted(form.carry)} "
                        f"must split the cell's inputs {sorted(sig.inputs)}")
    for name in steps:
        if not _is_int_scalar(sig.inputs[name]):
            raise TypeError(f"{form.cell}.{name}: step inputs must be integer scalars")
    for name, out in form.carry.items():
        _check_fits(sig.outputs.get(out), sig.inputs[name], f"{form.cell}.{name} <- {out!r}")
    if isinstance(form, Chain):
        for key, out in form.outputs.items():
            if out not in sig.outputs:
                raise TypeError(f"{form.cell}: output {key!r} names no output {out!r}")
        return
    if form.max_len < 1:
        raise TypeError(f"{form.cell}: max_len must be positive")
    for name in form.start:
        if name not in form.carry or not _is_int_scalar(sig.inputs[name]):
            raise TypeError(f"{form.cell}.{name}: start values are for carried integer scalar inputs")
    for out in (form.stop[0], *form.collect.values()):
        if out not in sig.outputs or not _is_int_scalar(sig.outputs[out]):
            raise TypeError(f"{form.cell}: {out!r} must be an integer scalar output to stop on or collect")


def _check_tree(form: Tree, leaf: Signature, internal: Signature) -> None:
    if set(leaf.inputs) != {form.token} or not _is_int_scalar(leaf.inputs[form.token]):
        raise TypeError(f"{form.leaf}: a leaf cell takes one integer scalar input, {form.token!r}")
    if set(form.left) | set(form.right) != set(internal.inputs) or set(form.left) & set(form.right):
        raise TypeError(f"{form.internal}: left {sorted(form.left)} and right {sorted(form.right)} must split "
                        f"its inputs {sorted(internal.inputs)}")
    for name, out in (*form.left.items(), *form.right.items()):
        _check_fits(leaf.outputs.get(out), internal.inputs[name], f"{form.internal}.{name} <- leaf {out!r}")
        _check_fits(internal.outputs.get(out), internal.inputs[name], f"{form.internal}.{name} <- internal {out!r}")
    for key, out in form.outputs.items():
        if out not in leaf.outputs or out not in internal.outputs:
            raise TypeError(f"tree output {key!r}: both cells must have output {out!r}")


def _check_fits(out_spec, in_spec, what: str) -> None:
    if out_spec is None or (out_spec.shape, out_spec.dtype) != (in_spec.shape, in_spec.dtype):
        raise TypeError(f"{what}: no output of shape {in_spec.shape} and dtype {in_spec.dtype}")


def _is_int_scalar(spec) -> bool:
    return spec.shape == () and spec.is_integer


__all__ = ["Chain", "DecodeLoop", "Tree", "Generate", "Form", "check_forms", "form_cells"]

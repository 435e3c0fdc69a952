"""Checking many requests' inputs at once: what structured models admit in one vectorized pass.

The fast path assumes well-formed inputs (lists of Python ints) and checks all requests of an
admission batch with a few numpy calls; if anything in the batch is off, each request is checked
on its own (the slow path), so every bad request gets its own precise BadRequestError and the
good ones go ahead.
"""
import struct
import threading
from numbers import Integral

import numpy as np

from batchmaker.errors import BadRequestError, OverloadedError

_INT64, _UINT64 = np.dtype(np.int64), np.dtype(np.uint64)


def is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)  # numpy ints count, bools do not


def in_range(array: np.ndarray, high: int | None) -> bool:
    """Are all values of a non-empty integer array in [0, high) (high None: no upper bound)?"""
    if high is None:
        return int(array.min()) >= 0
    if array.dtype == _INT64 and high <= 2**63:  # one reduction, not two: as uint64 a negative is >= 2**63
        return bool(np.maximum.reduce(array.view(_UINT64)) < high)
    return int(array.min()) >= 0 and int(array.max()) < high


def check_tokens(value, high: int | None, what: str = "tokens") -> np.ndarray:
    """One request's non-empty sequence of integer ids in [0, high) -> int64 array."""
    if hasattr(value, "numpy") and hasattr(value, "is_floating_point"):  # a torch tensor, without importing torch
        value = value.tolist() if value.is_floating_point() else value.numpy()
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise BadRequestError(f"{what}: expected a list of integer ids, got {type(value).__name__}")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, OverflowError):
        array = None
    if array is None or array.ndim != 1 or (array.dtype.kind not in "iu" and len(array)):
        bad = next((t for t in value if not is_int(t)), value) if array is None or array.ndim == 1 else value
        raise BadRequestError(f"{what}: expected a 1-d sequence of integer ids, got {bad!r:.60}")
    if not len(array):
        raise BadRequestError(f"{what}: empty sequence")
    if isinstance(value, (list, tuple)) and array.dtype.kind == "i" and (array <= 1).any():
        bad = next((i for i, t in enumerate(value) if isinstance(t, bool)), None)  # [True, 5] reads as [1, 5]
        if bad is not None:
            raise BadRequestError(f"{what}[{bad}]: expected an integer id, got {value[bad]!r}")
    if not in_range(array, high):
        pos = int(np.flatnonzero((array < 0) | (array >= (high if high is not None else np.inf)))[0])
        raise BadRequestError(f"{what}[{pos}]: id {int(array[pos])} out of range [0, {high})")
    return array.astype(np.int64, copy=False)


def check_token_lists(values: list, high: int | None, what: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """Many requests' token sequences at once -> (the good ones' tokens, concatenated, int64;
    their lengths; {position in `values`: BadRequestError} for the bad ones)."""
    if all(type(v) is list for v in values):
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        flat_list = []
        for v in values:  # (extending one list: faster than chain.from_iterable's items one by one)
            flat_list += v
        try:  # ints -> int64 bytes (no type discovery pass; 2x array.array's); a float, str, None, huge int or list raises
            flat = np.frombuffer(struct.pack(f"{len(flat_list)}q", *flat_list), dtype=np.int64)
        except (struct.error, ValueError, TypeError, OverflowError):
            flat = None
        if (flat is not None and len(flat) and lengths.all() and in_range(flat, high)
                and not any(type(flat_list[i]) is bool for i in np.flatnonzero(flat <= 1).tolist())):
            return flat, lengths, {}
    good, errors = [], {}
    for i, v in enumerate(values):
        try:
            good.append(check_tokens(v, high, what))
        except BadRequestError as e:
            errors[i] = e
    lengths = np.fromiter(map(len, good), dtype=np.int64, count=len(good))
    flat = np.concatenate(good) if good else np.zeros(0, dtype=np.int64)
    return flat, lengths, errors


def check_context(prompt_len: int, history: int, max_len: int, what: str = "prompt") -> None:
    """Refuse a prompt that leaves no position for a generated token under the model's `max_len`, after the
    `history` tokens of its conversation."""
    if history + prompt_len >= max_len:
        text = f"{what}: {prompt_len} tokens" + (f" after the conversation's {history}" if history else "")
        raise BadRequestError(f"{text}; the model's maximum is {max_len} (the prompt and at least one generated token)")


def check_keys(inputs, required, optional=()) -> None:
    """The request's inputs are a dict with every required key and nothing else but optional ones."""
    if not isinstance(inputs, dict):
        raise BadRequestError(f"inputs must be a dict, got {type(inputs).__name__}")
    if len(inputs) == len(required) and all(k in inputs for k in required):
        return  # exactly the required keys (the common case: no sets to build)
    missing = sorted(set(required) - set(inputs))
    extra = sorted(set(inputs) - set(required) - set(optional))
    if missing:
        raise BadRequestError(f"missing input(s) {missing}; expected {sorted(required)}")
    if extra:
        raise BadRequestError(f"unexpected input(s) {extra}; allowed {sorted(set(required) | set(optional))}")


def check_limit(value, limit: int, what: str) -> int:
    """An integer in [1, limit]."""
    if not is_int(value) or not 1 <= value <= limit:
        raise BadRequestError(f"{what}: expected an integer in [1, {limit}], got {value!r}")
    return int(value)


class AdmissionBound:
    """Requests accepted and not yet finished, at most `limit` (submitting threads take a place
    under a lock; whoever finishes requests counts them): beyond it a request is answered
    OverloadedError at once, so a flood costs a reply, not memory."""

    def __init__(self, limit: int):
        self.limit = limit
        self.num_accepted = 0
        self._lock = threading.Lock()

    def take(self, num_finished: int) -> OverloadedError | None:
        """A place for one more request (None), or the error that refuses it."""
        with self._lock:
            if self.num_accepted - num_finished >= self.limit:
                return self.overloaded()
            self.num_accepted += 1
            return None

    def overloaded(self) -> OverloadedError:
        return OverloadedError(f"{self.limit} requests queued or running; retry later")

    def take_many(self, count: int, num_finished: int) -> int:
        """Places for up to `count` more requests under one lock: how many were taken (the first
        that many are accepted, the rest refused as take refuses one)."""
        with self._lock:
            taken = max(0, min(count, self.limit - (self.num_accepted - num_finished)))
            self.num_accepted += taken
            return taken


def check_options(priority, deadline) -> BadRequestError | None:
    """A request's priority and deadline as submit takes them (Engine, Replicas)."""
    if type(priority) is not int or not -(2**31) <= priority < 2**31:
        return BadRequestError(f"priority must be a 32-bit integer, got {priority!r}")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                 or not 0 < deadline < 1e7):
        return BadRequestError(f"deadline must be a positive number of seconds, got {deadline!r}")
    return None

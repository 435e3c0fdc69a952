"""What a decode loop's rounds record (core/chain_group.py): per lane, where its stop value first
came, and per slot of the group, the values of each collected output position by position (the
decoded tokens), written a whole round at a time when the round completes and read out once its
request ends.
"""
from dataclasses import dataclass

import numpy as np

from batchmaker.core.request import RaggedRows


@dataclass(slots=True)
class DecodeLanes:
    """What a decode round's completion needs: its lanes' slots and occupants, first positions."""

    slots: np.ndarray
    serials: np.ndarray
    pos0: np.ndarray
    steps: np.ndarray


def first_stops(recorded: np.ndarray, value: int, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """recorded [k, B]: (stopped [B]: the lane emitted `value` within its steps, produced [B]:
    the values it keeps this round, its stop value included). A hit past a lane's last step is
    padding's and does not count."""
    k, b = recorded.shape
    hit = np.empty((k + 1, b), dtype=bool)  # the last row a sentinel: one argmax finds the first hit or k
    np.equal(recorded, value, out=hit[:k])
    hit[k] = True
    stop_at = hit.argmax(axis=0)
    return stop_at < steps, np.minimum(stop_at + 1, steps)


class CollectedRows:
    """Output -> [num_slots, width]: row `slot` holds its occupant's values, position by position.
    Rows keep room for a round past the longest length, so that a round whose lanes are all still
    their slots' occupants is written whole (what lies past a lane's values is never read)."""

    def __init__(self, outputs: tuple[str, ...], num_slots: int):
        self.rows = {out: np.zeros((num_slots, 1), dtype=np.int64) for out in outputs}
        self._step_ix = np.arange(64)[:, None]  # [j, 1]

    def make_room(self, width: int) -> None:
        for out, buf in self.rows.items():
            if buf.shape[1] < width:
                grown = np.zeros((len(buf), width), dtype=np.int64)
                grown[:, :buf.shape[1]] = buf
                self.rows[out] = grown

    def write(self, recorded: dict, lanes: DecodeLanes, current: np.ndarray, produced: np.ndarray) -> None:
        """A completed round's values ([k, B] per output) into its lanes' rows from their first positions."""
        k = len(next(iter(recorded.values())))
        if k > len(self._step_ix):
            self._step_ix = np.arange(k)[:, None]
        j = self._step_ix[:k]
        if current.all():  # (the usual case) the whole round
            width = next(iter(self.rows.values())).shape[1]
            at = (lanes.slots * width + lanes.pos0) + j  # [k, B] in the flat rows
            for out, buf in self.rows.items():
                buf.reshape(-1)[at] = recorded[out]
            return
        keep = (j < produced[None, :]) & current[None, :]  # only current lanes' values, up to their stop
        at_slot = np.broadcast_to(lanes.slots[None, :], keep.shape)[keep]
        at_pos = (lanes.pos0[None, :] + j)[keep]
        for out, buf in self.rows.items():
            buf[at_slot, at_pos] = recorded[out][keep]

    def values(self, out: str, slot: int, a: int, b: int) -> list[int]:
        return self.rows[out][slot, a:b].tolist()

    def ragged(self, out: str, slots: np.ndarray, ends: np.ndarray) -> RaggedRows:
        """The slots' values [0, ends) as a result column."""
        return RaggedRows(self.rows[out][slots, :int(ends.max())], ends)

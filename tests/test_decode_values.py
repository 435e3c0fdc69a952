"""A decode round's stops and collected values (batchmaker/core/decode_values.py) against
per-lane loops: random rounds, stop values inside and past a lane's steps, lanes that are no longer
their slots' occupants, rounds written whole or lane by lane."""
import numpy as np
import pytest

from batchmaker.core.decode_values import CollectedRows, DecodeLanes, first_stops

STOP = 2


def reference_stops(recorded: np.ndarray, steps: np.ndarray) -> tuple[list, list]:
    stopped, produced = [], []
    for lane, n in enumerate(steps.tolist()):
        hits = [j for j in range(n) if recorded[j, lane] == STOP]
        stopped.append(bool(hits))
        produced.append(hits[0] + 1 if hits else n)
    return stopped, produced


@pytest.mark.parametrize("seed", range(5))
def test_first_stops_match_a_loop_over_each_lanes_steps(seed):
    rng = np.random.default_rng(seed)
    k, b = int(rng.integers(1, 12)), int(rng.integers(1, 40))
    recorded = rng.choice([STOP, 3, 4, 5], size=(k, b), p=[0.1, 0.3, 0.3, 0.3])
    steps = np.sort(rng.integers(1, k + 1, size=b))[::-1].copy()
    stopped, produced = first_stops(recorded, STOP, steps)
    want_stopped, want_produced = reference_stops(recorded, steps)
    assert stopped.tolist() == want_stopped and produced.tolist() == want_produced


@pytest.mark.parametrize("seed", range(5))
def test_collected_rows_hold_each_occupants_values_up_to_its_stop(seed):
    rng = np.random.default_rng(seed)
    num_slots, k, max_len = 16, 4, 13
    rows = CollectedRows(("token",), num_slots)
    rows.make_room(max_len + k)
    want = {slot: [] for slot in range(num_slots)}  # slot -> the values a reader may see
    lengths = rng.integers(1, max_len + 1, size=num_slots)
    pos = np.zeros(num_slots, dtype=np.int64)
    while (pos < lengths).any():
        lanes_ix = np.flatnonzero(pos < lengths)
        steps = np.minimum(lengths[lanes_ix] - pos[lanes_ix], k)
        order = np.argsort(-steps, kind="stable")
        slots, steps = lanes_ix[order], steps[order]
        lanes = DecodeLanes(slots, np.zeros(len(slots)), pos[slots].copy(), steps)
        recorded = {"token": rng.choice([STOP, 5, 6, 7], size=(k, len(slots)), p=[0.05, 0.3, 0.3, 0.35])}
        current = rng.random(len(slots)) < 0.8 if rng.random() < 0.5 else np.ones(len(slots), dtype=bool)
        stopped, produced = first_stops(recorded["token"], STOP, steps)
        rows.write(recorded, lanes, current, produced)
        for i, slot in enumerate(slots.tolist()):
            if current[i]:
                want[slot] += recorded["token"][:produced[i], i].tolist()
            if stopped[i] or not current[i]:
                lengths[slot] = 0  # (done: no more rounds for this slot)
            else:
                pos[slot] += steps[i]
    ends = np.array([len(want[s]) for s in range(num_slots)])
    live = np.flatnonzero(ends > 0)
    if len(live):
        ragged = rows.ragged("token", live, ends[live])
        assert [ragged[i] for i in range(len(live))] == [want[s] for s in live.tolist()]
    for slot in live.tolist():
        assert rows.values("token", slot, 0, ends[slot]) == want[slot]

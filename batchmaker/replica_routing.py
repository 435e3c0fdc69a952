"""Routing a turn's requests to the replicas: least outstanding first, decided for all at once.

Sending requests one by one, each to the replica with the fewest of its model outstanding (ties
to the lowest index), fills the least-loaded replicas up to the next one's level, then those
together, and so on. `spread` computes how many of n requests each replica gets that way in a
few steps per replica rather than a step per request; the front then hands each replica a
contiguous slice of the turn's requests (batchmaker/replica_front.py).
"""
DEAD = 1 << 62  # the load of a failed replica: never the least


def spread(loads: list[int], n: int) -> list[int]:
    """How many of n requests each replica gets when each request goes in turn to the least
    loaded (loads: requests outstanding per replica; DEAD ones get none). All live replicas
    must not be DEAD (the caller checks that one is live)."""
    counts = [0] * len(loads)
    order = sorted((i for i, load in enumerate(loads) if load < DEAD), key=loads.__getitem__)  # (stable: ties by index)
    level, num_level = loads[order[0]], 0  # the replicas order[:num_level] are all at `level`
    while n:
        while num_level < len(order) and loads[order[num_level]] <= level:
            num_level += 1
        ceiling = loads[order[num_level]] if num_level < len(order) else level + n  # the next replica's level
        steps = min(n // num_level, ceiling - level)
        if not steps:  # fewer left than replicas at this level: one each, lowest index first
            for i in sorted(order[:num_level])[:n]:
                counts[i] += 1
            return counts
        for i in order[:num_level]:
            counts[i] += steps
        level += steps
        n -= steps * num_level
    return counts

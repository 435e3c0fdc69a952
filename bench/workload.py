"""The chat workload's statistics and its multi-turn conversations, with numpy only (so that
bench/eviction_sim.py runs without torch): ShareGPT as Pensieve's Table 3.2 describes it."""
import numpy as np

TURNS, INPUT, OUTPUT = 5.56, 37.77, 204.58  # ShareGPT (Pensieve Table 3.2): mean turns, input and output tokens per turn


def conversation_draws(n: int, rate: float, reaction: float, max_context: int, vocab: int,
                       seed: int) -> list[tuple[float, list]]:
    """n conversations starting as a Poisson process of `rate`: (start, [(new prompt token ids,
    output tokens, reaction seconds before this turn)]); a conversation ends at its geometric turn
    count or before the turn that would pass `max_context`."""
    rng = np.random.default_rng(seed)
    out = []
    for start in np.cumsum(rng.exponential(1 / rate, n)):
        turns, context = [], 0
        for t in range(rng.geometric(1 / TURNS)):
            new = max(1, int(rng.lognormal(np.log(INPUT) - 0.5, 1.0)))
            answer = max(1, min(1024, int(rng.lognormal(np.log(OUTPUT) - 0.5, 1.0))))
            if context + new + answer > max_context:
                break
            turns.append((rng.integers(1, vocab, new), answer, 0.0 if t == 0 else rng.exponential(reaction)))
            context += new + answer
        if turns:
            out.append((float(start), turns))
    return out

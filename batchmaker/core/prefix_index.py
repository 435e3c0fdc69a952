"""Which idle cached context a stateless request's prompt continues (automatic prefix caching, first
slice; issue 32): a client that resends its whole history each turn (every OpenAI client) gets
what an explicit conversation gets, without naming one. No torch here.

Each idle anonymous conversation (core/conversations.py) is filed under the chain hash of its
tokens' whole 16-token blocks: h_k = hash(h_{k-1}, block k). A prompt's chain hashes are computed
once, block by block, and looked up longest first; a candidate is taken only if its tokens are
exactly a proper prefix of the prompt (the hash only narrows the search), so a cached context is
never used for a different prefix. A conversation leaves the index while a turn of it runs, and
comes back, under its longer tokens, when the turn finishes.
"""
import numpy as np

BLOCK = 16  # tokens per hashed block


def _chain(tokens: np.ndarray, blocks: int) -> list[int]:
    """The chain hashes of the first `blocks` whole blocks of `tokens`."""
    hashes, h = [], 0
    data = np.ascontiguousarray(tokens[:blocks * BLOCK], dtype=np.int64)
    for k in range(blocks):
        h = hash((h, data[k * BLOCK:(k + 1) * BLOCK].tobytes()))
        hashes.append(h)
    return hashes


class PrefixIndex:
    def __init__(self):
        self._by_hash: dict[int, list] = {}  # chain hash of a conversation's whole blocks -> conversations
        self._key: dict[int, int] = {}  # id(conversation) -> its hash (0: under no whole block)

    def __len__(self) -> int:
        return len(self._key)

    def add(self, conversation) -> None:
        """File `conversation` (idle, its tokens final until its next turn) by its tokens."""
        self.remove(conversation)
        blocks = len(conversation.tokens) // BLOCK
        key = _chain(conversation.tokens, blocks)[-1] if blocks else 0
        self._by_hash.setdefault(key, []).append(conversation)
        self._key[id(conversation)] = key

    def remove(self, conversation) -> None:
        key = self._key.pop(id(conversation), None)
        if key is None:
            return
        filed = self._by_hash[key]
        filed.remove(conversation)
        if not filed:
            del self._by_hash[key]

    def find(self, prompt: np.ndarray):
        """The filed conversation with the longest tokens that are a proper prefix of `prompt`, or None."""
        hashes = [0] + _chain(prompt, len(prompt) // BLOCK)
        for k in range(len(hashes) - 1, -1, -1):
            best = None
            for c in self._by_hash.get(hashes[k], ()):
                n = len(c.tokens)
                if n < len(prompt) and (best is None or n > len(best.tokens)) and np.array_equal(prompt[:n], c.tokens):
                    best = c
            if best is not None:
                return best
        return None

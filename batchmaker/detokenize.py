"""Streaming text out of streamed tokens: incremental detokenization that hands out whole
characters only, and stop strings matched across token boundaries.

A byte-level BPE token may end inside a multi-byte UTF-8 character ("🙂" can be four tokens of
one byte each); its text is held until the tokens that complete the character arrive. A stop
string may span tokens ("END" as "E" + "ND"); text that could still become one is held until the
next text proves it does not.
"""

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character


class IncrementalDetokenizer:
    """The text of a growing list of token ids, as deltas whose concatenation is
    `tokenizer.decode(ids)` (skipping special tokens).

    Each step decodes a short window: the tokens whose text was handed out last (so that a token's
    leading space or a SentencePiece word boundary decodes as in the whole text) and the tokens
    not handed out yet; the delta is what the window's text adds to the text of its first part.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`
        self.ids: list[int] = []
        self._start = 0  # ids[_start:_read]: handed out last step, the window's context
        self._read = 0  # ids[:_read] are handed out

    def add(self, token: int) -> str:
        """The text that `token` completes ("" while it ends inside a character)."""
        self.ids.append(token)
        return self._delta(is_final=False)

    def flush(self) -> str:
        """At the end: whatever is held, incomplete characters as U+FFFD."""
        return self._delta(is_final=True)

    def _delta(self, is_final: bool) -> str:
        decode = self.tokenizer.decode
        context = decode(self.ids[self._start:self._read], skip_special_tokens=True)
        text = decode(self.ids[self._start:], skip_special_tokens=True)
        if len(text) <= len(context) or (text.endswith(REPLACEMENT) and not is_final):
            return ""
        self._start, self._read = self._read, len(self.ids)
        return text[len(context):]


class StopMatcher:
    """Cuts text at the first stop string: the earliest place where one ends (the longest of those
    ending there), whatever pieces the text came in. Text that ends in a stop string's beginning
    is held back until more text or the end."""

    def __init__(self, stops: tuple[str, ...]):
        assert stops and all(stops), "stop strings are non-empty"
        self.stops = stops
        self.is_stopped = False
        self._held = ""

    def add(self, text: str) -> str:
        """What of `text` (and of what was held) may be sent now."""
        assert not self.is_stopped, "nothing comes after a stop string"
        held = self._held + text
        cut = self._first_stop(held)
        if cut is not None:
            self.is_stopped, self._held = True, ""
            return held[:cut]
        keep = self._open_prefix(held)
        self._held = held[len(held) - keep:]
        return held[:len(held) - keep]

    def flush(self) -> str:
        """At the end, no stop string can complete: the held text goes out."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, text: str) -> int | None:
        """Where the stop string that ends first in `text` starts (ties: the longest), or None.
        (A stop string cannot start in text already sent: its beginning would have been held.)"""
        best = None  # (end, -length)
        for stop in self.stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), -len(stop)) < best):
                best = (start + len(stop), -len(stop))
        return None if best is None else best[0] + best[1]

    def _open_prefix(self, text: str) -> int:
        """The length of the longest end of `text` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

"""Streaming text out of streamed tokens: incremental detokenization that hands out whole
characters only, stop strings matched across token boundaries, and each token's own bytes.

A byte-level BPE token may end inside a multi-byte UTF-8 character ("🙂" can be four tokens of
one byte each); its text is held until the tokens that complete the character arrive. A stop
string may span tokens ("END" as "E" + "ND"); text that could still become one is held until the
next text proves it does not.
"""
import json
import re

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback: one byte


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes byte b as a character: printable Latin-1 as itself, the other
    bytes from U+0100 on in byte order. Character -> byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_OF = _byte_level_alphabet()


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


class TokenBytes:
    """A token's own bytes (OpenAI's logprobs `bytes`), also where it ends inside a UTF-8 character
    and its text alone is U+FFFD: for a byte-level BPE (GPT-2's, Llama 3's), its vocabulary
    string's characters mapped back to bytes; for byte fallback (Llama 2's), `<0xNN>` is byte NN.
    Other tokens, and added ones, are whole characters: their decoded text's UTF-8."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`
        decoder = tokenizer.decoder
        kinds = _kinds(json.loads(decoder.__getstate__())) if decoder is not None else set()
        self.is_byte_level = "ByteLevel" in kinds
        self.has_byte_fallback = "ByteFallback" in kinds
        self.added = set(tokenizer.get_added_tokens_decoder())  # (written as their content, not as bytes)

    def __call__(self, token: int) -> bytes:
        piece = self.tokenizer.id_to_token(token)
        if piece is not None and token not in self.added:
            if self.is_byte_level and all(c in _BYTE_OF for c in piece):
                return bytes(_BYTE_OF[c] for c in piece)
            match = _BYTE_TOKEN.fullmatch(piece) if self.has_byte_fallback else None
            if match is not None:
                return bytes([int(match[1], 16)])
        return self.tokenizer.decode([token]).encode()


def _kinds(decoder: dict) -> set[str]:
    """The types of a decoder's JSON and of the decoders of a Sequence."""
    return {decoder.get("type"), *(k for d in decoder.get("decoders", ()) for k in _kinds(d))}

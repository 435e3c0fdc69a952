"""Streaming text out of tokens (batchmaker/serving/detokenize.py): the deltas of the incremental
detokenizer make up the whole decode and never split a character; stop strings are cut where they
first end, whatever pieces the text comes in, and nothing past the cut is ever handed out."""
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")
from batchmaker.detokenize import REPLACEMENT, IncrementalDetokenizer, StopMatcher, TokenBytes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from tiny_checkpoint import train_tokenizer  # noqa: E402

TOKENIZER = train_tokenizer()  # byte-level BPE trained on README.md: non-ASCII text takes byte tokens
VOCAB = TOKENIZER.get_vocab_size()


def deltas(ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    return [detokenizer.add(t) for t in ids] + [detokenizer.flush()]


def test_a_character_split_over_byte_tokens_comes_out_whole():
    text = "naïve café: 🙂 costs 3 µs ≈ nothing"
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text.split())  # (the non-ASCII characters are several tokens each)
    pieces = deltas(ids)
    assert "".join(pieces) == text
    assert not any(REPLACEMENT in p for p in pieces)
    assert "🙂" in pieces[[i for i, p in enumerate(pieces) if "🙂" in p][0]]  # whole in one delta


def test_special_tokens_leave_no_text():
    eos = TOKENIZER.token_to_id("</s>")
    ids = TOKENIZER.encode("the engine", add_special_tokens=False).ids
    assert "".join(deltas(ids + [eos])) == "the engine"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, VOCAB - 1), max_size=40))
def test_deltas_make_up_the_decode_of_any_token_list(ids):
    pieces = deltas(ids)
    assert "".join(pieces) == TOKENIZER.decode(ids, skip_special_tokens=True)
    assert not any(p.endswith(REPLACEMENT) for p in pieces[:-1] if p)  # only the flush may end mid-character


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="ab é🙂\n", max_size=30))
def test_text_from_valid_utf8_never_streams_a_replacement_character(text):
    assert not any(REPLACEMENT in p for p in deltas(TOKENIZER.encode(text, add_special_tokens=False).ids))


# token bytes ----------------------------------------------------------------------------------
def test_a_tokens_bytes_are_its_own_where_it_ends_inside_a_character():
    text = "naïve 🙂 ≈ µs"
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    own = TokenBytes(TOKENIZER)
    assert b"".join(map(own, ids)) == text.encode()
    assert any(TOKENIZER.decode([t]) == REPLACEMENT for t in ids)  # (what decoding one token alone gives)
    assert own(ids[-1]) == b"s" and own(TOKENIZER.token_to_id("</s>")) == b""  # (as its text: special, skipped)


def test_byte_fallback_tokens_are_their_byte():
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "\u2581caf": 3}  # ("é" is not in the vocabulary: two bytes)
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    own = TokenBytes(tokenizer)
    assert [own(t) for t in (1, 2)] == [b"\xc3", b"\xa9"] and tokenizer.decode([1, 2]) == "é"
    assert own(3) == b" caf"


# stop strings ---------------------------------------------------------------------------------
def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Where the first stop string ends (the longest of those ending there), scanning the text."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[:end - max(map(len, ending))], True
    return text, False


def run_matcher(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    matcher, out = StopMatcher(tuple(stops)), []
    for piece in pieces:
        out.append(matcher.add(piece))
        if matcher.is_stopped:
            return out, True
    return out + [matcher.flush()], False


def test_a_stop_string_across_pieces_is_held_back_then_cut():
    out, stopped = run_matcher(["Hello, wor", "ld! EN", "D and more"], ["END"])
    assert stopped and out == ["Hello, wor", "ld! ", ""]
    out, stopped = run_matcher(["ab", "c", "d"], ["bce"])  # "bc" held, then proved not a stop
    assert not stopped and out == ["a", "", "bcd", ""]


def test_the_stop_that_ends_first_wins_and_ties_go_to_the_longest():
    assert run_matcher(["abcd"], ["abcd", "c"]) == (["ab"], True)  # "c" ends before "abcd"
    assert run_matcher(["xabc"], ["bc", "abc"]) == (["x"], True)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="ab c", max_size=24), st.lists(st.text(alphabet="ab c", min_size=1, max_size=4),
                                                      min_size=1, max_size=3),
       st.lists(st.integers(0, 24), max_size=6))
def test_the_cut_does_not_depend_on_how_the_text_is_split(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, stopped = run_matcher(pieces, stops)
    assert ("".join(out), stopped) == reference_cut(text, stops)

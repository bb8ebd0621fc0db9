"""The text stage: incremental detokenization and stop strings, on the embedded tokenizer."""

from __future__ import annotations

import random
from functools import cache
from typing import Any
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cbpipe import detokenizer
from cbpipe.detokenizer import Detokenizer, SampleText
from cbpipe.models import EMBEDDED_MODEL_DIR

TEXT = "Return the list of all the elements, héllo wörld 日本語 🎉 ok.\nNext: a line"


@cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)


class SlowTokenizer:
    """The embedded tokenizer without its Rust backend: the window path."""

    def __init__(self, inner: Any) -> None:
        self.decode = inner.decode


def token_ids(text: str) -> list[int]:
    return list(tokenizer()(text, add_special_tokens=False).input_ids)


def stream_all(sample: SampleText, ids: list[int]) -> list[str]:
    return [sample.add(t) for t in ids] + [sample.release()]


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "window"])
def test_streamed_text_is_the_decoded_text(slow: bool) -> None:
    detokenizer = Detokenizer(SlowTokenizer(tokenizer()) if slow else tokenizer())
    ids = token_ids(TEXT) + [1]  # and the EOS token, which is special: no text
    pieces = stream_all(detokenizer.sample(()), ids)
    assert "".join(pieces) == tokenizer().decode(ids, skip_special_tokens=True) == TEXT
    # Multi-byte characters span tokens: some tokens add nothing, none adds a broken one.
    assert "" in pieces[:-1] and not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "window"])
def test_random_token_sequences_stream_as_they_decode(slow: bool) -> None:
    """Random ids split characters anywhere, and leave some bytes that never complete one."""
    rng = random.Random(0)
    vocab = len(tokenizer())
    detokenizer = Detokenizer(SlowTokenizer(tokenizer()) if slow else tokenizer())
    for _ in range(50):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]
        joined = "".join(stream_all(detokenizer.sample(()), ids))
        assert joined == tokenizer().decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("stop", ["wörld", "d 日", "本語 🎉", ".\nN", "ok"])
def test_a_stop_string_ends_the_text_where_it_starts(stop: str) -> None:
    sample = Detokenizer(tokenizer()).sample(("never there", stop))
    streamed = []
    for token in token_ids(TEXT):
        streamed.append(sample.add(token))
        if sample.stopped_by is not None:
            break
    streamed.append(sample.release())
    assert sample.stopped_by == stop
    assert "".join(streamed) == sample.text == TEXT[: TEXT.index(stop)]


def test_text_that_a_stop_string_could_still_cut_is_held_back() -> None:
    stop = "the elements, héllo"
    sample = Detokenizer(tokenizer()).sample((stop,))
    released = ""
    for token in token_ids(TEXT):
        released += sample.add(token)
        if sample.stopped_by is not None:
            break
        # Whatever was streamed is final: it is a prefix of the text before the match.
        assert TEXT.index(stop) >= len(released)
    assert released + sample.release() == TEXT[: TEXT.index(stop)]


def test_nothing_is_added_after_a_stop() -> None:
    sample = Detokenizer(tokenizer()).sample(("list",))
    pieces = stream_all(sample, token_ids(TEXT))
    assert "".join(pieces) == "Return the "
    assert sample.add(token_ids(" more")[0]) == ""


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "window"])
@pytest.mark.parametrize(
    ("stops", "min_tokens", "stopped_by", "text"),
    [
        # "the" completed by the 2nd token is never matched; the next "the" is.
        (("the",), 2, "the", "Return the list of all "),
        (("the",), 1, "the", "Return "),
        # As vLLM: a match may start in the first min_tokens tokens' text and end after it...
        (("the list",), 2, "the list", "Return "),
        # ...but one that ends in that text is never matched later.
        (("the list",), 3, None, TEXT),
        # Each stop string looks back its own length, not the longest one's.
        (("the", "the list of all the elements!"), 2, "the", "Return the list of all "),
    ],
)
def test_min_tokens_holds_off_stop_strings(
    slow: bool, stops: tuple[str, ...], min_tokens: int, stopped_by: str | None, text: str
) -> None:
    detokenizer = Detokenizer(SlowTokenizer(tokenizer()) if slow else tokenizer())
    sample = detokenizer.sample(stops, min_tokens)
    released = ""
    for token in token_ids(TEXT):
        released += sample.add(token)
        assert text.startswith(released)  # nothing streamed is cut later
        if sample.stopped_by is not None:
            break
    released += sample.release()
    assert (sample.stopped_by, sample.text) == (stopped_by, text)
    assert released == text


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "window"])
def test_the_token_that_ends_a_sample_adds_no_text(slow: bool) -> None:
    """vLLM's: EOS or a stop token that ends the sample is not decoded, so it completes no
    stop string; the text before it, held back or still incomplete, is all released, once."""
    detokenizer = Detokenizer(SlowTokenizer(tokenizer()) if slow else tokenizer())
    sample = detokenizer.sample(("the list",))
    ids = token_ids("Return the list")
    released = "".join(sample.add(t) for t in ids[:-1])
    assert sample.add(ids[-1], stop_terminated=True) == ""
    released += sample.release()
    assert (sample.stopped_by, sample.text, released) == (None, "Return the", "Return the")
    # A character cut short by the ending token reads as U+FFFD, and is flushed only once.
    sample = detokenizer.sample(())
    ids = token_ids("ok 🎉")
    cut = next(i for i in range(1, len(ids)) if "\ufffd" in tokenizer().decode(ids[:i]))
    released = "".join(sample.add(t) for t in ids[:cut])
    assert sample.add(ids[cut], stop_terminated=True) == ""
    released += sample.release() + sample.release()
    assert released == sample.text == tokenizer().decode(ids[:cut])


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "window"])
def test_special_tokens_are_text_when_not_skipped(slow: bool) -> None:
    detokenizer = Detokenizer(SlowTokenizer(tokenizer()) if slow else tokenizer())
    ids = [0, *token_ids("ok 🎉"), 1, *token_ids(" more")]  # <|bos|> ... <|eos|> ...
    skipped = "".join(stream_all(detokenizer.sample(()), ids))
    kept = "".join(stream_all(detokenizer.sample((), skip_special_tokens=False), ids))
    assert skipped == "ok 🎉 more"
    assert kept == tokenizer().decode(ids, skip_special_tokens=False) == "<|bos|>ok 🎉<|eos|> more"


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "window"])
@pytest.mark.parametrize("stop", ["wörld", "d 日", "本語 🎉", ".\nN", "ok"])
def test_an_included_stop_string_ends_the_text(slow: bool, stop: str) -> None:
    """vLLM's ``include_stop_str_in_output``: the text runs to the stop string's end (what
    the same token added after it is cut), and nothing is held back while streaming."""
    detokenizer = Detokenizer(SlowTokenizer(tokenizer()) if slow else tokenizer())
    sample = detokenizer.sample(("never there", stop), include_stop=True)
    decoded, streamed = "", ""
    for token in token_ids(TEXT):
        piece = sample.add(token)
        decoded = tokenizer().decode(token_ids(TEXT)[: sample.num_tokens])
        streamed += piece
        if sample.stopped_by is None:
            # All of it but a character still incomplete: no stop string can cut it now.
            assert streamed == decoded.rstrip("\ufffd")
        else:
            break
    streamed += sample.release()
    end = TEXT.index(stop) + len(stop)
    assert (sample.stopped_by, sample.text, streamed) == (stop, TEXT[:end], TEXT[:end])


def test_an_included_ending_token_adds_its_text() -> None:
    """With ``include_stop_str_in_output`` the stop or EOS token that ends a sample is
    decoded, as vLLM does; the EOS token reads as text only without skipping specials."""
    detokenizer = Detokenizer(tokenizer())
    ids = token_ids("Return the list")
    for skip, eos_text in ((True, ""), (False, "<|eos|>")):
        sample = detokenizer.sample((), skip_special_tokens=skip, include_stop=True)
        released = "".join(sample.add(t) for t in ids[:-1])
        released += sample.add(ids[-1], stop_terminated=True) + sample.release()
        assert released == "Return the list"
        sample = detokenizer.sample((), skip_special_tokens=skip, include_stop=True)
        released = "".join(sample.add(t) for t in ids)
        released += sample.add(1, stop_terminated=True) + sample.release()
        assert released == "Return the list" + eos_text


class _Pieces:
    """A token stream that hands out fixed pieces: stop strings across piece boundaries."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def step(self, token_id: int) -> str:
        return self.pieces[token_id]

    def flush(self) -> str:
        return ""


def _reference(pieces: list[str], stop: tuple[str, ...], min_tokens: int, include: bool) -> str:
    """The rules on the whole text at once: the earliest stop string that ends in the text
    of a token after the min_tokens-th cuts it (kept with include_stop_str_in_output)."""
    text, best = "", None
    for index, piece in enumerate(pieces, start=1):
        searched, text = len(text), text + piece
        if not piece or index <= min_tokens:
            continue
        found = [(at, s) for s in stop if (at := text.find(s, max(searched - len(s) + 1, 0))) >= 0]
        if found:
            at, s = min(found)
            best = text[: at + len(s)] if include else text[:at]
            break
    return text if best is None else best


@settings(max_examples=400)
# Kept in the output, a stop string is looked for in text already streamed (nothing is held
# back): here in a joined chunk.
@example(pieces=["ab", "ca"], stop=("bc",), min_tokens=0, include=True, chunk=1)
@given(
    pieces=st.lists(st.text(alphabet="abc", max_size=3), max_size=12),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3).map(tuple),
    min_tokens=st.integers(0, 4),
    include=st.booleans(),
    chunk=st.sampled_from([1, 2, 3, 64]),
)
def test_streamed_text_follows_the_stop_rules_at_any_piece_boundaries(
    pieces: list[str], stop: tuple[str, ...], min_tokens: int, include: bool, chunk: int
) -> None:
    """``chunk``: pieces joined at a time, so a stop string's look-back also reaches into
    text already joined."""
    with mock.patch.object(detokenizer, "_PIECES_PER_CHUNK", chunk):
        sample = SampleText(_Pieces(pieces), stop, min_tokens, include)
        streamed = ""
        for token in range(len(pieces)):
            streamed += sample.add(token)
            assert _reference(pieces, stop, min_tokens, include).startswith(streamed)
        streamed += sample.release()
    assert streamed == sample.text == _reference(pieces, stop, min_tokens, include)
    assert sample.release() == ""

"""Token ids to text as they come, and the stop strings matched in that text.

A byte-level BPE token can hold part of a character (a UTF-8 sequence split over tokens), and
SentencePiece tokens change how the previous one reads (a leading space); decoding each token
alone gets both wrong. With a fast tokenizer the text comes from ``tokenizers``'
``DecodeStream``, which holds back incomplete characters; other tokenizers decode a window of
recent tokens and keep what the newest token added, the way transformers' streamers do.

A sample's text is the concatenation of what it streamed: the tokenizer's whole-sequence
clean-up (``clean_up_tokenization_spaces``) is not applied, as in vLLM, so streamed and final
text never disagree. With stop strings, text that a later match could still cut is held
back (up to the longest stop string's length minus one character), so nothing streamed is
ever retracted; the matched stop string and everything after it is never returned. As in vLLM,
stop strings are looked for only once a sample has more than ``min_tokens`` tokens, in the
text that each token adds (a match may begin up to its length minus one character earlier);
and the EOS or stop token that ends a sample is not decoded: its text is never returned, and
no stop string is matched in it. ``include_stop_str_in_output`` keeps both, vLLM's way: the
stop string stays at the text's end (what followed it in the same token is still cut), the
ending token is decoded, and nothing is held back, since nothing streamed can be cut.
Special tokens are left out of the text unless ``skip_special_tokens`` is false.

The stage runs where the text is made: in the scheduler's frontend for a client without the
model's tokenizer, in the client's ``JobState`` for one with it (the HTTP server's), so the
engine's scheduling thread spends nothing on text.
"""

from __future__ import annotations

import collections
import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Protocol


class _TokenStream(Protocol):
    def step(self, token_id: int) -> str:
        """The text the token adds; "" while it completes no character."""
        ...

    def flush(self) -> str:
        """What the tokens held back read as now that no more come (a character cut short
        reads as U+FFFD, as ``decode`` has it)."""
        ...


# Tokens decoded before held-back ones when flushing, for how the held-back ones read.
_FLUSH_CONTEXT = 4
# Streamed pieces joined into one string as they come: a long sample's text is then a join of
# a few chunks at its end, not of a piece per token allocated all over the run (a join that
# walks cold memory: tens of microseconds a sample, for hundreds finishing at once).
_PIECES_PER_CHUNK = 64


class _FastStream:
    def __init__(self, backend: Any, skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # The last tokens that added text, and the tokens since, which added none yet.
        self._recent: collections.deque[int] = collections.deque(maxlen=_FLUSH_CONTEXT)
        self._held: list[int] = []

    def step(self, token_id: int) -> str:
        piece = self._stream.step(self._backend, token_id) or ""
        if piece:
            self._recent.append(token_id)
            if self._held:
                self._held.clear()
        else:
            self._held.append(token_id)
        return piece

    def flush(self) -> str:
        if not self._held:
            return ""
        decode = self._backend.decode
        recent = list(self._recent)
        before = decode(recent, skip_special_tokens=self._skip)
        after = decode(recent + self._held, skip_special_tokens=self._skip)
        return after[len(before) :] if after.startswith(before) else ""


class _WindowStream:
    """For tokenizers without a Rust backend: decode the tokens since the last complete
    character together with those before it, keep what the new ones added."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # the window's first token: context for how the next ones read
        self._read = 0  # tokens up to here are in the text already

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        before, now = self._window()
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""  # an incomplete character, or a special token
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before) :]

    def flush(self) -> str:
        before, now = self._window()
        return now[len(before) :] if now.startswith(before) else ""

    def _window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        return before, decode(self._ids[self._prefix :], skip_special_tokens=self._skip)


@dataclass
class SampleText:
    """One sample's text so far: the part streamed to the client, kept as the pieces it was
    streamed in, joined a chunk at a time (appending to one string would copy the whole text
    at every token), and the part still held back."""

    stream: _TokenStream
    stop: tuple[str, ...]
    min_tokens: int = 0  # stop strings match only once the sample has more tokens than this
    include_stop: bool = False  # include_stop_str_in_output
    num_tokens: int = 0  # tokens added
    stopped_by: str | None = None
    over: bool = False  # released whole: no token adds text any more
    _chunks: list[str] = field(default_factory=list, init=False)  # streamed, joined
    _streamed: list[str] = field(default_factory=list, init=False)  # streamed since
    _held: str = field(default="", init=False)  # text not streamed yet
    _lookback: int = field(init=False)  # characters before a piece a stop string may start in
    _hold: int = field(init=False)  # characters held back after each piece

    def __post_init__(self) -> None:
        self._lookback = max((len(s) for s in self.stop), default=1) - 1
        self._hold = 0 if self.include_stop else self._lookback

    @property
    def text(self) -> str:
        """The text so far, streamed or held back."""
        return "".join(self._chunks) + "".join(self._streamed) + self._held

    def add(self, token_id: int, *, stop_terminated: bool = False) -> str:
        """Append a token; return the text now safe to stream. A stop string match cuts the
        text where it starts and sets ``stopped_by``; nothing is added after that. The token
        that ended the sample (``stop_terminated``: EOS or one of its stop tokens) adds no
        text, as vLLM's detokenizer has it, unless ``include_stop``."""
        if self.stopped_by is not None or self.over:
            return ""
        self.num_tokens += 1
        if stop_terminated and not self.include_stop:
            return ""
        piece = self.stream.step(token_id)
        if not piece:
            return ""
        if not self.stop:  # nothing held back: the piece streams as it is
            self._append(piece)
            return piece
        # As vLLM: only a match ending in text added after the min_tokens-th token counts.
        if self.num_tokens > self.min_tokens:
            before = self._context()
            text = before + piece
            match = _earliest_match(text, self.stop, len(before))
            if match is not None:
                at, self.stopped_by = match
                end = at + len(self.stopped_by) if self.include_stop else at
                # The match starts in the held-back text (that is what holding back is for)
                # or, kept in the output, ends in the piece: either way nothing streamed is cut.
                self._held = text[len(before) - len(self._held) : end]
                return self._stream_held(keep=0)
        self._held += piece
        return self._stream_held(keep=self._hold)

    def release(self) -> str:
        """Stream whatever is held back, with what the token stream still holds: the sample
        is over (a second call releases nothing)."""
        if self.stopped_by is None and not self.over:
            self._held += self.stream.flush()
        self.over = True
        return self._stream_held(keep=0)

    def _context(self) -> str:
        """The text before a new piece in which a stop string ending in the piece may start:
        the held-back text, and as much streamed text before it as a stop string is long."""
        missing = self._lookback - len(self._held)
        if missing <= 0:
            return self._held
        tail = ""
        for piece in itertools.chain(reversed(self._streamed), reversed(self._chunks)):
            tail = piece + tail
            if len(tail) >= missing:
                break
        return tail[-missing:] + self._held

    def _stream_held(self, keep: int) -> str:
        """Stream the held-back text but its last ``keep`` characters."""
        cut = len(self._held) - keep
        if cut <= 0:
            return ""
        delta, self._held = self._held[:cut], self._held[cut:]
        self._append(delta)
        return delta

    def _append(self, piece: str) -> None:
        """Add a streamed piece, joining the pieces into a chunk every so many."""
        streamed = self._streamed
        streamed.append(piece)
        if len(streamed) == _PIECES_PER_CHUNK:
            self._chunks.append("".join(streamed))
            streamed.clear()


def _earliest_match(text: str, stops: tuple[str, ...], searched: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends after its first ``searched`` characters
    (each looks back its own length, so none is found wholly in text searched before)."""
    found = [(at, s) for s in stops if (at := text.find(s, max(searched - len(s) + 1, 0))) >= 0]
    return min(found) if found else None


class Detokenizer:
    """Makes each sample's text stream for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

    @classmethod
    def of(cls, tokenizer: Any) -> Detokenizer | None:
        """For a client's ``tokenizer=``: a tokenizer, the folder or Hub id to load one from
        (``AutoTokenizer``), or None (no text made here)."""
        if tokenizer is None:
            return None
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        return cls(tokenizer)

    def sample(
        self,
        stop: tuple[str, ...],
        min_tokens: int = 0,
        *,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> SampleText:
        stream: _TokenStream
        if self._backend is not None:
            stream = _FastStream(self._backend, skip_special_tokens)
        else:
            stream = _WindowStream(self.tokenizer, skip_special_tokens)
        return SampleText(stream, stop, min_tokens, include_stop)

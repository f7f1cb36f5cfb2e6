"""A request's text as its tokens arrive, decoded incrementally.

Decoding a request's whole text again on every step costs its length each time, so a long reply costs its length
squared, per stream, on the server's event loop (docs/engine-semantics.md: incremental detokenizing). tokenizers'
`DecodeStream` (what vLLM's fast incremental detokenizer steps) decodes each new token against the few before it,
and its pieces join to the whole decode (until a token it cannot step, where a new stream starts). A stop string is
looked for only where it could end in the new text (as vLLM's `check_stop_strings`).
"""

from __future__ import annotations

import bisect

from tokenizers.decoders import DecodeStream

from specdoctor.runtime.checkpoint.tokenizer import TextCodec

INVALID_PREFIX = "Invalid prefix encountered"  # tokenizers' DecodeStream, on text that does not extend its last


def earliest_stop(text: str, stops: list[str], start: int = 0, floor: int = 0) -> tuple[int, int] | None:
    """(begin, end) of the stop string that completes first (from `start`, ending past `floor`: the text of the
    first min_tokens tokens, where vLLM looks for none): a step of several tokens is cut as adding them one at a
    time would cut it (vLLM's rule; ties go to the earlier in the list)."""
    found = [
        (index, index + len(stop))
        for stop in stops
        if (index := text.find(stop, max(start, floor - len(stop) + 1))) >= 0
    ]
    return min(found, key=lambda span: span[1]) if found else None


def apply_stop(text: str, stops: list[str], floor: int = 0) -> tuple[str, bool]:
    """Cut the text at the stop string that completes first past `floor`; True when one was found."""
    span = earliest_stop(text, stops, 0, floor)
    return (text, False) if span is None else (text[: span[0]], True)


class StreamedText:
    """One job's text so far: `feed` it the job's tokens after each step."""

    def __init__(self, codec: TextCodec, stops: list[str], min_tokens: int = 0, skip_special: bool = True):
        self.codec, self.stops, self.min_tokens, self.skip_special = codec, stops, min_tokens, skip_special
        self.reach = max((len(stop) for stop in stops), default=1) - 1  # how far back a stop can begin
        self.decoder = DecodeStream(skip_special_tokens=skip_special)  # as the reply's whole decode
        self.text = ""
        self.ends: list[int] = []  # the text's length after each token fed
        self.stop: tuple[int, int] | None = None  # (begin, end) of the stop string met, once one has appeared
        self.restarted = False  # the tokenizer could not step a token: the text no longer matches a whole decode

    def feed(self, tokens: list[int]) -> bool:
        """Decode the tokens past those already fed (`tokens`: all of the job's so far); True once a stop string
        has appeared. Bytes that do not make a whole character yet wait for the next token."""
        if self.stop is not None:
            return True  # the text ends at the stop: nothing after it is shown
        before = length = len(self.text)
        pieces = []
        for token in tokens[len(self.ends) :]:
            if piece := self.step(token):
                pieces.append(piece)
                length += len(piece)
            self.ends.append(length)
        self.text += "".join(pieces)
        if self.stops and len(self.text) > before and len(self.ends) > self.min_tokens:
            floor = self.ends[self.min_tokens - 1] if self.min_tokens else 0
            start = max(0, before - self.reach)  # it ends in the new text
            self.stop = earliest_stop(self.text, self.stops, start, floor)
        return self.stopped

    def step(self, token: int) -> str | None:
        """The text `token` completes, if any, recovering as vLLM's detokenizer does."""
        try:
            return self.decoder.step(self.codec.tokenizer, token)
        except (OverflowError, TypeError):  # an id the tokenizer cannot take: no text for it
            return None
        except Exception as err:  # tokenizers raises a bare Exception
            if not str(err).startswith(INVALID_PREFIX):
                raise
            # Some byte-fallback sequences decode to text that does not extend the text before, which breaks the
            # stream's state: a new stream starts at this token (its text is appended, never rewritten).
            self.decoder, self.restarted = DecodeStream(skip_special_tokens=self.skip_special), True
            return self.decoder.step(self.codec.tokenizer, token)

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    def kept_tokens(self) -> int:
        """Once stopped: how many tokens the stop string keeps, up to the one that completed it."""
        return bisect.bisect_left(self.ends, self.stop[1]) + 1

    def ready(self) -> str:
        """What may be sent: the text up to a stop string, or without its last `reach` characters, which
        could still begin one."""
        if self.stop is not None:
            return self.text[: self.stop[0]]
        return self.text[: max(0, len(self.text) - self.reach)]

"""A request's text as its tokens arrive, decoded incrementally.

Decoding a request's whole text again on every step costs its length each time, so a long reply costs its
length squared, per stream, on the server's event loop (docs/performance.md: long replies). tokenizers'
`DecodeStream` (what vLLM's fast incremental detokenizer steps) decodes each new token against the few before
it, at a constant cost, and its pieces join to the whole decode. A stop string is looked for only where it
could end in the new text (as vLLM's `check_stop_strings`).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from specdoctor.runtime.checkpoint.tokenizer import TextCodec


def apply_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Cut the text at the earliest stop string; True when one was found."""
    cuts = [index for stop in stops if (index := text.find(stop)) >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


class StreamedText:
    """One job's text so far: `feed` it the job's tokens after each step."""

    def __init__(self, codec: TextCodec, stops: list[str]):
        self.codec, self.stops = codec, stops
        self.reach = max((len(stop) for stop in stops), default=1) - 1  # how far back a stop can begin
        self.decoder: DecodeStream | None = DecodeStream(skip_special_tokens=True)  # as TextCodec.decode skips them
        self.text, self.fed = "", 0
        self.stop_at: int | None = None  # where the earliest stop string begins, once one has appeared

    def feed(self, tokens: list[int]) -> bool:
        """Decode the tokens past those already fed (`tokens`: all of the job's so far); True once a stop string
        has appeared. Bytes that do not make a whole character yet wait for the next token."""
        if self.stop_at is not None:
            return True  # the text ends at the stop: nothing after it is shown
        before = len(self.text)
        self.text += self.added_text(tokens)
        self.fed = len(tokens)
        if self.stops and len(self.text) > before:
            start = max(0, before - self.reach)  # a stop not found before must end in the new text
            cuts = [index for stop in self.stops if (index := self.text.find(stop, start)) >= 0]
            self.stop_at = min(cuts) if cuts else None
        return self.stopped

    def added_text(self, tokens: list[int]) -> str:
        if self.decoder is not None:
            try:
                pieces = [self.decoder.step(self.codec.tokenizer, token) for token in tokens[self.fed :]]
                return "".join(piece for piece in pieces if piece)
            except Exception:  # tokenizers' bare Exception ("Invalid prefix encountered") on some byte-fallback runs
                self.decoder = None  # this job's text is decoded whole from now on
        whole = self.codec.decode(tokens).rstrip("\ufffd")  # an unfinished character waits, as in the stream
        return whole[len(self.text) :] if whole.startswith(self.text) else ""

    @property
    def stopped(self) -> bool:
        return self.stop_at is not None

    def ready(self) -> str:
        """What may be sent: the text up to a stop string, or without its last `reach` characters, which
        could still begin one."""
        if self.stop_at is not None:
            return self.text[: self.stop_at]
        return self.text[: len(self.text) - self.reach]

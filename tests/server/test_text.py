"""A request's text decoded as its tokens arrive (server/text.py), on tokenizers built by the tokenizers
library: the demo's byte-level BPE, and a SentencePiece-style BPE with byte fallback and Llama's decoder
chain (its leading space stripped once, bytes fused). Oracle: the tokenizer's own `decode` of every token so
far, and `str.find` over that text for stop strings. Tokens are random ids (special ones and bytes that
make no character included), fed a few at a time as speculative steps emit them."""

from __future__ import annotations

import itertools
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specdoctor.runtime.checkpoint.tokenizer import TextCodec
from specdoctor.runtime.decode.requests import SequenceRequest
from specdoctor.server.app import ServerState
from specdoctor.server.metrics import ServerMetrics
from specdoctor.server.protocol import CompletionRequest
from specdoctor.server.reply import Reply
from specdoctor.server.scheduler import Job
from specdoctor.server.text import INVALID_PREFIX, StreamedText
from tests.server.test_reply import CODEC, PROMPT, events_payloads, serve, server_state, step_update

TRAINING_TEXT = [
    "def read_config(path):\n    return json.loads(Path(path).read_text())\n",
    "Größe über alles, naïve café, 東京タワー, emoji 🙂 and tabs\tend",
    "class Parser:\n    def parse(self, text: str) -> list[str]:\n        return text.split()\n",
]


def sentencepiece_style_codec(tmp_path) -> TextCodec:
    """A BPE with byte fallback and Llama's tokenizer.json decoder chain, trained on a little text."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return TextCodec(path)


@pytest.fixture(params=["demo byte-level BPE", "SentencePiece-style BPE"])
def codec(request, tmp_path) -> TextCodec:
    return CODEC if request.param.startswith("demo") else sentencepiece_style_codec(tmp_path)


def random_steps(codec: TextCodec, seed: int, tokens: int = 300) -> list[list[int]]:
    """Random ids in steps of 1 to 4 tokens; a third of them from a real text, so words and characters form."""
    rng = random.Random(seed)
    real = codec.encode(" ".join(TRAINING_TEXT))
    vocab = codec.tokenizer.get_vocab_size()
    ids = [rng.choice(real) if rng.random() < 0.33 else rng.randrange(vocab) for _ in range(tokens)]
    steps, start = [], 0
    while start < len(ids):
        size = rng.randint(1, 4)
        steps.append(ids[start : start + size])
        start += size
    return steps


@pytest.mark.parametrize("seed", range(4))
def test_the_streamed_text_is_the_whole_decode_less_only_bytes_that_make_no_character_yet(codec, seed):
    streamed, tokens = StreamedText(codec, []), []
    for step in random_steps(codec, seed):
        tokens += step
        streamed.feed(tokens)
        whole = codec.decode(tokens)
        assert whole.startswith(streamed.text)
        assert whole == streamed.text or whole.endswith("\ufffd")  # held back: an unfinished character


@pytest.mark.parametrize("seed", range(8))
def test_a_stop_string_is_found_at_the_step_that_completes_it_and_cuts_the_text_there(codec, seed):
    rng = random.Random(seed)
    steps = random_steps(codec, seed)
    everything = codec.decode([token for step in steps for token in step])
    # Stops of 3 to 6 characters that first occur past the text's middle, so most span a step's boundary.
    candidates = [
        (start, rng.randint(3, 6)) for start in rng.sample(range(len(everything) // 2, len(everything) - 6), 50)
    ]
    firsts = [everything[a : a + n] for a, n in candidates if everything.find(everything[a : a + n]) == a]
    stops = [stop for stop in firsts if "\ufffd" not in stop][:2]
    longest = max(len(stop) for stop in stops)
    streamed, tokens = StreamedText(codec, stops), []
    for step in steps:
        tokens += step
        found = streamed.feed(tokens)
        whole = codec.decode(tokens)
        cut = first_completed(whole, stops)
        if found:
            assert streamed.ready() == whole[:cut]
            kept = streamed.kept_tokens()  # the token that completed the stop: the decode up to it has one
            assert first_completed(codec.decode(tokens[:kept]), stops) is not None
            before_it = StreamedText(codec, stops)
            assert not before_it.feed(tokens[: kept - 1])
            break
        if not whole.endswith("\ufffd"):  # every character is whole, so the stream has all of the text
            assert cut is None
            assert streamed.ready() == whole[: max(0, len(whole) - (longest - 1))]  # what could begin a stop held
    assert found  # the stops are in the text: one is met


def first_completed(text: str, stops: list[str]) -> int | None:
    """Where the stop string that completes first begins (the earlier in the list on a tie), as vLLM cuts."""
    best = None
    for stop in stops:
        index = text.find(stop)
        if index >= 0 and (best is None or index + len(stop) < best[0]):
            best = (index + len(stop), index)
    return best[1] if best else None


def test_text_shorter_than_a_stop_string_is_held_back_whole():
    streamed, tokens = StreamedText(CODEC, ["User: h"]), CODEC.encode("User: hi")
    for count in range(1, len(tokens) + 1):  # "U", "User", ...: each may still begin "User: h", so none is shown
        streamed.feed(tokens[:count])
        assert streamed.ready() == ""
    assert streamed.stopped and streamed.text.startswith("User: h")


def test_a_stream_decodes_each_token_once_not_the_whole_text_every_step(monkeypatch):
    """Fifty one-token steps with a stop string to look for: the stream's text and the stop check come from the
    incremental decoder, and the whole text is decoded once, for the last chunk (decoding it on every step
    costs a long reply its length squared)."""
    tokens = CODEC.encode(" ".join(TRAINING_TEXT))[:50]
    jobs = [Job(SequenceRequest(PROMPT, 64))]
    reply = Reply(server_state(), CompletionRequest(prompt="x", stream=True, stop=["never"]), jobs, chat=False)
    decoded: list[int] = []
    whole_decode = CODEC.decode
    monkeypatch.setattr(CODEC, "decode", lambda ids, *skip: decoded.append(len(ids)) or whole_decode(ids, *skip))

    async def consume(reply, scheduler, step):
        events = reply.events(scheduler)
        for index, token in enumerate(tokens):
            step({0: step_update([token], "length" if index == len(tokens) - 1 else None)})
        return [event async for event in events]

    payloads = events_payloads(serve(reply, jobs, consume))
    assert "".join(p["choices"][0]["text"] for p in payloads if p["choices"]) == whole_decode(tokens)
    assert decoded == [len(tokens)]


class FailingDecodeStream:
    """tokenizers' `DecodeStream` as it fails on some byte-fallback sequences: a bare Exception."""

    def __init__(self, message: str):
        self.message = message

    def step(self, tokenizer, token):
        raise Exception(self.message)


def test_a_stream_the_tokenizer_cannot_step_starts_again_at_that_token_and_only_grows(codec):
    """As vLLM recovers from tokenizers' "Invalid prefix encountered": a new stream from the token that failed."""
    steps = random_steps(codec, seed=11)
    streamed, tokens, texts = StreamedText(codec, []), [], []
    for index, step in enumerate(steps):
        if index == 5:
            streamed.decoder, failed_at, text_before = FailingDecodeStream(INVALID_PREFIX), len(tokens), streamed.text
        tokens += step
        streamed.feed(tokens)
        texts.append(streamed.text)
        if index >= 5:  # from the failed token on, the new stream's text is that of the tokens since
            assert codec.decode(tokens[failed_at:]).startswith(streamed.text[len(text_before) :])
    assert not isinstance(streamed.decoder, FailingDecodeStream) and streamed.restarted
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))  # it only ever grew


def test_any_other_tokenizer_failure_is_raised():
    streamed = StreamedText(CODEC, [])
    streamed.decoder = FailingDecodeStream("something else")
    with pytest.raises(Exception, match="something else"):
        streamed.feed(CODEC.encode("hi"))


def test_after_a_restart_the_stream_ends_with_its_own_text_held_back_tail_included(tmp_path):
    """Restarted at a SentencePiece-style token, the stream's text drops that token's leading space, so the whole
    decode no longer extends what was sent: the last chunk must still bring the characters held back for a stop
    string that never came, from the stream's own text."""
    codec = sentencepiece_style_codec(tmp_path)
    tokens = codec.encode("class Parser: def parse(self)")  # ... 'r', ':', '▁def', ...: the restart at '▁def'
    split = [codec.tokenizer.id_to_token(token) for token in tokens].index("▁def")
    state = ServerState(None, codec, "demo", "", None, ServerMetrics("demo", speculative=True))
    jobs = [Job(SequenceRequest(PROMPT, 64))]
    reply = Reply(state, CompletionRequest(prompt="x", stream=True, stop=["never"]), jobs, chat=False)

    async def restart_midway(reply, scheduler, step):
        events = reply.events(scheduler)
        step({0: step_update(tokens[:split])})
        first = await anext(events)
        reply.texts[jobs[0].id].decoder = FailingDecodeStream(INVALID_PREFIX)
        step({0: step_update(tokens[split:], "length")})
        return [first] + [event async for event in events]

    payloads = events_payloads(serve(reply, jobs, restart_midway))
    streamed = reply.texts[jobs[0].id]
    assert streamed.restarted and not codec.decode(tokens).startswith(streamed.text)
    assert "".join(p["choices"][0]["text"] for p in payloads if p["choices"]) == streamed.text

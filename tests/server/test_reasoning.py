"""`serve --reasoning-parser hf`'s template (server/reasoning.py) on a reasoning checkpoint written by transformers
(tests/helpers/reasoning.py): the closes' tokens, the split and the held-back stream; a parser or a template serve
cannot follow is refused in one line. (Served, split and constrained: tests/probe/test_reasoning.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.checkpoint.tokenizer import TOKENIZER_FILE, TextCodec
from specdoctor.server.reasoning import reasoning_template
from tests.helpers.reasoning import CLOSES, RESPONSE_TEMPLATE, save_thinking_demo


@pytest.fixture(scope="module")
def thinking_demo(tmp_path_factory):
    return save_thinking_demo(tmp_path_factory.mktemp("reasoning") / "demo")


@pytest.mark.parametrize(
    "parser, model, said",
    [
        ("hf", "demo", "needs a response_template with a thinking field"),
        ("deepseek_r1", "demo", "--reasoning-parser 'deepseek_r1' is not implemented"),
    ],
)
def test_a_reasoning_parser_serve_cannot_run_is_refused_in_one_line(parser, model, said):
    result = subprocess.run(
        [sys.executable, "-m", "specdoctor", "serve", "--model", model, "--reasoning-parser", parser],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and said in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_template_reads_the_closes_tokens_and_splits_a_reply_at_the_first_close(thinking_demo):
    """The closes' tokens as vLLM finds them (each one token here); a prompt's last turn opens the
    thinking; a reply splits at its first close, and a stream holds back an end that could begin one."""
    codec = TextCodec(thinking_demo / TOKENIZER_FILE)
    template = reasoning_template("hf", thinking_demo, codec)
    assert [len(ids) for ids in template.end_ids] == [1] * len(CLOSES)
    assert [codec.decode(list(ids)) for ids in template.end_ids] == CLOSES
    assert template.open_after("user: x if y\nassistant:<think>")
    assert not template.open_after("user: x\nassistant:<think>a if")  # closed in the prompt
    assert not template.open_after("import os\n")  # a completion's prompt: no thinking opened
    assert template.split("a.b if {") == ("a.b", " {") and template.split("a.b") == ("a.b", None)
    assert template.split('x self y """') == ("x", ' y """')  # the first close, whichever it is
    assert template.settled("a.b i") == "a.b" and template.settled("a.b if x") == "a.b if x"


@pytest.mark.parametrize(
    "change, said",
    [
        ({"fields": {"content": {}}}, "needs a response_template with a thinking field"),
        (
            {"fields": {"thinking": {"open": "<think>", "close_pattern": "</think>\\s*"}, "content": {}}},
            "must be literal strings",
        ),
    ],
)
def test_a_template_serve_cannot_follow_is_refused_naming_the_file(tmp_path, thinking_demo, change, said):
    config = json.loads((thinking_demo / "tokenizer_config.json").read_text())
    config["response_template"] = RESPONSE_TEMPLATE | change
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdoctorError, match=said) as refused:
        reasoning_template("hf", tmp_path, TextCodec(thinking_demo / TOKENIZER_FILE))
    assert str(tmp_path / "tokenizer_config.json") in str(refused.value)

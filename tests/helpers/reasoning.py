"""The demo as a reasoning model's checkpoint: its weights, with a chat template that opens the model's thinking and a
`response_template` naming what closes it, both written by transformers (`save_pretrained`), as a model that ships
them does. The demo writes Python, so its thinking ends at a Python keyword, each a single token that no other
token of its vocabulary contains (a close inside a longer token would end the text's reasoning but never start the
grammar, in vLLM as in serve): the first ends 2 of the first 3 battery prompts' thinking within 30 tokens."""

from __future__ import annotations

from pathlib import Path

from specdoctor.runtime.checkpoint.files import DEMO_DIR

OPEN = "<think>"
CLOSES = [' """', " if", " If", " self", " #", " else", " raise"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:" + OPEN + "{% endif %}"
)
RESPONSE_TEMPLATE = {
    "start_anchor": "assistant:",
    "fields": {"thinking": {"open": OPEN, "close": CLOSES}, "content": {}},
}


def save_thinking_demo(out: Path) -> Path:
    """The demo's weights and config linked into `out`, its tokenizer saved there by transformers with the two
    templates."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    for source in DEMO_DIR.iterdir():
        if source.suffix in (".safetensors", ".json") and not source.name.startswith("tokenizer"):
            (out / source.name).symlink_to(source)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    tokenizer.save_pretrained(out)
    return out

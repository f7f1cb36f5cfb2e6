"""The demo model shipped with the package: layout, size, transformers parity, tokenizer, quality."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from specdoctor.commands.inspect import summarize
from specdoctor.runtime.checkpoint import DEMO_DIR, Checkpoint
from specdoctor.runtime.loader import load_full_target
from tests.helpers.acceptance_trace import position0_acceptance
from tests.helpers.loading import load_target_and_drafter


def test_ships_inside_the_package_within_25_mb():
    size = sum(p.stat().st_size for p in DEMO_DIR.iterdir())
    assert 1_000_000 < size <= 25 * 1024 * 1024


def test_layout_is_the_one_that_suffers_the_bug():
    checkpoint = Checkpoint("demo")
    summary = summarize(checkpoint)
    assert checkpoint.layout == "index" and summary["num_shards"] >= 2
    # The embedding lives only at the top-level key: no copy under the MTP layer's prefix.
    embedding_keys = [k for k in checkpoint.tensors if "embed" in k]
    assert embedding_keys == ["model.embed_tokens.weight"]
    assert summary["mtp_layers"][0]["missing"] == []
    dtypes = {k: t.dtype for k, t in checkpoint.tensors.items()}
    assert {d for k, d in dtypes.items() if not k.endswith("e_score_correction_bias")} == {"BF16"}
    assert {d for k, d in dtypes.items() if k.endswith("e_score_correction_bias")} == {"F32"}


def test_transformers_loads_the_demo_and_agrees():
    from transformers import AutoTokenizer, Glm4MoeForCausalLM

    reference = Glm4MoeForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32).eval()
    checkpoint = Checkpoint("demo")
    stage = load_full_target(checkpoint)
    text = "def parse(self, text):\n    for line in text.splitlines():\n"
    ids = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json")).encode(text).ids
    assert AutoTokenizer.from_pretrained(DEMO_DIR)(text)["input_ids"] == ids
    batch = torch.tensor([ids])
    with torch.no_grad():
        expected = reference(batch).logits
        ours = stage.logits(stage(batch, torch.arange(len(ids))[None]))
    assert float((ours - expected).abs().max() / expected.abs().max()) < 1e-4


def test_drafter_agrees_with_the_target_on_held_out_text():
    from tests.helpers.demo_corpus import held_out_prompts

    checkpoint = Checkpoint("demo")
    target, drafter, provenance = load_target_and_drafter(checkpoint)
    assert not provenance.unfilled()
    tokenizer = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    prompts = held_out_prompts(tokenizer, count=8, length=48, seed=3)
    assert position0_acceptance(target, drafter, prompts, 32) >= 0.6

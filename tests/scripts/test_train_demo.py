"""The demo training script's models learn every tensor they ship: a training step's gradients reach each
parameter the checkpoint names, the fused q/k/v, gate/up and expert projections included (their forward
reads one shared storage, which training must not bypass), and the drafter-only phase trains the drafter
alone. The runtime's fused fast path gives the same logits as the differentiable one."""

from __future__ import annotations

import pytest
import torch

from scripts import dspark_training
from scripts.train_demo import DEMOS, DSPARK_DEMO, DemoModel, demo_config
from specdoctor.runtime.models.dspark import read_dspark_config
from specdoctor.runtime.models.registry import read_config

VOCAB = 256


def model_of(demo: str):
    torch.manual_seed(0)
    config = read_config(demo_config(demo, VOCAB, 0))
    if demo != DSPARK_DEMO:
        return DemoModel(config)
    drafter = read_dspark_config({**dspark_training.DRAFTER_FIELDS, "vocab_size": VOCAB, "mask_token_id": VOCAB - 1})
    return dspark_training.DSparkDemoModel(config, drafter, seed=0)


def without_gradient(model, routed: dict[str, set[int]]) -> list[str]:
    """Parameters a training step should have reached but did not. A routed expert no token was sent to gets
    none, and the DSA indexer only selects keys (it is trained by a loss of its own in DeepSeek's recipe)."""
    missing = []
    for name, p in model.named_parameters():
        layer, _, expert = name.partition(".experts.")
        if ".indexer." in name or (expert and int(expert.split(".")[0]) not in routed[layer]):
            continue
        if p.requires_grad and (p.grad is None or not p.grad.any()):
            missing.append(name)
    return missing


def routed_experts(model) -> dict[str, set[int]]:
    """MoE module name -> the experts its router picked, filled as the model runs."""
    routed: dict[str, set[int]] = {}
    for name, module in model.named_modules():
        if hasattr(module, "experts"):
            routed[name] = set()
            module.gate.register_forward_hook(
                lambda _m, _i, out, name=name: routed[name].update(out[1].flatten().tolist())
            )
    return routed


@pytest.mark.parametrize("demo", [*sorted(DEMOS), DSPARK_DEMO])
def test_a_training_step_reaches_every_parameter(demo):
    model = model_of(demo).train()
    routed = routed_experts(model)
    batch = torch.randint(0, VOCAB - 1, (2, 48), generator=torch.Generator().manual_seed(1))
    loss, _ = model.loss(batch)
    loss.backward()
    assert all(routed.values()) and without_gradient(model, routed) == []
    with torch.no_grad():  # the runtime's path: one storage per fused projection, no concatenation
        positions = torch.arange(48).expand(2, -1)
        fused = model.eval().target.logits(model.target(batch, positions))
    live = model.train().target.logits(model.target(batch, positions))
    torch.testing.assert_close(live.detach(), fused)


def test_the_drafter_phase_trains_the_drafter_alone():
    model = model_of(DSPARK_DEMO).train()
    own = model.drafter_only()
    loss, _ = model.drafter_loss(torch.randint(0, VOCAB - 1, (2, 48), generator=torch.Generator().manual_seed(2)))
    loss.backward()
    assert all(p.grad is not None and p.grad.any() for p in own)
    assert all(p.grad is None for p in model.target.parameters())  # frozen: the embedding and head it shares too
    names = {name for name, p in model.drafter.named_parameters() if any(p is q for q in own)}
    assert not {"embed_tokens.weight", "lm_head.weight"} & names


def test_a_later_phase_starts_from_the_saved_checkpoints(tmp_path):
    """--init-from-out: the saved target and drafter (the drafter without the embedding and head it shares) load
    back into a fresh model, which then computes what the saved one does (bf16, as saved)."""
    from scripts.train_demo import save_dspark, train_tokenizer

    saved = model_of(DSPARK_DEMO).eval()
    raw = demo_config(DSPARK_DEMO, VOCAB, 0)
    tokenizer = train_tokenizer(["def f(x):\n    return x\n"] * 4, 260)
    save_dspark(saved, raw, {}, tokenizer, tmp_path / "model", tmp_path / "drafter", 1 << 20)
    fresh = model_of(DSPARK_DEMO)
    with torch.no_grad():  # unlike the saved model in every tensor, so only loading can make them agree
        for p in fresh.parameters():
            p.normal_()
    fresh.load(tmp_path / "model", tmp_path / "drafter")
    batch = torch.randint(0, VOCAB - 1, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for model in (saved, fresh):
            model.to(torch.bfloat16).float()  # the saved values: rounded to bf16
        expected, loaded = saved.eval().drafter_loss(batch)[0], fresh.eval().drafter_loss(batch)[0]
    torch.testing.assert_close(loaded, expected)

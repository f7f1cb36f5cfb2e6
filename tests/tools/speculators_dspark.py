"""Run by the speculators environment's interpreter (tests/tools/speculators_env.py), never imported by the tests:
writes a DSpark drafter with speculators' own DSparkDraftModel and its save_pretrained, and runs that class's
forward pass as the reference for one block draft step.

    python speculators_dspark.py write OUT --target DIR --aux 2,4,5 --mask-token M --seed S [--layers N ...]
    python speculators_dspark.py step DRAFTER INPUTS OUT   # INPUTS: taps [T, aux, H], tokens [T], anchor [1]
"""

from __future__ import annotations

import argparse

import torch
from safetensors.torch import load_file, save_file
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
from speculators.models.dspark import core as dspark_core
from speculators.train.cli import create_transformer_layer_config
from speculators_tool import look_trained  # its neighbour in this directory, on the script's path


def write(args) -> None:
    """A drafter as speculators' training entry point builds one (its decoder config from the verifier's),
    every layer full attention: the runtime refuses the sliding-window layers the CLI makes by default."""
    layer = create_transformer_layer_config(args.target, args.layers, "qwen3", None, 2048, list(range(args.layers)))
    torch.manual_seed(args.seed)
    model = DSparkDraftModel.from_training_args(
        layer,
        verifier_name_or_path=args.target,
        target_layer_ids=[int(i) for i in args.aux.split(",")],
        draft_vocab_size=layer.vocab_size,
        block_size=args.block,
        mask_token_id=args.mask_token,
        markov_rank=args.markov_rank,
        enable_confidence_head=not args.no_confidence_head,
        draft_attn_impl="eager",
    )
    look_trained(model)
    model.save_pretrained(args.out)


def block_logits(model, hidden_states, tokens, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, Markov-biased) logits [block, V] of DSparkDraftModel.forward's one block anchored at `context`.
    forward hands its biased logits only to its loss (compute_metrics), so they are taken there."""
    taken = {}

    def loss(logits, *_args, **_kwargs):
        taken["biased"] = logits[0]
        return None, {}

    hook = model.lm_head.register_forward_hook(lambda _module, _inputs, output: taken.update(base=output[0]))
    original, dspark_core.compute_metrics = dspark_core.compute_metrics, loss
    loss_mask = torch.zeros_like(tokens)
    loss_mask[context] = 1  # the only anchor forward can draw
    try:
        model(
            hidden_states=hidden_states[None],
            input_ids=tokens[None],
            loss_mask=loss_mask[None],
            verifier_last_hidden_states=torch.zeros(1, len(tokens), model.config.transformer_layer_config.hidden_size),
            document_ids=torch.zeros_like(tokens)[None],
            position_ids=torch.arange(len(tokens))[None],
            max_anchors=1,
        )
    finally:
        dspark_core.compute_metrics = original
        hook.remove()
    return taken["base"], taken["biased"]


def step(args) -> None:
    """One block after the context: its base and Markov-biased logits along speculators' greedy walk."""
    config = DSparkSpeculatorConfig.from_pretrained(args.drafter)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention compiles; eager is exact on CPU
    model = DSparkDraftModel.from_pretrained(args.drafter, config=config).eval()
    model.load_verifier_weights()  # the embedding and head it does not save: the target's
    inputs = load_file(args.inputs)
    taps, context, block = inputs["taps"], len(inputs["tokens"]), model.block_size
    # forward anchors a block only where a whole block and one more position follow; the rows past the
    # context are never attended (its mask lets a block see the base sequence before its anchor only).
    length = context + block + 1
    hidden_states = torch.zeros(length, taps.shape[1] * taps.shape[2])
    hidden_states[:context] = taps.flatten(1)
    tokens = torch.zeros(length, dtype=torch.long)
    tokens[:context], tokens[context] = inputs["tokens"], inputs["anchor"]
    # forward biases slot i by the token at the slot's position (teacher forcing): feeding back its own greedy
    # drafts settles one more slot per pass, so `block` passes give the inference walk.
    with torch.no_grad():
        for _ in range(block):
            base, biased = block_logits(model, hidden_states, tokens, context)
            tokens[context + 1 : context + block] = biased.argmax(-1)[:-1]
    save_file({"base": base.contiguous(), "logits": biased.contiguous(), "drafts": biased.argmax(-1)}, args.out)


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    writer = commands.add_parser("write")
    writer.add_argument("out")
    writer.add_argument("--target", required=True)
    writer.add_argument("--aux", required=True, help="aux_hidden_state_layer_ids: the capture entries it reads")
    writer.add_argument("--mask-token", type=int, required=True)
    writer.add_argument("--layers", type=int, default=2)
    writer.add_argument("--block", type=int, default=4)
    writer.add_argument("--markov-rank", type=int, default=16)
    writer.add_argument("--seed", type=int, default=0)
    writer.add_argument("--no-confidence-head", action="store_true")
    stepper = commands.add_parser("step")
    stepper.add_argument("drafter")
    stepper.add_argument("inputs")
    stepper.add_argument("out")
    args = parser.parse_args()
    {"write": write, "step": step}[args.command](args)


if __name__ == "__main__":
    main()

"""Run by the speculators environment's interpreter (tests/tools/speculators_env.py), never imported by the tests:
writes EAGLE-3 heads with speculators' own model class and its save_pretrained, and runs that class's forward
pass as the reference for one draft step.

    python speculators_tool.py write OUT --target DIR --aux 1,3,6 --draft-vocab N --seed S [--layer-family qwen3]
    python speculators_tool.py save OUT --target DIR --aux 1,3,5 --tensors TRAINED --speculative-tokens 5
    python speculators_tool.py step HEAD INPUTS OUT [--verifier TARGET]   # INPUTS: aux, tokens, positions
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from safetensors.torch import load_file, save_file
from speculators.convert.entrypoints import convert_model
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from transformers import AutoConfig, LlamaConfig, Qwen3Config

FLAGS = ("norm_before_fc", "norm_output", "fc_norm")


def build(args) -> Eagle3DraftModel:
    """A head for the target as speculators' training entry point makes one (embedding and head from the target)."""
    verifier = AutoConfig.from_pretrained(args.target)
    # A layer at the verifier's sizes, whatever the verifier's family: Llama (vLLM's Eagle3LlamaForCausalLM) or
    # Qwen3 (Eagle3Qwen3ForCausalLM, speculators' default).
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "rms_norm_eps", "max_position_embeddings")  # fmt: skip
    theta = (getattr(verifier, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    layer = {"llama": LlamaConfig, "qwen3": Qwen3Config}[args.layer_family](
        **{name: getattr(verifier, name) for name in sizes},
        num_hidden_layers=args.layers,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    draft_vocab = args.draft_vocab or verifier.vocab_size
    d2t = t2d = None
    if draft_vocab < verifier.vocab_size:  # a pruned vocabulary: a random sorted subset of target ids
        generator = torch.Generator().manual_seed(args.seed)
        kept = torch.randperm(verifier.vocab_size, generator=generator)[:draft_vocab].sort().values
        d2t = kept - torch.arange(draft_vocab)
        t2d = torch.zeros(verifier.vocab_size, dtype=torch.bool)
        t2d[kept] = True
    torch.manual_seed(args.seed)
    return Eagle3DraftModel.from_training_args(
        layer,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=args.target,
        target_layer_ids=[int(i) for i in args.aux.split(",")] if args.aux else None,
        draft_vocab_size=draft_vocab,
        norm_before_residual=not args.no_norm_before_residual,
        ttt_steps=args.speculative_tokens,
        draft_attn_impl="eager",
        **{flag: flag in args.flag for flag in FLAGS},
    )


def look_trained(model) -> None:
    """Random weights as trained ones look, the target's embedding and head kept: the initialiser's near-zero
    linears and unit norms would hide mistakes in which norm or state goes where."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.startswith(("embed_tokens", "lm_head", "verifier_")):
                continue
            if parameter.dim() == 1:
                parameter.copy_(1.0 + 0.3 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 1.0 / parameter.shape[1] ** 0.5)


def write(args) -> None:
    """A head with random weights, as trained ones look."""
    model = build(args)
    look_trained(model)
    model.save_pretrained(args.out)


def save(args) -> None:
    """A head with trained tensors (`--tensors`: its own, without the embedding and head it shares), saved
    without the target's embedding and head."""
    model = build(args)
    missing, unexpected = model.load_state_dict(load_file(args.tensors), strict=False)
    if unexpected or set(missing) - {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                      "verifier_norm.weight", "d2t", "t2d"}:  # fmt: skip
        raise SystemExit(f"trained tensors do not fit the head: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(args.out)
    weights = f"{args.out}/model.safetensors"
    shared = ("embed_tokens.weight", "lm_head.weight")
    save_file({k: v for k, v in load_file(weights).items() if k not in shared}, weights, metadata={"format": "pt"})


def step(args) -> None:
    head = args.head
    if args.verifier:  # an original-layout head, converted by speculators' own converter for its target
        head = tempfile.mkdtemp()
        convert_model(args.head, verifier=args.verifier, algorithm="eagle3", output_path=head)
    # A head that ships no embedding or head takes the verifier's, as vLLM does: speculators' from_pretrained
    # initialises the absent tensors at random and its load_verifier_weights keeps them unless told to overwrite
    # (docs/eagle3.md).
    config = Eagle3SpeculatorConfig.from_pretrained(head)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention compiles; eager is exact on CPU
    model = Eagle3DraftModel.from_pretrained(head, config=config).eval()
    shipped = set(load_file(f"{args.head}/model.safetensors"))
    model._load_verifier_weights(
        overwrite_embed_tokens="embed_tokens.weight" not in shipped, overwrite_lm_head="lm_head.weight" not in shipped
    )
    inputs = load_file(args.inputs)
    logits = []
    model.lm_head.register_forward_hook(lambda _module, _inputs, output: logits.append(output))
    with torch.no_grad():
        tokens = model(
            hidden_states=inputs["aux"].flatten(-2)[None],
            input_ids=inputs["tokens"][None],
            document_ids=torch.zeros_like(inputs["tokens"])[None],
            position_ids=inputs["positions"][None],
            ttt_steps=1,
        )[0]
    save_file({"logits": logits[0][0].contiguous(), "tokens": tokens[0].contiguous()}, args.out)


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("write", "save"):
        writer = commands.add_parser(name)
        writer.add_argument("out")
        writer.add_argument("--target", required=True)
        writer.add_argument("--aux", default="")
        writer.add_argument("--draft-vocab", type=int)
        writer.add_argument("--layers", type=int, default=1)
        writer.add_argument("--layer-family", choices=("llama", "qwen3"), default="llama")
        writer.add_argument("--seed", type=int, default=0)
        writer.add_argument("--speculative-tokens", type=int, default=3)
        writer.add_argument("--no-norm-before-residual", action="store_true")
        writer.add_argument("--flag", action="append", default=[], choices=FLAGS)
        writer.add_argument("--tensors", help="save: the trained tensors")
    stepper = commands.add_parser("step")
    stepper.add_argument("head")
    stepper.add_argument("inputs")
    stepper.add_argument("out")
    stepper.add_argument("--verifier", help="the target of an original-layout head, which speculators converts")
    args = parser.parse_args()
    {"write": write, "save": save, "step": step}[args.command](args)


if __name__ == "__main__":
    main()

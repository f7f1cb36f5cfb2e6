"""Train demo-eagle3: an EAGLE-3 head (one Llama layer) for demo-dspark's frozen Qwen3 target, on the same text
as the other demos, saved by speculators itself in its format (tests/tools/speculators_tool.py) without an
embedding or head of its own: both are the target's, so at PP > 1 vLLM 0.32 leaves its embedding unloaded.

    python -m scripts.train_eagle3 --out specdoctor/demo_eagle3_drafter --steps 1500

Trained as it drafts (docs/eagle3.md), with speculators' test-time training: step 0 reads fc(aux states) at
position t and the token after t and predicts the target's distribution at t + 1; step j reads step j - 1's
output state at the same row, position t + j and the text's token there (teacher forcing), and attends to
step 0's keys up to t and to the row's own earlier steps, as the chain does when it drafts from t.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from scripts.train_demo import encode_stream, train
from specdoctor.runtime.checkpoint.files import DEMO_MODELS
from specdoctor.runtime.checkpoint.loader import load_full_target
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.models.eagle3 import Eagle3Drafter, read_eagle3_config
from specdoctor.runtime.models.rope import rotary_cos_sin
from tests.helpers.acceptance_trace import chain_acceptance
from tests.helpers.demo_corpus import corpus_files, read_texts
from tests.tools import TOOLS
from tests.tools.speculators_env import SPECULATORS

TARGET = "demo-dspark"
AUX_IDS = (1, 3, 5)  # entries of the 6-layer target: PP 2-4 spread them over two or three ranks
STEPS = 5  # the chain length it is trained for (num_speculative_tokens)
STEP_DECAY = 0.8  # loss weight of chain step j: DECAY**j (early drafts decide acceptance)
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rope_theta", "rms_norm_eps", "max_position_embeddings", "vocab_size")  # fmt: skip
TOOL = TOOLS / "speculators_tool.py"


class ChainSpan:
    """Stands in for the KV cache in a training pass: step 0's keys over the whole sequence, then each later
    step's at the same rows; a query of row t sees step 0's keys up to t and its own row's later ones."""

    def __init__(self, rows: int):
        self.rows, self.keys, self.values = rows, [], []

    def update(self, layer_id: int, positions, k, v) -> list[torch.Tensor]:
        self.keys.append(k)
        self.values.append(v)
        return [torch.cat(self.keys, dim=1), torch.cat(self.values, dim=1)]

    def causal_mask(self) -> torch.Tensor:
        rows = torch.arange(self.rows)
        context = rows[None, :] <= rows[:, None]
        own = [rows[None, :] == rows[:, None]] * (len(self.keys) - 1)
        return torch.cat([context, *own], dim=1)


class Eagle3DemoModel(torch.nn.Module):
    loss_names = tuple(f"step{j}" for j in range(STEPS))

    def __init__(self, target: Checkpoint, config):
        super().__init__()
        self.target = load_full_target(target).requires_grad_(False)
        self.target.tap_entries = AUX_IDS
        self.drafter = Eagle3Drafter(config)
        self.drafter.embed_tokens = self.target.model.embed_tokens
        self.drafter.lm_head = self.target.lm_head
        for param in self.drafter.parameters():
            if param.requires_grad and param.dim() >= 2:
                torch.nn.init.normal_(param, std=0.02)

    def parameters_to_train(self) -> list[torch.nn.Parameter]:
        return [p for p in self.drafter.parameters() if p.requires_grad]

    def loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        """Distillation to the frozen target's distribution at every chain step."""
        size, length = batch.shape
        positions = torch.arange(length).expand(size, -1)
        with torch.no_grad():
            hidden, captured = self.target.forward_with_taps(batch, positions)
            teacher = self.target.logits(hidden).softmax(-1)  # [B, L, V]
            aux = torch.stack([captured[entry] for entry in AUX_IDS], dim=2)
        rows = length - 1
        state = self.drafter.combine(aux[:, :rows])
        span, losses = ChainSpan(rows), []
        for step in range(STEPS):
            # Row t at step j: position t + j, the token after it, predicting the target's choice at t + j + 1.
            tokens = batch[:, 1 + step :]
            tokens = torch.cat([tokens, tokens.new_zeros(size, rows - tokens.shape[1])], dim=1)
            step_positions = positions[:, :rows] + step
            rotary = rotary_cos_sin(self.drafter.config.backbone, step_positions, state.dtype)
            embeds = self.drafter.embed_tokens(tokens)
            state, logits = self.drafter.run_layers(embeds, state, step_positions, rotary, span)
            valid = rows - step  # rows whose prediction lies inside the sequence
            log_q = logits[:, :valid].log_softmax(-1)
            losses.append(-(teacher[:, 1 + step :][:, :valid] * log_q).sum(-1).mean())
        total = sum(STEP_DECAY**j * loss for j, loss in enumerate(losses)) / sum(STEP_DECAY**j for j in range(STEPS))
        return total, [loss.item() for loss in losses]

    def held_out(self, prompts: list[list[int]], new_tokens: int) -> str:
        rates = chain_acceptance(self.target, self.drafter, prompts, new_tokens, STEPS)
        shown = " ".join(f"{rate:.0%}" for rate in rates)
        return f"held-out greedy chain {STEPS} per-position acceptance {shown}, mean length {1 + sum(rates):.2f}"


def head_config(target: Checkpoint) -> dict:
    """The speculators format read back by the runtime: the layer's Llama config at the target's sizes."""
    layer = {name: target.raw_config[name] for name in LAYER_FIELDS} | {"model_type": "llama", "num_hidden_layers": 1}
    return {
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": layer["vocab_size"],
        "eagle_aux_hidden_state_layer_ids": list(AUX_IDS),
        "norm_before_residual": True,
    }


def save(model: Eagle3DemoModel, target: Checkpoint, out: Path) -> None:
    """speculators writes the head from the trained tensors; then the verifier path it records is replaced by the
    demo's name (a path on the training machine means nothing elsewhere), and the copy of its config class it
    writes for trust_remote_code is dropped (the speculators package provides that class; vLLM reads neither)."""
    tensors = {k: v.detach().contiguous() for k, v in model.drafter.state_dict().items()}
    with tempfile.TemporaryDirectory() as scratch:
        trained = Path(scratch) / "trained.safetensors"
        save_file({k: v for k, v in tensors.items() if k not in ("embed_tokens.weight", "lm_head.weight")}, trained)
        command = [str(SPECULATORS.ensure()), str(TOOL), "save", str(out), "--target", str(target.path)]
        command += ["--aux", ",".join(map(str, AUX_IDS)), "--tensors", str(trained), "--speculative-tokens", str(STEPS)]
        subprocess.run(command, check=True)
    config = json.loads((out / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = TARGET
    config.pop("auto_map", None)
    (out / "config.py").unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-from", type=Path, help="start from a head saved by an earlier run")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    target = Checkpoint(DEMO_MODELS[TARGET])
    tokenizer = Tokenizer.from_file(str(target.path / "tokenizer.json"))
    train_files, held_files = corpus_files()
    stream, held = encode_stream(tokenizer, read_texts(train_files)), encode_stream(tokenizer, read_texts(held_files))
    model = Eagle3DemoModel(target, read_eagle3_config(head_config(target)))
    if args.init_from:  # the head's own tensors; the embedding and head stay the target's
        saved = load_file(args.init_from / "model.safetensors")
        missing, unexpected = model.drafter.load_state_dict(saved, strict=False)
        if unexpected or set(missing) - {"embed_tokens.weight", "lm_head.weight"}:
            parser.error(f"{args.init_from} does not fit the head: missing {missing}, unexpected {unexpected}")
    print(f"train tokens {len(stream):,}; head parameters {sum(p.numel() for p in model.parameters_to_train()):,}")
    generator = torch.Generator().manual_seed(args.seed)
    watch = [held[o : o + 64].tolist() for o in range(0, 8 * 997, 997)]
    start = time.time()
    train(model, "eagle3", model.loss, model.parameters_to_train(), args.steps, args.lr, stream, args, generator, {},
          watch)  # fmt: skip
    model.eval()
    offsets = torch.randint(0, len(held) - 64, (32,), generator=torch.Generator().manual_seed(args.seed + 1)).tolist()
    print(f"{model.held_out([held[o : o + 64].tolist() for o in offsets], 64)} (32 prompts x 64 tokens)")
    save(model, target, args.out)
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"saved {args.out} ({size / 1e6:.1f} MB) after {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()

"""demo-dspark's model and objective (scripts/train_demo.py --demo demo-dspark): a dense Qwen3 target and
its DSpark drafter, trained together on the same text as the other demos.

The drafter is trained as it drafts (docs/dspark.md): for anchors p sampled in each sequence, the block
[x_p, mask, ..., mask] at positions p..p+N-1 attends to the context keys and values of the fused taps at
positions < p and to its own block (non-causal), and predicts x_{p+1..p+N}; the Markov head is fed the
true previous token (teacher forcing; at inference, the previous draft). Target and drafter share the
embedding and head, as the shipped drafter shares the target's.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdoctor.runtime.models.dspark import DSparkConfig, DSparkDrafter, context_keys_values
from specdoctor.runtime.models.rope import rotary_cos_sin
from specdoctor.runtime.models.stage import TargetStage
from tests.helpers.acceptance_trace import block_acceptance


def read_shards(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v.float() for shard in sorted(directory.glob("*.safetensors")) for k, v in load_file(shard).items()}


MASK = "<|mask|>"
BLOCK = 5  # the block (num_speculative_tokens) it is trained for
ANCHORS = 16  # blocks trained per sequence together with the target
DRAFTER_ANCHORS = 32  # and by the drafter alone (the frozen target's pass is cheap)
POSITION_DECAY = 0.85  # loss weight of block position i: DECAY**i (early drafts decide acceptance)
DRAFTER_WEIGHT = 1.0
# The drafter learns the target's distribution at each position, not the text's next token: acceptance is
# agreement with the target (on demo-dspark's first target, 800 drafter steps: 2.69 against 2.41 greedy-trace
# mean acceptance length at block 5).
DISTILL = True

TARGET_FIELDS = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
# Qwen3DSparkModel's fields (vLLM 0.32: qwen3_dspark.py): four draft layers at the target's width, with a key
# and value head per query head (the context reaches the block only through them), reading the outputs of
# target layers 1, 3 and 5, which PP 2-4 spread over two to three ranks.
SHARED_FIELDS = ("model_type", "hidden_size", "intermediate_size", "head_dim", "rope_theta", "rms_norm_eps",
                 "attention_bias", "max_position_embeddings", "hidden_act", "torch_dtype")  # fmt: skip
DRAFTER_FIELDS = {
    "architectures": ["Qwen3DSparkModel"],
    **{name: TARGET_FIELDS[name] for name in SHARED_FIELDS},
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "target_layer_ids": [1, 3, 5],
    "markov_rank": 128,
    "block_size": BLOCK,
    "sample_from_anchor": True,
}


def block_mask(anchors: torch.Tensor, length: int, block: int) -> torch.Tensor:
    """[B, 1, A*N, L + A*N]: a query of block a sees context positions < anchor a and its own block."""
    batch, count = anchors.shape
    query_anchor = anchors.repeat_interleave(block, dim=1)  # [B, A*N]
    sees_context = torch.arange(length) < query_anchor[:, :, None]  # [B, A*N, L]
    block_of = torch.arange(count).repeat_interleave(block)
    sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)  # [B, A*N, A*N]
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


class TrainingSpan:
    """Stands in for the KV cache in a training pass: each draft layer's context keys and values over the
    whole sequence, joined with the block's own, under the block mask."""

    def __init__(self, context: dict[int, tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor):
        self.context, self.mask = context, mask

    def update(self, layer_id: int, positions, k, v) -> list[torch.Tensor]:
        context_k, context_v = self.context[layer_id]
        return [torch.cat([context_k, k], dim=1), torch.cat([context_v, v], dim=1)]

    def causal_mask(self) -> torch.Tensor:
        return self.mask


class DSparkDemoModel(torch.nn.Module):
    loss_names = ("main", *(f"block{i}" for i in range(BLOCK)))

    def __init__(self, target_config, drafter_config: DSparkConfig, seed: int):
        super().__init__()
        self.anchors = torch.Generator().manual_seed(seed + 2)  # where each batch's blocks start
        self.target = TargetStage(target_config, range(target_config.num_hidden_layers), True, True)
        self.target.tap_entries = drafter_config.tap_entries
        self.drafter = DSparkDrafter(drafter_config)
        self.drafter.embed_tokens = self.target.model.embed_tokens
        self.drafter.lm_head = self.target.lm_head
        for param in self.parameters():
            if param.dim() >= 2:
                torch.nn.init.normal_(param, std=0.02)

    def load(self, target_dir: Path, drafter_dir: Path) -> None:
        """Start from saved weights (a later drafter-only phase); the drafter's checkpoint lacks the embedding and
        head it shares with the target."""
        self.target.load_state_dict(read_shards(target_dir))
        missing, unexpected = self.drafter.load_state_dict(read_shards(drafter_dir), strict=False)
        assert sorted(missing) == ["embed_tokens.weight", "lm_head.weight"] and not unexpected, (missing, unexpected)

    def block_losses(
        self, batch: torch.Tensor, taps: torch.Tensor, count: int, teacher: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Cross-entropy per block position over `count` random anchors per sequence: against the next token,
        or, with `teacher` (the target's logits [B, L, V]), against the target's distribution there (what
        acceptance measures the drafter by)."""
        drafter, cfg = self.drafter, self.drafter.config
        size, length = batch.shape
        positions = torch.arange(length).expand(size, -1)
        states = drafter.hidden_norm(drafter.fuse(taps))  # taps: [B, L, taps, H]
        rotary = rotary_cos_sin(cfg.backbone, positions, states.dtype)
        context = {int(i): context_keys_values(layer.self_attn, states, rotary) for i, layer in drafter.layers.items()}
        anchors = torch.randint(1, length - BLOCK, (size, count), generator=self.anchors).sort(dim=1).values
        offsets = anchors[:, :, None] + torch.arange(BLOCK)  # [B, A, N] positions of each block
        tokens = torch.full_like(offsets, cfg.mask_token_id)
        tokens[:, :, 0] = batch.gather(1, anchors)
        block_positions = offsets.flatten(1)
        span = TrainingSpan(context, block_mask(anchors, length, BLOCK))
        block_rotary = rotary_cos_sin(cfg.backbone, block_positions, states.dtype)
        hidden = drafter.run_layers(drafter.embed_tokens(tokens.flatten(1)), block_positions, block_rotary, span)
        previous = batch.gather(1, block_positions)  # teacher forcing: the true token before each prediction
        logits = drafter.markov_logits(drafter.lm_head(hidden), previous).view(size, count, BLOCK, -1)
        if teacher is not None:
            soft = teacher.gather(1, block_positions[..., None].expand(-1, -1, teacher.shape[-1])).softmax(-1)
            soft = soft.view(size, count, BLOCK, -1)
            return [-(soft[:, :, i] * logits[:, :, i].log_softmax(-1)).sum(-1).mean() for i in range(BLOCK)]
        targets = batch.gather(1, block_positions + 1).view(size, count, BLOCK)
        return [F.cross_entropy(logits[:, :, i].flatten(0, 1), targets[:, :, i].flatten()) for i in range(BLOCK)]

    def held_out(self, prompts: list[list[int]], new_tokens: int) -> str:
        rates = block_acceptance(self.target, self.drafter, prompts, new_tokens, BLOCK)
        shown = " ".join(f"{rate:.0%}" for rate in rates)
        return f"held-out greedy block {BLOCK} per-position acceptance {shown}, mean length {1 + sum(rates):.2f}"

    def target_pass(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # logits, taps [B, L, taps, H]
        positions = torch.arange(batch.shape[1]).expand(batch.shape[0], -1)
        hidden, captured = self.target.forward_with_taps(batch, positions)
        taps = torch.stack([captured[entry] for entry in self.drafter.config.tap_entries], dim=2)
        return self.target.logits(hidden), taps

    def weighted(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        weights = [POSITION_DECAY**i for i in range(BLOCK)]
        return sum(w * b for w, b in zip(weights, blocks, strict=True)) / sum(weights)

    def loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        """Target and drafter together."""
        logits, taps = self.target_pass(batch)
        main = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        blocks = self.block_losses(batch, taps, ANCHORS, teacher=logits.detach() if DISTILL else None)
        return main + DRAFTER_WEIGHT * self.weighted(blocks), [main.item()] + [b.item() for b in blocks]

    def drafter_only(self) -> list[torch.nn.Parameter]:
        """Freeze the target (and so the embedding and head the drafter shares with it); the drafter's own tensors."""
        self.target.requires_grad_(False)
        return [p for p in self.drafter.parameters() if p.requires_grad]

    def drafter_loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        """The drafter alone on the frozen target's taps (DSpark's own recipe: the target is not trained)."""
        with torch.no_grad():
            logits, taps = self.target_pass(batch)
            main = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        blocks = self.block_losses(batch, taps, DRAFTER_ANCHORS, teacher=logits if DISTILL else None)
        return self.weighted(blocks), [main.item()] + [b.item() for b in blocks]

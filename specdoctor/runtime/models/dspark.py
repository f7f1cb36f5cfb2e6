"""The DSpark block drafter (vLLM 0.32: `qwen3_dspark.py` on `qwen3_dflash.py`; docs/dspark.md): a small
Qwen3 stack that drafts a whole block in one parallel pass over context keys and values projected from
the fused hidden states of several target layers (the taps), then a low-rank Markov head adds a
previous-token bias to each position's logits, left to right. It is a checkpoint of its own; its token
embedding and head are the target's unless it ships them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdoctor.errors import CheckpointError
from specdoctor.runtime.architectures import NO_MTP
from specdoctor.runtime.cache.kv_cache import KVCache, new_cache
from specdoctor.runtime.config import DraftLayersConfig, ModelConfig, RawConfig
from specdoctor.runtime.models import qwen3
from specdoctor.runtime.models.layers import RMSNorm
from specdoctor.runtime.models.parallel_layers import ParallelLMHead, VocabParallelEmbedding
from specdoctor.runtime.models.rope import apply_rotary, rotary_cos_sin
from specdoctor.runtime.sharding import local_config
from specdoctor.runtime.tensor_parallel import current

# vLLM 0.32 builds Qwen3DSparkForCausalLM for these (config/speculative.py; DSparkDraftModel only with
# model_type qwen3, else it is DeepSeek-V4's drafter).
ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel")
SPECULATORS_TYPE = "dspark"  # `speculators_model_type` of the speculators format
# What vLLM's update_dspark copies from a speculators config onto the layers' config, where set.
SPECULATORS_FIELDS = (
    "draft_vocab_size",
    "target_hidden_size",
    "mask_token_id",
    "markov_rank",
    "markov_head_type",
    "block_size",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "use_aux_hidden_state",
)


@dataclass(frozen=True)
class DSparkConfig(DraftLayersConfig):
    architecture: str
    backbone: ModelConfig  # the draft layers, as a Qwen3 config (its vocabulary is the target's)
    layer_ids: tuple[int, ...]  # the target layers whose outputs it reads (0-based), in the order listed
    # The residual-stream entries the drafter reads, as vLLM captures them: entry j is the state entering
    # target layer j (j = 0: the embedding output; j = num_hidden_layers: after the last layer). vLLM takes
    # a DSpark id i as entry i + 1 (the output of layer i) and sorts and de-duplicates them.
    tap_entries: tuple[int, ...]
    target_hidden_size: int
    markov_rank: int
    mask_token_id: int
    block_size: int | None  # the block it was trained for: vLLM's default num_speculative_tokens
    logit_scale: float
    confidence_head: bool
    confidence_with_markov: bool

    def validate(self, source: str) -> None:
        self.backbone.validate(source)


def _layer_ids(raw: RawConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the target layers whose outputs it reads, in listed order; vLLM's capture entries), in the order vLLM's
    get_eagle3_aux_layers_from_config reads them: `eagle_aux_hidden_state_layer_ids` are entries already (layer
    id + 1); the DFlash / DSpark ids are layers, taken + 1."""
    dflash = raw.get("dflash_config") or {}
    listed = raw.get("eagle_aux_hidden_state_layer_ids")
    shift = 0
    if not listed:
        listed = dflash.get("target_layer_ids") or raw.get("dspark_target_layer_ids") or raw.get("target_layer_ids")
        shift = 1
    if not listed or not all(isinstance(i, int) and not isinstance(i, bool) for i in listed):
        raise CheckpointError(f"{raw.source}: a DSpark drafter needs target_layer_ids, a list of target layer ids")
    return tuple(i + shift - 1 for i in listed), tuple(sorted({i + shift for i in listed}))


def _mask_token_id(raw: RawConfig) -> int:
    """The id fed at the block's masked slots, looked up as vLLM's get_parallel_drafting_token_id does."""
    dflash = raw.get("dflash_config") or {}
    for value in (dflash.get("mask_token_id"), raw.get("mask_token_id"), raw.get("dspark_noise_token_id")):
        if value is not None:
            return int(value)
    raise CheckpointError(f"{raw.source}: a DSpark drafter needs mask_token_id (the id of its masked block slots)")


def _refuse_unrun(raw: RawConfig) -> None:
    """Settings vLLM runs but this runtime does not: refused, not approximated."""
    dflash = raw.get("dflash_config") or {}
    causal = raw.get("is_causal", dflash.get("causal"))
    sliding = "sliding_attention" in (raw.get("layer_types") or []) or dflash.get("use_swa")
    reasons = {
        "causal draft layers (is_causal / dflash_config.causal)": bool(causal),
        "sliding-window draft layers": bool(sliding),
        "sample_from_anchor false (DFlash's 1 + N block layout)": raw.get("sample_from_anchor", True) is False,
        "a reduced draft vocabulary (draft_vocab_size with d2t)": (
            raw.get("draft_vocab_size") or raw.need("vocab_size")
        )
        < raw.need("vocab_size"),
        "attention_bias (DFlash layers add an o_proj bias)": bool(raw.get("attention_bias")),
        "use_aux_hidden_state false": dflash.get("use_aux_hidden_state", raw.get("use_aux_hidden_state", True))
        is False,
        f"markov_head_type {raw.get('markov_head_type')!r}": raw.get("markov_head_type", "vanilla") != "vanilla",
        f"hidden_act {raw.get('hidden_act')!r}": raw.get("hidden_act", "silu") != "silu",
    }
    refused = [reason for reason, present in reasons.items() if present]
    if refused:
        raise CheckpointError(f"{raw.source}: the runtime does not run DSpark drafters with {refused[0]}")


def is_dspark_config(raw: dict) -> bool:
    if raw.get("speculators_model_type") == SPECULATORS_TYPE:
        return True
    architectures = raw.get("architectures") or []
    return bool(architectures) and architectures[0] in ARCHITECTURES and raw.get("model_type", "qwen3") == "qwen3"


def from_speculators(raw: dict, source: str) -> dict:
    """The speculators format (`speculators_model_type: dspark`, the layers' config under
    `transformer_layer_config`) as vLLM 0.32 reads it (update_dspark): that config with DSpark's fields copied
    on, the aux ids as entries and as target_layer_ids (each - 1), `sample_from_anchor` false where absent, and
    the architecture Qwen3DSparkModel (Qwen3-Omni's kept, which this runtime refuses)."""
    layers, aux = raw.get("transformer_layer_config"), raw.get("aux_hidden_state_layer_ids")
    if not isinstance(layers, dict):
        raise CheckpointError(f"{source}: a speculators DSpark config needs transformer_layer_config, an object")
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
        raise CheckpointError(f"{source}: a speculators DSpark config needs aux_hidden_state_layer_ids, layer ids")
    omni = "Qwen3OmniDSparkModel" in (raw.get("architectures") or [])
    return {
        **layers,
        "architectures": ["Qwen3OmniDSparkModel" if omni else "Qwen3DSparkModel"],
        "sample_from_anchor": raw.get("sample_from_anchor", False),
        "eagle_aux_hidden_state_layer_ids": aux,
        "target_layer_ids": [i - 1 for i in aux],
        **{key: raw[key] for key in SPECULATORS_FIELDS if raw.get(key) is not None},
    }


def read_dspark_config(raw, source: str = "config.json") -> DSparkConfig:
    if isinstance(raw, dict) and raw.get("speculators_model_type") == SPECULATORS_TYPE:
        raw = from_speculators(raw, source)
    fields = RawConfig(raw, source)
    if not is_dspark_config(raw):
        found = (raw.get("architectures") or ["none"])[0]
        raise CheckpointError(
            f"{source}: not a DSpark drafter (architectures {found!r}; expected one of {', '.join(ARCHITECTURES)} "
            "with model_type qwen3)"
        )
    _refuse_unrun(fields)
    rank = fields.need("markov_rank")
    if rank < 1:
        raise CheckpointError(f"{source}: markov_rank must be positive, got {rank}")
    listed, entries = _layer_ids(fields)
    block = fields.get("block_size", fields.get("dspark_block_size"))
    config = DSparkConfig(
        architecture=fields.architecture,
        backbone=qwen3.read_config(fields, qwen3.ARCHITECTURE, NO_MTP),
        layer_ids=listed,
        tap_entries=entries,
        target_hidden_size=int(fields.get("target_hidden_size") or fields.need("hidden_size")),
        markov_rank=rank,
        mask_token_id=_mask_token_id(fields),
        block_size=int(block) if block else None,
        logit_scale=float(fields.get("logit_scale", 1.0)),
        confidence_head=bool(fields.get("enable_confidence_head", False)),
        confidence_with_markov=bool(fields.get("confidence_head_with_markov", False)),
    )
    config.validate(source)
    if not 0 <= config.mask_token_id < config.vocab_size:
        raise CheckpointError(f"{source}: mask_token_id {config.mask_token_id} is outside the vocabulary")
    return config


def pairing_problems(drafter: DSparkConfig, target: ModelConfig) -> list[str]:
    """Why this drafter cannot draft for this target (vLLM fails at load or at the first step on each)."""
    problems = drafter.size_problems(target)
    outside = [e - 1 for e in drafter.tap_entries if not 0 <= e <= target.num_hidden_layers]
    if outside:
        problems.append(f"target_layer_ids {outside} lie outside the target's {target.num_hidden_layers} layers")
    return problems


class MarkovHead(nn.Module):
    """The sequential bias: `markov_w1[previous token]` (rank r) projected by `markov_w2` to the vocabulary."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # replicated under TP, as vLLM holds it
        self.markov_w2 = ParallelLMHead(rank, vocab_size)

    def forward(self, previous: torch.Tensor) -> torch.Tensor:  # [...] token ids -> [..., V] bias
        return self.markov_w2(self.markov_w1(previous))


class ConfidenceHead(nn.Module):
    """An acceptance estimate per position (vLLM uses it only for adaptive verification; no token depends on it)."""

    def __init__(self, input_size: int):
        super().__init__()
        self.proj = nn.Linear(input_size, 1, bias=True)


def context_keys_values(attention, states: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft layer's keys (k_norm, then RoPE) and values [B, T, kv_heads, D] of context states [B, T, H]:
    DFlash's precompute, without the layer's input norm (the fused states went through `hidden_norm`)."""
    batch, length, _ = states.shape
    kv_size = attention.num_kv_heads * attention.head_dim
    weight, bias = attention.qkv()
    weight, bias = weight[-2 * kv_size :], bias[-2 * kv_size :] if bias is not None else None
    k, v = F.linear(states, weight, bias).view(batch, length, 2, attention.num_kv_heads, attention.head_dim).unbind(2)
    return apply_rotary(attention.k_norm(k), *rotary), v


class DSparkDrafter(nn.Module):
    """Parameter names are the drafter checkpoint's keys; `embed_tokens` and `lm_head` are the target's
    tensors unless the checkpoint ships its own (vLLM's load_dspark_model shares them)."""

    graph_methods = ("run_layers",)
    greedy_chain = None  # the DraftingModule protocol's: no argmax chain of its own, no cache-only fill
    fills_cache_only = False

    def __init__(self, config: DSparkConfig):
        super().__init__()
        # This TP rank's slice of the layers (vLLM shards them as Qwen3's; fc and the norms are replicated).
        config = self.config = dataclasses.replace(config, backbone=local_config(config.backbone, current().size))
        backbone, hidden = config.backbone, config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        self.layers = nn.ModuleDict({str(i): qwen3.DecoderLayer(backbone, i) for i in range(config.num_layers)})
        self.fc = nn.Linear(config.target_hidden_size * len(config.tap_entries), hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, backbone.rms_norm_eps)
        self.norm = RMSNorm(hidden, backbone.rms_norm_eps)
        self.lm_head = ParallelLMHead(hidden, config.vocab_size)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)
        if config.confidence_head:
            self.confidence_head = ConfidenceHead(hidden + config.markov_rank * config.confidence_with_markov)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
        return new_cache(self.config.backbone, list(range(self.config.num_layers)), batch, max_len, dtype, device)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:  # [B, T, taps, H_target] -> [B, T, H]
        return self.fc(taps.flatten(-2))

    def write_context(self, taps: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> None:
        """Project the fused taps at these positions ([B, T, taps, H_target], [B, T]) into every draft layer's
        keys and values, stored at those positions."""
        states = self.hidden_norm(self.fuse(taps))
        rotary = rotary_cos_sin(self.config.backbone, positions, states.dtype)
        cache.plan(positions)
        for layer_id, layer in self.layers.items():
            cache.update(int(layer_id), positions, *context_keys_values(layer.self_attn, states, rotary))

    def block_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """The block [B, N] (anchor, then mask tokens) at its positions, through the draft layers over the
        context and the whole block (non-causal): the final-normed states [B, N, H]."""
        x = self.embed_tokens(tokens)
        cache.plan(positions, whole_block=True)
        return self.run_layers(x, positions, rotary_cos_sin(self.config.backbone, positions, x.dtype), cache)

    def run_layers(self, x, positions, rotary, cache) -> torch.Tensor:
        """The draft layers and final norm: the part of a step `--compile` compiles."""
        for layer in self.layers.values():
            x = layer(x, positions, rotary, cache)
        return self.norm(x)

    def markov_logits(self, base: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """One position's logits: the base logits [B, V] plus the bias of the previous token [B], scaled as
        vLLM's logits processor scales both."""
        return self.config.logit_scale * (base + self.markov_head(previous))

    def draft(self, next_tokens, taps, positions, base, cache: KVCache, k: int):
        """The drafts' logits, one position at a time (see `draft_block`), after the context is stored.

        next_tokens [B, T]: the token after each new position (at `base`, the target's newest token: the
        anchor); taps [B, T, taps, H_target] at positions [B, T]; base [B]: the last accepted position.
        Context rows past `base` (rejected drafts) are overwritten by the block, which starts after it."""
        rows = torch.arange(taps.shape[0], device=taps.device)
        self.write_context(taps, positions, cache)
        return self.draft_block(next_tokens[rows, base], positions[rows, base], cache, k)

    def draft_block(self, anchor: torch.Tensor, last_context: torch.Tensor, cache: KVCache, k: int):
        """Yields each draft position's logits [B, V], left to right; send() back each picked token [B].
        anchor [B] sits at last_context + 1 [B], followed by k - 1 mask tokens."""
        block_positions = last_context[:, None] + 1 + torch.arange(k, device=anchor.device)  # [B, k]
        tokens = torch.full_like(block_positions, self.config.mask_token_id)
        tokens[:, 0] = anchor
        base_logits = self.lm_head(self.block_hidden(tokens, block_positions, cache))  # [B, k, V]
        previous = anchor
        for i in range(k):
            previous = yield self.markov_logits(base_logits[:, i], previous)

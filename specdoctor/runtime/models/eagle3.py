"""The EAGLE-3 drafter as vLLM 0.32 runs it (`llama_eagle3.py`, docs/eagle3.md): `fc` fuses the target's
aux hidden states (residual-stream entries of chosen layers), and a Llama layer whose q/k/v take the
embedding of the next token beside that state drafts one token a step, feeding its own output back. Its
head may cover a reduced draft vocabulary, mapped to target ids by `d2t` offsets.

Two checkpoint layouts: the speculators format (`speculators_model_type: eagle3`, the layer's config under
`transformer_layer_config`, keys `layers.0.*`) and the original EAGLE-3 release (`LlamaForCausalLMEagle3`,
a flat Llama config, keys `midlayer.*`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from specdoctor.errors import CheckpointError
from specdoctor.runtime.architectures import NO_MTP
from specdoctor.runtime.cache.kv_cache import KVCache, new_cache
from specdoctor.runtime.config import DraftLayersConfig, ModelConfig, RawConfig
from specdoctor.runtime.models import llama, qwen3
from specdoctor.runtime.models.layers import RMSNorm
from specdoctor.runtime.models.mtp import draft_chain
from specdoctor.runtime.models.parallel_layers import ParallelLMHead, VocabParallelEmbedding
from specdoctor.runtime.models.rope import rotary_cos_sin
from specdoctor.runtime.sharding import local_config
from specdoctor.runtime.tensor_parallel import current

SPECULATORS_TYPE = "eagle3"  # `speculators_model_type` of the speculators format
ORIGINAL_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Qwen3ForCausalLM")
DEFAULT_AUX_COUNT = 3  # vLLM's fc width (in aux states) when a config names neither a count nor eagle_config ids
# The layer families vLLM 0.32 runs EAGLE-3 heads of (llama_eagle3.py, qwen3_eagle3.py), by the layer config's
# model_type: its config reader, and vLLM's architecture name. One block serves both (Qwen3's q/k norm is a
# config setting); DeepSeek's (deepseek_eagle3.py) is not run.
LAYER_FAMILIES = {
    "llama": (llama.read_config, llama.ARCHITECTURE, "Eagle3LlamaForCausalLM"),
    "qwen3": (qwen3.read_config, qwen3.ARCHITECTURE, "Eagle3Qwen3ForCausalLM"),
}


@dataclass(frozen=True)
class Eagle3Config(DraftLayersConfig):
    layout: str  # "speculators" or "original"
    backbone: ModelConfig  # the draft layers, as a Llama or Qwen3 config (its vocabulary is the target's)
    draft_vocab_size: int
    target_hidden_size: int
    # Residual-stream entries of the target read, as the config lists them (entry i enters target layer i,
    # no + 1); None: the config names none and the engine uses its default (aux_entries).
    aux_layer_ids: tuple[int, ...] | None
    num_aux: int
    norm_before_fc: bool
    fc_norm: bool
    norm_before_residual: bool
    norm_output: bool
    logit_scale: float
    speculative_tokens: int | None  # speculators_config's proposal: vLLM's default num_speculative_tokens

    @property
    def architecture(self) -> str:
        return next(name for _, layers, name in LAYER_FAMILIES.values() if layers == self.backbone.architecture)

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    def validate(self, source: str) -> None:
        self.backbone.validate(source)
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise CheckpointError(
                f"{source}: draft_vocab_size {self.draft_vocab_size} must be in 1..{self.vocab_size} (the vocabulary)"
            )


def engine_default_entries(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's `get_eagle3_default_aux_hidden_state_layers`, what it captures when a drafter's config names no
    ids: the entries (2, L // 2, L - 3), in layer order."""
    return tuple(sorted({2, num_target_layers // 2, num_target_layers - 3}))


def aux_entries(config: Eagle3Config, num_target_layers: int) -> tuple[int, ...]:
    """The entries the engine captures, in the order fc reads them: the config's ids in layer order (vLLM
    captures them as the layers run), else the engine's default."""
    if config.aux_layer_ids is None:
        return engine_default_entries(num_target_layers)
    return tuple(sorted(set(config.aux_layer_ids)))


def is_eagle3_config(raw: dict) -> bool:
    architectures = raw.get("architectures") or []
    return raw.get("speculators_model_type") == SPECULATORS_TYPE or (
        bool(architectures) and architectures[0] in ORIGINAL_ARCHITECTURES
    )


def _ids(value, source: str) -> tuple[int, ...] | None:
    if not value:
        return None
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise CheckpointError(f"{source}: eagle_aux_hidden_state_layer_ids must be a list of layer ids, got {value!r}")
    return tuple(value)


def _number(fields: RawConfig, name: str, default, kind: type):
    """A numeric field (int or float), its default where absent or null; anything else is refused."""
    value = fields.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        raise CheckpointError(f"{fields.source}: field {name!r} must be {'an integer' if kind is int else 'a number'}")
    return kind(value)


def _object(fields: RawConfig, name: str) -> dict:
    value = fields.get(name) or {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{fields.source}: {name} must be an object")
    return value


def _aux_count(layer: RawConfig, model_type: str, raw: dict, eagle_ids) -> int:
    """How many aux states vLLM builds fc for: `num_aux_hidden_states`, else eagle_config's ids, else 3; its
    Qwen3 head reads `num_aux_layers` first and the config's own id list before eagle_config's (the speculators
    format's top-level ids are copied onto the layer config)."""
    listed = eagle_ids
    if model_type == "qwen3":
        count = _number(layer, "num_aux_layers", None, int)
        if count is not None:
            return count
        listed = _ids(layer.get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_aux_hidden_state_layer_ids"),
                      layer.source) or eagle_ids  # fmt: skip
    return _number(layer, "num_aux_hidden_states", len(listed) if listed else DEFAULT_AUX_COUNT, int)


def _proposal_tokens(fields: RawConfig) -> int | None:
    methods = _object(fields, "speculators_config").get("proposal_methods")
    first = methods[0] if isinstance(methods, list) and methods else {}
    tokens = first.get("speculative_tokens") if isinstance(first, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else None


def read_eagle3_config(raw, source: str = "config.json") -> Eagle3Config:
    """Either layout, read as vLLM 0.32 reads it. For the speculators format vLLM's config is the layer's
    (`transformer_layer_config`) with a few top-level fields copied in, a missing `norm_before_residual` true;
    in the original layout everything is top level, that flag false. vLLM sizes fc from `num_aux_hidden_states`,
    else the ids in `eagle_config`, else 3: never from the top-level id list, which says only what is captured."""
    top = RawConfig(raw, source)
    speculators = raw.get("speculators_model_type") == SPECULATORS_TYPE
    layer = RawConfig(raw.get("transformer_layer_config"), f"{source} transformer_layer_config") if speculators else top
    eagle = _object(layer, "eagle_config")
    model_type = layer.get("model_type", "llama")
    if model_type not in LAYER_FAMILIES:
        raise CheckpointError(
            f"{source}: the runtime runs {' and '.join(LAYER_FAMILIES)} EAGLE-3 layers, not model_type {model_type!r}"
        )
    if eagle.get("use_aux_hidden_state", True) is False:
        raise CheckpointError(f"{source}: the runtime does not run EAGLE-3 without aux hidden states")
    if layer.get("layer_types") and "sliding_attention" in layer.get("layer_types"):
        raise CheckpointError(f"{source}: the runtime does not run sliding-window EAGLE-3 layers")
    eagle_ids = _ids(eagle.get("eagle_aux_hidden_state_layer_ids"), source)
    read_layer_config, layer_architecture, _ = LAYER_FAMILIES[model_type]
    backbone = read_layer_config(layer, layer_architecture, NO_MTP)
    config = Eagle3Config(
        layout="speculators" if speculators else "original",
        backbone=backbone,
        draft_vocab_size=_number(top, "draft_vocab_size", backbone.vocab_size, int),
        target_hidden_size=_number(top, "target_hidden_size", backbone.hidden_size, int),
        aux_layer_ids=_ids(raw.get("eagle_aux_hidden_state_layer_ids"), source) or eagle_ids,
        num_aux=_aux_count(layer, model_type, raw, eagle_ids),
        norm_before_fc=bool(eagle.get("norm_before_fc", raw.get("norm_before_fc", False))),
        fc_norm=bool(raw.get("fc_norm", False)),
        norm_before_residual=bool(raw.get("norm_before_residual", speculators)),
        norm_output=bool(raw.get("norm_output", False)),
        logit_scale=_number(layer, "logit_scale", 1.0, float),
        speculative_tokens=_proposal_tokens(top) if speculators else None,
    )
    config.validate(source)
    return config


def pairing_problems(drafter: Eagle3Config, target: ModelConfig) -> list[str]:
    """Why this head cannot draft for this target (vLLM fails at load or drafts from the wrong states)."""
    problems = drafter.size_problems(target)
    entries = aux_entries(drafter, target.num_hidden_layers)
    outside = [i for i in entries if not 0 <= i <= target.num_hidden_layers]
    if outside:
        problems.append(f"aux layer ids {outside} lie outside the target's {target.num_hidden_layers} layers")
    if len(entries) != drafter.num_aux:
        problems.append(
            f"vLLM builds its fc for {drafter.num_aux} aux states (num_aux_hidden_states, else eagle_config's ids, "
            f"else 3) and captures {len(entries)}"
        )
    return problems


class Eagle3FirstLayer(llama.DecoderLayer):
    """A Llama layer whose q/k/v read [input_layernorm(embedding), hidden_norm(state)] (2H wide)."""

    def __init__(self, config: ModelConfig, layer_id: int, norm_before_residual: bool):
        super().__init__(config, layer_id)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def add_mixer(self, config: ModelConfig, layer_id: int) -> None:
        self.self_attn = llama.LlamaAttention(config, layer_id, input_size=2 * config.hidden_size)

    def forward(self, embeds, hidden, positions, rotary, cache: KVCache | None) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = residual + self.self_attn(x, positions, rotary, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Drafter(nn.Module):
    """Parameter names are the speculators format's keys (the original layout's `midlayer.` is `layers.0.`);
    `embed_tokens` and `lm_head` are the target's where the checkpoint ships none."""

    graph_methods = ("run_layers",)
    greedy_chain = None  # the DraftingModule protocol's: no argmax chain of its own, no cache-only fill
    fills_cache_only = False

    def __init__(self, config: Eagle3Config):
        super().__init__()
        # This TP rank's slice of the layers (vLLM shards them as Llama's; fc and the norms are replicated).
        config = self.config = dataclasses.replace(config, backbone=local_config(config.backbone, current().size))
        backbone, hidden = config.backbone, config.hidden_size
        eps, fc_input = backbone.rms_norm_eps, config.num_aux * config.target_hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        if config.norm_before_fc:
            self.input_norm = RMSNorm(fc_input, eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, eps) for _ in range(config.num_aux))
        self.fc = nn.Linear(fc_input, hidden, bias=False)
        first = Eagle3FirstLayer(backbone, 0, config.norm_before_residual)
        later = {str(i): llama.DecoderLayer(backbone, i) for i in range(1, config.num_layers)}
        self.layers = nn.ModuleDict({"0": first, **later})
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = ParallelLMHead(hidden, config.draft_vocab_size)
        if config.reduced_vocab:  # vLLM's draft_id_to_target_id: zeros until the checkpoint's d2t loads
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
        return new_cache(self.config.backbone, list(range(self.config.num_layers)), batch, max_len, dtype, device)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:  # [B, T, aux, H_target] -> [B, T, H]
        """vLLM's `combine_hidden_states`: once per proposal, on the target's states."""
        x = aux.flatten(-2)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        if self.config.fc_norm:
            chunks = x.chunk(self.config.num_aux, dim=-1)
            x = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(x)

    def draft(self, next_tokens, aux, positions, base, cache: KVCache, k: int):
        """The MTP chain (models/mtp.py: step 0 over every new position, then from `base`) on fc's state."""
        return draft_chain(self, next_tokens, self.combine(aux), positions, base, cache, k)

    def forward(self, tokens, hidden, positions, cache: KVCache | None = None):
        """(the state fed to the next step [B, T, H], logits over the target vocabulary [B, T, V])."""
        if cache is not None:
            cache.plan(positions)
        rotary = rotary_cos_sin(self.config.backbone, positions, hidden.dtype)
        return self.run_layers(self.embed_tokens(tokens), hidden, positions, rotary, cache)

    def run_layers(self, embeds, hidden, positions, rotary, cache: KVCache | None):
        """The layers and head: the part of a step `--compile` compiles."""
        layers = iter(self.layers.values())
        x = next(layers)(embeds, hidden, positions, rotary, cache)
        for layer in layers:
            x = layer(x, positions, rotary, cache)
        normed = self.norm(x)
        return (normed if self.config.norm_output else x), self.target_logits(self.lm_head(normed))

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM's `compute_logits`: the head's logits scaled, placed at their target ids (draft id + d2t), −inf
        elsewhere. A head over the whole vocabulary (the target's, put in place of a pruned one) maps nothing."""
        logits = self.config.logit_scale * logits
        if not self.config.reduced_vocab or logits.shape[-1] == self.config.vocab_size:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        targets = torch.arange(self.config.draft_vocab_size, device=logits.device) + self.d2t
        return full.index_copy(-1, targets, logits)

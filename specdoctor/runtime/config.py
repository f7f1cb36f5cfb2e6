"""The model configuration specdoctor needs, as each family maps it from a Hugging Face
`config.json` (runtime/models/)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specdoctor.errors import CheckpointError


@dataclass(frozen=True)
class MtpKeyLayout:
    """Where a checkpoint keeps its MTP layers; the default is DeepSeek-V3 / GLM's (docs/engine-semantics.md
    §MTP step). runtime/architectures.py names the layout of every architecture."""

    name: str = "deepseek"
    layer_prefix: str = "model.layers.{layer}."  # an MTP layer's tensors
    numbered_after_target: bool = True  # layer N+i after N target layers; else 0..n-1
    own_embedding: str | None = "embed_tokens.weight"  # the layer's own embedding copy, where shipped
    own_head: str | None = "shared_head.head.weight"  # and its own head
    layer_keys: tuple[str, ...] = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
    shared_keys: tuple[str, ...] = ()  # keys the drafter has once, outside its layers
    shared_prefix: str = ""  # where the shared keys live: a layer module's `fc.weight` is `{shared_prefix}fc.weight`
    count_fields: tuple[str, ...] = ("num_nextn_predict_layers", "num_mtp_layers")  # config: how many layers

    def prefix(self, layer_id: int) -> str:
        return self.layer_prefix.format(layer=layer_id)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling as DeepSeek-V3 configures it (rope_type "yarn"), with vLLM's defaults."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama-3's rope scaling (rope_type "llama3"): the frequencies whose wavelength is longer than the
    original context over `low_freq_factor` are divided by `factor`, those whose wavelength is shorter than it
    over `high_freq_factor` kept, a blend of the two between (vLLM: Llama3RotaryEmbedding; transformers:
    _compute_llama3_parameters)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


RopeScaling = YarnScaling | Llama3Scaling


class RawConfig:
    """A parsed config.json with typed reads; every problem is one readable CheckpointError."""

    def __init__(self, raw, source: str):
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        self.raw, self.source = raw, source

    def need(self, name: str) -> int:
        if name not in self.raw:
            raise CheckpointError(f"{self.source}: missing required field {name!r}")
        value = self.raw[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{self.source}: field {name!r} must be an integer, got {value!r}")
        return value

    def get(self, name: str, default=None):
        return self.raw.get(name, default)

    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.raw.get("eos_token_id")
        return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

    def mtp_layer_count(self, layout: MtpKeyLayout) -> int:
        """The number of MTP layers, from the first of the layout's count fields that config.json has."""
        value = next((self.raw[name] for name in layout.count_fields if self.raw.get(name) is not None), 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{self.source}: the number of MTP layers must be a whole number, got {value!r}")
        return value

    @property
    def architecture(self) -> str | None:
        architectures = self.raw.get("architectures") or []
        return architectures[0] if architectures else None


def common_fields(raw: RawConfig, architecture: str, layout: MtpKeyLayout, all_moe: bool = False) -> dict:
    """The ModelConfig fields every runnable family reads the same way: sizes, the GLM-4.5 / DeepSeek-V3
    MoE router, the MTP layers, tying and EOS. Attention, rotary and the dense-layer count are the
    family's own. `all_moe`: the family has no dense MLP (every layer is MoE, as in Qwen3.5-MoE), so its
    config need not carry `intermediate_size` (transformers' Qwen3_5MoeTextConfig has none); 0 then."""
    return dict(
        architecture=architecture,
        vocab_size=raw.need("vocab_size"),
        hidden_size=raw.need("hidden_size"),
        intermediate_size=int(raw.get("intermediate_size") or 0) if all_moe else raw.need("intermediate_size"),
        num_hidden_layers=raw.need("num_hidden_layers"),
        attention_bias=bool(raw.get("attention_bias", False)),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
        n_routed_experts=int(raw.get("n_routed_experts") or 0),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 1)),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        num_nextn_predict_layers=raw.mtp_layer_count(layout),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        eos_token_ids=raw.eos_token_ids(),
        mtp_keys=layout,
    )


def dense_attention_fields(raw: RawConfig) -> dict:
    """The ModelConfig fields of grouped-query attention rotated over the whole head (Qwen3, Llama)."""
    heads = raw.need("num_attention_heads")
    head_dim = int(raw.get("head_dim") or raw.need("hidden_size") // heads)
    return dict(
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rotary_dim=head_dim,
    )


class DraftLayersConfig:
    """What a drafter checkpoint's config (DSpark, EAGLE-3) answers from its draft layers' config, `backbone`."""

    backbone: ModelConfig
    target_hidden_size: int

    @property
    def vocab_size(self) -> int:
        return self.backbone.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.backbone.hidden_size

    @property
    def num_layers(self) -> int:
        return self.backbone.num_hidden_layers

    @property
    def mtp_layer_ids(self) -> list[int]:
        return []  # a drafter checkpoint has no MTP layers (the shared quantisation pre-flight reads this)

    def size_problems(self, target: ModelConfig) -> list[str]:
        """Its vocabulary and the hidden size its fc reads, against the target's (vLLM fails at load on each)."""
        problems = []
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} differs from the target's {target.vocab_size}")
        if self.target_hidden_size != target.hidden_size:
            problems.append(f"target_hidden_size {self.target_hidden_size} is not the target's {target.hidden_size}")
        return problems


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    attention_bias: bool
    use_qk_norm: bool
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    mtp_keys: MtpKeyLayout = field(default_factory=MtpKeyLayout)
    rope_scaling: RopeScaling | None = None
    # Positions from this one on rotate as their remainder by it (--fault drafter-rope-past=N, on a drafter only).
    rope_wrap: int | None = None
    # Where the checkpoint keeps the target's `model.*` tensors (layers, norm; the embedding has its own candidate
    # keys): `model.`, or `model.language_model.` in a multimodal release whose config nests the text model.
    decoder_prefix: str = "model."
    runtime_refusal: str | None = None  # why the runtime will not compute with a config it reads (registry)

    @property
    def kv_cache_shapes(self) -> tuple[tuple[int, int], ...]:
        """(heads, width) of each entry cached per position: keys and values."""
        return (self.num_key_value_heads, self.head_dim), (self.num_key_value_heads, self.head_dim)

    @property
    def mtp_layer_ids(self) -> list[int]:
        """Checkpoint layer indices of the MTP layers (after the target's layers, or from 0)."""
        first = self.num_hidden_layers if self.mtp_keys.numbered_after_target else 0
        return list(range(first, first + self.num_nextn_predict_layers))

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.n_routed_experts > 0 and layer_id >= self.first_k_dense_replace

    def is_linear_attention(self, layer_id: int) -> bool:
        """A layer with a recurrent state instead of keys and values (hybrid families)."""
        return False

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self, source: str) -> None:
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        for name in positive:
            if getattr(self, name) <= 0:
                raise CheckpointError(f"{source}: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"{source}: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise CheckpointError(f"{source}: rotary dimension {self.rotary_dim} does not fit head_dim {self.head_dim}")
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
                raise CheckpointError(
                    f"{source}: {self.n_routed_experts} experts cannot form {self.n_group} groups "
                    f"with topk_group {self.topk_group}"
                )
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise CheckpointError(f"{source}: num_experts_per_tok must be in 1..{self.n_routed_experts}")
        if self.num_nextn_predict_layers < 0:
            raise CheckpointError(f"{source}: num_nextn_predict_layers must not be negative")

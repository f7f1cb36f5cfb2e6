"""The model configuration specdoctor needs, read from a Hugging Face `config.json`."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specdoctor.errors import CheckpointError

SUPPORTED_ARCHITECTURES = ("Glm4MoeForCausalLM",)


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

    @property
    def mtp_layer_ids(self) -> list[int]:
        """Checkpoint layer indices of the MTP layers (they follow the target's layers)."""
        first = self.num_hidden_layers
        return list(range(first, first + self.num_nextn_predict_layers))

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.n_routed_experts > 0 and layer_id >= self.first_k_dense_replace

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        """Validate `raw` (a parsed config.json); every problem is one readable CheckpointError."""
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        architectures = raw.get("architectures") or []
        architecture = architectures[0] if architectures else "Glm4MoeForCausalLM"
        if architecture not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise CheckpointError(f"{source}: architecture {architecture!r} is not supported (supported: {supported})")

        def need(name: str, kind=int):
            if name not in raw:
                raise CheckpointError(f"{source}: missing required field {name!r}")
            value = raw[name]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise CheckpointError(f"{source}: field {name!r} must be an integer, got {value!r}")
            return kind(value)

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        head_dim = int(raw.get("head_dim") or hidden // heads)
        # Older GLM configs keep rope settings at the top level; newer ones under rope_parameters.
        rope = raw.get("rope_parameters") or {}
        partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5)))
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        config = cls(
            architecture=architecture,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rope_theta=rope_theta,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            attention_bias=bool(raw.get("attention_bias", False)),
            use_qk_norm=bool(raw.get("use_qk_norm", False)),
            moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
            n_routed_experts=int(raw.get("n_routed_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok", 1)),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            first_k_dense_replace=int(raw.get("first_k_dense_replace", 0)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0)) or 0),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            eos_token_ids=eos_ids,
        )
        config._validate(source)
        return config

    def _validate(self, source: str) -> None:
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

"""The blocks families assemble: a decoder layer (token mixer, then a dense MLP or MoE), and the MTP
layer of the DeepSeek-V3 / GLM layouts with its shared head."""

from __future__ import annotations

import torch
from torch import nn

from specdoctor import kernels
from specdoctor.runtime.cache.kv_cache import KVCache
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.models.layers import MLP, RMSNorm
from specdoctor.runtime.models.moe import MoE
from specdoctor.runtime.models.parallel_layers import ParallelLMHead


class SharedHead(nn.Module):
    """An MTP layer's output head: its own norm and vocabulary projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.hidden_size, config.vocab_size)


class DecoderBlock(nn.Module):
    """A token mixer then a dense MLP or MoE (`config.is_moe_layer`), each pre-normed with a residual.
    A family's block sets `attention` (GLM-4.5: grouped-query attention; DeepSeek-V3: MLA) and, where its
    own differ, `moe_type` and `norm_type` (not `norm`: a module may carry that name); a hybrid family
    overrides `add_mixer` to pick the mixer per layer."""

    attention: type[nn.Module]
    moe_type: type[nn.Module] = MoE
    norm_type: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.add_mixer(config, layer_id)
        if config.is_moe_layer(layer_id):
            self.mlp = self.moe_type(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = self.norm_type(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_type(config.hidden_size, config.rms_norm_eps)

    def add_mixer(self, config: ModelConfig, layer_id: int) -> None:
        self.self_attn = self.attention(config, layer_id)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        positions: torch.Tensor,  # [B, T]
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None,
    ) -> torch.Tensor:  # [B, T, H]
        x = x + self.mixer(self.input_layernorm(x), positions, rotary, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekMtpLayer(nn.Module):
    """What makes a family's decoder block a DeepSeek-style MTP layer (docs/engine-semantics.md §MTP step):
    the norms and projection of its input, and its own output head. A family's MTP layer is
    `class MtpLayer(DeepseekMtpLayer, DecoderLayer)`."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__(config, layer_id)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def mtp_input(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The block's input [B, T, H] from the next tokens' embeddings and the previous hidden states."""
        eps = self.enorm.eps
        return self.eh_proj(
            kernels.mtp_input(embeds, prev_hidden, positions, self.enorm.weight, self.hnorm.weight, eps)
        )

    def mtp_output(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hidden state the next chain step is fed: the block's output, the logits)."""
        return hidden, self.shared_head.head(self.shared_head.norm(hidden))

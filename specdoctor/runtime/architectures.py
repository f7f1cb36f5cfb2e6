"""What specdoctor knows about each architecture vLLM 0.32 registers an MTP drafter for (and dense Qwen3 and
Llama, the targets of separate drafters), whether or not its runtime can run it: where the checkpoint keeps the
MTP layers, and the placement facts of vLLM's model (docs/engine-semantics.md §Ownership). The
header-only commands (inspect, check's pre-flight) work for every architecture here;
runtime/models/registry.py lists the ones the runtime runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdoctor.runtime.config import MtpKeyLayout

DEEPSEEK_MTP = MtpKeyLayout()
# Qwen3-Next / Qwen3.5 (vLLM: qwen3_next_mtp.py, qwen3_5_mtp.py): one `mtp.` module with a projection and
# norms shared by its layers; the embedding and head are the target's.
QWEN_MTP = MtpKeyLayout(
    name="qwen3-next",
    layer_prefix="mtp.layers.{layer}.",
    numbered_after_target=False,
    own_embedding=None,
    own_head=None,
    layer_keys=("input_layernorm.weight", "post_attention_layernorm.weight"),
    shared_keys=(
        "mtp.fc.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
    ),
    shared_prefix="mtp.",
    count_fields=("mtp_num_hidden_layers", "num_nextn_predict_layers"),
)
# A dense target without MTP layers (its drafters, DSpark / DFlash / EAGLE-3, are separate checkpoints).
NO_MTP = MtpKeyLayout(name="none", count_fields=())
# MiMo (vLLM: mimo_mtp.py).
MIMO_MTP = MtpKeyLayout(
    name="mimo",
    layer_prefix="model.mtp_layers.{layer}.",
    numbered_after_target=False,
    own_embedding=None,
    own_head=None,
    layer_keys=("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight"),
    count_fields=("num_nextn_predict_layers",),
)
# MiMo-V2-Flash / -Pro (vLLM: mimo_v2_mtp.py).
MIMO_V2_MTP = MtpKeyLayout(
    name="mimo-v2",
    layer_prefix="model.mtp.layers.{layer}.",
    numbered_after_target=False,
    own_embedding=None,
    own_head=None,
    layer_keys=("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"),
    count_fields=("num_nextn_predict_layers", "mtp_num_hidden_layers"),
)


@dataclass(frozen=True)
class Architecture:
    mtp: MtpKeyLayout
    vllm_drafter: str  # vLLM 0.32's module of its MTP drafter
    # vLLM's model builds the embedding on the last PP rank too when tie_word_embeddings is set.
    tied_embedding_on_last_rank: bool = False
    # vLLM's model refuses to build a PP rank whose layers hold no MoE layer ("No ... layer found").
    needs_moe_layer_per_rank: bool = False
    # vLLM builds the MoE with DeepSeek-V2's, which reads the router from config.json: softmax scores unless
    # `scoring_func` says otherwise, the correction bias only with `topk_method` noaux_tc.
    vllm_router_from_config: bool = False
    # vLLM's drafter forward takes its inputs only `if get_pp_group().is_first_rank`; it runs on the last rank,
    # so at PP > 1 it takes the intermediate-tensors branch and asserts on the first draft step.
    drafter_needs_first_rank: bool = False


ARCHITECTURES = {
    "Glm4MoeForCausalLM": Architecture(DEEPSEEK_MTP, "glm4_moe_mtp", needs_moe_layer_per_rank=True),
    "Glm4MoeLiteForCausalLM": Architecture(DEEPSEEK_MTP, "glm4_moe_lite_mtp"),
    "GlmMoeDsaForCausalLM": Architecture(DEEPSEEK_MTP, "deepseek_mtp (deepseek_v32)", vllm_router_from_config=True),
    "DeepseekV3ForCausalLM": Architecture(DEEPSEEK_MTP, "deepseek_mtp", vllm_router_from_config=True),
    "DeepseekV32ForCausalLM": Architecture(DEEPSEEK_MTP, "deepseek_mtp (deepseek_v32)", vllm_router_from_config=True),
    "Qwen3NextForCausalLM": Architecture(
        QWEN_MTP, "qwen3_next_mtp", needs_moe_layer_per_rank=True, drafter_needs_first_rank=True
    ),
    "Qwen3_5ForCausalLM": Architecture(QWEN_MTP, "qwen3_5_mtp"),
    "Qwen3_5MoeForCausalLM": Architecture(QWEN_MTP, "qwen3_5_mtp", needs_moe_layer_per_rank=True),
    "Qwen3_5ForConditionalGeneration": Architecture(QWEN_MTP, "qwen3_5_mtp"),
    "Qwen3_5MoeForConditionalGeneration": Architecture(QWEN_MTP, "qwen3_5_mtp", needs_moe_layer_per_rank=True),
    "MiMoForCausalLM": Architecture(MIMO_MTP, "mimo_mtp"),
    "Qwen3ForCausalLM": Architecture(
        NO_MTP, "none (its drafters are separate checkpoints: qwen3_dspark, qwen3_dflash)"
    ),
    "LlamaForCausalLM": Architecture(
        NO_MTP, "none (its drafters are separate checkpoints: llama_eagle3, draft models)"
    ),
    "MiMoV2FlashForCausalLM": Architecture(MIMO_V2_MTP, "mimo_v2_mtp", tied_embedding_on_last_rank=True),
    "MiMoV2ForCausalLM": Architecture(MIMO_V2_MTP, "mimo_v2_mtp", tied_embedding_on_last_rank=True),
}

"""Goldens from vLLM's own code, printed as JSON. Runs inside the peer environment (vLLM installed,
specdoctor not): `python tests/peer/vllm_goldens.py DEMO_DIR TIED_DEMO_DIR`.

- get_pp_indices over a grid of (layers, PP size), and explicit VLLM_PP_LAYER_PARTITION strings;
- VocabParallelEmbedding's padding and each TP rank's row range, TP 1-8;
- what Glm4MoeForCausalLM builds on each PP rank (embedding, head, layers), tied and untied, from the
  model class itself with the PP group's rank faked and every tensor on the meta device; and whether
  it builds that rank at all (it raises "No Glm4MoE layer found" on a rank without an MoE layer);
- DSpark: the aux hidden-state layers (get_eagle3_aux_layers_from_config, then the sorted set the target
  keeps) and the mask token (get_parallel_drafting_token_id) for several draft configs, and how many aux
  states reach each PP rank from upstream (EagleModelMixin's slot base, with the PP group faked);
- penalties under speculation: the logits vLLM's rejection sampler verifies each draft position against, and the
  bonus position's, with presence, frequency and repetition penalties (its own apply_all_penalties, on the outputs
  its samplers build from the committed output and the drafts);
- EAGLE-3: the default aux layers (SupportsEagle3), the layers and flags vLLM reads from head configs of both
  layouts (the speculators format converted by its SpeculatorsConfig), and compute_logits' d2t placement.
"""

from __future__ import annotations

import json
import os
import sys

import torch

PP_GRID = [(layers, pp) for layers in (1, 2, 3, 4, 5, 7, 8, 12, 45, 61, 92) for pp in range(1, 9)]
PARTITIONS = [(45, 4, "14,12,12,7"), (4, 4, "0,2,2,0"), (45, 4, "45,0,0,0"), (4, 2, ""), (4, 2, "1,2"), (4, 2, "a,b")]
VOCABS = (300, 320, 2048, 2112, 32000, 50257, 129280, 151552, 151936, 202752)


def pp_indices() -> dict:
    from vllm.distributed.utils import get_pp_indices

    os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
    grid = {f"{n},{pp}": [list(get_pp_indices(n, rank, pp)) for rank in range(pp)] for n, pp in PP_GRID}
    explicit = {}
    for n, pp, spec in PARTITIONS:
        os.environ["VLLM_PP_LAYER_PARTITION"] = spec
        try:
            explicit[f"{n},{pp},{spec}"] = [list(get_pp_indices(n, rank, pp)) for rank in range(pp)]
        except ValueError:
            explicit[f"{n},{pp},{spec}"] = "error"
    os.environ.pop("VLLM_PP_LAYER_PARTITION")
    return {"grid": grid, "explicit": explicit}


def vocab_shards() -> dict:
    from vllm.model_executor.layers.vocab_parallel_embedding import pad_vocab_size, vocab_range_from_global_vocab_size

    out = {}
    for vocab in VOCABS:
        padded = pad_vocab_size(vocab)
        for tp in range(1, 9):
            try:
                out[f"{vocab},{tp}"] = [list(vocab_range_from_global_vocab_size(padded, r, tp)) for r in range(tp)]
            except AssertionError:  # vLLM's divide(): the padded vocabulary does not split evenly
                out[f"{vocab},{tp}"] = "error"
    return out


class FakePPGroup:
    def __init__(self, rank: int, size: int):
        self.rank_in_group, self.world_size = rank, size

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1


def placements(models: dict[str, str]) -> dict:
    import vllm.distributed.parallel_state as parallel_state
    import vllm.model_executor.models.glm4_moe as glm4_moe
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    refused = []
    original = glm4_moe.Glm4MixtureOfExperts.extract_moe_parameters

    def record_refusal(self, example_moe):  # vLLM raises here; note it and let the rest of __init__ run
        if example_moe is None:
            refused.append(True)
            return
        original(self, example_moe)

    glm4_moe.Glm4MixtureOfExperts.extract_moe_parameters = record_refusal
    configs = {name: ModelConfig(model=path, dtype="float32") for name, path in models.items()}
    with set_current_vllm_config(VllmConfig(model_config=next(iter(configs.values())))):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
    out = {}
    for name, model_config in configs.items():
        for pp in range(1, 5):
            ranks = []
            for rank in range(pp):
                group = FakePPGroup(rank, pp)
                glm4_moe.get_pp_group = parallel_state.get_pp_group = lambda group=group: group
                vllm_config = VllmConfig(model_config=model_config)  # attention layers register names per config
                refused.clear()
                with set_current_vllm_config(vllm_config), torch.device("meta"):
                    model = glm4_moe.Glm4MoeForCausalLM(vllm_config=vllm_config)
                ranks.append(
                    {
                        "layers": [model.model.start_layer, model.model.end_layer],
                        "has_embedding": type(model.model.embed_tokens).__name__ != "PPMissingLayer",
                        "has_head": type(model.lm_head).__name__ != "PPMissingLayer",
                        "refuses_without_moe_layer": bool(refused),
                    }
                )
            out[f"{name},{pp}"] = ranks
    return out


# Draft configs as DSpark and DFlash checkpoints spell them (fields on top of a Qwen3 config).
DSPARK_CONFIGS = [
    {"target_layer_ids": [1, 3, 5], "mask_token_id": 7},
    {"target_layer_ids": [5, 1, 3, 3], "mask_token_id": 7},
    {"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 9}, "mask_token_id": 7},
    {"dspark_target_layer_ids": [2], "dspark_noise_token_id": 5},
    {"eagle_aux_hidden_state_layer_ids": [2, 4], "target_layer_ids": [1], "mask_token_id": 3},
]
# The speculators format (speculators writes sample_from_anchor; older files lack it), which vLLM converts first.
SPECULATORS_DSPARK = {"speculators_model_type": "dspark", "architectures": ["DSparkDraftModel"],
                      "transformer_layer_config": {"model_type": "qwen3"}, "aux_hidden_state_layer_ids": [2, 4, 5],
                      "mask_token_id": 7, "block_size": 4, "markov_rank": 16}  # fmt: skip
SPECULATORS_CONFIGS = [{**SPECULATORS_DSPARK, "sample_from_anchor": True}, SPECULATORS_DSPARK]
# (target layers, PP partition, aux entries): how many aux states each rank receives from upstream.
AUX_LAYOUTS = [(6, "2,2,2", (2, 4, 6)), (6, "1,2,2,1", (2, 4, 6)), (6, "3,0,3", (2, 4, 6)), (8, "4,4", (1, 4, 5, 8))]


def dspark() -> dict:
    from types import SimpleNamespace

    import vllm.distributed.parallel_state as parallel_state
    from vllm.model_executor.models.interfaces import EagleModelMixin
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    parallel_state.model_parallel_is_initialized = lambda: True
    parallel_state.get_pp_group = lambda: FakePPGroup(0, 1)  # one rank: the config alone decides the aux layers
    configs = []
    for fields in DSPARK_CONFIGS + SPECULATORS_CONFIGS:
        read = fields
        if "speculators_model_type" in fields:  # vLLM's model config is the converted one
            read = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(fields)))
        hf_config = SimpleNamespace(**{"model_type": "qwen3", **read})
        aux = get_eagle3_aux_layers_from_config(
            SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config))
        )
        holder = EagleModelMixin()
        holder._set_aux_hidden_state_layers(aux)  # the target keeps them sorted and de-duplicated
        configs.append(
            {
                "fields": fields,
                "aux": list(holder.aux_hidden_state_layers),
                "mask": get_parallel_drafting_token_id(hf_config),
                "sample_from_anchor": read.get("sample_from_anchor", True),
            }
        )
    slots = {}
    for layers, spec, aux in AUX_LAYOUTS:
        parts = [int(part) for part in spec.split(",")]
        received = []
        for rank in range(len(parts)):
            parallel_state.get_pp_group = lambda rank=rank, size=len(parts): FakePPGroup(rank, size)
            holder = EagleModelMixin()
            holder.start_layer = sum(parts[:rank])
            holder._set_aux_hidden_state_layers(aux)
            received.append(holder._aux_slot_base_cached)
        slots[f"{layers},{spec},{','.join(map(str, aux))}"] = received
    return {"configs": configs, "received": slots}


# EAGLE-3 head configs as speculators writes them and as the original release does (on a Llama layer config).
LAYER = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 320}
SPECULATORS_EAGLE3 = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                      "transformer_layer_config": LAYER, "draft_vocab_size": 200}  # fmt: skip
EAGLE3_CONFIGS = [
    {**SPECULATORS_EAGLE3, "eagle_aux_hidden_state_layer_ids": [1, 3, 6]},
    {**SPECULATORS_EAGLE3, "eagle_aux_hidden_state_layer_ids": [6, 1, 3], "norm_before_fc": True},
    {**SPECULATORS_EAGLE3, "transformer_layer_config": {**LAYER, "model_type": "qwen3"}, "norm_before_residual": False},
    SPECULATORS_EAGLE3,
    {**LAYER, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 200},
]
TARGET_DEPTHS = (4, 6, 8, 32, 61)


def eagle3() -> dict:
    from types import SimpleNamespace

    import vllm.distributed.parallel_state as parallel_state
    from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    parallel_state.get_pp_group = lambda: FakePPGroup(0, 1)

    def captured(ids) -> list[int]:  # what the target keeps of the ids it is given (sorted, de-duplicated)
        holder = EagleModelMixin()
        holder._set_aux_hidden_state_layers(ids)
        return list(holder.aux_hidden_state_layers)

    default = SupportsEagle3.get_eagle3_default_aux_hidden_state_layers
    defaults = {layers: captured(default(SimpleNamespace(layers=[0] * layers))) for layers in TARGET_DEPTHS}
    configs = []
    for fields in EAGLE3_CONFIGS:
        read = fields
        if "speculators_model_type" in fields:
            read = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(fields)))
        spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(**read)))
        aux = get_eagle3_aux_layers_from_config(spec)
        flags = {name: read.get(name) for name in ("norm_before_fc", "norm_before_residual", "architectures")}
        configs.append({"fields": fields, "aux": captured(aux) if aux else None, **flags})
    d2t = torch.tensor([0, 3, 3, 5, 9])  # draft id i -> target id i + d2t[i]
    head = SimpleNamespace(
        logits_processor=lambda _head, hidden: hidden,  # the head's logits stand in for the hidden states
        draft_id_to_target_id=d2t,
        config=SimpleNamespace(vocab_size=16, draft_vocab_size=len(d2t)),
        lm_head=None,
    )
    logits = torch.arange(10.0).view(2, 5)
    placed = Eagle3LlamaForCausalLM.compute_logits(head, logits)
    return {"defaults": defaults, "configs": configs, "d2t": d2t.tolist(), "logits": logits.tolist(),
            "placed": placed.tolist()}  # fmt: skip


# (q heads, KV heads, head size, hidden) for QKVParallelLinear: KV heads split, and replicated when fewer than ranks.
QKV_SHAPES = [(8, 2, 4, 16), (6, 6, 4, 16), (4, 1, 4, 16)]


def held_rows(tensor: torch.Tensor, width: int) -> list[int]:
    """The rows of an arange-filled [rows, width] tensor (each value names its row, the last column never zero) that a
    loaded slice holds; a row of zeros (padding) is none of them."""
    return sorted({int(row[-1]) // width for row in tensor if row.abs().sum() > 0})


def tp_slices() -> dict:
    """What vLLM's own weight loaders put on each TP rank, for arange-filled checkpoint tensors: QKVParallelLinear's
    q/k/v rows, MergedColumnParallelLinear's gate rows, RowParallelLinear's columns and VocabParallelEmbedding's
    rows and zero padding rows, with the TP group's rank and size faked (every vLLM TP helper reads them)."""
    import vllm.distributed.parallel_state as parallel_state
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.vocab_parallel_embedding as vocab
    from vllm.config import VllmConfig, set_current_vllm_config

    def arange(rows: int, width: int) -> torch.Tensor:
        return torch.arange(rows * width, dtype=torch.float32).view(rows, width) + 1  # + 1: no row sums to zero

    out = {}
    with set_current_vllm_config(VllmConfig()):
        for tp in (2, 4):
            for rank in range(tp):
                group = FakePPGroup(rank, tp)  # a group's rank and size
                parallel_state.get_tp_group = lambda group=group: group
                for heads, kv_heads, size, hidden in QKV_SHAPES:
                    if heads % tp or (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
                        continue
                    layer = linear.QKVParallelLinear(hidden, size, heads, kv_heads, bias=False)
                    spans = {
                        "q": layer.num_heads * size,
                        "k": layer.num_kv_heads * size,
                        "v": layer.num_kv_heads * size,
                    }
                    held, start = {}, 0
                    for shard, total in (("q", heads * size), ("k", kv_heads * size), ("v", kv_heads * size)):
                        layer.weight_loader(layer.weight, arange(total, hidden), shard)
                        held[shard] = held_rows(layer.weight[start : start + spans[shard]] - 1, hidden)
                        start += spans[shard]
                    out[f"qkv,{heads},{kv_heads},{size},{hidden},{tp},{rank}"] = held
                gate_up = linear.MergedColumnParallelLinear(16, [24, 24], bias=False)
                gate_up.weight_loader(gate_up.weight, arange(24, 16), 0)
                out[f"gate,24,16,{tp},{rank}"] = held_rows(gate_up.weight[: 24 // tp] - 1, 16)
                row = linear.RowParallelLinear(32, 8, bias=False)  # [8, 32]: the transpose names each column
                row.weight_loader(row.weight, arange(32, 8).T.contiguous())
                out[f"row,8,32,{tp},{rank}"] = held_rows(row.weight.T - 1, 8)
                embedding = vocab.VocabParallelEmbedding(300, 8)
                embedding.weight.data.zero_()
                embedding.weight_loader(embedding.weight, arange(300, 8))
                loaded = embedding.weight.data.clone()
                padding = int((loaded.abs().sum(-1) == 0).sum())
                loaded[loaded.abs().sum(-1) > 0] -= 1  # the loaded rows' values, padding rows left zero
                out[f"vocab,300,8,{tp},{rank}"] = {"rows": held_rows(loaded, 8), "padding": padding}
    return out


PENALTY_VOCAB, PENALTY_PROMPT, PENALTY_OUTPUT, PENALTY_DRAFTS = 40, [3, 7, 7, 11], [5, 9, 5, 2, 30], [9, 5, 13]
PENALTY_CASES = {"presence": (1.5, 0.0, 1.0), "frequency": (0.0, 1.0, 1.0), "repetition": (0.0, 0.0, 1.5)}
PENALTY_CASES["all three"] = (0.5, -0.7, 1.3)


def penalties() -> dict:
    """Logits [k + 1, V] (seeded, both signs) through vLLM's penalties, each row for its own output: the draft
    positions' from RejectionSampler (the committed output, then each earlier draft), the bonus position's from
    Sampler (every draft)."""
    from vllm.v1.sample.ops.penalties import apply_all_penalties
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    logits = torch.randn(len(PENALTY_DRAFTS) + 1, PENALTY_VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    outputs = RejectionSampler._combine_outputs_with_spec_tokens([PENALTY_OUTPUT], [PENALTY_DRAFTS])
    outputs += Sampler._combine_outputs_with_spec_tokens([PENALTY_OUTPUT], [PENALTY_DRAFTS])
    rows = len(outputs)
    prompt = torch.tensor([PENALTY_PROMPT] * rows)
    cases = {}
    for name, (presence, frequency, repetition) in PENALTY_CASES.items():
        wanted = [torch.full((rows,), value) for value in (presence, frequency, repetition)]
        cases[name] = apply_all_penalties(logits.clone(), prompt, *wanted, outputs).tolist()
    return {"logits": logits.tolist(), "outputs": outputs, "cases": cases}


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[3] if len(sys.argv) > 3 else "29531")
    goldens = {
        "pp": pp_indices(),
        "vocab": vocab_shards(),
        "placement": placements({"untied": sys.argv[1], "tied": sys.argv[2]}),
        "dspark": dspark(),
        "eagle3": eagle3(),
        "penalties": penalties(),
        "tp": tp_slices(),
    }
    print("GOLDENS " + json.dumps(goldens))

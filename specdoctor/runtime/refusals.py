"""Why the runtime will not run a pair: what vLLM 0.32 refuses at a tensor-parallel size (its own rules quoted),
what specdoctor does not shard yet (refused, never approximated) and ranks this machine has no device for."""

from __future__ import annotations

import torch

from specdoctor.errors import CheckpointError, SpecdoctorError
from specdoctor.runtime.checkpoint.loader import build_stage
from specdoctor.runtime.partition import placements
from specdoctor.runtime.sharding import SPLIT_FIELDS, vocab_shard_range
from specdoctor.runtime.tensor_parallel import TensorParallel, acting_as


def refusal(config, size: int) -> str | None:
    """Why vLLM 0.32 refuses this model at TP `size` (its own rule quoted), or None."""
    if size == 1:
        return None
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        return (
            f"Total number of attention heads ({heads}) must be divisible by tensor parallel size ({size}) "
            "(vLLM's rule)"
        )
    if kv_heads % size if kv_heads >= size else size % kv_heads:
        return f"{kv_heads} KV heads neither divide over nor replicate evenly across {size} ranks (vLLM's rule)"
    for name in SPLIT_FIELDS[1:]:
        value = getattr(config, name, 0)
        if value % size:
            return f"{name} {value} is not divisible by {size} (vLLM's rule for its column-parallel projections)"
    try:
        vocab_shard_range(config.vocab_size, size, 0)
    except SpecdoctorError as err:
        return str(err)
    return None


def runtime_refusal(checkpoint, drafter, options, local_ranks: int | None = None) -> str | None:
    """Why the runtime will not run this pair: at `options.tp` > 1 what vLLM or specdoctor will not shard, then
    more ranks on this machine than CUDA devices (NCCL refuses two ranks on one GPU). `local_ranks`: the ranks on
    this machine (torchrun's LOCAL_WORLD_SIZE; None: all of them, as specdoctor's own launcher starts them)."""
    return sharding_refusal(checkpoint, drafter, options) or device_refusal(options, local_ranks)


def device_refusal(options, local_ranks: int | None = None) -> str | None:
    if options.device.value != "cuda":
        return None
    local_ranks, devices = local_ranks or options.tp * options.pp, torch.cuda.device_count()
    if devices == 0:
        return "--device cuda: this machine has no CUDA device"
    if local_ranks > devices:
        return (
            f"--tp {options.tp} x --pp {options.pp} on --device cuda: {local_ranks} ranks on this machine need as "
            f"many CUDA devices (NCCL runs one rank per GPU), it has {devices}"
        )
    return None


def sharding_refusal(checkpoint, drafter, options) -> str | None:
    """Why the runtime will not run this pair at `options.tp` > 1: vLLM's own rules (`refusal`), then what
    specdoctor does not shard yet (refused, never approximated)."""
    size, config = options.tp, checkpoint.config
    if size == 1:
        return None
    reason = refusal(config, size)
    if reason is None and drafter is not None and drafter.checkpoint is not None:  # a drafter checkpoint of its own
        reason = drafter_refusal(drafter, size)
    if reason is None and any("g_idx" in weight.parts for weight in checkpoint.quantized.values()):
        reason = "the runtime does not shard activation-ordered groups (weight_g_idx) yet"
    if reason is None and checkpoint.quantized and options.quantized_weights.value == "packed":
        reason = packed_slice_refusal(checkpoint, options)
    return f"--tensor-parallel-size {size}: {reason}" if reason else None


def drafter_refusal(drafter, size: int) -> str | None:
    """vLLM's rules for a drafter checkpoint's layers (an EAGLE-3 or DSpark backbone, a draft model) and for its
    draft vocabulary, which its head splits as the target's."""
    reason = refusal(drafter.layers_config, size)
    draft_vocab = drafter.draft_vocab_size
    if reason is None and draft_vocab:
        try:
            vocab_shard_range(draft_vocab, size, 0)
        except SpecdoctorError as err:
            reason = f"its draft vocabulary: {err}"
    return f"the drafter: {reason}" if reason else None


def packed_slice_refusal(checkpoint, options) -> str | None:
    """Whether every stage's packed weights slice into whole words, groups and blocks at TP `options.tp` (vLLM's
    kernels refuse a slice that does not: "Weight input_size_per_partition = N is not divisible by ..."): each
    stage built on the meta device, as a rank builds it, in TP rank 0's shapes."""
    try:
        with acting_as(TensorParallel(0, options.tp)), torch.device("meta"):
            for stage in placements(checkpoint.config, options.pp, options.pp_partition):
                build_stage(checkpoint, stage.layers, stage.has_embedding, stage.has_head, packed=True)
    except CheckpointError as err:
        return f"a rank's slice of a packed weight: {str(err).removeprefix(f'{checkpoint.path}: ')}"
    return None

"""One rank's shard: its device, joining the process group, and building its stage (and the drafter, on the last
stage) from the tensors and rows it owns."""

from __future__ import annotations

import os

import torch

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime import tensor_parallel
from specdoctor.runtime.background_compile import BackgroundCompiler
from specdoctor.runtime.cache.prefix import PrefixStore
from specdoctor.runtime.checkpoint.loader import load_target_stage
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.checkpoint.tokenizer import model_eos_token_ids, tokenizer_file
from specdoctor.runtime.comm import PipelineComm
from specdoctor.runtime.compile import compile_layers
from specdoctor.runtime.decode.pipeline import RankModel
from specdoctor.runtime.drafter.kind import DrafterKind
from specdoctor.runtime.drafter.policy import Provenance
from specdoctor.runtime.drafter.registry import open_drafter
from specdoctor.runtime.drafter.taps import tap_route
from specdoctor.runtime.faults import Faults
from specdoctor.runtime.models.moe import MoE
from specdoctor.runtime.models.rope import wrap_rope_past
from specdoctor.runtime.moe_paths import choose_moe_paths
from specdoctor.runtime.options import Device, QuantizedWeights, RuntimeOptions, StateRollback
from specdoctor.runtime.partition import placements


def rank_device(options: RuntimeOptions, rank: int) -> torch.device:
    if options.device == Device.CPU:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SpecdoctorError("--device cuda was requested but no CUDA device is available")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def load_rank(options: RuntimeOptions, rank: int) -> tuple[RankModel, dict]:
    """Join the process group (which sets this rank's tensor-parallel group), then build this rank's shard of
    its stage (and of the drafter on the last stage)."""
    comm = PipelineComm(rank, options.pp, options.tp, rank_device(options, rank), options.timeout)
    torch.manual_seed(comm.shared_seed())  # unseeded sampling draws alike on the TP ranks of the last stage
    if comm.device.type == "cuda":
        # SDPA's cuDNN backend (its pick for bf16 on Hopper) plans each new key length, and decoding grows it every
        # step: 15 ms of host time per attention call on an H200 (profiled). Flash and memory-efficient attention take
        # any length.
        torch.backends.cuda.enable_cudnn_sdp(False)
    with comm.working("loading its shard"):
        model, info = build_rank(options, rank)
    model.comm = comm
    # A peer still loading (a larger stage, a slower disk) is waited for here, not timed out at the first command.
    comm.wait_for_peers("to finish loading")
    return model, info


def build_rank(
    options: RuntimeOptions, rank: int, checkpoint: Checkpoint | None = None, kind: DrafterKind | None = None
) -> tuple[RankModel, dict]:
    """Global rank `rank`'s shard of its stage (and of the drafter on the last stage), reading only the tensors and
    rows it owns; not yet connected to its peers (`comm` is None), so one rank of a pipeline can be built alone
    (the tests, and a model larger than the machine). `checkpoint` and `kind`: already opened by the caller."""
    device, dtype = rank_device(options, rank), options.dtype.torch()
    stage_rank, tp_rank = divmod(rank, options.tp)
    if tensor_parallel.current().group is None:  # built alone: the shapes of its TP rank, no group
        tensor_parallel.use(tensor_parallel.TensorParallel(tp_rank, options.tp))
    checkpoint = checkpoint or Checkpoint(options.model)
    checkpoint.require_runnable()  # also under torchrun, where no Engine checked first
    if kind is None:
        kind = open_drafter(checkpoint, options)
    else:
        kind.require_runnable()
    ranks = placements(checkpoint.config, options.pp, options.pp_partition, has_drafter=kind is not None)
    placement = ranks[stage_rank]
    packed = options.quantized_weights == QuantizedWeights.PACKED
    stage = load_target_stage(
        checkpoint, placement.layers, placement.has_embedding, placement.has_head, dtype, device, packed
    )
    route = None
    if kind and kind.taps:  # the taps this rank captures and moves on (runtime/drafter/taps.py)
        route = tap_route(
            kind.engine_taps(options.tap_policy), options.tap_policy, placement, [r.layers for r in ranks]
        )
        stage.tap_entries = route.own
    drafter, provenance = None, Provenance()
    if placement.has_drafter:
        drafter, provenance = kind.build(stage, options, device)
        if past := Faults.parse(options.fault).drafter_rope_past:
            wrap_rope_past(drafter, past)
    modules = (stage, drafter) if drafter is not None else (stage,)
    moe_layers = [layer for module in modules for layer in module.modules() if isinstance(layer, MoE)]
    grouped_from = choose_moe_paths(moe_layers, device)
    graphs = None
    if options.compile:
        graphs = BackgroundCompiler(rank, tensor_parallel.current().group, device)
        for module in modules:
            compile_layers(module, graphs)
    info = {
        "rank": stage_rank,
        "tp_rank": tp_rank,
        "layers": [placement.layers.start, placement.layers.stop],
        "has_embedding": placement.has_embedding,
        "has_head": placement.has_head,
        "has_drafter": placement.has_drafter,
        "keys_read": sorted(set(checkpoint.keys_read)),
        "bytes_read": checkpoint.bytes_read,
        "drafter_provenance": provenance.labels(),
        # where the MoE layers switch paths: serve's compile warm-up crosses it (runtime/compile.py)
        "gathered_token_limit": max((layer.gathered_token_limit() for layer in moe_layers), default=0),
        "grouped_from": grouped_from,
    }
    rollback = options.state_rollback == StateRollback.EXACT
    faults = Faults.parse(options.fault).gated(kind.dummy_drafts_past(options) if kind else None)
    model = RankModel(
        placement, stage, drafter, None, device, dtype, checkpoint, provenance, rollback, route, kind, faults
    )
    model.graphs = graphs
    model.tokenizer = tokenizer_file(checkpoint.path, options.tokenizer)
    model.eos_token_ids = model_eos_token_ids(checkpoint.path, checkpoint.config.eos_token_ids, options.tokenizer)
    config = checkpoint.config
    hybrid = any(map(config.is_linear_attention, range(config.num_hidden_layers)))
    if options.enable_prefix_caching and not hybrid:  # recurrent states are not kept per block
        model.prefix_store = PrefixStore()
    return model, info

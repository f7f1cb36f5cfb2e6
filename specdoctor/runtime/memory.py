"""The memory plan, made before any rank starts: the bytes each rank will hold against the memory it can
have, so a model larger than the machine is diagnosed as far as it fits instead of killed by the OOM killer.

A rank holds its tensors in the compute dtype (quantised weights packed as stored, or dequantised), the KV
cache of a battery run and a workspace; on the CPU every rank shares the host's RAM, on CUDA each rank has
its GPU's free memory. Each rank's tensors are counted from its modules built on the meta device and the
packed weights' headers, so the plan is exactly what the ranks allocate, for every family and drafter kind,
and costs no memory itself.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specdoctor.runtime.cache.kv_cache import new_cache
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.kind import DrafterKind
from specdoctor.runtime.models.registry import family_of
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.options import Device, QuantizedWeights, RuntimeOptions
from specdoctor.runtime.partition import Placement
from specdoctor.runtime.sharding import local_config
from specdoctor.runtime.tensor_parallel import TensorParallel, acting_as

# An idle rank with torch and the runtime imported (220 MiB measured on x86_64, torch 2.13.0+cpu), with room.
PROCESS_BYTES = 320 << 20
LOGIT_COPIES = 4  # logits, probabilities and their float32 copies alive at once in the last rank's step


@dataclass
class RankMemory:
    rank: int
    weights: int  # its tensors as held: the compute dtype, quantised weights packed unless dequantised
    kv_cache: int
    workspace: int  # activations, the logits of a verify pass, a packed weight dequantised, the process itself

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.workspace


@dataclass
class MemoryPlan:
    ranks: list[RankMemory]
    available: list[int]  # bytes free: one entry for the host's RAM, or one per rank's GPU
    where: str  # "host RAM" or "GPU memory"
    limited: bool = False  # `available` is the user's limit, not what the machine has

    @property
    def needed(self) -> int:
        return sum(rank.total for rank in self.ranks)

    @property
    def fits(self) -> bool:
        if len(self.available) == 1:
            return self.needed <= self.available[0]
        return all(rank.total <= free for rank, free in zip(self.ranks, self.available, strict=True))

    def shortfall(self) -> str:
        """One line: what the ranks need against what this machine has."""
        if len(self.available) == 1:
            return (
                f"the {len(self.ranks)} rank(s) need {human_bytes(self.needed)} of {self.where}; "
                f"{'the limit is' if self.limited else 'this machine has'} {human_bytes(self.available[0])}"
                f"{'' if self.limited else ' available'}"
            )
        short = [(r, free) for r, free in zip(self.ranks, self.available, strict=True) if r.total > free]
        rank, free = short[0]
        has = "the limit is" if self.limited else "its GPU has"
        return f"rank {rank.rank} needs {human_bytes(rank.total)} of {self.where}; {has} {human_bytes(free)}"

    def to_dict(self) -> dict:
        return {
            "ranks": [asdict(rank) | {"total": rank.total} for rank in self.ranks],
            "needed": self.needed,
            "available": self.available,
            "where": self.where,
            "fits": self.fits,
            "limited": self.limited,
        }


def human_bytes(count: int) -> str:
    for unit, size in (("TB", 10**12), ("GB", 10**9)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count / 2**20:.0f} MiB"


def module_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def rank_weights(
    checkpoint: Checkpoint, placement: Placement, drafter: DrafterKind | None, options: RuntimeOptions
) -> tuple[int, int]:
    """(bytes of the tensors a rank allocates: its stage, and the drafter on the drafter's rank; bytes one call of
    its largest packed weight dequantises). Layers of one kind (dense or MoE, full or linear attention) are the
    same size and hold the same linears, so each kind is built once."""
    config, dtype = checkpoint.config, options.dtype.torch()
    family, sizes, kind_linears, linears = family_of(config), {}, {}, {}
    local = local_config(config, options.tp)  # this TP rank's slice (the caller acts as the rank)
    with torch.device("meta"):
        total = module_bytes(TargetStage(config, range(0), placement.has_embedding, placement.has_head).to(dtype))
        for layer in placement.layers:
            kind = (config.is_moe_layer(layer), config.is_linear_attention(layer))
            if kind not in sizes:
                module = family.decoder_layer(local, layer).to(dtype)
                sizes[kind] = module_bytes(module)
                kind_linears[kind] = {
                    f"{name}.weight" for name, m in module.named_modules() if isinstance(m, nn.Linear)
                }
            total += sizes[kind]
            linears[layer] = kind_linears[kind]
        if placement.has_drafter and drafter is not None:
            total += module_bytes(drafter.module().to(dtype))
    if options.quantized_weights == QuantizedWeights.DEQUANTIZED:
        return total, 0
    saving, transient = packing(checkpoint, linears, dtype)
    return total - saving // options.tp, transient // options.tp  # the split linears' share (nearly all of them)


def packing(checkpoint: Checkpoint, linears: dict[int, set[str]], dtype: torch.dtype) -> tuple[int, int]:
    """(bytes the layers' quantised linears save held packed instead of dequantised, the most one call of the
    torch reference GEMM dequantises: int32 values, the fp32 product and the compute-dtype copy). `linears`:
    each layer's linear weights, by name in the layer: what runtime/checkpoint/loader.py's pack_linears packs."""
    prefix, saving, transient = f"{checkpoint.config.decoder_prefix}layers.", 0, 0
    for key, weight in checkpoint.quantized.items():
        layer, _, name = key.removeprefix(prefix).partition(".") if key.startswith(prefix) else ("", "", "")
        if layer.isdigit() and name in linears.get(int(layer), ()):
            values = math.prod(weight.shape)
            saving += values * dtype.itemsize - sum(checkpoint.stored[part].nbytes for part in weight.parts.values())
            transient = max(transient, values * (8 + dtype.itemsize))
    return saving, transient


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for entries in cache.entries.values() for t in entries)


def plan_memory(
    checkpoint: Checkpoint,
    ranks: list[Placement],
    drafter: DrafterKind | None,
    options: RuntimeOptions,
    batch: int,
    max_len: int,
    limit: int | None = None,
) -> MemoryPlan:
    """The plan for a run of `batch` sequences of up to `max_len` positions (the battery's), within `limit`
    bytes where given (else what the machine has available)."""
    config, dtype, k = checkpoint.config, options.dtype.torch(), options.num_speculative_tokens or 0
    logits = batch * (k + 1) * config.vocab_size * 4 * LOGIT_COPIES
    activations = batch * max_len * config.hidden_size * dtype.itemsize * 8
    plans = []
    for placement, tp_rank in itertools.product(ranks, range(options.tp)):  # every rank: TP inner
        with acting_as(TensorParallel(tp_rank, options.tp)):
            local = local_config(config, options.tp)
            kv = cache_bytes(new_cache(local, list(placement.layers), batch, max_len, dtype, "meta"))
            if placement.has_drafter and drafter is not None:  # its own cache: a draft model's is a whole model's
                with torch.device("meta"):
                    kv += cache_bytes(drafter.module().new_cache(batch, max_len, dtype, "meta"))
            weights, dequantizing = rank_weights(checkpoint, placement, drafter, options)
        # Each rank of the last stage holds the whole vocabulary's logits (gathered).
        workspace = PROCESS_BYTES + activations + dequantizing + (logits if placement.is_last else 0)
        plans.append(RankMemory(placement.rank * options.tp + tp_rank, weights, kv, workspace))
    if options.device == Device.CUDA and torch.cuda.is_available():
        count = torch.cuda.device_count()
        free = [torch.cuda.mem_get_info(plan.rank % count)[0] for plan in plans]
        where = "GPU memory"
    else:
        free, where = [host_memory_available()], "host RAM"
    limited = limit is not None and limit < min(free)
    return MemoryPlan(plans, [limit] * len(free) if limited else free, where, limited)


def host_memory_available() -> int:
    """What the kernel says can still be allocated without swapping, within this process's cgroup limit."""
    available = meminfo_available()
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    ):
        try:
            cap, used = Path(limit).read_text().strip(), int(Path(usage).read_text())
        except (OSError, ValueError):
            continue
        if cap.isdigit():
            available = min(available, int(cap) - used)
    return available


def meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

"""Building blocks shared by the model families, with the checkpoints' parameter names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdoctor.kernels.reference import rms_norm
from specdoctor.runtime.models.packed import any_packed
from specdoctor.runtime.models.parallel_layers import row_parallel


class PPMissingLayer(nn.Identity):
    """Placeholder for a module another pipeline rank owns: no weight, returns its first argument."""

    def forward(self, *args, **kwargs):
        return args[0] if args else None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        return rms_norm(x, self.weight, self.eps)


def concat_weights(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Copy the linears' weights (and biases) into one tensor each and make every part a view of it.
    The parts keep the checkpoint's names, so loading a part fills the whole, and one matmul
    replaces several: on a small model each op costs more in overhead than in arithmetic."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    bias = torch.cat([linear.bias.detach() for linear in linears]) if linears[0].bias is not None else None
    start = 0
    for linear in linears:
        end = start + linear.weight.shape[0]
        linear.weight = nn.Parameter(weight[start:end])
        if bias is not None:
            linear.bias = nn.Parameter(bias[start:end])
        start = end
    return weight, bias


class FusedWeights(nn.Module):
    """A module whose parts share one storage (see `concat_weights`). Moving or re-allocating it
    (`.to`, `.to_empty`) gives each parameter new storage, so the parts are joined again after.
    Training reads the parts themselves (`joined`), so the gradients reach the parameters the
    checkpoint names, and the optimiser's in-place steps land in the shared storage."""

    def fuse(self) -> None:
        raise NotImplementedError

    def joined(self, fused: torch.Tensor | None, parts: list[torch.Tensor]) -> torch.Tensor | None:
        """The fused tensor for this forward: the shared storage, or, in training with gradients on, the
        parts joined again (the same values, differentiable)."""
        if fused is None or not (self.training and torch.is_grad_enabled()):
            return fused
        return torch.cat(parts).view(fused.shape)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.fuse()
        return self


class MLP(FusedWeights):
    """gate/up column-parallel, down row-parallel; `reduce=False`: its caller sums the TP ranks (an MoE block
    reduces its experts and shared experts once, as vLLM's does)."""

    def __init__(self, hidden: int, intermediate: int, reduce: bool = True):
        super().__init__()
        self.reduce = reduce
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.fuse()

    def fuse(self) -> None:
        packed = any_packed(self.gate_proj, self.up_proj)
        self.gate_up = None if packed else concat_weights([self.gate_proj, self.up_proj])[0]  # [2I, H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:  # packed weights: one quantised GEMM each
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = F.linear(x, self.joined(self.gate_up, [self.gate_proj.weight, self.up_proj.weight])).chunk(2, -1)
        return row_parallel(self.down_proj, F.silu(gate) * up, self.reduce)

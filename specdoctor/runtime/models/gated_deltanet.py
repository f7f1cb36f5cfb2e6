"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5 (docs/engine-semantics.md §Hybrid models).

Per token: q, k, v from a depthwise causal conv (kernel K, SiLU) over their projections; q and k
L2-normalised, q scaled by key_dim^-0.5; then, per value head, with decay g = -exp(A_log) *
softplus(a + dt_bias) and write strength beta = sigmoid(b):

    S = S * exp(g);  S = S + k (beta (v - S^T k))^T;  out = S^T q

and the output is RMS-normed per head, gated by SiLU(z), and projected. The state S [key_dim, value_dim]
and the conv window (the last K-1 inputs) are what the cache carries (runtime/cache/linear_state.py).
Qwen3-Next stores q, k, v, z in one `in_proj_qkvz` grouped per key head (and b, a in `in_proj_ba`);
Qwen3.5 stores `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdoctor.runtime import tensor_parallel
from specdoctor.runtime.cache.kv_cache import KVCache
from specdoctor.runtime.models.parallel_layers import row_parallel


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule(
    q: torch.Tensor,  # [B, T, H, Dk] fp32, normalised and scaled
    k: torch.Tensor,  # [B, T, H, Dk] fp32, normalised
    v: torch.Tensor,  # [B, T, H, Dv] fp32
    g: torch.Tensor,  # [B, T, H] log decay
    beta: torch.Tensor,  # [B, T, H]
    state: torch.Tensor,  # [B, H, Dk, Dv] fp32
    keep_positions: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs [B, T, H, Dv], the states after each position [B, T, H, Dk, Dv], or the last one [B, 1, ...])."""
    outputs, states = [], []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        remembered = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
        if keep_positions:
            states.append(state)
    return torch.stack(outputs, dim=1), torch.stack(states, dim=1) if keep_positions else state[:, None]


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (weight initialised to ones), then a SiLU gate."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    # `delta_rule` steps through the positions in Python: a compiled pass would unroll it, a graph per prompt
    # length, so --compile leaves prompt passes longer than a verify pass eager (runtime/compile.py).
    loops_over_positions = True

    def __init__(self, config, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.key_heads, self.value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        hidden, keys, values = config.hidden_size, self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.channels = 2 * keys + values
        self.fused_projection = config.fused_qkvz
        if self.fused_projection:
            self.in_proj_qkvz = nn.Linear(hidden, 2 * keys + 2 * values, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.value_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden, self.channels, bias=False)
            self.in_proj_z = nn.Linear(hidden, values, bias=False)
            self.in_proj_b = nn.Linear(hidden, self.value_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, self.value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.channels, self.channels, self.kernel, groups=self.channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(values, hidden, bias=False)
        # Under TP a rank holds its key and value heads (config: this rank's): of the q | k | v channels, its
        # slice of each (rows of the whole tensor: the loader's segments); the grouped in_proj_qkvz and
        # in_proj_ba, and dt_bias and A_log, hold its heads as one contiguous slice.
        size = tensor_parallel.current().size
        segments = (size * keys, size * keys, size * values)
        self.tp_segments = {"conv1d.weight": segments, "in_proj_qkv.weight": segments}

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the conv's input [B, T, C] as q | k | v, z [B, T, Hv, Dv], b and a [B, T, Hv]) of x [B, T, H]."""
        batch, length, _ = x.shape
        if not self.fused_projection:
            z = self.in_proj_z(x).view(batch, length, self.value_heads, self.value_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        # Qwen3-Next groups q, k, v, z (and b, a) per key head; ungroup them into Qwen3.5's order.
        per_key = self.value_heads // self.key_heads
        grouped = self.in_proj_qkvz(x).view(batch, length, self.key_heads, -1)
        q, k, v, z = grouped.split([self.key_dim, self.key_dim, per_key * self.value_dim, per_key * self.value_dim], -1)
        b, a = self.in_proj_ba(x).view(batch, length, self.key_heads, -1).split([per_key, per_key], -1)
        mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
        z = z.reshape(batch, length, self.value_heads, self.value_dim)
        return mixed, z, b.reshape(batch, length, -1), a.reshape(batch, length, -1)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        positions: torch.Tensor,  # [B, T]
        rotary,  # unused: no positions in linear attention
        cache: KVCache | None,
    ) -> torch.Tensor:  # [B, T, H]
        batch, length, _ = x.shape
        mixed, z, b, a = self.project(x)
        states = cache.states if cache is not None else None
        window = states.conv[self.layer_id] if states else mixed.new_zeros(batch, self.channels, self.kernel - 1)
        sequence = torch.cat([window, mixed.transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
        conv = F.silu(F.conv1d(sequence, self.conv1d.weight, groups=self.channels)).transpose(1, 2)
        keys = self.key_heads * self.key_dim
        q, k, v = conv.float().split([keys, keys, self.value_heads * self.value_dim], dim=-1)
        repeat = self.value_heads // self.key_heads  # each key head serves this many consecutive value heads
        q = l2_normalise(q.view(batch, length, self.key_heads, -1)).repeat_interleave(repeat, dim=2)
        k = l2_normalise(k.view(batch, length, self.key_heads, -1)).repeat_interleave(repeat, dim=2)
        q = q * self.key_dim**-0.5
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if states and states.valid_end is not None:  # padding past a row's end leaves its state as it was
            real = (positions < states.valid_end[:, None])[..., None]
            beta, g = beta * real, g * real
        shape = (batch, self.value_heads, self.key_dim, self.value_dim)
        initial = states.recurrent[self.layer_id] if states else q.new_zeros(shape)
        keep = bool(states and states.keep_positions)
        out, after = delta_rule(q, k, v.view(batch, length, self.value_heads, -1), g, beta, initial, keep)
        if states:
            windows = sequence.unfold(2, self.kernel - 1, 1)[:, :, 1:].transpose(1, 2)  # [B, T, C, K-1]
            states.stage(self.layer_id, windows, after)
        out = self.norm(out.to(x.dtype), z)
        return row_parallel(self.out_proj, out.reshape(batch, length, -1))

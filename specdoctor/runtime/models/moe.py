"""Mixture-of-experts layers: the router (softmax or sigmoid with a correction bias, grouped top-k) and the
experts, run gathered, every expert at once, as a grouped GEMM over the tokens sorted by expert, or one expert
at a time (by size, and on the CPU by what this rank's threads measured faster)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.models.layers import MLP, FusedWeights, concat_weights
from specdoctor.runtime.models.packed import any_packed
from specdoctor.runtime.tensor_parallel import all_reduce


class Router(nn.Module):
    """Sigmoid router with a score-correction bias and group-limited top-k (DeepSeek-V3 / GLM-4.5)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x: [N, H]
        """Return (weights [N, top_k], expert ids [N, top_k])."""
        cfg = self.config
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)  # [N, groups]
        top_groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(choice.shape)
        expert_ids = choice.masked_fill(~expert_mask, float("-inf")).topk(cfg.num_experts_per_tok, dim=-1)[1]
        weights = scores.gather(1, expert_ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, expert_ids


# Below this many bytes of gathered expert weights a step runs every routed expert it picked in one
# batched matmul over copies of their weights. Above it, a layer whose routed experts together take at
# most EVERY_EXPERT_LIMIT_BYTES runs every expert over every token (weighted 0 where not picked), and a
# larger one loops over the experts hit, reading them in place (and its expert list on the host). Where
# every expert may run, gathering stops sooner: once it would copy more expert matrices than every expert
# reads (docs/performance.md: MoE paths).
GATHER_LIMIT_BYTES = 16 << 20


EVERY_EXPERT_LIMIT_BYTES = 16 << 20

# Pass sizes (tokens) at which a CPU rank times the grouped GEMM against every expert when it loads: powers of two
# from 16. A pass within the gathered limit gathers whatever the crossover is (16 is past the demo's limit of 4).
GROUPED_CANDIDATES = (16, 32, 64, 128, 256, 512)


@torch.library.custom_op("specdoctor::grouped_mm", mutates_args=())
def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm as an opaque op: its shape function refuses float32 under torch.compile, which the CPU
    kernel runs."""
    return torch._grouped_mm(rows, weights, offs=offsets)


@grouped_mm.register_fake
def _(rows, weights, offsets):
    return rows.new_empty(rows.shape[0], weights.shape[-1])


class MoE(FusedWeights):
    router: type[nn.Module] = Router  # (config) -> module returning (weights [N, k], expert ids [N, k])
    grouped_from: int | None = None  # passes of this many tokens or more run the grouped GEMM (set where measured)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = self.router(config)
        self.top_k = config.num_experts_per_tok
        size = config.moe_intermediate_size
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, size, reduce=False) for _ in range(config.n_routed_experts)
        )
        if config.n_shared_experts:
            self.shared_experts = MLP(config.hidden_size, size * config.n_shared_experts, reduce=False)
        self.fuse()

    def fuse(self) -> None:
        linears = [linear for expert in self.experts for linear in (expert.gate_proj, expert.up_proj, expert.down_proj)]
        self.packed = any_packed(*linears)
        if self.packed:  # each expert runs its own quantised GEMMs (looped_experts)
            self.gate_up = self.down = None
            return
        experts, (size, hidden) = len(self.experts), self.experts[0].gate_proj.weight.shape
        self.expert_bytes = self.experts[0].gate_proj.weight.nbytes * 3  # gate, up and down
        parts = [linear for expert in self.experts for linear in (expert.gate_proj, expert.up_proj)]
        self.gate_up = concat_weights(parts)[0].view(experts, 2 * size, hidden)  # [E, 2I, H]
        self.down = concat_weights([expert.down_proj for expert in self.experts])[0].view(experts, hidden, size)
        for index, expert in enumerate(self.experts):
            expert.gate_up = self.gate_up[index]

    def gathered_token_limit(self) -> int:
        """The most tokens a pass routes through `gathered_experts` (none with packed experts): as many as copy
        at most GATHER_LIMIT_BYTES of weights, and where every expert may run, at most E / top_k (N tokens copy
        N x top_k expert matrices, every expert reads E)."""
        if self.packed:
            return 0
        if self.every_expert_fits():
            return len(self.experts) // self.top_k
        return GATHER_LIMIT_BYTES // (self.top_k * self.expert_bytes)

    def every_expert_fits(self) -> bool:
        return not self.packed and len(self.experts) * self.expert_bytes <= EVERY_EXPERT_LIMIT_BYTES

    def loop_token_limit(self) -> int | None:
        """The most tokens a pass can take without the per-expert loop, which reads its expert list on the
        host (so a compiled pass must stay under it); None: any number."""
        return None if self.every_expert_fits() else self.gathered_token_limit()

    def path(self, tokens: int) -> str:
        """How a pass of `tokens` tokens runs the routed experts (a compiled graph holds one path per layer)."""
        if not self.packed and tokens <= self.gathered_token_limit():
            return "gathered"
        if self.grouped_from is not None and tokens >= self.grouped_from:
            return "grouped"
        return "every" if self.every_expert_fits() else "looped"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        flat = x.reshape(-1, x.shape[-1])
        weights, expert_ids = self.gate(flat)
        path = self.path(flat.shape[0])
        if path == "gathered":
            out = self.gathered_experts(flat, weights, expert_ids)
        elif path == "grouped":
            out = self.grouped_experts(flat, weights, expert_ids)
        elif path == "every":
            out = self.every_expert(flat, weights, expert_ids)
        else:
            out = self.looped_experts(flat, weights, expert_ids)
        return all_reduce(out + self.shared(flat)).view_as(x)  # each TP rank summed its experts' slices

    def shared(self, flat: torch.Tensor) -> torch.Tensor | float:  # [N, H] -> what the shared experts add
        return self.shared_experts(flat) if hasattr(self, "shared_experts") else 0.0

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every routed expert's gate/up [E, 2I, H] and down [E, H, I] projections."""
        gate_up = [linear.weight for expert in self.experts for linear in (expert.gate_proj, expert.up_proj)]
        down = [expert.down_proj.weight for expert in self.experts]
        return self.joined(self.gate_up, gate_up), self.joined(self.down, down)

    def gathered_experts(self, flat, weights, expert_ids) -> torch.Tensor:  # [N, H], [N, k], [N, k] -> [N, H]
        tokens, per_token = expert_ids.shape
        ids = expert_ids.reshape(-1)
        inputs = flat[:, None, :].expand(tokens, per_token, -1).reshape(tokens * per_token, 1, -1)
        gate_up, down = self.expert_weights()
        # index_select copies whole expert matrices; advanced indexing (w[ids]) is several times slower.
        gate, up = torch.bmm(inputs, gate_up.index_select(0, ids).transpose(1, 2)).chunk(2, dim=-1)
        routed = torch.bmm(F.silu(gate) * up, down.index_select(0, ids).transpose(1, 2))  # [N*k, 1, H]
        return (routed.view(tokens, per_token, -1) * weights[..., None].to(flat.dtype)).sum(1)

    def every_expert(self, flat, weights, expert_ids) -> torch.Tensor:  # [N, H], [N, k], [N, k] -> [N, H]
        picked = torch.zeros(flat.shape[0], len(self.experts), dtype=flat.dtype, device=flat.device)
        picked.scatter_(1, expert_ids, weights.to(flat.dtype))  # [N, E]: the routing weight, 0 where not picked
        gate_up, down = self.expert_weights()
        gate, up = torch.matmul(flat, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I] each
        routed = torch.matmul(F.silu(gate) * up, down.transpose(1, 2))  # [E, N, H]
        return (routed * picked.T[:, :, None]).sum(0)

    def grouped_experts(self, flat, weights, expert_ids) -> torch.Tensor:  # [N, H], [N, k], [N, k] -> [N, H]
        """Each picked expert over its own tokens only (a quarter of every expert's multiply-adds at top 2 of 8),
        one small GEMM per expert, reading its weights in place."""
        tokens, per_token = expert_ids.shape
        ids = expert_ids.reshape(-1)
        order = ids.argsort(stable=True)  # (token, slot) pairs by expert; offsets: where each expert's run ends
        experts = torch.arange(len(self.experts), device=ids.device)
        offsets = torch.searchsorted(ids[order], experts, right=True).to(torch.int32)
        gate_up, down = self.expert_weights()
        gate, up = grouped_mm(flat.index_select(0, order // per_token), gate_up.transpose(1, 2), offsets).chunk(2, -1)
        routed = grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offsets)
        unsorted = torch.empty_like(routed).index_copy_(0, order, routed)
        return (unsorted.view(tokens, per_token, -1) * weights[..., None].to(flat.dtype)).sum(1)

    def looped_experts(self, flat, weights, expert_ids) -> torch.Tensor:
        out = torch.zeros_like(flat)
        for expert in expert_ids.unique().tolist():
            token, slot = torch.where(expert_ids == expert)
            routed = self.experts[expert](flat[token]) * weights[token, slot, None].to(flat.dtype)
            out.index_add_(0, token, routed)
        return out


def measure_grouped_from(layer: MoE, rounds: int = 3) -> int | None:
    """The fewest tokens (of GROUPED_CANDIDATES) from which the grouped GEMM ran faster than every expert at each
    candidate size, timed on this layer with this rank's threads (the best of `rounds`); None where it never did,
    or where this layer does not run every expert (packed experts, or too many to run at once). On a 2-core CI
    machine it won from 16 tokens on one thread, from 32 or 64 on two (docs/runtime.md: the MoE paths)."""
    if not layer.every_expert_fits():
        return None
    hidden = layer.gate.weight.shape[1]
    dtype, device = layer.gate_up.dtype, layer.gate_up.device
    faster = []
    with torch.no_grad():
        for tokens in GROUPED_CANDIDATES:
            flat = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(device, dtype)
            routing = (flat, *layer.gate(flat))
            paths = {"every": layer.every_expert, "grouped": layer.grouped_experts}
            seconds = dict.fromkeys(paths, float("inf"))
            for _ in range(rounds):
                for name, path in paths.items():
                    start = time.perf_counter()
                    try:
                        path(*routing)
                    except RuntimeError:  # torch's grouped GEMM refuses some layouts (rows not of 16-byte steps)
                        return None
                    seconds[name] = min(seconds[name], time.perf_counter() - start)
            faster.append(seconds["grouped"] < seconds["every"])
    winning = [tokens for index, tokens in enumerate(GROUPED_CANDIDATES) if all(faster[index:])]
    return winning[0] if winning else None

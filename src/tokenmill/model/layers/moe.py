"""A sparse mixture-of-experts MLP (Qwen3-MoE's): a router picks the top-k experts per token.

Routing keeps transformers' semantics exactly: softmax over all experts in float32, then top-k,
optionally renormalized over the chosen k (`norm_topk_prob`), then cast back to the activations'
dtype. The experts run grouped rather than per token: the (token, expert) pairs are sorted by
expert, so each expert's tokens form one contiguous run and every expert that has tokens runs once,
as one matmul over all of them:

    pairs (token, expert):   (0,3) (0,1) (1,3) (1,0) (2,1) (2,3)
    sorted by expert:        (1,0) | (0,1) (2,1) | (0,3) (1,3) (2,3)
                             exp 0    exp 1         exp 3            (expert 2 has none: skipped)

Each result is scaled by its routing weight and added into its token's row; the adds run in the
sorted order, i.e. per token in ascending expert order, as transformers adds them.

Expert weights are stacked as the transformers 5 module holds them: `experts.gate_up_proj`
[E, 2 * I, H] (gate rows first) and `experts.down_proj` [E, H, I]; `expert_destination` maps the
per-expert checkpoint names (and a GGUF's stacked gate / up tensors) onto them. They stay dense
float weights under every linear-layer conversion (packing, block-int8), and so does the router,
whose choices a rounded weight could flip.
"""
from __future__ import annotations

import re
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.layers.basic import make_gated_activation


class MoeRouter(nn.Module):
    """The router's weight [E, H]; a plain parameter, not an nn.Linear, so no conversion touches it."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))


class MoeExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, activation: str,
                 reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        """reduce: under tensor parallelism (each rank holds 1/N of every expert's features), the
        all-reduce of the routed sum, a partial sum on each rank."""
        super().__init__()
        self.reduce = reduce
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = MoeRouter(num_experts, hidden_size)
        self.experts = MoeExperts(num_experts, hidden_size, intermediate_size)
        self.act = make_gated_activation(activation)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) as transformers' top-k router computes them."""
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens ascending within one
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        inputs = x[tokens]
        pair_weights = weights.flatten()[order].unsqueeze(1)
        results = torch.empty_like(inputs)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                h = self.act(F.linear(inputs[start:end], self.experts.gate_up_proj[expert]))
                results[start:end] = F.linear(h, self.experts.down_proj[expert]) * pair_weights[start:end]
                start = end
        out = torch.zeros_like(x).index_add_(0, tokens, results)
        return out if self.reduce is None else self.reduce(out)


# layers.3.mlp.experts.7.gate_proj.weight (per expert) or layers.3.mlp.experts.gate_proj.weight (stacked)
_EXPERT_NAME = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj|gate_up_proj)"
                          r"(?:\.weight)?$")


def expert_destination(name: str, intermediate_size: int) -> Optional[tuple[str, tuple]]:
    """(our parameter, index into it) for a checkpoint's expert tensor; None for any other name."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    prefix, expert, part = match.groups()
    experts = slice(None) if expert is None else int(expert)
    rows = {"gate_proj": slice(0, intermediate_size), "up_proj": slice(intermediate_size, 2 * intermediate_size),
            "gate_up_proj": slice(None)}
    if part == "down_proj":
        return f"{prefix}.down_proj", (experts,)
    return f"{prefix}.gate_up_proj", (experts, rows[part])

"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek): a router picks each
token's best experts, whose gated-MLP outputs are summed with the router's weights (Qwen2-MoE adds a
shared expert that every token runs, scaled by its own sigmoid gate; DeepSeek-V3 scores by sigmoid,
chooses with a bias and among the best groups of experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.config import ModelConfig
from kvgen.models.layers import bias_of, feed_forward
from kvgen.models.weights import WeightSource, frozen


class SparseMoE(nn.Module):
    """softmax(router(x)) -> the top `experts_per_token` experts per token (their weights
    renormalised to sum to 1 where the model does so) -> sum of weight * expert(x).

    The router runs in fp32 (a near tie between two experts must not flip with the weights' dtype);
    each expert is a GatedMLP (Nemotron-H: a ReluSquaredMLP) over its own weights, fp32 or quantized, and runs once per step on
    the rows routed to it."""

    def __init__(self, config: ModelConfig, weights: WeightSource, prefix: str):
        super().__init__()
        self.router = frozen(weights.take_tensor(f"{prefix}.gate.weight").float().contiguous())  # [E, H]; decode.c reads it
        bias = bias_of(weights, f"{prefix}.gate")
        self.router_bias = frozen(bias.float()) if bias is not None else None  # gpt-oss's router has one
        self.top_k, self.normalize = config.experts_per_token, config.normalize_expert_weights
        self.scaling = config.routed_scaling_factor  # DeepSeek's; 1 elsewhere
        self.sigmoid = config.expert_scoring == "sigmoid"  # DeepSeek-V3's
        self.groups, self.groups_used = config.expert_groups, config.expert_groups_used
        choice_bias = f"{prefix}.gate.e_score_correction_bias"  # DeepSeek-V3's: chooses, never weighs
        self.choice_bias = frozen(weights.take_tensor(choice_bias).float().contiguous()) if weights.has(choice_bias) else None
        self.experts = nn.ModuleList(
            feed_forward(config, weights, f"{prefix}.experts.{e}", intermediate=config.expert_intermediate_size)
            for e in range(config.num_experts)
        )  # fmt: skip
        self.shared_expert, self.shared_gate = None, None
        if config.shared_expert_intermediate_size:
            self.shared_expert = feed_forward(config, weights, f"{prefix}.shared_expert", intermediate=config.shared_expert_intermediate_size)
            if config.shared_expert_gated:  # Qwen2-MoE's; DeepSeek adds its shared experts as they are
                self.shared_gate = frozen(weights.take_tensor(f"{prefix}.shared_expert_gate.weight").float().reshape(-1).contiguous())  # [H]

    def shared_weight(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the shared expert's weight per token, sigmoid(gate . x) [T] (fp32); 1 ungated."""
        if self.shared_gate is None:
            return torch.ones(x.shape[0])
        return torch.sigmoid(x.float() @ self.shared_gate)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> each token's expert weights [T, k] (fp32) and expert indices [T, k]."""
        logits = F.linear(x.float(), self.router, self.router_bias)
        probs = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        if self.choice_bias is None and self.groups == 1:
            weights, chosen = probs.topk(self.top_k, dim=-1)
        else:
            chosen = self.eligible(probs if self.choice_bias is None else probs + self.choice_bias).topk(self.top_k, dim=-1).indices
            weights = probs.gather(1, chosen)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.scaling if self.scaling != 1.0 else weights), chosen

    def eligible(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] with -inf outside each token's expert_groups_used best groups (all of them
        with one group): a group's score is its best choice (softmax scoring, DeepSeek-V2) or the sum
        of its best two (sigmoid, DeepSeek-V3)."""
        if self.groups == 1:
            return choice
        grouped = choice.reshape(choice.shape[0], self.groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1) if self.sigmoid else grouped.amax(-1)
        kept = torch.zeros(group_scores.shape, dtype=torch.bool).scatter_(1, group_scores.topk(self.groups_used, dim=-1).indices, True)
        return grouped.masked_fill(~kept[..., None], float("-inf")).reshape(choice.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(flat)
        out = self.routed(flat, weights, chosen)
        if self.shared_expert is not None:  # after the routed experts, as the C steps add it
            out += self.shared_weight(flat)[:, None] * self.shared_expert(flat).float()
        return out.to(x.dtype).reshape(x.shape)

    def routed(self, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """flat [T, H], the router's weights and choices [T, k] -> the sum of weight * expert(x) [T, H]
        (fp32). The (token, slot) pairs are sorted by expert once, each expert runs on its slice of
        the gathered rows (tokens ascending, as a mask would give them), and one index_add adds
        every token's outputs in the order of its experts."""
        pairs = chosen.flatten()
        order = pairs.argsort(stable=True)
        rows = order // chosen.shape[1]  # each sorted pair's token
        gathered = flat[rows]
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                outputs.append(self.experts[expert](gathered[start : start + count]).float())
                start += count
        y = torch.cat(outputs) * weights.flatten()[order, None]
        return torch.zeros(flat.shape, dtype=torch.float32, device=flat.device).index_add_(0, rows, y)

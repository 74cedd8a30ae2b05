"""Routers per family and the MoE block: router, routed experts (any tiers), shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .experts import LayerExperts
from .families import ModelArgs
from .model import DenseMlp


def route(args: ModelArgs, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> selected experts ``[T, k]`` (int64) and their weights ``[T, k]``.

    ``softmax_topk``: softmax over all experts in float32, top-k, renormalised when
    ``norm_topk_prob`` (Mixtral always). ``sigmoid_topk_scale_input`` (Llama 4): top-k of the raw
    logits, weight = sigmoid(logit); the weight scales the expert's input, not its output.
    """
    k = args.top_k
    if args.router == "sigmoid_topk_scale_input":
        top, ids = torch.topk(logits, k, dim=-1)
        return ids, torch.sigmoid(top.float()).to(logits.dtype)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, k, dim=-1)
    if args.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return ids, top.to(logits.dtype)


class MoeBlock:
    """One MoE layer's feed-forward. Router and shared expert on the accelerator; routed experts in
    ``experts`` (any mix of tiers). Adds the selected experts to ``counts[layer]`` on the device."""

    def __init__(self, args: ModelArgs, layer: int, router: torch.Tensor, experts: LayerExperts,
                 shared: DenseMlp | None, shared_router: torch.Tensor | None, counts: torch.Tensor):
        self.args = args
        self.layer = layer
        self.router = router
        self.experts = experts
        self.shared = shared
        self.shared_router = shared_router
        self.counts = counts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router)  # [T, E]
        ids, weights = route(self.args, logits)
        self.counts[self.layer].index_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1)))
        out = self.experts(x, ids, weights, scale_input=self.args.router == "sigmoid_topk_scale_input")
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_router is not None:
                s = torch.sigmoid(F.linear(x, self.shared_router)) * s
            out = out + s
        return out

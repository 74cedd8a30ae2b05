"""Routers per family and the MoE block: router, routed experts (any tiers), shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gpu_kernels, packed
from .experts import LayerExperts
from .families import ModelArgs
from .model import DenseMlp


def route(args: ModelArgs, logits: torch.Tensor, score_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> selected experts ``[T, k]`` (int64) and their weights ``[T, k]``.

    ``softmax_topk``: softmax over all experts in float32, top-k (DeepSeek V2: within the best
    groups), renormalised when ``norm_topk_prob`` (Mixtral always). ``sigmoid_topk_scale_input``
    (Llama 4): top-k of the raw logits, weight = sigmoid(logit), applied to the expert's input.
    ``sigmoid_group_bias`` (DeepSeek V3): sigmoid scores; choice by score + ``score_bias`` within the
    ``topk_group`` best groups (sum of each group's top-2); weights = the plain scores. ``topk_softmax``
    (gpt-oss): top-k logits, softmax over them. DeepSeek weights are finally scaled by
    ``routed_scaling``.
    """
    k = args.top_k
    if args.router == "sigmoid_topk_scale_input":
        top, ids = torch.topk(logits, k, dim=-1)
        return ids, torch.sigmoid(top.float()).to(logits.dtype)
    if args.router == "topk_softmax":
        top, ids = torch.topk(logits, k, dim=-1)
        return ids, torch.softmax(top, dim=-1)
    if args.router == "sigmoid_group_bias":
        scores = logits.sigmoid()
        choice = scores + score_bias if score_bias is not None else scores
        choice = _keep_best_groups(choice, args, lambda g: g.topk(2, dim=-1)[0].sum(dim=-1), float("-inf"))
        ids = torch.topk(choice, k, dim=-1, sorted=False)[1]
        top = scores.gather(1, ids)
        if args.norm_topk_prob:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, top * args.routed_scaling
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    if args.group_limited:
        probs = _keep_best_groups(probs, args, lambda g: g.max(dim=-1).values, 0.0)
    top, ids = torch.topk(probs, k, dim=-1)
    if args.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    if args.routed_scaling != 1.0:
        top = top * args.routed_scaling
    return ids, top.to(logits.dtype)


def _keep_best_groups(scores: torch.Tensor, args: ModelArgs, group_score, fill: float) -> torch.Tensor:
    """``scores [T, E]`` with ``fill`` outside the ``topk_group`` best of ``n_group`` expert groups;
    ``group_score`` reduces the ``[T, G, E/G]`` view to ``[T, G]``."""
    T, E = scores.shape
    G = args.n_group
    if G <= 1:
        return scores
    best = torch.topk(group_score(scores.view(T, G, E // G)), args.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros(T, G, dtype=torch.bool, device=scores.device).scatter_(1, best, True)
    return scores.masked_fill(~keep[:, :, None].expand(T, G, E // G).reshape(T, E), fill)


class MoeBlock:
    """One MoE layer's feed-forward. Router and shared expert on the accelerator; routed experts in
    ``experts`` (any mix of tiers). Adds the selected experts to ``counts[layer]`` on the device."""

    def __init__(self, args: ModelArgs, layer: int, router: torch.Tensor, experts: LayerExperts,
                 shared: DenseMlp | None, shared_router: torch.Tensor | None, counts: torch.Tensor,
                 router_bias: torch.Tensor | None = None, score_bias: torch.Tensor | None = None):
        self.args = args
        self.layer = layer
        self.router = router
        self.router_bias = router_bias
        self.score_bias = score_bias
        self.experts = experts
        self.shared = shared
        self.shared_router = shared_router
        self.counts = counts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        return self.experts(x, ids, weights, scale_input=self.scale_input, extra=self.extra(x))

    @property
    def scale_input(self) -> bool:
        return self.args.router == "sigmoid_topk_scale_input"

    def extra(self, x: torch.Tensor):
        """The shared expert as ``() -> [T, H]`` for ``LayerExperts`` (None without one)."""
        return None if self.shared is None else (lambda: self._shared(x))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router and selection for ``x [T, H]``: ``ids``, ``weights [T, k]``; counts the picks on the device."""
        a = self.args
        one = (x.shape[0] == 1 and gpu_kernels.usable(x) and self.router.dtype == x.dtype and x.is_contiguous()
               and self.router.is_contiguous())
        if (one and gpu_kernels.routing_kernels() and self.router_bias is None and a.router == "softmax_topk" and not a.group_limited
                and not a.family.startswith("deepseek") and gpu_kernels.fused_routing()):  # one kernel
            picked = self._on_kernel(gpu_kernels.router_route, x, self.router)
            if picked is not None:
                return picked
        if a.family.startswith("deepseek"):  # DeepSeek routes in float32
            logits = F.linear(x.float(), self.router.float())  # [T, E]
        elif one:  # one token: the one-token kernel beats cuBLAS on a router
            logits = packed.float_matvec(x, self.router)
            if self.router_bias is not None:
                logits = logits + self.router_bias
        else:
            logits = F.linear(x, self.router, self.router_bias)
        if (logits.shape[0] == 1 and a.router == "softmax_topk" and not a.group_limited
                and gpu_kernels.usable(logits) and gpu_kernels.routing_kernels()):  # softmax, top-k, counts: one kernel
            picked = self._on_kernel(gpu_kernels.route_softmax_topk, logits)
            if picked is not None:
                return picked
        ids, weights = route(self.args, logits, self.score_bias)
        flat = ids.reshape(-1)
        n = flat.numel()
        # kept, one launch less per layer and step; the one-token buffer is never replaced, since
        # captured decode graphs read it by address
        name = "_ones_step" if n == self.args.top_k else "_ones"
        ones = getattr(self, name, None)
        if ones is None or ones.numel() < n:
            ones = torch.ones(n, dtype=self.counts.dtype, device=flat.device)
            setattr(self, name, ones)
        self.counts[self.layer].index_add_(0, flat, ones[:n])
        return ids, weights

    def _on_kernel(self, kernel, *inputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``kernel(*inputs, k, norm, scaling, counts)``'s ``(ids, weights)``; None where it fails to
        build or run here (``gpu_kernels.routing_failed``: PyTorch routes from then on)."""
        a = self.args
        try:
            return kernel(*inputs, a.top_k, a.norm_topk_prob, a.routed_scaling, self.counts[self.layer])
        except Exception as exc:
            if not gpu_kernels.failed_here(exc):
                raise
            gpu_kernels.routing_failed(exc)
            return None

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert ``[T, H]`` (gated by ``shared_router`` when the family has one)."""
        s = self.shared(x)
        if self.shared_router is not None:
            s = torch.sigmoid(F.linear(x, self.shared_router)) * s
        return s

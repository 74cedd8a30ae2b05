"""DeepSeek multi-head latent attention (MLA) with a latent KV cache.

The cache keeps, per position, the normalised KV latent ``[kv_lora]`` and the shared rotated key part
``[rope]`` (what ``ModelSpec.kv_values_per_token`` counts); keys and values of all heads are expanded
from the latent with ``kv_b`` at each step, as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .families import ModelArgs
from .model import Rope, attention_mask, rms_norm
from .packed import linear

MLA_NORM_EPS = 1e-6
"""transformers builds the q_a / kv_a RMSNorms with their default epsilon, not the config's."""


class LatentCache:
    """``latent [S, kv_lora]`` and ``k_rot [S, rope]`` for ``S = max_context`` positions."""

    def __init__(self, max_context: int, kv_lora: int, rope: int, device, dtype):
        self.latent = torch.zeros(max_context, kv_lora, device=device, dtype=dtype)
        self.k_rot = torch.zeros(max_context, rope, device=device, dtype=dtype)

    def update(self, start: int | None, latent: torch.Tensor, k_rot: torch.Tensor, pos: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write positions ``start..start+T-1`` and return ``0..start+T-1``; ``start=None``: write at
        ``pos`` (device tensor) and return the whole cache."""
        if start is None:
            self.latent.index_copy_(0, pos, latent)
            self.k_rot.index_copy_(0, pos, k_rot)
            return self.latent, self.k_rot
        end = start + latent.shape[0]
        self.latent[start:end] = latent
        self.k_rot[start:end] = k_rot
        return self.latent[:end], self.k_rot[:end]

    @property
    def nbytes(self) -> int:
        return (self.latent.numel() + self.k_rot.numel()) * self.latent.element_size()


class MlaAttention:
    """One layer's MLA. ``w``: q (or q_a, q_a_norm, q_b), kv_a, kv_a_norm, kv_b, o on the accelerator."""

    def __init__(self, args: ModelArgs, layer: int, w: dict[str, torch.Tensor], cache: LatentCache):
        self.a, self.layer, self.w, self.cache = args, layer, w, cache
        m = args.mla
        self.kv_lora, self.nope, self.rope_dim, self.v = m["kv_lora_rank"], m["nope"], m["rope"], m["v"]
        self.scale = m["scale"]
        self.window = self.chunk = None

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, start: int | None, rope: Rope,
                 then: tuple | None = None) -> torch.Tensor:
        """The attention's output ``[T, H]`` (``then``, as ``model.Attention`` takes it: no fused
        output kernel here, so the output alone)."""
        a, w = self.a, self.w
        T, nH = x.shape[0], a.n_heads
        if "q" in w:
            q = linear(x, w["q"])
        else:
            q = linear(rms_norm(linear(x, w["q_a"]), w["q_a_norm"], MLA_NORM_EPS), w["q_b"])
        q = q.view(T, nH, self.nope + self.rope_dim)
        q_pass, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        kv = linear(x, w["kv_a"])  # [T, kv_lora + rope]
        latent, k_rot = kv.split([self.kv_lora, self.rope_dim], dim=-1)
        latent = rms_norm(latent, w["kv_a_norm"], MLA_NORM_EPS)
        q_rot = rope.apply(q_rot, pos)
        k_rot = rope.apply(k_rot[:, None, :], pos)[:, 0]
        latents, k_rots = self.cache.update(start, latent, k_rot, pos)  # [S, kv_lora], [S, rope]
        S = latents.shape[0]
        kv_full = F.linear(latents, w["kv_b"]).view(S, nH, self.nope + self.v)
        k_nope, values = kv_full.split([self.nope, self.v], dim=-1)
        keys = torch.cat([k_nope, k_rots[:, None, :].expand(S, nH, self.rope_dim)], dim=-1)
        query = torch.cat([q_pass, q_rot], dim=-1)
        mask = attention_mask(pos, S, None, None)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask[None, None], scale=self.scale,
        )  # [1, nH, T, v]
        return linear(out[0].transpose(0, 1).reshape(T, nH * self.v), w["o"], w.get("o_bias"))

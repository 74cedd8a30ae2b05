"""The decoder: embeddings, attention with a static KV cache, RoPE variants, dense MLPs, lm_head.

Plain tensors on the accelerator, no nn.Module tree: the engine attaches weights per placement and
the MoE part (``moe.MoeBlock``) decides where each expert runs. Shapes: ``T`` tokens in this call,
``H`` hidden size, ``nH``/``nKV`` query/key-value heads, ``hd`` head dim, ``S`` cached positions.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from . import gpu_kernels, out_norm
from .families import ModelArgs, RopeArgs
from .packed import cat_rows, linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 like transformers (``F.rms_norm`` accumulates in float32 and
    rounds once to ``x``'s dtype: one fused kernel on CUDA instead of eight); ``weight=None`` is
    Llama 4's L2 norm."""
    if weight is not None and weight.shape == x.shape[-1:] and weight.dtype == x.dtype:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # weight folded in: one kernel
    xn = F.rms_norm(x, (x.shape[-1],), eps=eps)
    return xn if weight is None else weight * xn


def swiglu(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` for ``x [T, H]``, nn.Linear-layout weights (tensors or
    ``packed.Packed``)."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


# -- rotary embeddings ---------------------------------------------------------------------------

def rope_inv_freq(rope: RopeArgs, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim/2]`` (float32) and the attention scaling of the RoPE variant."""
    p = rope.params
    base = rope.theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope.kind
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(p["factor"]), 1.0
    if kind == "llama3":
        factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, smoothed, out), 1.0
    if kind == "yarn":
        factor = float(p.get("factor") or 1.0)
        orig = float(p["original_max_position_embeddings"])
        att = p.get("attention_factor")
        if att is None:
            def mscale(s: float, m: float = 1.0) -> float:
                return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
            ms, msa = p.get("mscale"), p.get("mscale_all_dim")
            att = mscale(factor, ms) / mscale(factor, msa) if ms and msa else mscale(factor)
        beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

        def corr(rot: float) -> float:
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = corr(beta_fast), corr(beta_slow)
        if p.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extra = 1 - ramp
        pos = base ** (torch.arange(0, dim, 2).float() / dim)
        inv = (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra
        return inv, float(att)
    raise ValueError(f"RoPE type {kind!r} is not supported by the engine")


class Rope:
    """Cos/sin tables for positions ``0..max_context-1`` on the accelerator. ``freq_factors [hd/2]``
    (GGUF ``rope_freqs``) divide the inverse frequencies."""

    def __init__(self, rope: RopeArgs, head_dim: int, max_position: int, max_context: int, device,
                 freq_factors: torch.Tensor | None = None):
        inv, scale = rope_inv_freq(rope, head_dim, max_position)
        if freq_factors is not None:  # llama.cpp's rope_freqs: Llama 3 scaling as per-frequency divisors
            inv = inv / freq_factors.float()
        freqs = torch.arange(max_context, dtype=torch.float32)[:, None] * inv[None, :]  # [S, hd/2]
        self.interleaved = rope.interleaved
        self.halves_out = rope.pairs_out_as_halves
        if self.halves_out:
            self.cos = (freqs.cos() * scale).to(device)  # [S, hd/2]
            self.sin = (freqs.sin() * scale).to(device)
        elif self.interleaved:
            self.cis = (torch.polar(torch.ones_like(freqs), freqs) * scale).to(device)  # complex [S, hd/2]
        else:
            emb = torch.cat([freqs, freqs], dim=-1)
            self.cos = (emb.cos() * scale).to(device)  # [S, hd]
            sin = emb.sin() * scale
            self.sin = sin.to(device)
            half = sin.shape[-1] // 2  # rotate_half's sign folded into the table: three kernels, not five
            self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(device)

    def _tables(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, 1, d]`` for ``pos``, gathered once per forward pass (every layer passes the
        same ``pos`` tensor) instead of four kernels per layer and projection."""
        memo = getattr(self, "_memo", None)
        if memo is None or memo[0] is not pos or memo[1] != dtype:
            sin = getattr(self, "sin_signed", self.sin)
            memo = (pos, dtype, self.cos[pos][:, None, :].to(dtype), sin[pos][:, None, :].to(dtype))
            self._memo = memo
        return memo[2], memo[3]

    def apply(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, n, hd]`` for positions ``pos [T]``."""
        if self.halves_out:
            cos, sin = self._tables(pos, x.dtype)
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        if self.interleaved:
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(xc * self.cis[pos][:, None, :]).flatten(-2).type_as(x)
        cos, sin = self._tables(pos, x.dtype)  # sin: rotate_half's sign folded in
        half = x.shape[-1] // 2
        return torch.addcmul(x * cos, torch.cat([x[..., half:], x[..., :half]], dim=-1), sin)


# -- attention -----------------------------------------------------------------------------------

class KVCache:
    """Static per-layer cache ``k, v [S, nKV, hd]``.

    ``S = max_context`` positions, or for a layer that only sees the last ``span`` positions
    (sliding window, attention chunk) a ring of ``S = min(max_context, span)`` slots: position ``p``
    lives in slot ``p % S`` and ``slot_pos [S]`` (device, int64, -1 = empty) says which position
    each slot holds. A ring cannot go back: see ``resumable``.
    """

    def __init__(self, max_context: int, n_kv: int, head_dim: int, device, dtype, span: int | None = None):
        self.size = min(max_context, span) if span else max_context
        self.ring = self.size < max_context
        self.k = torch.zeros(self.size, n_kv, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros(self.size, n_kv, head_dim, device=device, dtype=dtype)
        self.slot_pos = torch.full((self.size,), -1, dtype=torch.long, device=device) if self.ring else None
        self.next_pos = 0  # one past the last position written; the engine keeps it (``resumable``)

    def resumable(self, start: int) -> bool:
        """Whether writing from position ``start`` keeps every earlier position a query there needs:
        always for a plain cache; for a ring, unless going back overwrote them (the ring keeps
        positions ``next_pos - S .. next_pos - 1``)."""
        if not self.ring or start == 0 or start >= self.next_pos:
            return True
        return max(0, start - self.size) >= self.next_pos - self.size

    def update(self, start: int | None, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write the new positions and return ``(keys, values, key_pos)`` to attend over.

        Plain cache: writes ``start..start+T-1``, returns positions ``0..start+T-1`` and
        ``key_pos=None``. ``start=None`` (static decode): writes at the device positions ``pos [T]``
        and returns the whole cache. Ring: returns the ring's slots (entries from ``start`` on are
        stale and marked -1) followed by the new keys, with every key's position in ``key_pos``.
        """
        if self.ring:
            return self._update_ring(start, k, v, pos)
        if start is None:
            self.k.index_copy_(0, pos, k)
            self.v.index_copy_(0, pos, v)
            return self.k, self.v, None
        end = start + k.shape[0]
        self.k[start:end] = k
        self.v[start:end] = v
        return self.k[:end], self.v[:end], None

    def _update_ring(self, start, k, v, pos):
        if start is None:  # one token, positions on the device only: the slot's old entry is out of reach
            slot = pos % self.size
            self.k.index_copy_(0, slot, k)
            self.v.index_copy_(0, slot, v)
            self.slot_pos.index_copy_(0, slot, pos)
            return self.k, self.v, self.slot_pos
        old = torch.where(self.slot_pos < start, self.slot_pos, -1)
        keys, values = torch.cat([self.k, k]), torch.cat([self.v, v])
        key_pos = torch.cat([old, pos])
        n = min(k.shape[0], self.size)  # the last S new positions stay
        slot = pos[-n:] % self.size
        self.k.index_copy_(0, slot, k[-n:])
        self.v.index_copy_(0, slot, v[-n:])
        self.slot_pos.index_copy_(0, slot, pos[-n:])
        return keys, values, key_pos

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def key_mask(pos: torch.Tensor, key_pos: torch.Tensor, window: int | None, chunk: int | None) -> torch.Tensor:
    """Boolean ``[T, K]``: query at ``pos[t]`` may attend the key at position ``key_pos[j]``
    (-1: an empty or stale slot)."""
    s = key_pos[None, :]
    q = pos[:, None]
    mask = (s >= 0) & (s <= q)
    if window is not None:
        mask &= s > q - window
    if chunk is not None:
        mask &= (s // chunk) == (q // chunk)
    return mask


def attention_mask(pos: torch.Tensor, end: int, window: int | None, chunk: int | None) -> torch.Tensor:
    """Boolean ``[T, end]``: query at ``pos[t]`` may attend key position ``s``."""
    s = torch.arange(end, device=pos.device)[None, :]
    q = pos[:, None]
    mask = s <= q
    if window is not None:
        mask &= s > q - window
    if chunk is not None:
        mask &= (s // chunk) == (q // chunk)
    return mask


STEP_MASKS: dict = {}
"""Masks of the current static decode step by ``(pos, S, window, chunk)``: layers with the same
attention shape share one (fewer kernels per step). ``graphs.DecodeStep`` clears it before each eager
step or capture and keeps the captured masks alive."""


def step_mask(pos: torch.Tensor, end: int, window: int | None, chunk: int | None) -> torch.Tensor:
    """``attention_mask`` for a static decode step, built once per step and attention shape."""
    key = (id(pos), end, window, chunk)
    mask = STEP_MASKS.get(key)
    if mask is None:
        mask = STEP_MASKS[key] = attention_mask(pos, end, window, chunk)
    return mask


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                         sinks: torch.Tensor) -> torch.Tensor:
    """gpt-oss attention: each head's softmax has one extra learned logit (``sinks [nH]``) that takes
    probability mass and is dropped. ``q [T, nH, hd]``, ``k``/``v [S, nKV, hd]`` -> ``[T, nH, hd]``."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [nH, S, hd]
    v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale  # [nH, T, S]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    sink = sinks.reshape(-1, 1, 1).expand(-1, scores.shape[1], 1).to(scores.dtype)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1)  # [T, nH, hd]


class Attention:
    """One layer's self-attention. ``w`` holds canonical tensors already on the accelerator."""

    def __init__(self, args: ModelArgs, layer: int, w: dict[str, torch.Tensor], cache: KVCache):
        self.a = args
        self.layer = layer
        self.w = w
        self.cache = cache
        self.use_rope = args.use_rope[layer]
        self.window = args.window[layer]
        self.chunk = args.chunk[layer]
        self.scale = args.head_dim ** -0.5
        self.fused = self._fuse_qkv() if FUSE_QKV or next(iter(w.values())).device.type == "cuda" else None

    def _fuse_qkv(self):
        """``(qkv [nq+2nk, H], bias or None, qk norm weight [nH+nKV, hd] or None)``: one projection,
        one head norm and one RoPE for q and k together (fewer kernel launches per decode step), where
        the layer allows it; ``w``'s q/k/v (and biases) become views of the fused tensors."""
        a, w = self.a, self.w
        if not all(r in w for r in ("q", "k", "v")) or a.clip_qkv is not None or a.qk_norm not in (None, "head"):
            return None
        if not self.use_rope and a.temperature_tuning is not None:
            return None
        biases = [w.get(f"{r}_bias") for r in "qkv"]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            return None
        nq, nk = w["q"].shape[0], w["k"].shape[0]
        qkv, (w["q"], w["k"], w["v"]) = cat_rows([w["q"], w["k"], w["v"]])
        bias = None
        if biases[0] is not None:
            bias = torch.cat(biases)
            w["q_bias"], w["k_bias"], w["v_bias"] = bias[:nq], bias[nq:nq + nk], bias[nq + nk:]
        norm = None
        if a.qk_norm == "head":
            norm = torch.cat([w["q_norm"].expand(a.n_heads, -1), w["k_norm"].expand(a.n_kv_heads, -1)])
        return qkv, bias, norm

    def _fused_qkv(self, x: torch.Tensor, pos: torch.Tensor, rope: Rope):
        a = self.a
        qkv_w, bias, norm = self.fused
        T, nh, nkv, hd = x.shape[0], a.n_heads, a.n_kv_heads, a.head_dim
        qkv = linear(x, qkv_w, bias)  # [T, (nH + 2 nKV) hd]
        qk = qkv[:, :(nh + nkv) * hd].view(T, nh + nkv, hd)
        v = qkv[:, (nh + nkv) * hd:].view(T, nkv, hd)
        if norm is not None:
            qk = rms_norm(qk, norm, a.rms_eps)
        if self.use_rope:
            qk = rope.apply(qk, pos)
        return qk[:, :nh], qk[:, nh:], v

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, start: int, rope: Rope, then: tuple | None = None):
        """The attention's output ``[T, H]``. ``then=(residual, norm weight, eps)`` (a static decode
        step): where the output projection, the residual add and that RMS norm can run as one kernel
        (``out_norm``), ``(residual + output, its norm)`` instead; otherwise the output alone, as
        without ``then``."""
        a, w = self.a, self.w
        T = x.shape[0]
        if self.fused is not None:
            if start is None and T == 1 and self._one_kernel(rope) and gpu_kernels.usable(x):
                return self._decode_in_place(x, pos, rope, then)
            q, k, v = self._fused_qkv(x, pos, rope)
            return self._attend(q, k, v, pos, start)
        q = linear(x, w["q"], w.get("q_bias"))  # [T, nH*hd]
        k = linear(x, w["k"], w.get("k_bias"))
        v = linear(x, w["v"], w.get("v_bias"))
        if a.qk_norm == "full":
            q, k = rms_norm(q, w["q_norm"], a.rms_eps), rms_norm(k, w["k_norm"], a.rms_eps)
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        q = q.view(T, a.n_heads, a.head_dim)
        k = k.view(T, a.n_kv_heads, a.head_dim)
        v = v.view(T, a.n_kv_heads, a.head_dim)
        if a.qk_norm == "head":
            q, k = rms_norm(q, w["q_norm"], a.rms_eps), rms_norm(k, w["k_norm"], a.rms_eps)
        if self.use_rope:
            q, k = rope.apply(q, pos), rope.apply(k, pos)
            if a.qk_norm == "l2":
                q, k = rms_norm(q, None, a.rms_eps), rms_norm(k, None, a.rms_eps)
        elif a.temperature_tuning is not None:
            attn_scale, floor_scale = a.temperature_tuning
            scales = torch.log1p(torch.floor((pos.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        return self._attend(q, k, v, pos, start)

    def _one_kernel(self, rope: Rope) -> bool:
        """Whether a static decode step can take q/k norm, RoPE and the cache write in one kernel."""
        hd = self.a.head_dim
        return (hd & (hd - 1)) == 0 and not (self.use_rope and (rope.interleaved or rope.halves_out))

    def _decode_in_place(self, x: torch.Tensor, pos: torch.Tensor, rope: Rope, then: tuple | None = None):
        """Static one-token step: projection, one kernel for head norm + RoPE + KV cache write, and
        (full attention) two for the attention; with ``then`` (``__call__``) the output projection,
        residual add and norm in one where ``out_norm`` takes them."""
        a = self.a
        qkv_w, bias, norm = self.fused
        c = self.cache
        q = gpu_kernels.qkv_rope_cache(
            linear(x, qkv_w, bias), norm, rope.cos if self.use_rope else None,
            rope.sin_signed if self.use_rope else None, pos, a.n_heads, a.n_kv_heads, c.k, c.v, c.slot_pos, a.rms_eps)
        if c.slot_pos is None and "sinks" not in self.w and (self.window or c.size) >= c.size and (
                self.chunk or c.size) >= c.size:  # every cached key up to pos: no mask, two kernels
            out = gpu_kernels.decode_attention(q, c.k, c.v, pos, self.scale)
            if then is not None and "o_bias" not in self.w and out_norm.wanted() and out_norm.usable(
                    out, self.w["o"], then[0], then[1]):
                return out_norm.out_add_norm(out, self.w["o"], *then)
            return linear(out, self.w["o"], self.w.get("o_bias"))
        return self._attend_all(q, c.k, c.v, c.slot_pos, pos)

    def _attend_all(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_pos: torch.Tensor | None,
                    pos: torch.Tensor) -> torch.Tensor:
        """``q [T, nH, hd]`` over ``keys``/``values [S, nKV, hd]`` under a mask from ``pos`` (and each
        key's position ``key_pos`` for a ring), projected: ``[T, H]``."""
        w = self.w
        if key_pos is not None:  # a ring: mask from each key's own position
            mask = key_mask(pos, key_pos, self.window, self.chunk)
        else:
            mask = step_mask(pos, keys.shape[0], self.window, self.chunk)
        if "sinks" in w:
            out = attention_with_sinks(q, keys, values, mask, self.scale, w["sinks"])
        else:
            out = _attend_masked(q, keys, values, mask, self.scale)
        return linear(out.reshape(q.shape[0], -1), w["o"], w.get("o_bias"))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, start: int | None):
        """Cache ``k, v [T, nKV, hd]``, attend with ``q [T, nH, hd]``, project: ``[T, H]``.
        ``start=None``: static decode (see ``Layer``), the whole cache masked by ``pos``; a ring
        cache (windowed layers) is always attended under a mask of its keys' positions."""
        a, w = self.a, self.w
        T = q.shape[0]
        keys, values, key_pos = self.cache.update(start, k, v, pos)  # [S', nKV, hd]
        if start is None or key_pos is not None:
            return self._attend_all(q, keys, values, key_pos, pos)
        plain = self.window is None and self.chunk is None and (T == 1 or start == 0)
        mask = None if plain and "sinks" not in w else attention_mask(pos, start + T, self.window, self.chunk)
        if "sinks" in w:
            out = attention_with_sinks(q, keys, values, mask, self.scale, w["sinks"])
            return linear(out.reshape(T, -1), w["o"], w.get("o_bias"))
        # Full attention needs no mask for one new token (it sees every cached key) nor for a prompt
        # from position 0 (causal): then SDPA takes its flash kernel. cuDNN's attention is left out
        # on CUDA: it built a new plan per KV length, ~2 ms of host time per layer and decode step.
        with _sdpa_backends(q.device):
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=None if plain else mask[None, None], is_causal=plain and T > 1, scale=self.scale,
                enable_gqa=a.n_heads != a.n_kv_heads,
            )  # [1, nH, T, hd]
        out = out[0].transpose(0, 1).reshape(T, a.n_heads * a.head_dim)
        return linear(out, w["o"], w.get("o_bias"))


def _attend_masked(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
                   ) -> torch.Tensor:
    """Attention of ``q [T, nH, hd]`` over ``keys``/``values [S, nKV, hd]`` under ``mask [T, S]`` ->
    ``[T, nH, hd]``. Grouped-query heads are folded into the query length (``[nKV, T*rep, hd]`` for one
    token), so every SDPA backend that takes a mask runs it and no key/value is repeated."""
    T, nH, hd = q.shape
    nKV = keys.shape[1]
    rep = nH // nKV
    qg = q.reshape(T, nKV, rep, hd).permute(1, 0, 2, 3).reshape(nKV, T * rep, hd)  # [nKV, T*rep, hd]
    # [T*rep, S]; one token's single row broadcasts over its rep query rows
    m = mask if T == 1 else mask[:, None, :].expand(T, rep, mask.shape[1]).reshape(T * rep, -1)
    with _sdpa_backends(q.device):
        out = F.scaled_dot_product_attention(qg[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                             attn_mask=m[None, None], scale=scale)  # [1, nKV, T*rep, hd]
    return out[0].reshape(nKV, T, rep, hd).permute(1, 0, 2, 3).reshape(T, nH, hd)


_NO_CUDNN = None
FUSE_QKV = False
"""Fuse q/k/v on a CPU accelerator too (tests); on CUDA they are always fused where possible."""


def _sdpa_backends(device: torch.device):
    """Context for SDPA: on CUDA every backend but cuDNN's; elsewhere PyTorch's choice."""
    global _NO_CUDNN
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if _NO_CUDNN is None:
        _NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(_NO_CUDNN)


class DenseMlp:
    """A dense SwiGLU MLP (dense layers; also a model's shared expert)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate, self.up, self.down)


class Layer:
    """Pre-norm decoder layer: ``x + attn(norm(x))`` then ``h + ffn(norm(h))``."""

    def __init__(self, attn: Attention, attn_norm: torch.Tensor, ffn_norm: torch.Tensor, ffn, eps: float):
        self.attn, self.attn_norm, self.ffn_norm, self.ffn, self.eps = attn, attn_norm, ffn_norm, ffn, eps

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, start: int, rope: Rope) -> torch.Tensor:
        h = self.attend(x, pos, start, rope)
        return h + self.ffn(rms_norm(h, self.ffn_norm, self.eps))

    def attend(self, x: torch.Tensor, pos: torch.Tensor, start: int | None, rope: Rope) -> torch.Tensor:
        """The attention half ``x + attn(norm(x))`` ``[T, H]``. ``start=None`` is the static decode
        form used under CUDA graphs: positions only in the device tensor ``pos``, the KV cache
        written with ``index_copy_`` and attended in full under a mask (fixed shapes, no host value)."""
        return x + self.attn(rms_norm(x, self.attn_norm, self.eps), pos, start, rope)

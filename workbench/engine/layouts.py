"""Where each family keeps each weight, in one canonical layout whatever the file.

``FamilyWeights`` answers "give me layer 3's q projection": HF safetensors names (per-expert or fused
expert tensors, MXFP4 blocks, FP8 with block scales) or llama.cpp GGUF names, with llama.cpp's
rewrites undone (Mixtral's permuted Q/K rows, DeepSeek's split kv_b) in this one module.

Canonical layouts (``nn.Linear`` convention, out x in): q ``[nH*hd, H]``, k/v ``[nKV*hd, H]``,
o ``[H, nH*hd]``, router ``[E, H]``, expert ``w13 [2I, H]`` (gate rows then up rows), ``w2 [H, I]``.
"""

from __future__ import annotations

import torch

from workbench.core.errors import ModelFormatError
from workbench.core.memory import kept_in_blocks

from .blocks import expert_formats
from .families import ModelArgs
from .packed import Packed
from .weights import WeightReader

_HF_ATTN = {"q": "q_proj.weight", "k": "k_proj.weight", "v": "v_proj.weight", "o": "o_proj.weight",
            "q_bias": "q_proj.bias", "k_bias": "k_proj.bias", "v_bias": "v_proj.bias", "o_bias": "o_proj.bias",
            "q_norm": "q_norm.weight", "k_norm": "k_norm.weight", "sinks": "sinks",
            "q_a": "q_a_proj.weight", "q_a_norm": "q_a_layernorm.weight", "q_b": "q_b_proj.weight",
            "kv_a": "kv_a_proj_with_mqa.weight", "kv_a_norm": "kv_a_layernorm.weight", "kv_b": "kv_b_proj.weight"}
_GGUF_LAYER = {"q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "o": "attn_output.weight",
               "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
               "o_bias": "attn_output.bias", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
               "sinks": "attn_sinks.weight", "attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight",
               "router": "ffn_gate_inp.weight", "router_bias": "ffn_gate_inp.bias",
               "shared_gate": "ffn_gate_shexp.weight", "shared_up": "ffn_up_shexp.weight",
               "shared_down": "ffn_down_shexp.weight", "shared_router": "ffn_gate_inp_shexp.weight",
               "mlp_gate": "ffn_gate.weight", "mlp_up": "ffn_up.weight", "mlp_down": "ffn_down.weight",
               "score_bias": "exp_probs_b.bias", "q_a": "attn_q_a.weight", "q_a_norm": "attn_q_a_norm.weight",
               "q_b": "attn_q_b.weight", "kv_a": "attn_kv_a_mqa.weight", "kv_a_norm": "attn_kv_a_norm.weight",
               "kv_b": "attn_kv_b.weight"}
_GGUF_MODEL = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
_GGUF_ARCH_PERMUTES_QK = {"llama"}  # llama.cpp's llama converter (Mixtral, Llama, Mistral) permutes Q/K rows


class FamilyWeights:
    """Canonical tensors of one model (CPU, stored dtype or float32), by role, from either format."""

    def __init__(self, reader: WeightReader, args: ModelArgs):
        self.reader = reader
        self.args = args
        self.gguf = reader.inventory.format == "gguf"
        if not self.gguf:
            self.prefix = self._find_prefix()
            self.mlp = {"mixtral": "block_sparse_moe", "llama4": "feed_forward"}.get(args.family, "mlp")

    def _find_prefix(self) -> str:
        for p in ("model.", "language_model.model.", "model.language_model."):
            if self.reader.has(p + "embed_tokens.weight"):
                return p
        raise ModelFormatError(f"{self.reader.inventory.path.name}: no embed_tokens tensor found")

    # -- names -----------------------------------------------------------------------------------

    def _hf_name(self, role: str, layer: int | None) -> str:
        a, p = self.args, self.prefix
        if layer is None:
            if role == "lm_head":
                return p.replace("model.", "", 1) + "lm_head.weight" if p != "model.language_model." \
                    else "lm_head.weight"
            return p + {"embed": "embed_tokens.weight", "norm": "norm.weight"}[role]
        lp = f"{p}layers.{layer}."
        if role in _HF_ATTN:
            return lp + "self_attn." + _HF_ATTN[role]
        if role == "attn_norm":
            return lp + "input_layernorm.weight"
        if role == "ffn_norm":
            return lp + "post_attention_layernorm.weight"
        m = lp + self.mlp + "."
        if role in ("router", "router_bias"):
            suffix = "weight" if role == "router" else "bias"
            return m + (f"router.{suffix}" if a.family in ("llama4", "gpt_oss") else f"gate.{suffix}")
        if role == "score_bias":
            return m + "gate.e_score_correction_bias"
        if role.startswith("shared_"):
            if role == "shared_router":
                return m + "shared_expert_gate.weight"
            shared = "shared_experts" if a.family.startswith("deepseek") else "shared_expert"
            return m + f"{shared}.{role[7:]}_proj.weight"
        if role.startswith("mlp_"):
            return m + f"{role[4:]}_proj.weight"
        raise KeyError(role)

    def name(self, role: str, layer: int | None = None) -> str:
        """File tensor name of ``role`` (``"q"``, ``"router"``, ``"embed"``...) in ``layer``."""
        if self.gguf:
            if layer is None:
                return _GGUF_MODEL[role]
            if role == "ffn_norm" and self.args.family == "gpt_oss":
                return f"blk.{layer}.post_attention_norm.weight"
            return f"blk.{layer}." + _GGUF_LAYER[role]
        return self._hf_name(role, layer)

    # -- tensors ---------------------------------------------------------------------------------

    def has(self, role: str, layer: int | None = None) -> bool:
        if role == "kv_b" and self.gguf:
            return self.reader.has(f"blk.{layer}.attn_k_b.weight") or self.reader.has(self.name(role, layer))
        return self.reader.has(self.name(role, layer))

    def get(self, role: str, layer: int | None = None) -> torch.Tensor:
        """Tensor of ``role`` in canonical layout (a zero-copy file view when no transform applies)."""
        if role == "lm_head" and not self.has("lm_head"):
            role = "embed"  # tied embeddings
        if role == "kv_b" and self.gguf and self.reader.has(f"blk.{layer}.attn_k_b.weight"):
            return self._kv_b_from_halves(layer)
        t = self._read(self.name(role, layer))
        if self.gguf:
            t = self._undo_gguf(role, t)
        if role == "shared_router":
            t = t.reshape(1, -1)
        return t

    def blocks(self, role: str, layer: int | None = None):
        """``role``'s matrix as a ``packed.Packed`` on the CPU (views of the file) when the engine keeps
        it in the file's blocks (``memory.kept_in_blocks``: a GGUF Q8_0 / Q4_K / Q5_K / Q6_K projection,
        embedding or head), with llama.cpp's Q/K row permutation undone; else None."""
        if not self.gguf:
            return None
        if role == "lm_head" and not self.has("lm_head"):
            role = "embed"  # tied embeddings
        name = self.name(role, layer)
        if not self.reader.has(name):
            return None
        info = self.reader.info(name)
        if not kept_in_blocks(info) or len(info.shape) != 2:
            return None
        fmt, parts = self.reader.blocks(name)
        return Packed(fmt, [self._undo_gguf(role, p) for p in parts], info.shape[-1])  # rows permute as values do

    def _read(self, name: str, expert: int | None = None) -> torch.Tensor:
        """Tensor ``name`` (expert ``expert`` of a stacked one); FP8 weights with a block-scale
        companion (``*.weight_scale_inv``, DeepSeek-V3 / Qwen3 FP8 checkpoints) come dequantized."""
        t = self.reader.tensor(name, expert)
        if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return t
        scale_name = name.removesuffix(".weight") + ".weight_scale_inv" if name.endswith(".weight") \
            else name + "_scale_inv"
        if not self.reader.has(scale_name):
            return t.float()
        return fp8_block_dequantize(t, self.reader.tensor(scale_name, expert), self.fp8_block)

    @property
    def fp8_block(self) -> tuple[int, int]:
        q = self.reader.inventory.config.get("quantization_config") or {}
        rows, cols = q.get("weight_block_size") or (128, 128)
        return int(rows), int(cols)

    def _undo_gguf(self, role: str, t: torch.Tensor) -> torch.Tensor:
        a = self.args
        arch = self.reader.inventory.metadata.get("general.architecture")
        if arch in _GGUF_ARCH_PERMUTES_QK and role in ("q", "k", "q_bias", "k_bias"):
            heads = a.n_heads if role.startswith("q") else a.n_kv_heads
            t = _unpermute_rows(t, heads)
        return t

    def rope_factors(self) -> torch.Tensor | None:
        """GGUF ``rope_freqs.weight [hd/2]`` (llama.cpp's form of Llama 3 RoPE scaling), or None."""
        if self.gguf and self.reader.has("rope_freqs.weight"):
            return self.reader.tensor("rope_freqs.weight").float()
        return None

    def _kv_b_from_halves(self, layer: int) -> torch.Tensor:
        """llama.cpp splits MLA's ``kv_b [nH*(nope+v), kv_lora]`` into ``attn_k_b [nH, kv_lora, nope]``
        and ``attn_v_b [nH, v, kv_lora]``; put it back together."""
        k_b = self.reader.tensor(f"blk.{layer}.attn_k_b.weight")
        v_b = self.reader.tensor(f"blk.{layer}.attn_v_b.weight")
        kv = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [nH, nope+v, kv_lora]
        return kv.reshape(-1, kv.shape[-1])

    def expert_biases(self, layer: int, e: int) -> dict | None:
        """gpt-oss expert biases ``{"b13": (gate [I], up [I]), "b2": [H]}``, or None."""
        if not self.args.expert_bias:
            return None
        if self.gguf:
            g, u, d = (self.reader.tensor(f"blk.{layer}.ffn_{p}_exps.bias", e) for p in ("gate", "up", "down"))
            return {"b13": (g, u), "b2": d}
        m = f"{self.prefix}layers.{layer}.{self.mlp}.experts."
        b = self.reader.tensor(m + "gate_up_proj_bias", e)
        return {"b13": (b[::2], b[1::2]), "b2": self.reader.tensor(m + "down_proj_bias", e)}

    def expert_blocks(self, layer: int, e: int) -> dict | None:
        """Expert ``e`` of ``layer`` in the GGUF's quantized blocks, as stored (``WeightReader.blocks``):
        ``{"fmt": (gate/up format, down format), "w13": (gate tensors, up tensors), "w2": down tensors}``
        (formats of ``blocks.FORMATS``), or None unless the file is a GGUF holding the three expert
        matrices in formats the kernels pair (``blocks.expert_formats``), or a gpt-oss checkpoint
        holding them as MXFP4 ``*_blocks`` / ``*_scales`` (repacked into GGUF's MXFP4 blocks: the same
        values, bit for bit)."""
        if not self.gguf:
            m = f"{self.prefix}layers.{layer}.{self.mlp}.experts."
            if not self.reader.has(m + "gate_up_proj_blocks"):
                return None
            gu = mxfp4_as_gguf(self.reader.tensor(m + "gate_up_proj_blocks", e),
                               self.reader.tensor(m + "gate_up_proj_scales", e))  # [2I, ...], interleaved
            d = mxfp4_as_gguf(self.reader.tensor(m + "down_proj_blocks", e), self.reader.tensor(m + "down_proj_scales", e))
            return {"fmt": ("mxfp4", "mxfp4"), "w13": ([gu[::2]], [gu[1::2]]), "w2": [d]}
        parts = [self.reader.blocks(f"blk.{layer}.ffn_{p}_exps.weight", e) for p in ("gate", "up", "down")]
        if any(p is None for p in parts):
            return None
        (f13, g), (fu, u), (f2, d) = parts
        fmt = expert_formats(f13, fu, f2)
        return None if fmt is None else {"fmt": fmt, "w13": (g, u), "w2": d}

    def expert(self, layer: int, e: int) -> dict:
        """Expert ``e`` of ``layer``: ``{"w13": (gate [I, H], up [I, H]), "w2": [H, I]}`` (CPU views of
        the file where the layout allows, dequantized float32 for quantized GGUF)."""
        if self.gguf:
            g = self.reader.tensor(f"blk.{layer}.ffn_gate_exps.weight", e)
            u = self.reader.tensor(f"blk.{layer}.ffn_up_exps.weight", e)
            d = self.reader.tensor(f"blk.{layer}.ffn_down_exps.weight", e)
            return {"w13": (g, u), "w2": d}
        m = f"{self.prefix}layers.{layer}.{self.mlp}.experts."
        if self.reader.has(m + "gate_up_proj_blocks"):  # gpt-oss checkpoints: MXFP4 blocks + scales
            gu = mxfp4_rows(self.reader.tensor(m + "gate_up_proj_blocks", e),
                            self.reader.tensor(m + "gate_up_proj_scales", e))  # [2I, H], interleaved
            d = mxfp4_rows(self.reader.tensor(m + "down_proj_blocks", e), self.reader.tensor(m + "down_proj_scales", e))
            return {"w13": (gu[::2], gu[1::2]), "w2": d}
        if self.reader.has(m + "gate_up_proj"):
            gu = self._read(m + "gate_up_proj", e)
            d = self._read(m + "down_proj", e)
            if self.args.family == "gpt_oss":  # [H, 2I] with gate/up interleaved, [I, H]
                return {"w13": (gu[:, ::2].t(), gu[:, 1::2].t()), "w2": d.t()}
            if self.args.family == "llama4":  # stored [H, 2I] and [I, H]: x @ W
                gu, d = gu.t(), d.t()
            half = gu.shape[0] // 2
            return {"w13": (gu[:half], gu[half:]), "w2": d}
        names = ("w1", "w3", "w2") if self.args.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        g, u, d = (self._read(f"{m}{e}.{n}.weight") for n in names)
        return {"w13": (g, u), "w2": d}


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of Q/K rows (HF halves layout -> GGML pairs layout)."""
    shape = w.shape
    rest = shape[1:]
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *rest).transpose(1, 2).reshape(shape)


_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OCP MXFP4 as gpt-oss checkpoints store it -> float32 ``[rows, G * 32]``.

    ``blocks [rows, G, 16]`` (uint8, two e2m1 values a byte, low nibble first) and ``scales
    [rows, G]`` (uint8 e8m0: the power of two ``scale - 127`` of each 32-value group).
    """
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.int64)
    vals = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # [rows, G, 32]
    vals = torch.ldexp(vals, (scales.to(torch.int32) - 127)[..., None].float())
    return vals.reshape(vals.shape[0], -1)


def mxfp4_as_gguf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss checkpoints' MXFP4 (``blocks [rows, G, 16]``: byte j holds values 2j (low nibble) and
    2j + 1; ``scales [rows, G]``: E8M0 exponents) -> GGUF's MXFP4 blocks, uint8 ``[rows, G * 17]``:
    each block its exponent, then byte j holding values j (low nibble) and j + 16. The FP4 codes and
    exponents are the same numbers (GGUF doubles the values and halves the scale)."""
    b = blocks.to(torch.int16)
    idx = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)  # [rows, G, 32] in value order
    qs = (idx[..., :16] | (idx[..., 16:] << 4)).to(torch.uint8)
    return torch.cat([scales.to(torch.uint8)[..., None], qs], dim=-1).reshape(blocks.shape[0], -1)


def fp8_block_dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w [N, K]`` (FP8) times its per-block scales ``scale_inv [ceil(N/bn), ceil(K/bk)]`` -> float32."""
    n, k = w.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :n, :]
    s = s.repeat_interleave(block[1], dim=-1)[..., :k]
    return w.float() * s

"""Synthetic MoE models written as real GGUF files, for benchmarks (scenario S1 and friends).

The files use llama.cpp's architecture names and tensor layout, so llama.cpp and our engine run the
very same bytes. Weights are tiles of one random block per tensor kind (drawing 30 GB of normals
would take minutes); each tensor starts at its own offset into a block whose length is not a
multiple of any row, so rows and experts differ. Data is streamed to the file chunk by chunk:
writing S1 (~30 GB of bf16) holds well under 1 GB in RAM.

Routing skew is built into the router weights. Every token embedding is ``alpha*sqrt(H)*u + n``
(``u`` one unit vector, ``n`` noise): after RMSNorm each hidden state has the same component
``m = alpha*sqrt(H)/sqrt(alpha^2+1)`` along ``u``. Router row ``e`` of layer ``l`` is
``(beta*z[rank]/m)*u + g_e`` with ``g_e`` random and orthogonal to ``u``, so the router logits are
``beta*z[rank_l(e)] + N(0, 1)`` per token: ``z`` decays with an expert's rank (a different random
ranking per layer), and ``beta`` is calibrated so that the top ``hot_fraction`` of a layer's
experts serve ``coverage`` of its selections. ``coverage=None`` gives uniform routing (beta = 0);
a list gives each layer its own coverage (None entries: uniform layers).
Branch outputs (attention output and expert down projections) are kept small so the residual
stream keeps its component along ``u`` through all layers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from workbench.core.errors import WorkbenchError
from workbench.core.kquants import quantize_k
from workbench.core.spec import ModelSpec

log = logging.getLogger(__name__)

WEIGHT_TYPES = ("bf16", "q8_0", "q4_k", "q2_k", "q3_k", "q5_k", "q6_k", "iq4_xs", "mxfp4")
"""Formats of the 2-D weights (token embedding and norms excepted) a synthetic file can hold;
``mxfp4`` is the routed experts' alone, the rest bf16, as gpt-oss's GGUF files store them."""

ALPHA = 1.0  # weight of the shared direction u in every token embedding (noise has rms 1)
_CHUNK = 64 << 20  # bytes per write
_BLOCK_ELEMS = (1 << 21) + 15  # bf16 tile length: odd, so no row length divides it
_QBLOCKS = 20011  # quantized tile length in blocks (prime)
_SUPER_BYTES = {"q2_k": 84, "q3_k": 110, "q4_k": 144, "q5_k": 176, "q6_k": 210, "iq4_xs": 136}  # per 256 values


@dataclass(frozen=True)
class SynthShape:
    """Architecture of a synthetic model. ``arch`` is the GGUF ``general.architecture``."""

    name: str
    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    n_active: int
    expert_ffn: int
    vocab: int
    shared_ffn: int = 0
    qk_norm: bool = False
    rope_base: float = 1e6

    def spec(self) -> ModelSpec:
        """The ModelSpec a reader of the written file should find."""
        family = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "llama": "mixtral"}[self.arch]
        return ModelSpec(
            family=family, n_layers=self.n_layers, hidden_size=self.hidden, vocab_size=self.vocab,
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            n_experts=self.n_experts, n_experts_active=self.n_active,
            n_shared_experts=1 if self.shared_ffn else 0, expert_ffn=self.expert_ffn,
            shared_ffn=self.shared_ffn, moe_layers=tuple(range(self.n_layers)),
            layer_window=(None,) * self.n_layers,
        )


SHAPES: dict[str, SynthShape] = {
    # S1: Qwen3-30B-A3B with 24 of its 48 layers
    "s1": SynthShape("s1", "qwen3moe", 24, 2048, 32, 4, 128, 128, 8, 768, 151936, qk_norm=True),
    "qwen3-30b-a3b": SynthShape("qwen3-30b-a3b", "qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, 151936,
                                qk_norm=True),
    "mixtral-8x7b": SynthShape("mixtral-8x7b", "llama", 32, 4096, 32, 8, 128, 8, 2, 14336, 32000,
                               rope_base=1e6),
    # gpt-oss-120b's MoE and attention sizes in the qwen3moe layout (no sinks, no biases, bf16 experts)
    "gpt-oss-120b-like": SynthShape("gpt-oss-120b-like", "qwen3moe", 36, 2880, 64, 8, 64, 128, 4, 2880,
                                    201088, qk_norm=True, rope_base=1.5e5),
    # DeepSeek-V2-Lite's MoE sizes (64 routed + shared FFN 2x1408) in the qwen2moe layout, GQA
    # attention instead of MLA, every layer MoE
    "deepseek-v2-lite-like": SynthShape("deepseek-v2-lite-like", "qwen2moe", 27, 2048, 16, 16, 128, 64, 6,
                                        1408, 102400, shared_ffn=2816, rope_base=1e4),
    # a few MB, for tests and quick checks of the whole pipeline
    "tiny": SynthShape("tiny", "qwen3moe", 2, 256, 4, 2, 64, 20, 2, 256, 1000, qk_norm=True),
}


def shape(name: str, n_layers: int | None = None) -> SynthShape:
    """A shape from SHAPES by name, optionally with another layer count."""
    if name not in SHAPES:
        raise WorkbenchError(f"unknown synthetic shape {name!r}; choose from {', '.join(SHAPES)}")
    s = SHAPES[name]
    if n_layers is not None:
        if n_layers < 1:
            raise WorkbenchError(f"a model needs at least one layer, not {n_layers}")
        s = replace(s, n_layers=n_layers)
    return s


# ---------------------------------------------------------------- routing skew

def rank_profile(n_experts: int, hot_fraction: float = 0.1) -> np.ndarray:
    """Logit bias shape by expert rank: ``exp(-rank / (hot_fraction*E))``, [E] float64."""
    scale = max(hot_fraction * n_experts, 1.0)
    return np.exp(-np.arange(n_experts) / scale)


def coverage(counts: np.ndarray, hot_fraction: float = 0.1) -> np.ndarray:
    """Share of selections served by the most used ``hot_fraction`` of experts, per layer.

    ``counts``: [L, E] (or [E]) selection counts. Returns [L] (or a scalar array) in [0, 1].
    """
    c = np.atleast_2d(np.asarray(counts, dtype=np.float64))
    k = max(1, int(round(hot_fraction * c.shape[1])))
    top = -np.sort(-c, axis=1)[:, :k].sum(axis=1)
    out = top / np.maximum(c.sum(axis=1), 1e-300)
    return out if np.ndim(counts) > 1 else out[0]


def simulate_coverage(beta: float, n_experts: int, n_active: int, *, hot_fraction: float = 0.1,
                      n_tokens: int = 4000, seed: int = 0) -> float:
    """Coverage of the top ``hot_fraction`` experts when logits are ``beta*profile + N(0,1)``."""
    rng = np.random.default_rng(seed)
    logits = beta * rank_profile(n_experts, hot_fraction) + rng.standard_normal((n_tokens, n_experts))
    top = np.argpartition(-logits, n_active - 1, axis=1)[:, :n_active]
    counts = np.bincount(top.ravel(), minlength=n_experts)
    return float(coverage(counts, hot_fraction))


def calibrate_beta(target: float, n_experts: int, n_active: int, hot_fraction: float = 0.1) -> float:
    """The bias scale ``beta`` whose simulated coverage is ``target`` (bisection)."""
    floor = simulate_coverage(0.0, n_experts, n_active, hot_fraction=hot_fraction)
    n_hot = max(1, int(round(hot_fraction * n_experts)))
    ceil = min(1.0, n_hot / n_active)  # a token picks at most n_hot of its n_active experts among the hot
    if not floor - 1e-9 <= target < ceil:
        raise WorkbenchError(f"routing coverage must be in [{floor:.2f}, {ceil:.2f}) for {n_experts} experts "
                             f"with {n_active} active, not {target}")
    lo, hi = 0.0, 32.0
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if simulate_coverage(mid, n_experts, n_active, hot_fraction=hot_fraction) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def layer_betas(s: SynthShape, coverage_target) -> np.ndarray:
    """[L] bias scales for ``coverage_target``: None, one coverage for every layer, or one per layer."""
    if coverage_target is None or np.isscalar(coverage_target):
        targets = [coverage_target] * s.n_layers
    else:
        targets = list(coverage_target)
        if len(targets) != s.n_layers:
            raise WorkbenchError(f"{len(targets)} per-layer coverages given for {s.n_layers} layers")
    cache: dict[float, float] = {}
    out = np.zeros(s.n_layers)
    for layer, t in enumerate(targets):
        if t is None:
            continue
        if t not in cache:
            cache[t] = calibrate_beta(float(t), s.n_experts, s.n_active)
        out[layer] = cache[t]
    return out


def _targets_meta(s: SynthShape, coverage_target) -> tuple[float, list[float]]:
    """(mean target or -1 for uniform, per-layer targets with -1 for uniform layers)."""
    if coverage_target is None or np.isscalar(coverage_target):
        per = [-1.0 if coverage_target is None else float(coverage_target)] * s.n_layers
    else:
        per = [-1.0 if t is None else float(t) for t in coverage_target]
    set_ = [t for t in per if t >= 0]
    return (float(np.mean(set_)) if set_ else -1.0), per


def expert_ranks(n_layers: int, n_experts: int, seed: int) -> np.ndarray:
    """[L, E]: rank of each expert in its layer (0 = hottest), a fresh permutation per layer."""
    rng = np.random.default_rng([seed, 7])
    return np.stack([rng.permutation(n_experts) for _ in range(n_layers)])


def shared_direction(hidden: int, seed: int) -> np.ndarray:
    """The unit vector ``u`` [H] every token embedding shares (float64)."""
    u = np.random.default_rng([seed, 3]).standard_normal(hidden)
    return u / np.linalg.norm(u)


def router_weights(s: SynthShape, layer: int, beta: float, seed: int) -> np.ndarray:
    """Router of one layer, [E, H] float32, giving logits ``beta*profile[rank] + N(0,1)``."""
    h = s.hidden
    u = shared_direction(h, seed)
    m = ALPHA * np.sqrt(h) / np.sqrt(ALPHA**2 + 1.0)
    rng = np.random.default_rng([seed, 11, layer])
    g = rng.standard_normal((s.n_experts, h)) * (np.sqrt(ALPHA**2 + 1.0) / np.sqrt(h))
    g -= np.outer(g @ u, u)  # orthogonal to u: no per-expert constant bias in the uniform case
    ranks = expert_ranks(s.n_layers, s.n_experts, seed)[layer]
    bias = beta * rank_profile(s.n_experts)[ranks] / m
    return (g + np.outer(bias, u)).astype(np.float32)


# ---------------------------------------------------------------- tensor data

def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even); returns the raw uint16 bits, same shape."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _quant_block(wtype: str, std: float, rng: np.random.Generator) -> bytes:
    """``_QBLOCKS`` random GGUF blocks of ``wtype`` whose values have about ``std`` spread."""
    from gguf import GGMLQuantizationType, quants

    if wtype == "q8_0":
        qt, nb = GGMLQuantizationType.Q8_0, 34
        raw = np.empty((_QBLOCKS, nb), np.uint8)
        raw[:, 2:] = rng.integers(-127, 128, (_QBLOCKS, 32), dtype=np.int8).view(np.uint8)
        scale_std = 1.0 / 73.3  # std of uniform ints in [-127, 127]
        d = np.full(_QBLOCKS, std * scale_std, np.float16)
        raw[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    elif wtype == "q4_k":
        qt, nb = GGMLQuantizationType.Q4_K, 144
        raw = rng.integers(0, 256, (_QBLOCKS, nb), dtype=np.uint8)
        # value = d*sc*q - dmin*m, q in 0..15, sc and m in 0..63: dmin = 7.5 d centres it
        d1 = np.ones(_QBLOCKS, np.float16)
        raw[:, 0:2] = d1.view(np.uint8).reshape(-1, 2)
        raw[:, 2:4] = (d1 * np.float16(7.5)).view(np.uint8).reshape(-1, 2)
        got = float(quants.dequantize(raw[:256].reshape(-1), qt).std())
        d = np.full(_QBLOCKS, std / got, np.float16)
        raw[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        raw[:, 2:4] = (d * np.float16(7.5)).view(np.uint8).reshape(-1, 2)
    elif wtype in _SUPER_BYTES:  # the other k-quants and IQ4_XS: normal values through the writer's encoder
        raw = quantize_k(rng.normal(0.0, std, (_QBLOCKS, 256)).astype(np.float32), wtype.upper())
    elif wtype == "mxfp4":  # normal values through gguf-py's encoder
        raw = quants.quantize(rng.normal(0.0, std, (_QBLOCKS, 32)).astype(np.float32), GGMLQuantizationType.MXFP4)
    else:
        raise WorkbenchError(f"unknown weight type {wtype!r}; choose from {', '.join(WEIGHT_TYPES)}")
    return raw.tobytes()


@dataclass
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order
    gtype: str  # "f32", "bf16" or one of WEIGHT_TYPES
    kind: str  # "tile", "embed", "router", "ones", "small"
    std: float = 0.0
    layer: int = -1

    @property
    def nbytes(self) -> int:
        n = int(np.prod(self.shape))
        if self.gtype in _SUPER_BYTES:
            return n // 256 * _SUPER_BYTES[self.gtype]
        return {"f32": 4 * n, "bf16": 2 * n, "q8_0": n // 32 * 34, "mxfp4": n // 32 * 17}[self.gtype]


def tensor_list(s: SynthShape, wtype: str = "bf16") -> list[_Tensor]:
    """The tensors of the file in write order, with llama.cpp's names (numpy-order shapes)."""
    if wtype not in WEIGHT_TYPES:
        raise WorkbenchError(f"unknown weight type {wtype!r}; choose from {', '.join(WEIGHT_TYPES)}")
    h, q, kv = s.hidden, s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    e, i = s.n_experts, s.expert_ffn

    def fmt(row: int) -> str:  # llama.cpp's quantizer also falls back where rows don't fit the block
        if wtype == "mxfp4":  # gpt-oss's files: the experts alone in MXFP4
            return "bf16"
        if wtype in _SUPER_BYTES and row % 256:
            return "q8_0" if row % 32 == 0 else "bf16"
        if wtype == "q8_0" and row % 32:
            return "bf16"
        return wtype

    def efmt(row: int) -> str:  # the routed experts'
        return ("mxfp4" if row % 32 == 0 else "bf16") if wtype == "mxfp4" else fmt(row)

    t = [_Tensor("token_embd.weight", (s.vocab, h), "bf16", "embed")]
    for layer in range(s.n_layers):
        p = f"blk.{layer}."
        t += [
            _Tensor(p + "attn_norm.weight", (h,), "f32", "ones"),
            _Tensor(p + "attn_q.weight", (q, h), fmt(h), "tile", 0.02),
            _Tensor(p + "attn_k.weight", (kv, h), fmt(h), "tile", 0.02),
            _Tensor(p + "attn_v.weight", (kv, h), fmt(h), "tile", 0.02),
            _Tensor(p + "attn_output.weight", (h, q), fmt(q), "tile", 0.002),
        ]
        if s.qk_norm:
            t += [_Tensor(p + "attn_q_norm.weight", (s.head_dim,), "f32", "ones"),
                  _Tensor(p + "attn_k_norm.weight", (s.head_dim,), "f32", "ones")]
        t += [
            _Tensor(p + "ffn_norm.weight", (h,), "f32", "ones"),
            _Tensor(p + "ffn_gate_inp.weight", (e, h), "f32", "router", layer=layer),
            _Tensor(p + "ffn_gate_exps.weight", (e, i, h), efmt(h), "tile", 0.02),
            _Tensor(p + "ffn_up_exps.weight", (e, i, h), efmt(h), "tile", 0.02),
            _Tensor(p + "ffn_down_exps.weight", (e, h, i), efmt(i), "tile", 0.002),
        ]
        if s.shared_ffn:
            t += [
                _Tensor(p + "ffn_gate_inp_shexp.weight", (h,), "f32", "small", 0.02),
                _Tensor(p + "ffn_gate_shexp.weight", (s.shared_ffn, h), fmt(h), "tile", 0.02),
                _Tensor(p + "ffn_up_shexp.weight", (s.shared_ffn, h), fmt(h), "tile", 0.02),
                _Tensor(p + "ffn_down_shexp.weight", (h, s.shared_ffn), fmt(s.shared_ffn), "tile", 0.002),
            ]
    t += [_Tensor("output_norm.weight", (h,), "f32", "ones"),
          _Tensor("output.weight", (s.vocab, h), fmt(h), "tile", 0.02)]
    return t


class _Tiles:
    """One random block per (format, std); a tensor reads it cyclically from its own offset."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng([seed, 5])
        self.blocks: dict[tuple[str, float], bytes] = {}

    def block(self, gtype: str, std: float) -> bytes:
        key = (gtype, std)
        if key not in self.blocks:
            if gtype == "bf16":
                self.blocks[key] = f32_to_bf16(self.rng.standard_normal(_BLOCK_ELEMS, np.float32) * std).tobytes()
            else:
                self.blocks[key] = _quant_block(gtype, std, self.rng)
        return self.blocks[key]

    def write(self, f, t: _Tensor) -> None:
        blk = self.block(t.gtype, t.std)
        unit = {"bf16": 2, "q8_0": 34, "mxfp4": 17, **_SUPER_BYTES}[t.gtype]
        pos = int(self.rng.integers(0, len(blk) // unit)) * unit
        view, left = memoryview(blk), t.nbytes
        while left:
            n = min(left, len(blk) - pos)
            f.write(view[pos:pos + n])
            left -= n
            pos = 0


def _embed_rows(s: SynthShape, seed: int, rows: slice, noise: np.ndarray | None = None) -> np.ndarray:
    """Token embeddings ``alpha*sqrt(H)*u + noise`` for a range of rows, [n, H] float32.

    ``noise``: the tile (``_embed_noise(seed)``), passed in to draw it once per file.
    """
    if noise is None:
        noise = _embed_noise(seed)
    u = shared_direction(s.hidden, seed).astype(np.float32)
    n = (rows.stop - rows.start) * s.hidden
    out = np.empty(n, np.float32)
    pos, done = (rows.start * s.hidden) % len(noise), 0
    while done < n:
        k = min(n - done, len(noise) - pos)
        out[done:done + k] = noise[pos:pos + k]
        done, pos = done + k, 0
    out = out.reshape(-1, s.hidden)
    out += np.float32(ALPHA * np.sqrt(s.hidden)) * u
    return out


def _embed_noise(seed: int) -> np.ndarray:
    return np.random.default_rng([seed, 13]).standard_normal(_BLOCK_ELEMS, np.float32)


# ---------------------------------------------------------------- the file

@dataclass
class SynthInfo:
    """What ``write_gguf`` wrote: the file, its size (bytes), the time (s) and the routing design."""

    path: Path
    shape: SynthShape
    wtype: str
    coverage_target: float | list | None
    betas: list[float]
    nbytes: int
    seconds: float
    design_coverage: float = 0.0
    extra: dict = field(default_factory=dict)


def _gguf_type(gtype: str):
    from gguf import GGMLQuantizationType as Q

    return {"f32": Q.F32, "bf16": Q.BF16}.get(gtype) or Q[gtype.upper()]


def _add_metadata(w, s: SynthShape, wtype: str, coverage_target, seed: int) -> None:
    a = s.arch
    w.add_name(f"workbench synthetic {s.name} {wtype}")
    w.add_uint32(f"{a}.block_count", s.n_layers)
    w.add_uint32(f"{a}.context_length", 32768)
    w.add_uint32(f"{a}.embedding_length", s.hidden)
    w.add_uint32(f"{a}.feed_forward_length", s.expert_ffn)
    w.add_uint32(f"{a}.attention.head_count", s.n_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", s.n_kv_heads)
    w.add_uint32(f"{a}.attention.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    w.add_uint32(f"{a}.rope.dimension_count", s.head_dim)
    w.add_float32(f"{a}.rope.freq_base", s.rope_base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(f"{a}.expert_count", s.n_experts)
    w.add_uint32(f"{a}.expert_used_count", s.n_active)
    if a != "llama":
        w.add_uint32(f"{a}.expert_feed_forward_length", s.expert_ffn)
    if s.shared_ffn:
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", s.shared_ffn)
    w.add_uint32(f"{a}.vocab_size", s.vocab)
    w.add_string("tokenizer.ggml.model", "none")
    w.add_string("workbench.synth.shape", s.name)
    w.add_string("workbench.synth.weights", wtype)
    mean, per = _targets_meta(s, coverage_target)
    w.add_float32("workbench.synth.coverage_target", mean)
    w.add_array("workbench.synth.coverage_targets", per)
    w.add_uint32("workbench.synth.seed", seed)


def write_gguf(path: str | Path, s: SynthShape, *, coverage_target: float | list | None = 0.5,
               wtype: str = "bf16", seed: int = 0, sparse: bool = False) -> SynthInfo:
    """Write a synthetic model to ``path`` (GGUF, llama.cpp names) and return what was written.

    ``coverage_target``: share of each layer's selections served by its top 10% experts (0.5 for
    S1), a list of one per layer, or None for uniform routing. ``wtype``: format of the 2-D weights (the token embedding stays
    bf16, norms and routers f32). RAM use stays under ~0.5 GB whatever the model size.
    ``sparse``: the tiled weights are left as holes in the file (zeros, no disk space): the header,
    embeddings, norms and routers are real, so memory estimates and predictions (which read the
    header only) work offline on a machine without room for the weights; not for running.
    """
    from gguf import GGUFWriter

    t0 = time.perf_counter()
    tensors = tensor_list(s, wtype)
    betas = layer_betas(s, coverage_target)
    path = Path(path)
    w = GGUFWriter(path, s.arch)
    _add_metadata(w, s, wtype, coverage_target, seed)
    for t in tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.uint16), t.nbytes, raw_dtype=_gguf_type(t.gtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    tiles = _Tiles(seed)
    align = w.data_alignment
    for t in tensors:
        f.write(b"\0" * (-f.tell() % align))
        if t.kind == "tile" and sparse:
            f.seek(t.nbytes, 1)
        elif t.kind == "tile":
            tiles.write(f, t)
        elif t.kind == "embed":
            step, noise = max(1, _CHUNK // (4 * s.hidden)), _embed_noise(seed)
            for r in range(0, s.vocab, step):
                rows = slice(r, min(s.vocab, r + step))
                f.write(f32_to_bf16(_embed_rows(s, seed, rows, noise)).tobytes())
        elif t.kind == "router":
            f.write(router_weights(s, t.layer, betas[t.layer], seed).tobytes())
        elif t.kind == "ones":
            f.write(np.ones(t.shape, np.float32).tobytes())
        else:
            f.write((np.random.default_rng([seed, 17]).standard_normal(t.shape) * t.std).astype(np.float32).tobytes())
        f.write(b"\0" * (-t.nbytes % align))
    f.truncate()  # a hole at the end still counts in the file's length
    w.close()
    info = SynthInfo(path, s, wtype, coverage_target, [float(b) for b in betas], path.stat().st_size,
                     time.perf_counter() - t0)
    sim = {b: simulate_coverage(b, s.n_experts, s.n_active, seed=1) for b in set(info.betas)}
    info.design_coverage = float(np.mean([sim[b] for b in info.betas]))
    log.info("wrote %s: %.1f GB in %.1f s", path, info.nbytes / 1e9, info.seconds)
    return info


def rewrite_routers(path: str | Path, *, coverage_target: float | list | None,
                    seed: int | None = None) -> list[float]:
    """Give an existing synthetic file new router weights in place (e.g. skewed -> uniform).

    Returns the new per-layer ``beta``. Only the ``ffn_gate_inp`` tensors (a few MB) and the
    coverage metadata are written.
    """
    from gguf import GGUFReader

    try:
        r = GGUFReader(path, "r+")
    except (ValueError, OSError) as e:
        raise WorkbenchError(f"{path} is not a GGUF file that can be rewritten: {e}") from e
    fields = {f.name: f for f in r.fields.values()}
    if "workbench.synth.shape" not in fields:
        raise WorkbenchError(f"{path} is not a synthetic workbench model")

    def _val(name):
        f = fields[name]
        return f.contents()

    a = _val("general.architecture")
    s = replace(shape(_val("workbench.synth.shape")), n_layers=int(_val(f"{a}.block_count")),
                hidden=int(_val(f"{a}.embedding_length")), n_experts=int(_val(f"{a}.expert_count")),
                n_active=int(_val(f"{a}.expert_used_count")))
    seed = int(_val("workbench.synth.seed")) if seed is None else seed
    betas = layer_betas(s, coverage_target)
    for t in r.tensors:
        if t.name.endswith("ffn_gate_inp.weight"):
            layer = int(t.name.split(".")[1])
            t.data[...] = router_weights(s, layer, betas[layer], seed).reshape(t.data.shape)
    mean, per = _targets_meta(s, coverage_target)
    cov = fields["workbench.synth.coverage_target"]
    cov.parts[cov.data[0]][...] = mean
    if "workbench.synth.coverage_targets" in fields:
        arr = fields["workbench.synth.coverage_targets"]
        for i, idx in enumerate(arr.data):
            arr.parts[idx][...] = per[i]
    r.data.flush()
    return [float(b) for b in betas]

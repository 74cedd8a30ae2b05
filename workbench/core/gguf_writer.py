"""Hugging Face folder -> GGUF, the way llama.cpp's ``convert_hf_to_gguf.py`` writes it.

Used to make GGUF copies of the tiny test models and of the demo model, so that the readers and the
engine meet the layout real GGUF files have. What it reproduces from llama.cpp's converter:

- names: llama.cpp's tensor names (``token_embd``, ``blk.{l}.attn_q``, ``blk.{l}.ffn_gate_inp``,
  ``blk.{l}.ffn_{gate,up,down}_exps``, ``..._shexp``, ``exp_probs_b.bias``, ``attn_sinks``...), through
  gguf-py's TensorNameMap for everything but the experts;
- stacked experts: per-expert HF tensors are stacked into one tensor per projection, numpy shape
  ``[E, I, H]`` for gate/up and ``[E, H, I]`` for down (ggml ``ne`` reversed);
- metadata keys: ``general.architecture`` = ``llama`` (Mixtral and dense Llama/Mistral), ``qwen2moe``,
  ``qwen3moe``, ``olmoe``, ``llama4``, ``deepseek2`` (V2 and V3), ``gpt-oss``, ``qwen2``, ``qwen3``;
  ``{arch}.expert_count``, ``expert_used_count``, ``expert_feed_forward_length``... as the converter;
- per-architecture transforms (the engine undoes them on load):
  * ``llama`` (Mixtral, Llama, Mistral): rows of ``q_proj`` and ``k_proj`` (weights and biases) are
    permuted from HF's rotate-half RoPE layout to llama.cpp's interleaved one:
    ``w.reshape(n, 2, rows // n // 2, ...).swapaxes(1, 2)`` with ``n`` = heads (Q) or KV heads (K).
    Undo: ``w.reshape(n, rows // n // 2, 2, ...).swapaxes(1, 2)``.
  * ``deepseek2``: ``kv_b_proj`` [H*(nope+v), kv_lora] is split into ``attn_k_b`` [H, kv_lora, nope]
    (transposed) and ``attn_v_b`` [H, v, kv_lora]; ``{arch}.attention.head_count_kv`` is 1 (MLA
    written as MQA); ``key_length`` = kv_lora + rope, ``value_length`` = kv_lora,
    ``key_length_mla`` / ``value_length_mla`` = per-head q/k and v lengths; the
    multi-token-prediction layers (index >= ``num_hidden_layers``) are dropped; the router's
    ``e_score_correction_bias`` becomes ``blk.{l}.exp_probs_b.bias``.
  * ``llama4``: fused ``experts.gate_up_proj`` [E, H, 2I] is transposed to [E, 2I, H] and split in
    halves (gate first); ``experts.down_proj`` [E, I, H] is transposed to [E, H, I]. No Q/K
    permutation (``undo_permute = False``). llama.cpp assumes a chunked-attention size of 8192 and
    writes no key for it; when the model's ``attention_chunk_size`` differs this writer adds the
    workbench key ``llama4.attention.chunk_size``.
  * ``gpt-oss``: fused ``experts.gate_up_proj`` [E, H, 2I] is transposed to [E, 2I, H] and
    de-interleaved (gate = even rows, up = odd rows), likewise ``gate_up_proj_bias`` [E, 2I];
    ``down_proj`` [E, I, H] is transposed; ``self_attn.sinks`` becomes ``attn_sinks.weight``;
    ``post_attention_layernorm`` is named ``post_attention_norm``.
  * fused ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I] of other families (as
    transformers 5 holds Qwen/OLMoE/DeepSeek/Mixtral experts in memory) are split (gate first) as is.
  * tied embeddings: no ``output.weight`` (llama.cpp then reads ``token_embd``).
  * dense MLP layers of MoE models (Qwen ``mlp_only_layers`` / ``decoder_sparse_step``) are written
    as ``blk.{l}.ffn_{gate,up,down}.weight``; llama.cpp itself has no such layers for qwen2moe and
    qwen3moe (its converter would fail on them), the workbench reads them.
- types (K-quants encoded by ``kquants.py``, the others by ``gguf.quants``): 1-D tensors, biases
  (every name not ending in ``.weight``), norms and routers (``ffn_gate_inp``, ``ffn_gate_inp_shexp``)
  stay F32 as in the converter; other tensors get ``tensor_type`` (experts ``expert_type`` when given); a tensor
  whose rows do not fill whole blocks of that type falls back to F16, as llama.cpp does.
- tokenizer (``tokenizer.json`` with a BPE model): ``tokenizer.ggml.model = gpt2``, ``.pre``,
  ``.tokens``, ``.token_type``, ``.merges``, special token ids and ``chat_template`` (gguf-py's
  SpecialVocab).

Safetensors data is read with numpy memory maps (BF16 widened through ``uint16 << 16``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np

from .errors import ModelFormatError
from .kquants import KQUANT_TYPES, quantize_k
from .naming import hf_role, is_non_text
from .readers.gguf_config import LLAMA4_CHUNK_KEY, LLAMA4_DEFAULT_CHUNK
from .readers.hf_config import family_of, text_config
from .readers.safetensors import read_safetensors_folder
from .units import TensorInfo

log = logging.getLogger(__name__)

ARCH_OF_FAMILY = {
    "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe",
    "llama4": "llama4", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss",
}
ARCH_OF_DENSE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "IQ4_XS", "MXFP4")
_FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K": 12, "Q4_K": 15,
              "Q5_K": 17, "Q6_K": 18, "IQ4_XS": 30, "BF16": 32, "MXFP4": 38}
_KEEP_F32 = re.compile(r".*(_norm\.weight|ffn_gate_inp\.weight|ffn_gate_inp_shexp\.weight|exp_probs_b\.bias|"
                       r"attn_sinks\.weight)$")
_EXPERT_PROJ = {"w1": "gate", "w2": "down", "w3": "up", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def load_tensor(info: TensorInfo) -> np.ndarray:
    """A safetensors tensor as a numpy array (floats as float32), read through a memory map."""
    kinds = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
             "U8": "u1", "BOOL": "?"}
    if info.dtype == "BF16":
        raw = np.memmap(info.file, dtype="<u2", mode="r", offset=info.offset, shape=info.shape)
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if info.dtype not in kinds:
        raise ModelFormatError(f"tensor {info.name!r}: the GGUF writer cannot convert {info.dtype} data")
    arr = np.array(np.memmap(info.file, dtype=kinds[info.dtype], mode="r", offset=info.offset, shape=info.shape))
    return arr.astype(np.float32) if arr.dtype.kind == "f" else arr


def write_gguf(
    hf_dir: str | Path,
    out_path: str | Path,
    tensor_type: str = "F32",
    *,
    expert_type: str | None = None,
    expert_down_type: str | None = None,
    split_max_tensors: int = 0,
    name: str | None = None,
) -> list[Path]:
    """Convert the HF folder ``hf_dir`` to GGUF at ``out_path``; returns the written file(s).

    ``tensor_type``: one of ``TENSOR_TYPES`` for 2-D+ tensors; ``expert_type`` overrides it for the
    routed experts and ``expert_down_type`` for their down matrices, the attention's v and the head
    (as Q4_K_M stores those in Q6_K);
    ``split_max_tensors`` > 0 writes a split ``*-0000K-of-0000N.gguf`` set.
    """
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    for t in (tensor_type, expert_type or tensor_type, expert_down_type or tensor_type):
        if t not in TENSOR_TYPES:
            raise ValueError(f"unknown tensor type {t!r}: choose one of {', '.join(TENSOR_TYPES)}")
    config = json.loads((hf_dir / "config.json").read_text())
    family = family_of(config)
    c = text_config(config)
    arch = ARCH_OF_FAMILY.get(family) or ARCH_OF_DENSE.get(c.get("model_type"))
    if arch is None:
        raise ModelFormatError(f"the GGUF writer does not know model type {c.get('model_type')!r}")
    tensors, _ = read_safetensors_folder(hf_dir)

    writer = gguf.GGUFWriter(out_path, arch, split_max_tensors=split_max_tensors)
    writer.add_name(name or hf_dir.name)
    writer.add_file_type(_FILE_TYPE[tensor_type])
    _add_hparams(writer, arch, family, c)
    _add_tokenizer(writer, hf_dir, c)
    for gname, data in _convert_tensors(arch, family, c, tensors):
        is_expert = "_exps." in gname
        ttype = (expert_type or tensor_type) if is_expert else tensor_type
        if expert_down_type and ("ffn_down_exps" in gname or gname.endswith(".attn_v.weight")
                                 or gname == "output.weight"):
            ttype = expert_down_type
        _add_tensor(writer, gname, data, ttype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(out_path)


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, ttype: str) -> None:
    if data.dtype.kind != "f":
        writer.add_tensor(name, data)
        return
    data = np.ascontiguousarray(data, dtype=np.float32)
    if data.ndim <= 1 or _KEEP_F32.match(name) or not name.endswith(".weight") or ttype == "F32":
        writer.add_tensor(name, data)
        return
    if ttype == "F16":
        writer.add_tensor(name, data.astype(np.float16))
        return
    qtype = gguf.GGMLQuantizationType[ttype]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if data.shape[-1] % block:
        log.info("%s: rows of %d do not fill %s blocks, written as F16", name, data.shape[-1], ttype)
        writer.add_tensor(name, data.astype(np.float16))
        return
    raw = quantize_k(data, ttype) if ttype in KQUANT_TYPES else gguf.quants.quantize(data, qtype)
    writer.add_tensor(name, raw, raw_dtype=qtype)


def _permute_rope(w: np.ndarray, n: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (HF rotate-half -> interleaved pairs), per head group ``n``."""
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert_tensors(arch: str, family: str, c: dict, tensors: dict[str, TensorInfo]) -> Iterator[tuple[str, np.ndarray]]:
    n_layers = int(c["num_hidden_layers"])
    n_heads = int(c["num_attention_heads"])
    n_kv = int(c.get("num_key_value_heads") or n_heads)
    tie = bool(c.get("tie_word_embeddings", False))
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[_arch_enum(arch)], n_layers)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    n_experts = int(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 0)

    def mapped(hf_name: str) -> str:
        out = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if out is None:
            raise ModelFormatError(f"no llama.cpp name for tensor {hf_name!r} (arch {arch})")
        return out

    for name in sorted(tensors):
        role = hf_role(name)
        if role is None and is_non_text(name):
            continue  # vision tower and projector: llama.cpp writes them to a separate mmproj file
        if role is None:
            raise ModelFormatError(f"tensor {name!r} belongs to no unit")
        if role.layer is not None and role.layer >= n_layers:
            continue  # multi-token-prediction layers: dropped as llama.cpp does
        if name.endswith("lm_head.weight") and tie:
            continue
        layer = role.layer
        if role.expert is not None:
            proj = _EXPERT_PROJ[name.split(".")[-2]]
            experts.setdefault((layer, proj), {})[role.expert] = load_tensor(tensors[name])
            continue
        data = load_tensor(tensors[name])
        if role.stacked:
            yield from _fused_experts(family, layer, name, data)
            continue
        if name.endswith("e_score_correction_bias"):
            yield f"blk.{layer}.exp_probs_b.bias", data
            continue
        if name.endswith("self_attn.sinks"):
            yield f"blk.{layer}.attn_sinks.weight", data
            continue
        if arch == "llama" and re.search(r"self_attn\.[qk]_proj\.(weight|bias)$", name):
            data = _permute_rope(data, n_heads if ".q_proj." in name else n_kv)
        if arch == "deepseek2" and name.endswith("kv_b_proj.weight"):
            nope, v = int(c["qk_nope_head_dim"]), int(c["v_head_dim"])
            kv_b = data.reshape(n_kv, nope + v, data.shape[-1])
            yield f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1))
            yield f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:, :])
            continue
        if role.kind == "dense_mlp":  # by hand: llama.cpp's qwen2moe/qwen3moe know no dense layers
            proj = _EXPERT_PROJ[name.split(".")[-2]]
            yield f"blk.{layer}.ffn_{proj}.{name.rsplit('.', 1)[1]}", data
            continue
        yield mapped(name.removeprefix("language_model.")), data
    for (layer, proj), by_expert in sorted(experts.items()):
        if sorted(by_expert) != list(range(n_experts)):
            raise ModelFormatError(f"layer {layer}: {proj} of experts {sorted(set(range(n_experts)) - set(by_expert))} missing")
        yield f"blk.{layer}.ffn_{proj}_exps.weight", np.stack([by_expert[e] for e in range(n_experts)])


_IN_OUT_FUSED = ("llama4", "gpt_oss")
"""Families whose fused expert tensors are [E, in, out] (used as x @ W); the others store [E, out, in]."""


def _fused_experts(family: str, layer: int, name: str, data: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """llama4 / gpt-oss fused expert tensors -> llama.cpp's gate/up/down stacks."""
    base = f"blk.{layer}.ffn_{{}}_exps.{{}}"
    if name.endswith(("_blocks", "_scales")):
        raise ModelFormatError(f"tensor {name!r}: MXFP4 safetensors are not converted by the workbench writer")
    if name.endswith("gate_up_proj_bias"):  # gpt-oss [E, 2I], interleaved
        yield base.format("gate", "bias"), np.ascontiguousarray(data[:, ::2])
        yield base.format("up", "bias"), np.ascontiguousarray(data[:, 1::2])
    elif name.endswith("down_proj_bias"):
        yield base.format("down", "bias"), data
    elif name.endswith("gate_up_proj"):  # llama4 / gpt-oss: [E, H, 2I] -> [E, 2I, H]; others [E, 2I, H]
        t = data.transpose(0, 2, 1) if family in _IN_OUT_FUSED else data
        if family == "gpt_oss":
            gate, up = t[:, ::2, :], t[:, 1::2, :]
        else:
            half = t.shape[1] // 2
            gate, up = t[:, :half, :], t[:, half:, :]
        yield base.format("gate", "weight"), np.ascontiguousarray(gate)
        yield base.format("up", "weight"), np.ascontiguousarray(up)
    elif name.endswith("down_proj"):  # llama4 / gpt-oss: [E, I, H] -> [E, H, I]; others [E, H, I]
        yield base.format("down", "weight"), np.ascontiguousarray(
            data.transpose(0, 2, 1) if family in _IN_OUT_FUSED else data)
    else:
        raise ModelFormatError(f"tensor {name!r}: unknown fused expert layout")


def _arch_enum(arch: str) -> str:
    return {v: k.name for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]


def _add_hparams(w: gguf.GGUFWriter, arch: str, family: str, c: dict) -> None:
    n_heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    w.add_block_count(int(c["num_hidden_layers"]))
    w.add_context_length(int(c.get("max_position_embeddings") or 4096))
    w.add_embedding_length(hidden)
    ffn = c.get("intermediate_size_mlp") if family == "llama4" else c.get("intermediate_size")
    if ffn:
        w.add_feed_forward_length(int(ffn))
    w.add_head_count(n_heads)
    # llama.cpp writes DeepSeek's MLA as MQA: one KV head
    w.add_head_count_kv(1 if arch == "deepseek2" else int(c.get("num_key_value_heads") or n_heads))
    rope = c.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta") or c.get("rope_theta") or 10000.0))
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps") or 1e-6))
    head_dim = c.get("head_dim")
    if head_dim and arch != "deepseek2":
        w.add_key_length(int(head_dim))
        w.add_value_length(int(head_dim))
    n_experts = int(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 0)
    if n_experts and family != "dense":
        w.add_expert_count(n_experts)
        w.add_expert_used_count(int(c.get("num_experts_per_tok") or 1))
    if arch in ("llama", "llama4", "deepseek2"):
        w.add_vocab_size(int(c["vocab_size"]))
    if arch in ("llama", "llama4"):
        w.add_rope_dimension_count(int(head_dim or hidden // n_heads))
    if family in ("qwen2_moe", "qwen3_moe"):
        w.add_expert_feed_forward_length(int(c["moe_intermediate_size"]))
        if c.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(int(c["shared_expert_intermediate_size"]))
    elif family == "llama4":
        w.add_interleave_moe_layer_step(int(c.get("interleave_moe_layer_step") or 1))
        w.add_expert_feed_forward_length(int(c["intermediate_size"]))
        chunk = c.get("attention_chunk_size")
        if chunk and int(chunk) != LLAMA4_DEFAULT_CHUNK:
            w.add_uint32(LLAMA4_CHUNK_KEY, int(chunk))
    elif family in ("deepseek_v2", "deepseek_v3"):
        _add_deepseek(w, family, c)
    elif family == "gpt_oss":
        w.add_sliding_window(int(c.get("sliding_window") or 128))
        w.add_expert_feed_forward_length(int(c["intermediate_size"]))
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope.get("factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings", 4096)))


def _add_deepseek(w: gguf.GGUFWriter, family: str, c: dict) -> None:
    kv_lora, rope_dim = int(c["kv_lora_rank"]), int(c["qk_rope_head_dim"])
    w.add_leading_dense_block_count(int(c.get("first_k_dense_replace") or 0))
    if c.get("q_lora_rank"):
        w.add_q_lora_rank(int(c["q_lora_rank"]))
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope_dim)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(int(c["qk_nope_head_dim"]) + rope_dim)
    w.add_value_length_mla(int(c["v_head_dim"]))
    w.add_expert_feed_forward_length(int(c["moe_intermediate_size"]))
    w.add_expert_shared_count(int(c.get("n_shared_experts") or 0))
    if c.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(float(c["routed_scaling_factor"]))
    if c.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    gating = gguf.ExpertGatingFuncType.SIGMOID if family == "deepseek_v3" else gguf.ExpertGatingFuncType.SOFTMAX
    w.add_expert_gating_func(gating)
    if int(c.get("n_group") or 1) > 1:
        w.add_expert_group_count(int(c["n_group"]))
        w.add_expert_group_used_count(int(c.get("topk_group") or 1))
    w.add_rope_dimension_count(rope_dim)


def _split_patterns(node) -> list[str]:
    """The Split regexes of a tokenizer.json pre-tokenizer, in order."""
    if isinstance(node, dict):
        if node.get("type") == "Split":
            pattern = node.get("pattern") or {}
            return [pattern.get("Regex") or pattern.get("String") or ""]
        return [p for child in node.get("pretokenizers") or [] for p in _split_patterns(child)]
    return []


def _pre_tokenizer_name(tok: dict) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a tokenizer.json, from its split regexes (llama.cpp
    itself hashes the tokenization of a test text; the regexes tell the same vocabularies apart)."""
    patterns = _split_patterns(tok.get("pre_tokenizer"))
    text = "|".join(patterns)
    if len(patterns) > 1 and "一-龥" in text:
        return "deepseek-v3"
    if r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]" in text:
        return "gpt-4o"
    if "(?i:'s" in text and r"\p{N}{1,3}" in text:
        return "llama-bpe"
    if "(?i:'s" in text and r"\p{N}|" in text:
        return "qwen2"
    return "gpt-2"


def _add_tokenizer(w: gguf.GGUFWriter, hf_dir: Path, c: dict) -> None:
    path = hf_dir / "tokenizer.json"
    if not path.is_file():  # no vocabulary, but the special ids of config.json still matter
        gguf.SpecialVocab(hf_dir, load_merges=False).add_to_gguf(w, quiet=True)
        return
    tok = json.loads(path.read_text())
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        log.warning("%s: only BPE tokenizer.json is written to GGUF, not %s", path, model.get("type"))
        return
    vocab: dict[str, int] = dict(model["vocab"])
    special, added = set(), set()
    for t in tok.get("added_tokens") or []:
        vocab[t["content"]] = t["id"]
        (special if t.get("special") else added).add(t["id"])
    n = max(int(c.get("vocab_size") or 0), max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf.TokenType.UNUSED] * n
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = (gguf.TokenType.CONTROL if i in special else
                    gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_pre_tokenizer_name(tok))
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=n).add_to_gguf(w, quiet=True)

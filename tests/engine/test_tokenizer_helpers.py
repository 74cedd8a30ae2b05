"""Small real tokenizers for the engine tests: trained with `tokenizers`, saved as ``tokenizer.json``,
and copied into GGUF metadata the way llama.cpp's converter does (tokens, types, merges or scores)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12:45 and we've got 3.14159 reasons.",
    "Mixture-of-Experts models route each token to a few experts; the router picks the top-k.",
    "def forward(self, x):\n    return self.w2(F.silu(self.w1(x)) * self.w3(x))  # [T, D]\n",
    "Ünïcödé: café, naïve, Straße, 東京タワー, 北京欢迎你, emoji 🙂🚀, Ελληνικά, русский текст.",
    "Numbers 1234567890 and 42, URLs https://example.com/a?b=c, e-mail a.b@c.de, tabs\tand\nnewlines\n\n",
    "She said: \"I'll be there\" -- they'd been waiting; you're right, I'm sure, we'll see.",
] * 3

SAMPLES = [
    "Hello world! The router picks the top-k experts.",
    "  leading spaces and trailing   ",
    "café Straße 東京 北京 🙂 unseen: 龍 ∑ ü",
    "def f(x):\n\treturn x**2  # 12345678\n\n\nEND",
    "I'll we've THEY'RE it's 3.14 a\r\nb",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "",
    " ",
    "\n",
]

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_byte_level_tokenizer(vocab_size: int = 600) -> Tokenizer:
    """A Qwen2-shaped byte-level BPE (regex split + ByteLevel) with ChatML special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_LEVEL_SPECIALS])
    return tok


def build_sentencepiece_tokenizer(vocab_size: int = 500) -> tuple[Tokenizer, list[float]]:
    """A Llama-2-shaped SentencePiece BPE: <unk> <s> </s>, 256 byte tokens, then pieces; byte fallback.

    Returns the tokenizer and one score per id (SentencePiece style: later merges score lower).
    """
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    trainer_tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    trained = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    merge_rank = {a + b: r for r, (a, b) in enumerate(merges)}

    names = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0] * len(names)
    for piece, _ in trained:
        names.append(piece)
        # Merged pieces score by merge order; alphabet characters below every merge.
        scores.append(-float(merge_rank[piece]) if piece in merge_rank else -1e6 - len(names))
    vocab = {name: i for i, name in enumerate(names)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    # Llama-2's tokenizer.json: the space prefix comes from the normalizer, which runs on every
    # stretch of text between special tokens.
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1",
                                                       special_tokens=[("<s>", 1)])
    return tok, scores


def token_types(tok: Tokenizer, kind: str) -> list[int]:
    """llama.cpp token types for every id: control for special added tokens, byte for <0xXX>."""
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    types = []
    for i in range(tok.get_vocab_size()):
        text = tok.id_to_token(i)
        if i in specials:
            types.append(2 if text == "<unk>" else 3)
        elif kind == "llama" and text.startswith("<0x") and len(text) == 6:
            types.append(6)
        else:
            types.append(1)
    return types


def write_tokenizer_gguf(path: Path, tok: Tokenizer, kind: str, *, pre: str = "qwen2",
                         scores: list[float] | None = None, bos: int | None = None, eos: int | None = None,
                         add_bos: bool | None = None, chat_template: str | None = None,
                         arch: str = "qwen2moe") -> Path:
    """A GGUF with only tokenizer metadata (no tensors), as llama.cpp's converter spells it."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model(kind)
    tokens = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    writer.add_token_list(tokens)
    writer.add_token_types(token_types(tok, kind))
    if kind == "gpt2":
        writer.add_tokenizer_pre(pre)
        model = json.loads(tok.to_str())["model"]
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
    else:
        writer.add_token_scores(scores)
        writer.add_unk_token_id(0)
    if bos is not None:
        writer.add_bos_token_id(bos)
    if eos is not None:
        writer.add_eos_token_id(eos)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def build_tiny_chat_model(folder: Path):
    """A tiny Qwen3-MoE whose vocabulary is a real byte-level tokenizer's (saved beside it).

    Returns the transformers model; ``folder`` holds config, weights and ``tokenizer.json``.
    """
    from tests.tiny_models import build_hf_model

    tok = build_byte_level_tokenizer(vocab_size=320)
    model = build_hf_model("qwen3_moe", folder, vocab_size=tok.get_vocab_size(),
                       eos_token_id=tok.token_to_id("<|im_end|>"), bos_token_id=None)
    tok.save(str(folder / "tokenizer.json"))
    return model

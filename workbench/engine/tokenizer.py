"""Tokenizers: ``tokenizer.json`` through `tokenizers`, or one built from a GGUF vocabulary.

GGUF files carry no ``tokenizer.json``; llama.cpp stores the vocabulary as metadata
(``tokenizer.ggml.tokens``, ``.scores``, ``.token_type``, ``.merges``, ``.pre``...). Two kinds are
rebuilt here as `tokenizers` objects: ``gpt2`` (byte-level BPE with the merges from the file and the
split regex named by ``tokenizer.ggml.pre``) and ``llama`` (SentencePiece BPE with byte fallback;
the merges are recovered from the token scores, since merging the best-scored pair first is what
SentencePiece does). ``StreamDecoder`` turns token ids into text deltas without ever emitting half a
UTF-8 character.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from workbench.core.errors import ModelFormatError, WorkbenchError

log = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "olmo", "mpt", "jais", "trillion"), (_GPT2_SPLIT,)),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "falcon3", "pixtral"),
                    (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "megrez"), (_QWEN2_SPLIT,)),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), (_O200K_SPLIT,)),
    **dict.fromkeys(("deepseek-v3",), _DEEPSEEK3_SPLITS),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone"), (r"\p{N}", _GPT2_SPLIT)),
}
"""``tokenizer.ggml.pre`` -> the regex splits (applied in turn) that llama.cpp uses for that vocabulary."""

# Pre-tokenizer names whose vocabularies look a whole pre-token up before merging (llama.cpp's
# ``ignore_merges``), as Llama 3's tokenizer.json says too.
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3"}

# Texts of end-of-generation tokens llama.cpp recognises beyond the declared EOS (chat turn ends).
EOG_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
    "<|return|>", "<|call|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<|eot|>", "<|eom|>",
}


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens.

    ``backend`` is a `tokenizers.Tokenizer` (its post-processor adds BOS/EOS where the model wants
    them). ``special_tokens`` maps transformers' names (``bos_token``, ``eos_token``, ``unk_token``,
    ``pad_token``) to token texts; chat templates see them as variables. ``eos_ids`` are the ids
    that end generation as far as the tokenizer files know (the generation config may add more).
    """

    def __init__(self, backend: BackendTokenizer, special_tokens: dict[str, str] | None = None,
                 eos_ids: list[int] | None = None, source: str = ""):
        self.backend = backend
        self.special_tokens = dict(special_tokens or {})
        self.eos_ids = list(eos_ids or [])
        self.source = source

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` lets the post-processor add BOS/EOS."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Incremental detokenisation: feed ids one at a time, get the new text of each.

    Decodes a short window of recent ids (so that decoders which strip or merge across tokens, like
    SentencePiece's leading space, behave as on the whole text) and holds back text that ends in an
    incomplete UTF-8 sequence (decoded as U+FFFD) until the next ids complete it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # ids before this one have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is still incomplete)."""
        self.ids.append(int(token_id))
        emitted = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        # A character has at most 4 bytes and every token adds at least one: after 4 pending tokens
        # a trailing U+FFFD is an invalid sequence, not an incomplete one, and is emitted as it is.
        complete = not text.endswith("\ufffd") or len(self.ids) - self._read >= 4
        if len(text) > len(emitted) and complete:
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(emitted):]
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end), emitted as it decodes."""
        if self._read == len(self.ids):
            return ""
        emitted = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(emitted):] if text.startswith(emitted) else text


# --- loading -------------------------------------------------------------------------------------


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a model folder (``tokenizer.json``) or GGUF file; None when it has none."""
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return from_pretrained_dir(path)
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return from_gguf(ggufs[0])
        log.warning("no tokenizer.json in %s", path)
        return None
    if path.suffix == ".gguf":
        return from_gguf(path)
    raise ModelFormatError(f"{path}: not a model folder or a GGUF file")


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: unreadable JSON ({e})") from e


def _id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def tokenizer_for(inventory) -> Tokenizer | None:
    """The tokenizer of an opened model (an ``Inventory``): its GGUF vocabulary (from the metadata
    already read) or the ``tokenizer.json`` in its folder. None when the model ships none."""
    if inventory.format == "gguf":
        if "tokenizer.ggml.tokens" not in inventory.metadata:
            log.warning("%s has no tokenizer vocabulary", inventory.path)
            return None
        return from_gguf(inventory.path, inventory.metadata)
    return load_tokenizer(inventory.path)


def from_pretrained_dir(folder: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` (+ ``tokenizer_config.json`` for the special token names)."""
    folder = Path(folder)
    try:
        backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:  # tokenizers raises its own Exception type for malformed files
        raise ModelFormatError(f"{folder / 'tokenizer.json'}: cannot load the tokenizer ({e})") from e
    config = _read_json(folder / "tokenizer_config.json")
    special_map = _read_json(folder / "special_tokens_map.json")
    special = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        text = _token_text(config.get(name)) or _token_text(special_map.get(name))
        if text is not None:
            special[name] = text
    # BOS/EOS come from tokenizer.json's post-processor alone: transformers (5.x) ignores
    # tokenizer_config.json's add_bos_token / add_eos_token for a tokenizer.json too.
    eos_ids = []
    if special.get("eos_token") is not None and backend.token_to_id(special["eos_token"]) is not None:
        eos_ids.append(backend.token_to_id(special["eos_token"]))
    return Tokenizer(backend, special, eos_ids, source=str(folder / "tokenizer.json"))


def read_gguf_tokenizer_fields(path: str | Path) -> dict:
    """Every ``tokenizer.*`` key/value of a GGUF file, arrays included, as plain Python values."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path), "r")
    except Exception as e:  # gguf raises ValueError/KeyError/struct errors on foreign or truncated files
        raise ModelFormatError(f"{path}: not a readable GGUF file ({e})") from e
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.") or name == "general.architecture":
            fields[name] = field.contents()
    return fields


def from_gguf(path: str | Path, fields: dict | None = None) -> Tokenizer:
    """Build the tokenizer a GGUF vocabulary describes (``gpt2`` byte-level BPE or ``llama`` SentencePiece).

    ``fields``: the file's ``tokenizer.*`` key/values when already read (see
    ``read_gguf_tokenizer_fields``).
    """
    fields = read_gguf_tokenizer_fields(path) if fields is None else fields
    kind = fields.get("tokenizer.ggml.model")
    tokens = fields.get("tokenizer.ggml.tokens")
    tokens = [str(t) for t in tokens] if tokens is not None else []
    if kind is None or not tokens:
        raise ModelFormatError(f"{path}: the GGUF file has no tokenizer vocabulary")
    types = fields.get("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFormatError(f"{path}: {len(types)} token types for {len(tokens)} tokens")
    if kind == "gpt2":
        backend = _byte_level_bpe(fields, tokens)
    elif kind == "llama":
        backend = _sentencepiece_bpe(fields, tokens, types)
    else:
        raise WorkbenchError(
            f"{path}: GGUF tokenizer type {kind!r} is not supported (supported: gpt2, llama); "
            "pass --prompt-ids instead of text"
        )
    _add_special_tokens(backend, tokens, types)

    def token_at(key: str) -> str | None:
        i = fields.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    special = {name: token_at(key) for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                                     ("unk_token", "unknown_token_id"),
                                                     ("pad_token", "padding_token_id"))}
    special = {k: v for k, v in special.items() if v is not None}
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
    _set_post_processor(backend, special.get("bos_token") if add_bos else None,
                        special.get("eos_token") if add_eos else None)
    eos_ids = gguf_eos_ids(fields, tokens, types)
    return Tokenizer(backend, special, eos_ids, source=str(path))


def gguf_eos_ids(fields: dict, tokens: list[str], types: list[int]) -> list[int]:
    """End-of-generation ids of a GGUF vocabulary: EOS, EOT, EOM and known turn-end control tokens."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        if fields.get(f"tokenizer.ggml.{key}") is not None:
            ids.append(int(fields[f"tokenizer.ggml.{key}"]))
    ids += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, USER_DEFINED) and t in EOG_TEXTS]
    return sorted(set(i for i in ids if 0 <= i < len(tokens)))


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            log.warning("GGUF vocabulary repeats token %r (ids %d and %d); keeping the first", t, vocab[t], i)
            continue
        vocab[t] = i
    return vocab


def _byte_level_bpe(fields: dict, tokens: list[str]) -> BackendTokenizer:
    merges_text = fields.get("tokenizer.ggml.merges")
    if merges_text is None or len(merges_text) == 0:
        raise ModelFormatError("a gpt2-style GGUF vocabulary has no tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in merges_text]
    pre = fields.get("tokenizer.ggml.pre", "default")
    bpe = models.BPE(vocab=_vocab(tokens), merges=merges, fuse_unk=False, byte_fallback=False,
                     ignore_merges=pre in _IGNORE_MERGES)
    backend = BackendTokenizer(bpe)
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        log.warning("unknown GGUF pre-tokenizer %r; splitting text like GPT-2", pre)
        splits = (_GPT2_SPLIT,)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's "merge the pair whose union scores best" rule.

    Every split of a normal token into two tokens of the vocabulary is a merge; merges are ranked by
    the merged token's score (best first), then by the ids of the two halves.
    """
    vocab = _vocab(tokens)
    ranked = []
    for i, token in enumerate(tokens):
        if types[i] not in (NORMAL, USER_DEFINED) or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(fields: dict, tokens: list[str], types: list[int]) -> BackendTokenizer:
    scores = fields.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelFormatError("a llama (SentencePiece) GGUF vocabulary needs one score per token")
    scores = [float(x) for x in scores]
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    bpe = models.BPE(vocab=_vocab(tokens), merges=sentencepiece_merges(tokens, scores, types), unk_token=unk,
                     fuse_unk=True, byte_fallback=True)
    backend = BackendTokenizer(bpe)
    add_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    # As llama.cpp (and Llama-2/Mixtral's tokenizer.json): every stretch of text between special
    # tokens gets one "▁" in front, even when it already starts with spaces ("<s>Hi" -> "<s>", "▁Hi";
    # "  hi" -> "▁▁▁hi"). A normalizer does exactly that, since it runs on each stretch.
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_special_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so that both
    are matched whole in text (as llama.cpp does) and keep their ids."""
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _set_post_processor(backend: BackendTokenizer, bos: str | None, eos: str | None, force: bool = False) -> None:
    """Add ``bos``/``eos`` (token texts, None for none) around encoded text; with neither, leave the
    post-processor alone unless ``force`` (then nothing is added)."""
    if bos is None and eos is None and not force:
        return
    for name, text in (("BOS", bos), ("EOS", eos)):
        if text is not None and backend.token_to_id(text) is None:
            log.warning("the %s token %r is not in the vocabulary; not adding it", name, text)
            bos, eos = (None, eos) if name == "BOS" else (bos, None)
    single = " ".join(x for x in (f"{bos}:0" if bos else "", "$A:0", f"{eos}:0" if eos else "") if x)
    pair = " ".join(x for x in (f"{bos}:0" if bos else "", "$A:0", f"{eos}:0" if eos else "",
                                f"{bos}:1" if bos else "", "$B:1", f"{eos}:1" if eos else "") if x)
    special = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

"""GGUF vocabularies rebuilt as tokenizers encode and decode exactly like the tokenizer.json they came
from (and like transformers' own GGUF conversion); streaming decode never splits a character."""

from __future__ import annotations

import json

import pytest

from tests.engine.test_tokenizer_helpers import (
    SAMPLES,
    build_byte_level_tokenizer,
    build_sentencepiece_tokenizer,
    write_tokenizer_gguf,
)
from workbench.core.errors import ModelFormatError, WorkbenchError
from workbench.engine.tokenizer import StreamDecoder, from_gguf, load_tokenizer


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte_level")
    hf = build_byte_level_tokenizer()
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"}, "bos_token": None}))
    gguf_path = write_tokenizer_gguf(folder / "vocab.gguf", hf, "gpt2", pre="qwen2",
                                     eos=hf.token_to_id("<|endoftext|>"))
    return hf, folder, gguf_path


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spm")
    hf, scores = build_sentencepiece_tokenizer()
    hf.save(str(folder / "tokenizer.json"))
    gguf_path = write_tokenizer_gguf(folder / "vocab.gguf", hf, "llama", scores=scores, bos=1, eos=2,
                                     add_bos=True, arch="llama")
    return hf, folder, gguf_path


@pytest.mark.parametrize("which", ["byte_level", "sentencepiece"])
def test_gguf_vocabulary_matches_its_tokenizer_json(which, request):
    hf, _, gguf_path = request.getfixturevalue(which)
    ours = from_gguf(gguf_path)
    assert ours.vocab_size == hf.get_vocab_size()
    for text in SAMPLES:
        for special in (True, False):
            expected = hf.encode(text, add_special_tokens=special).ids
            assert ours.encode(text, add_special_tokens=special) == expected, (text, special)
        ids = hf.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("which", ["byte_level", "sentencepiece"])
def test_gguf_vocabulary_matches_transformers_gguf_conversion(which, request):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    _, _, gguf_path = request.getfixturevalue(which)
    architecture, vocab, _ = get_gguf_tokenizer(str(gguf_path))
    reference, _ = convert_gguf_tokenizer(architecture, vocab)
    ours = from_gguf(gguf_path)
    for text in SAMPLES:
        if which == "sentencepiece" and text.startswith(" "):
            continue  # transformers adds no "▁" before leading spaces; llama.cpp does (see below)
        expected = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == expected, text


def test_byte_level_special_tokens_stay_whole(byte_level):
    hf, _, gguf_path = byte_level
    ours = from_gguf(gguf_path)
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == hf.token_to_id("<|im_start|>") and ids[-1] == hf.token_to_id("<|im_end|>")
    # <|endoftext|> is the declared EOS; <|im_end|> is a control token llama.cpp ends turns on.
    assert ours.eos_ids == sorted({hf.token_to_id("<|endoftext|>"), hf.token_to_id("<|im_end|>")})
    assert ours.special_tokens["eos_token"] == "<|endoftext|>"


def test_sentencepiece_adds_bos_and_falls_back_to_bytes(sentencepiece):
    _, _, gguf_path = sentencepiece
    ours = from_gguf(gguf_path)
    ids = ours.encode("龍")  # not in the vocabulary: three byte tokens after "▁"
    assert ids[0] == 1
    assert [ours.id_to_token(i) for i in ids[-3:]] == ["<0xE9>", "<0xBE>", "<0x8D>"]
    assert ours.decode(ids, skip_special_tokens=True) == "龍"
    assert ours.eos_ids == [2]
    assert ours.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def test_sentencepiece_space_after_special_token(sentencepiece):
    """Every stretch of text gets one "▁" in front, also after a special token and before leading
    spaces, as in llama.cpp and Llama-2's tokenizer.json ("<s>The" -> "<s>", "▁The"; "  a" ->
    "▁▁▁a"). transformers' GGUF conversion (Metaspace, prepend "first") does neither."""
    hf, _, gguf_path = sentencepiece
    ours = from_gguf(gguf_path)
    text = "<s>The quick</s>The router"
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == hf.encode(text, add_special_tokens=False).ids
    assert [ours.id_to_token(i) for i in ids][:2] == ["<s>", "▁The"]
    ids = ours.encode("  a", add_special_tokens=False)
    assert "".join(ours.id_to_token(i) for i in ids) == "▁▁▁a"
    assert ours.decode(ids) == "  a"


def test_tokenizer_json_folder_with_config(byte_level):
    hf, folder, _ = byte_level
    tok = load_tokenizer(folder)
    assert tok.encode(SAMPLES[0]) == hf.encode(SAMPLES[0]).ids
    assert tok.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert tok.eos_ids == [hf.token_to_id("<|im_end|>")]


@pytest.mark.parametrize("which", ["byte_level", "sentencepiece"])
def test_stream_decoder_never_emits_half_characters(which, request):
    _, _, gguf_path = request.getfixturevalue(which)
    tok = from_gguf(gguf_path)
    text = "Straße 🙂 北京欢迎你 龍 ∑ end"
    ids = tok.encode(text, add_special_tokens=False)
    stream = StreamDecoder(tok)
    deltas = [stream.push(i) for i in ids]
    deltas.append(stream.flush())
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    # Some characters span several tokens here, so some pushes must have held their bytes back.
    assert len(ids) > len([d for d in deltas if d])


def test_stream_decoder_flushes_a_truncated_character(byte_level):
    _, _, gguf_path = byte_level
    tok = from_gguf(gguf_path)
    ids = tok.encode("a 🙂", add_special_tokens=False)
    stream = StreamDecoder(tok)
    pushed = "".join(stream.push(i) for i in ids[:-1])
    assert "\ufffd" not in pushed
    assert (pushed + stream.flush()).startswith("a")


def test_unsupported_and_foreign_files_are_refused(tmp_path, byte_level):
    hf, _, _ = byte_level
    path = write_tokenizer_gguf(tmp_path / "bert.gguf", hf, "gpt2")
    from workbench.engine.tokenizer import read_gguf_tokenizer_fields

    fields = read_gguf_tokenizer_fields(path)
    fields["tokenizer.ggml.model"] = "bert"
    with pytest.raises(WorkbenchError, match="not supported"):
        from_gguf(path, fields)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFormatError):
        from_gguf(junk)
    empty = tmp_path / "empty_model"
    empty.mkdir()
    assert load_tokenizer(empty) is None


@pytest.mark.parametrize("which", ["byte_level", "sentencepiece"])
def test_inventory_metadata_builds_the_same_tokenizer(which, request):
    """The GGUF reader's metadata (lazy string arrays, numpy arrays) serves as well as gguf-py's fields."""
    from workbench.core.readers.gguf import read_gguf

    hf, _, gguf_path = request.getfixturevalue(which)
    metadata, _, _ = read_gguf(gguf_path)
    ours = from_gguf(gguf_path, metadata)
    for text in SAMPLES:
        assert ours.encode(text) == hf.encode(text).ids


def test_stream_decoder_does_not_stall_on_invalid_bytes(byte_level):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    _, _, gguf_path = byte_level
    tok = from_gguf(gguf_path)
    lone_continuation = tok.token_to_id(bytes_to_unicode()[0x80])
    stream = StreamDecoder(tok)
    deltas = [stream.push(i) for i in [tok.token_to_id("a")] + [lone_continuation] * 6]
    assert deltas[0] == "a" and deltas[1:4] == ["", "", ""]
    assert "".join(deltas) + stream.flush() == "a" + "\ufffd" * 6


@pytest.mark.parametrize("flags", [{}, {"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True},
                                   {"add_eos_token": True}])
@pytest.mark.parametrize("post_processor", [True, False])
def test_bos_eos_flags_of_tokenizer_config_like_transformers(sentencepiece, tmp_path, flags, post_processor):
    from tokenizers import Tokenizer as Backend
    from transformers import AutoTokenizer

    hf, _, _ = sentencepiece
    hf = Backend.from_str(hf.to_str())
    if not post_processor:
        hf.post_processor = None
    hf.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", **flags}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = load_tokenizer(tmp_path)
    for text in SAMPLES[:3]:
        assert ours.encode(text) == reference(text)["input_ids"], (flags, text)

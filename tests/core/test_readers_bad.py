"""Bad input: one clear line on stderr, exit code 2, no traceback, nothing huge allocated."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.core.errors import ModelFormatError
from workbench.core.readers import open_model


def _inspect(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench", "inspect", str(path)],
                          capture_output=True, text=True, timeout=60)


def _assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("workbench inspect: ")
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    for n in needles:
        assert n in lines[0], lines[0]


def _safetensors(path: Path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _hf_folder(tmp: Path, tiny_model_dir, model_type="olmoe") -> Path:
    out = tmp / "model"
    shutil.copytree(tiny_model_dir(model_type), out)
    return out


def _gguf_copy(tmp: Path, tiny_gguf) -> tuple[Path, bytearray]:
    src = tiny_gguf("qwen3_moe", "Q8_0")
    out = tmp / "m.gguf"
    shutil.copy(src, out)
    return out, bytearray(out.read_bytes())


def test_missing_path(tmp_path):
    _assert_clean_error(_inspect(tmp_path / "nothing"), "does not exist")


def test_folder_without_config(tmp_path):
    _assert_clean_error(_inspect(tmp_path), "no config.json")


def test_bad_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    _assert_clean_error(_inspect(tmp_path), "not valid JSON")


def test_unknown_architecture_lists_supported(tmp_path, tiny_model_dir):
    folder = _hf_folder(tmp_path, tiny_model_dir)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_bigcode"}))
    _assert_clean_error(_inspect(folder), "gpt_bigcode", "mixtral", "qwen3_moe", "gpt_oss")


def test_unknown_tensor_is_named(tmp_path, tiny_model_dir):
    folder = _hf_folder(tmp_path, tiny_model_dir)
    _safetensors(folder / "model.safetensors",
                 {"model.layers.0.mystery.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                 b"\0" * 8)
    _assert_clean_error(_inspect(folder), "model.layers.0.mystery.weight")


def test_safetensors_header_truncated_or_oversized(tmp_path, tiny_model_dir):
    folder = _hf_folder(tmp_path, tiny_model_dir)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:200])  # the header says more bytes than there are
    _assert_clean_error(_inspect(folder), "header")
    st.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    _assert_clean_error(_inspect(folder), "header")
    with open(st, "wb") as f:  # a 200 MB sparse file claiming a 150 MB header
        f.write(struct.pack("<Q", 150 << 20))
        f.truncate(200 << 20)
    with pytest.raises(ModelFormatError, match="larger than any real header"):
        open_model(folder)
    st.write_bytes(b"abc")
    _assert_clean_error(_inspect(folder), "not a safetensors file")


def test_safetensors_truncated_data(tmp_path, tiny_model_dir):
    folder = _hf_folder(tmp_path, tiny_model_dir)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    _assert_clean_error(_inspect(folder), "truncated")


def test_safetensors_inconsistent_entry(tmp_path, tiny_model_dir):
    folder = _hf_folder(tmp_path, tiny_model_dir)
    _safetensors(folder / "model.safetensors",
                 {"model.norm.weight": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 8]}}, b"\0" * 8)
    _assert_clean_error(_inspect(folder), "model.norm.weight")


def test_gguf_bad_magic_and_version(tmp_path, tiny_gguf):
    path, data = _gguf_copy(tmp_path, tiny_gguf)
    path.write_bytes(b"GGML" + data[4:])
    _assert_clean_error(_inspect(path), "not a GGUF file")
    path.write_bytes(data[:4] + struct.pack("<I", 99) + data[8:])
    _assert_clean_error(_inspect(path), "version 99")


def test_gguf_absurd_counts(tmp_path, tiny_gguf):
    path, data = _gguf_copy(tmp_path, tiny_gguf)
    path.write_bytes(data[:8] + struct.pack("<Q", 1 << 60) + data[16:])
    _assert_clean_error(_inspect(path), "absurd")
    path.write_bytes(data[:16] + struct.pack("<Q", 1 << 40) + data[24:])
    _assert_clean_error(_inspect(path), "absurd")
    # the first key's length claims 2**60 bytes
    path.write_bytes(data[:24] + struct.pack("<Q", 1 << 60) + data[32:])
    _assert_clean_error(_inspect(path), "past the end")


def test_gguf_truncated(tmp_path, tiny_gguf):
    path, data = _gguf_copy(tmp_path, tiny_gguf)
    path.write_bytes(data[:-64])
    _assert_clean_error(_inspect(path), "truncated", "blk.")
    path.write_bytes(data[:300])  # cut inside the metadata
    _assert_clean_error(_inspect(path), "truncated or corrupt")


def test_gguf_unknown_architecture(tmp_path):
    import gguf

    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(path, "falcon")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_clean_error(_inspect(path), "falcon", "qwen3moe", "deepseek2")


def test_split_gguf_missing_part(tmp_path, tiny_model_dir):
    from workbench.core.gguf_writer import write_gguf

    parts = write_gguf(tiny_model_dir("olmoe"), tmp_path / "m.gguf", split_max_tensors=8)
    parts[-1].unlink()
    _assert_clean_error(_inspect(parts[0]), "missing part", parts[-1].name)


def test_not_a_model_file(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello")
    _assert_clean_error(_inspect(p), "neither")


# -- fuzzing: any corruption is a ModelFormatError, never another exception -------------------------


def test_fuzz_gguf_header(tmp_path, tiny_gguf):
    import random

    from workbench.core.readers.gguf import read_gguf_header

    original = tiny_gguf("qwen3_moe", "Q8_0").read_bytes()
    rng = random.Random(0)
    path = tmp_path / "f.gguf"
    for _ in range(400):
        raw = bytearray(original)
        for _ in range(rng.randrange(6)):
            raw[rng.randrange(3000)] = rng.randrange(256)
        if rng.random() < 0.3:  # a 64-bit count or length set to an extreme
            pos = rng.randrange(3000)
            raw[pos:pos + 8] = struct.pack("<Q", rng.choice([1 << 63, (1 << 64) - 1, rng.randrange(1 << 40)]))
        path.write_bytes(bytes(raw[:rng.randrange(len(raw) + 1)]))
        try:
            read_gguf_header(path)
        except ModelFormatError:
            pass


def test_fuzz_configs(tiny_model_dir, tiny_gguf):
    import random

    from workbench.core.readers.gguf import read_gguf
    from workbench.core.readers.gguf_config import config_from_gguf
    from workbench.core.readers.hf_config import spec_from_config

    rng = random.Random(0)
    junk = [None, "x", [], {}, -1, 0, 1.5, True, [1, 2]]
    for model_type in ("qwen2_moe", "deepseek_v3", "llama4_text", "gpt_oss"):
        config0 = json.loads((tiny_model_dir(model_type) / "config.json").read_text())
        meta0, tensors, _ = read_gguf(tiny_gguf(model_type, "F32"))
        for _ in range(100):
            config, meta = dict(config0), dict(meta0)
            for _ in range(3):
                config[rng.choice(sorted(config))] = rng.choice(junk)
                meta[rng.choice(sorted(meta))] = rng.choice(junk)
            try:
                spec_from_config(config)
            except ModelFormatError:
                pass
            try:
                spec_from_config(config_from_gguf(meta, tensors))
            except ModelFormatError:
                pass

"""Exact bytes for every GGML type: our type table against gguf-py's, and a GGUF holding all of them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from workbench.core.errors import ModelFormatError
from workbench.core.ggml_types import bytes_per_value, tensor_nbytes, type_name
from workbench.core.readers import open_model
from workbench.core.readers.gguf import read_gguf_header

ALL_TYPES = [t for t in gguf.GGMLQuantizationType if t in gguf.GGML_QUANT_SIZES]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_nbytes_equal_gguf_py(qtype):
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    shape = (3, 5, 2 * max(block, 256))
    assert tensor_nbytes(qtype.name, shape) == int(np.prod(gguf.quant_shape_to_byte_shape(shape, qtype)))
    assert type_name(int(qtype.value)) == qtype.name


def test_known_sizes_and_errors():
    assert tensor_nbytes("Q4_K", (4096, 4096)) == 4096 * 16 * 144
    assert tensor_nbytes("MXFP4", (32, 2880, 2880)) == 32 * 2880 * 90 * 17
    assert bytes_per_value("q8_0") == 34 / 32 and bytes_per_value("F16") == 2
    with pytest.raises(ModelFormatError, match="Q4_K"):
        tensor_nbytes("Q4_K", (10, 100))
    with pytest.raises(ModelFormatError, match="unknown GGML tensor type id 1234"):
        type_name(1234)


def test_gguf_with_every_type(tmp_path):
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for i, qtype in enumerate(ALL_TYPES):
        shape = (2, 256)
        byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
        w.add_tensor(f"blk.0.t{i}.weight", np.zeros(byte_shape, np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _, mine = read_gguf_header(path)
    theirs = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for name, t in theirs.items():
        assert mine[name].dtype == t.tensor_type.name
        assert mine[name].nbytes == int(t.n_bytes) and mine[name].offset == int(t.data_offset)
        assert mine[name].shape == (2, 256)
    with pytest.raises(ModelFormatError, match="lacks block_count"):
        open_model(path)  # a valid GGUF, but no model description

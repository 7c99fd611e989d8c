"""The lean GGUF reader agrees with the gguf package's GGUFReader on metadata and tensors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from stages.gguf_file import GGUFFile  # noqa: E402


@pytest.fixture()
def gguf_path(tmp_path: Path) -> Path:
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_float32("llama.rope.freq_base", 5e5)
    w.add_string("general.name", "tiny")
    w.add_token_list([f"tok{i}" for i in range(300)])  # long string array: skipped, length kept
    w.add_array("some.short", [1, 2, 3])
    rng = np.random.default_rng(0)
    w.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    q = gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("f16.weight", rng.standard_normal((4, 32)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_matches_gguf_reader(gguf_path: Path) -> None:
    ours, ref = GGUFFile(str(gguf_path)), gguf.GGUFReader(str(gguf_path))
    assert ours.fields["general.architecture"] == "llama" and ours.fields["llama.block_count"] == 2
    assert ours.fields["llama.rope.freq_base"] == pytest.approx(5e5)
    assert ours.fields["some.short"] == [1, 2, 3]
    assert ours.fields["tokenizer.ggml.tokens"] is None and ours.array_lengths["tokenizer.ggml.tokens"] == 300
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        expected = gguf.quants.dequantize(t.data, t.tensor_type)
        got = ours.read(t.name)
        np.testing.assert_array_equal(got, expected.reshape(got.shape))
    np.testing.assert_array_equal(ours.read("q8.weight", rows=(2, 5)), ours.read("q8.weight")[2:5])


def test_rejects_non_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF"):
        GGUFFile(str(bad))

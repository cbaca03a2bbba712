from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tidegate.model_files.gguf_file import GGUFFormatError, read_gguf_header
from tidegate.model_files.model_source import resolve_model


@pytest.mark.slow
def test_header_matches_gguf_reader_on_the_default_model() -> None:
    path = resolve_model("smollm2").path
    assert path is not None
    reference = gguf.GGUFReader(path)
    header = read_gguf_header(path)
    fields = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert header.metadata == fields
    assert [(t.name, t.dims, t.ggml_type, t.offset) for t in header.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset))
        for t in reference.tensors
    ]


def test_arrays_can_be_skipped(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["a", "bc", "d"])
    writer.add_token_types([1, 3, 1])
    writer.add_key_value("test.nested", [[1, 2], [3]], gguf.GGUFValueType.ARRAY)
    writer.add_context_length(77)
    writer.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    full = read_gguf_header(path)
    assert full.metadata["tokenizer.ggml.tokens"] == ["a", "bc", "d"]
    assert full.metadata["tokenizer.ggml.token_type"] == [1, 3, 1]
    assert full.metadata["test.nested"] == [[1, 2], [3]]
    assert full.tensors[0].shape == (2, 3)
    data = np.fromfile(path, dtype=np.float32, count=6, offset=full.tensors[0].offset)
    assert data.tolist() == list(range(6))

    light = read_gguf_header(path, arrays=False, tensors=False)
    assert "tokenizer.ggml.tokens" not in light.metadata
    assert light.metadata["llama.context_length"] == 77
    assert light.tensors == []


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "empty"), (b"GGML" + bytes(20), "bad magic"),
     (b"GGUF\x01\x00\x00\x00" + bytes(16), "version 1"), (b"GGUF\x03\x00\x00\x00\x05", "truncated")],
)
def test_broken_files_raise_format_errors(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFFormatError, match=message):
        read_gguf_header(path)

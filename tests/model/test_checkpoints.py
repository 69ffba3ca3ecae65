"""featcal.model.checkpoints.read_header: a safetensors header is checked against the format before any
tensor is read, and a lying one is refused naming the file (safetensors itself fails mid-run with a
Rust error that names none)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from featcal.model.checkpoints import CorruptShardError, read_header


def _forged(path, tensors: dict, data: bytes):
    """A safetensors file with the header ``tensors`` (name -> dtype, shape, data_offsets) over ``data``."""
    head = json.dumps(tensors).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    return path


def test_a_well_formed_file_is_read(tmp_path):
    save_file({"a": torch.zeros(2, 3), "b": torch.ones(4)}, str(tmp_path / "ok.safetensors"))
    specs = read_header(tmp_path / "ok.safetensors")
    assert {k: (v.dtype, v.shape) for k, v in specs.items()} == {
        "a": (torch.float32, (2, 3)),
        "b": (torch.float32, (4,)),
    }


@pytest.mark.parametrize(
    "header, match",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, "spans bytes -8 to 0"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            "tensors 'a' and 'b' overlap",
        ),
        ({"a": {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}}, "negative dimension"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, "its shape and dtype need 16"),
    ],
)
def test_a_lying_header_is_refused_naming_the_file(tmp_path, header, match):
    path = _forged(tmp_path / "lying.safetensors", header, bytes(16))
    with pytest.raises(CorruptShardError, match=f"lying.safetensors.*{match}"):
        read_header(path)


def test_offsets_past_the_end_are_a_truncated_file(tmp_path):
    path = _forged(tmp_path / "short.safetensors", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"")
    with pytest.raises(CorruptShardError, match="short.safetensors.*truncated"):
        read_header(path)

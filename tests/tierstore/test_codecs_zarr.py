"""Interop: plain ``zarr.open_array`` reads chunks that tierstore codecs wrote, given the
``zarr.json`` the store would write (``codec.zarr_codecs(dtype)`` + crc32c)."""

from __future__ import annotations

import json
import pathlib
import struct

import crc32c
import numpy as np
import pytest
import torch
import zarr

import tierstore  # noqa: F401  (registers the tierstore.q* zarr codecs)
from tierstore import codecs
from tierstore.dtypes import zarr_data_type, zarr_fill_value
from tools.bench.moments import synthetic_moments


def _write_array(root: pathlib.Path, codec: codecs.Codec, t: torch.Tensor,
                 chunk_shape: tuple[int, ...], data_type: str) -> None:
    """Write ``t`` by hand: one file per chunk = codec bytes + crc32c (little-endian)."""
    root.mkdir(parents=True)
    meta = {
        "zarr_format": 3, "node_type": "array", "shape": list(t.shape),
        "data_type": data_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": zarr_fill_value(t.dtype) if data_type != "float32" else 0.0,
        "codecs": codec.zarr_codecs(t.dtype) + [{"name": "crc32c"}],
        "attributes": {},
    }
    (root / "zarr.json").write_text(json.dumps(meta))
    grid = [-(-s // c) for s, c in zip(t.shape, chunk_shape, strict=True)]
    for idx in np.ndindex(*grid):
        # edge chunks are stored at full chunk shape, padded with zeros (zarr's layout)
        chunk = torch.zeros(chunk_shape, dtype=t.dtype)
        src = tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(idx, chunk_shape, t.shape, strict=True))
        chunk[tuple(slice(0, sl.stop - sl.start) for sl in src)] = t[src]
        data = codec.encode(chunk)
        raw = data.numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)
        path = root.joinpath("c", *map(str, idx)) if idx else root / "c"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw + struct.pack("<I", crc32c.crc32c(raw)))


@pytest.mark.parametrize("name", ["raw", "zstd", "blosc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32], ids=str)
def test_lossless_chunks_open_with_zarr(tmp_path: pathlib.Path, name: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(37, 50, generator=g) * 100).to(dtype)
    _write_array(tmp_path / "a", codecs.get(name), t, (16, 32), zarr_data_type(dtype))
    arr = zarr.open_array(tmp_path / "a", mode="r")
    np.testing.assert_array_equal(arr[...], t.numpy())


@pytest.mark.parametrize("name", ["q8", "q4", "q3", "q2"])
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantized_chunks_open_with_zarr(tmp_path: pathlib.Path, name: str, signed: bool,
                                         dtype: torch.dtype) -> None:
    m, v = synthetic_moments(40 * 70, seed=2)
    t = (m if signed else v).reshape(40, 70).to(dtype)
    codec = codecs.get(name, signed=signed, block=96)
    chunk_shape = (16, 64)
    _write_array(tmp_path / "q", codec, t, chunk_shape, "float32")
    arr = zarr.open_array(tmp_path / "q", mode="r")
    assert arr.dtype == np.float32
    got = arr[...]
    # the reference: the codec's own decode of each chunk, stitched together
    want = np.zeros(t.shape, dtype=np.float32)
    for i in range(0, 40, 16):
        for j in range(0, 70, 64):
            chunk = torch.zeros(chunk_shape, dtype=dtype)
            part = t[i:i + 16, j:j + 64]
            chunk[: part.shape[0], : part.shape[1]] = part
            data = codec.encode(chunk).numpy().tobytes()
            dec = codec.decode(memoryview(data), chunk_shape, dtype).numpy()
            want[i:i + 16, j:j + 64] = dec[: part.shape[0], : part.shape[1]]
    np.testing.assert_array_equal(got, want)
    if name in ("q8", "q4"):  # error bounds live in test_codecs_quant; this is a sanity check
        assert np.linalg.norm(got - t.float().numpy()) < 0.5 * np.linalg.norm(t.float().numpy())


def test_zero_d_quantized_array(tmp_path: pathlib.Path) -> None:
    t = torch.tensor(0.125)
    _write_array(tmp_path / "s", codecs.get("q4", signed=False), t, (), "float32")
    assert zarr.open_array(tmp_path / "s", mode="r")[...] == pytest.approx(0.125, rel=0.01)


def test_zarr_writes_what_tierstore_reads(tmp_path: pathlib.Path) -> None:
    """The zarr codec also encodes: zarr-written chunks decode with the tierstore codec."""
    codec = codecs.get("q4", signed=False, block=64)
    x = synthetic_moments(4096, seed=5)[1].reshape(64, 64).numpy()
    arr = zarr.create_array(tmp_path / "w", shape=x.shape, chunks=(32, 64), dtype="float32",
                            serializer=codec.zarr_codecs(torch.float32)[0], compressors=None)
    arr[...] = x
    raw = (tmp_path / "w" / "c" / "1" / "0").read_bytes()
    back = codec.decode(memoryview(raw), (32, 64), torch.float32)
    mine = codec.decode(memoryview(codec.encode(torch.from_numpy(x[32:])).numpy()), (32, 64),
                        torch.float32)
    assert torch.equal(back, mine)
    np.testing.assert_array_equal(arr[...][32:], mine.numpy())


def test_spec_of_the_old_block_layout_is_refused(tmp_path: pathlib.Path) -> None:
    """tierstore 0.1.0 wrote q-codec specs without "scales"; those bytes are not readable now,
    so both the catalog path and plain zarr refuse them instead of decoding wrong values."""
    old = {"name": "q4", "signed": False, "block": 128, "rounding": "nearest"}
    with pytest.raises(tierstore.CodecError, match="0.1.0"):
        codecs.from_spec(old)
    assert codecs.from_spec({**old, "scales": "rank1"}) == codecs.get("q4", signed=False)
    with pytest.raises(tierstore.CodecError, match="scales"):
        codecs.get("q4", scales="block")
    t = torch.rand(8, 8)
    _write_array(tmp_path / "old", codecs.get("q4", signed=False), t, (8, 8), "float32")
    meta_path = tmp_path / "old" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    del meta["codecs"][0]["configuration"]["scales"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(tierstore.CodecError, match="0.1.0"):
        zarr.open_array(tmp_path / "old", mode="r")[...]


@pytest.mark.parametrize("correction", [None, "bias", "norm"])
def test_dithered_chunks_open_with_zarr(tmp_path: pathlib.Path, correction: str | None) -> None:
    """A dithered chunk's decoder (and its correction) is in the spec zarr reads."""
    codec = codecs.get("q4", rounding="dither", correction=correction)
    t = synthetic_moments(32 * 64, seed=4)[0].reshape(32, 64)
    _write_array(tmp_path / "d", codec, t, (32, 64), "float32")
    want = codec.decode(memoryview(codec.encode(t).numpy().tobytes()), (32, 64), torch.float32)
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "d", mode="r")[...], want.numpy())

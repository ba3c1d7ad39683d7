"""Fuzzing of everything read from disk: catalog records, zarr metadata, safetensors headers.

Each parser must either accept its input or raise the documented error; never anything else,
and never hang (hypothesis' deadline bounds every example).
"""

from __future__ import annotations

import json
import os
import struct

import lmdb
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import tierstore
from tierstore.records import Commit, GenRecord
from tierstore.safetensors import read_header
from tools.cli import verify_cmd
from tools.cli.errors import MalformedInput

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
    max_leaves=20,
)
FUZZ = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])


def good_record() -> dict:
    return {"key": "a", "generation": 3, "dtype": "float32", "codec": {"name": "raw"},
            "grid": {"shape": [4, 2], "split_dim": 0, "rows": 2}, "chunks": [[16, 1], [16, 2]]}


def mutate(d: dict, field: str, value: object) -> bytes:
    d = dict(d)
    d[field] = value
    return json.dumps(d).encode()


@FUZZ
@given(st.binary(max_size=300) | JSON.map(lambda v: json.dumps(v).encode()))
def test_generation_records_reject_garbage(raw: bytes) -> None:
    for parse in (GenRecord.from_json, Commit.from_json):
        try:
            parse(raw)
        except tierstore.CorruptData:
            pass


@FUZZ
@given(st.sampled_from(sorted(good_record())), JSON)
@example("generation", float("inf"))  # found by this test: int(inf) raised OverflowError
def test_generation_records_reject_bad_fields(field: str, value: object) -> None:
    raw = mutate(good_record(), field, value)
    try:
        rec = GenRecord.from_json(raw)
    except tierstore.CorruptData:
        return
    assert len(rec.chunks) == rec.grid.n_chunks  # anything accepted is self-consistent


def test_deeply_nested_json_is_corrupt_not_a_crash() -> None:
    with pytest.raises(tierstore.CorruptData):
        GenRecord.from_json(b"[" * 100_000 + b"]" * 100_000)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.binary(max_size=200))
def test_store_with_a_garbage_catalog_record_fails_cleanly(tmp_path_factory, value: bytes) -> None:
    path = tmp_path_factory.mktemp("cat")
    with tierstore.open(path) as s:
        s.put("w", torch.ones(4))
    env = lmdb.open(str(path / "catalog"), max_dbs=4)
    db = env.open_db(b"generations")  # outside the write txn: open_db takes the writer lock too
    with env.begin(write=True) as txn:
        txn.put(struct.pack(">Q", 1), value, db=db)
    env.close()
    try:
        with tierstore.open(path, mode="r") as r:
            r.get("w")
    except tierstore.StoreError:
        pass


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400) | JSON.map(lambda v: json.dumps(v).encode()))
def test_zarr_metadata_checks_never_crash(tmp_path_factory, meta: bytes) -> None:
    path = tmp_path_factory.mktemp("z")
    with tierstore.open(path) as s:
        s.put("w", torch.ones(4))
        s.commit()
        zpath = os.path.join(s.zarr_path("w"), "zarr.json")
    with open(zpath, "wb") as f:
        f.write(meta)
    with tierstore.open(path, mode="r") as r:
        faults = verify_cmd.check_metadata(r, "w")
    assert all(isinstance(f, tierstore.CorruptData) for f in faults)


@FUZZ
@given(st.binary(max_size=300), st.integers(0, 2**64 - 1) | st.none(), JSON)
def test_safetensors_headers_never_crash(tmp_path_factory, tail: bytes, length: int | None,
                                         header: object) -> None:
    path = tmp_path_factory.mktemp("st") / "x.safetensors"
    body = json.dumps(header).encode()
    n = len(body) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + body + tail)
    try:
        read_header(str(path))
    except MalformedInput:
        pass


def test_deeply_nested_json_in_files_is_reported(tmp_path) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    with tierstore.open(tmp_path / "s") as s:
        s.put("w", torch.ones(4))
        s.commit()
        zpath = os.path.join(s.zarr_path("w"), "zarr.json")
    with open(zpath, "wb") as f:
        f.write(deep)
    with tierstore.open(tmp_path / "s", mode="r") as r:
        faults = verify_cmd.check_metadata(r, "w")
    assert len(faults) == 1 and "unreadable" in str(faults[0])
    st_path = tmp_path / "x.safetensors"
    st_path.write_bytes(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(MalformedInput):
        read_header(str(st_path))

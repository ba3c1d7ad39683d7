"""import rejects malformed safetensors files and folders with a clear error; nothing commits.

Each case starts from a valid file written by the safetensors library and breaks one thing.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

import tierstore


def _layout(path: str) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), f.read()


def _write(path: str, header: dict | bytes, data: bytes, length: int | None = None) -> None:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob) if length is None else length) + blob + data)


@pytest.fixture
def valid(tmp_path) -> str:
    path = str(tmp_path / "good.safetensors")
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "b": torch.ones(4, dtype=torch.int64)}, path)
    return path


def _breakers() -> dict[str, tuple]:
    """case -> (function(header, data) -> (header, data, length), expected message part)."""
    def entry(h: dict, name: str, **kw: object) -> dict:
        h = json.loads(json.dumps(h))
        h[name].update(kw)
        return h

    return {
        "length_beyond_file": (lambda h, d: (h, d, 10_000), "larger than the file"),
        "length_absurd": (lambda h, d: (h, d, 2**40), "over the 100000000-byte limit"),
        "garbage_json": (lambda h, d: (b"{not json at all" + b" " * 8, d, None), "not valid UTF-8 JSON"),
        "not_utf8": (lambda h, d: (b"{\"\xff\xfe\": 1}", d, None), "not valid UTF-8 JSON"),
        "json_list": (lambda h, d: (b"[1, 2, 3]", d, None), "not an object"),
        "offsets_outside": (lambda h, d: (entry(h, "b", data_offsets=[24, 24 + 32 + 8]), d, None),
                            "outside the"),
        "negative_offset": (lambda h, d: (entry(h, "a", data_offsets=[-4, 20]), d, None),
                            "outside the"),
        "unknown_dtype": (lambda h, d: (entry(h, "a", dtype="F7"), d, None), "dtype 'F7' is unknown"),
        "unstorable_dtype": (lambda h, d: (entry(h, "a", dtype="U32"), d, None), "is unknown or not storable"),
        "size_mismatch": (lambda h, d: (entry(h, "a", shape=[2, 4]), d, None), "needs 32"),
        "overlap": (lambda h, d: (entry(entry(h, "a", data_offsets=[0, 24]), "b",
                                        data_offsets=[16, 48]), d, None), "overlaps"),
        "gap": (lambda h, d: (entry(h, "a", data_offsets=[40, 64]), d + b"\0" * 8, None),
                "8 bytes before tensor 'a' belong to no tensor"),
        "trailing_bytes": (lambda h, d: (h, d + b"junk", None), "after the last tensor"),
        "bad_shape": (lambda h, d: (entry(h, "a", shape=[2, -3]), d, None), "non-negative ints"),
        "extra_field": (lambda h, d: (entry(h, "a", extra=1), d, None), "needs exactly"),
        "invalid_key": (lambda h, d: ({("../evil" if k == "a" else k): v for k, v in h.items()}, d, None),
                        "not a valid store key"),
        "duplicate_name": (lambda h, d: (json.dumps(h).replace('"b"', '"a"').encode(), d, None),
                           "duplicate name 'a'"),
        "bad_metadata": (lambda h, d: ({**h, "__metadata__": {"x": 1}}, d, None), "__metadata__"),
    }


@pytest.mark.parametrize("case", sorted(_breakers()))
def test_malformed_file_rejected_nothing_committed(case, cli, valid, tmp_path, make_store) -> None:
    header, data = _layout(valid)
    breaker, message = _breakers()[case]
    new_header, new_data, length = breaker(header, data)
    bad = str(tmp_path / "bad.safetensors")
    _write(bad, new_header, new_data, length)
    store = make_store(tmp_path / "store", {"keep": torch.ones(2)})
    code, out, err = cli("import", bad, store)
    assert code == 1, (case, out, err)
    assert err.startswith(f"tierstore import: error: {bad}: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    with tierstore.open(store, mode="r", device="cpu") as s:
        assert len(s.versions()) == 1 and s.keys() == ["keep"]
    # a malformed file never creates a store either
    assert cli("import", bad, str(tmp_path / "fresh"))[0] == 1
    assert not os.path.exists(tmp_path / "fresh")


def test_valid_file_imports(cli, valid, tmp_path) -> None:
    """The untouched file passes (so the cases above fail for their own reason)."""
    store = str(tmp_path / "s")
    assert cli("import", valid, store)[0] == 0
    with tierstore.open(store, mode="r", device="cpu") as s:
        assert torch.equal(s.get("a"), torch.arange(6, dtype=torch.float32).reshape(2, 3))
        assert torch.equal(s.get("b"), torch.ones(4, dtype=torch.int64))


def test_short_file(cli, tmp_path) -> None:
    bad = tmp_path / "short.safetensors"
    bad.write_bytes(b"\x01\x02")
    code, _, err = cli("import", str(bad), str(tmp_path / "s"))
    assert code == 1 and "too short" in err


def _folder(tmp_path, valid: str) -> str:
    folder = tmp_path / "hf"
    folder.mkdir()
    os.rename(valid, folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-00001-of-00001.safetensors",
                                        "b": "model-00001-of-00001.safetensors"}}))
    return str(folder)


@pytest.mark.parametrize("index, message", [
    ({"weight_map": {"a": "../good.safetensors", "b": "x"}}, "not a plain file name"),
    ({"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors",
                     "c": "model-00001-of-00001.safetensors"}}, "no shard holds"),
    ({"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "other.safetensors"}},
     "missing"),
    ({"weight_map": {"a": "model-00001-of-00001.safetensors"}}, "not mapped to this file"),
    ({"weight_map": ["a"]}, "weight_map"),
    ("{oops", "not valid UTF-8 JSON"),
])
def test_malformed_index_rejected(index, message, cli, valid, tmp_path) -> None:
    folder = _folder(tmp_path, valid)
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path, "w") as f:
        f.write(index if isinstance(index, str) else json.dumps(index))
    code, _, err = cli("import", folder, str(tmp_path / "s"))
    assert code == 1 and message in err and "Traceback" not in err, err
    assert not os.path.exists(tmp_path / "s")


def test_folder_config_must_be_json_object(cli, valid, tmp_path) -> None:
    folder = _folder(tmp_path, valid)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write("[]")
    code, _, err = cli("import", folder, str(tmp_path / "s"))
    assert code == 1 and "config.json: not a JSON object" in err


def test_missing_source_exit_2(cli, tmp_path) -> None:
    code, _, err = cli("import", str(tmp_path / "nothing"), str(tmp_path / "s"))
    assert code == 2 and "no such file or folder" in err
    (tmp_path / "empty").mkdir()
    code, _, err = cli("import", str(tmp_path / "empty"), str(tmp_path / "s"))
    assert code == 2 and "holds neither" in err

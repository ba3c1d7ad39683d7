"""The safetensors file format: a header parser that trusts nothing, tensor reads, header writing.

A file is an 8-byte little-endian header length N, N bytes of JSON header, then the data. The
header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the data start), plus an optional ``"__metadata__"`` map of strings. The checks here
follow the reference implementation (huggingface/safetensors ``validate``): the header must be a
JSON object within the file and at most 100 MB, names unique and valid store keys, dtypes known,
and the tensors must tile the data exactly (no overlap, no gap, sizes equal to shape * itemsize).
Tensor bytes are read with ``os.preadv``; nothing is ever unpickled. It lives in tierstore so
that both the ``tierstore import`` command and the trainer's ``load_model`` validate the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable
from typing import Any

import torch

from tierstore.errors import InvalidKey, MalformedFile
from tierstore.keys import validate_key

#: safetensors' own limit on the header (MAX_HEADER_SIZE in the reference implementation)
MAX_HEADER_BYTES = 100_000_000

#: the safetensors dtype codes of the dtypes a store holds
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
CODES: dict[torch.dtype, str] = {dt: code for code, dt in DTYPES.items()}


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are (absolute file offsets)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return self.stop - self.start


@dataclasses.dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """A validated header: the tensors in file order and the metadata strings."""

    path: str
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str]


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise MalformedFile(f"duplicate name {k!r} in the header")
        seen[k] = v
    return seen


def _entry(name: str, raw: Any, data_len: int, data_start: int) -> TensorEntry:
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise MalformedFile(f"tensor {name!r}: an entry needs exactly dtype, shape and "
                             f"data_offsets, got {raw!r:.200}")
    code, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(code, str) or code not in DTYPES:
        raise MalformedFile(f"tensor {name!r}: dtype {code!r:.40} is unknown or not storable; "
                             f"known: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise MalformedFile(f"tensor {name!r}: shape must be a list of non-negative ints, "
                             f"got {shape!r:.100}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise MalformedFile(f"tensor {name!r}: data_offsets must be [begin, end] ints, "
                             f"got {offsets!r:.100}")
    # torch sizes are int64: a zero-size tensor passes the byte check below whatever its other
    # dims, so bound the product of the non-zero ones (torch multiplies them in any order)
    if math.prod(d for d in shape if d) >= 2**63:
        raise MalformedFile(f"tensor {name!r}: shape {shape!r:.100} has dimensions too large for "
                             "a tensor (their product must be below 2**63)")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise MalformedFile(f"tensor {name!r}: data_offsets [{begin}, {end}] are outside the "
                             f"{data_len} data bytes of the file")
    itemsize = DTYPES[code].itemsize
    want = math.prod(shape) * itemsize
    if end - begin != want:
        raise MalformedFile(f"tensor {name!r}: data_offsets span {end - begin} bytes but shape "
                             f"{shape} of {code} needs {want}")
    try:
        validate_key(name)
    except InvalidKey as e:
        raise MalformedFile(f"tensor name {name[:80]!r} is not a valid store key: {e}") from None
    return TensorEntry(name, DTYPES[code], tuple(shape), data_start + begin, data_start + end)


def read_header(path: str) -> SafetensorsHeader:
    """Parse and validate the header of ``path``; MalformedFile names the file and the problem."""
    try:
        return _read_header(path)
    except MalformedFile as e:
        raise MalformedFile(f"{path}: {e}") from None


def _read_header(path: str) -> SafetensorsHeader:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise MalformedFile(f"{size} bytes is too short for a safetensors file (8-byte header "
                                 "length missing)")
        n = int.from_bytes(f.read(8), "little")
        if n > MAX_HEADER_BYTES:
            raise MalformedFile(f"header length {n} is over the {MAX_HEADER_BYTES}-byte limit")
        if n > size - 8:
            raise MalformedFile(f"header length {n} is larger than the file ({size} bytes)")
        if n < 2:
            raise MalformedFile(f"header length {n} is too short for a JSON object")
        blob = f.read(n)
    try:
        header = json.loads(blob.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as e:  # Unicode/JSONDecodeError are ValueErrors
        raise MalformedFile(f"the header is not valid UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise MalformedFile(f"the header is JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise MalformedFile("__metadata__ must map strings to strings")
    data_start = 8 + n
    data_len = size - data_start
    entries = [_entry(name, raw, data_len, data_start) for name, raw in header.items()]
    # the tensors must tile the data: sorted by start, each begins where the previous ended
    pos = data_start
    for e in sorted(entries, key=lambda e: (e.start, e.stop)):
        if e.start < pos:
            raise MalformedFile(f"tensor {e.name!r} overlaps the previous tensor's bytes "
                                 f"(starts at data offset {e.start - data_start}, the previous "
                                 f"ends at {pos - data_start})")
        if e.start > pos:
            raise MalformedFile(f"{e.start - pos} bytes before tensor {e.name!r} belong to no "
                                 "tensor")
        pos = e.stop
    if pos != size:
        raise MalformedFile(f"{size - pos} bytes after the last tensor belong to no tensor")
    return SafetensorsHeader(path, tuple(entries), dict(metadata))


def read_tensor(fd: int, entry: TensorEntry) -> torch.Tensor:
    """The tensor ``entry`` read from the open file ``fd`` into a new CPU tensor."""
    buf = torch.empty(entry.nbytes, dtype=torch.uint8)
    view = memoryview(buf.numpy()).cast("B") if entry.nbytes else memoryview(b"")
    done = 0
    while done < entry.nbytes:
        n = os.preadv(fd, [view[done:]], entry.start + done)
        if n == 0:
            raise MalformedFile(f"tensor {entry.name!r}: the file ended early")
        done += n
    return buf.view(entry.dtype).reshape(entry.shape)


def header_bytes(entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> tuple[bytes, list[int]]:
    """The length prefix plus the JSON header (padded to 8 bytes) of tensors laid out in order.

    Returns the bytes and each tensor's data offset; the data starts right after the bytes.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offsets, pos = [], 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        offsets.append(pos)
        pos += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # as the reference writer does: 8-byte aligned data
    return len(blob).to_bytes(8, "little") + blob, offsets
